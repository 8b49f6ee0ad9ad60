"""loader.shard_order=node: each node keeps the same samples across epochs (whole shards, and a
part of the shard at each cut between two nodes), so with a node cache a run fetches the data set
about once. The pure order (a permutation every epoch, every sample on one node throughout, nodes
balanced, rank spans and their padding in their node's share); every key once per epoch but the
padding through the real Loader; what the store sends to two nodes with a cache each over three
epochs, against the global order; an elastic resume onto another node count.

The stores are local HTTP servers that count the bytes they send; processes wait on queues,
never by time."""

from __future__ import annotations

import bisect
import http.server
import itertools
import multiprocessing
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import write_tiny_shards
from tests.helpers.servers import Servers, counting_store
from wdsdist import simdist
from wdsdist.cluster import distributed
from wdsdist.data import EvalLoader, Loader
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import GLOBAL, epoch_order, node_order, node_parts, node_shares, order_nodes, shard_order
from wdsdist.data.plan.sequence import EpochSequence, EpochShards
from wdsdist.data.plan.splits import rank_batches
from wdsdist.data.plan.state import LoaderState, gathered
from wdsdist.data.sources.index import local_sample_offsets, write_index
from wdsdist.data.sources.shardspec import SampleOffsets, Shard
from wdsdist.data.sources.spanread import part_span
from wdsdist.errors import UserError

WAIT = 120  # seconds a test waits for another process's answer before it fails (never a pause)
FORK = multiprocessing.get_context("fork")
COUNTS = [7, 13, 5, 11, 9, 6, 12, 8]  # 71 samples, uneven on purpose


def cfg(**kw):
    base = dict(batch_size=3, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=20, seed=3)
    return LoaderConfig(**(base | {"shard_order": "node"} | kw))


def layout_order(counts, world, node_ranks, bs, shard_order="node"):
    return node_order(shard_order, sum(counts), world, node_ranks, bs, "pad")


def sequence_keys(counts, order, seed, epoch):
    """The keys of the epoch's sample sequence by hand: parts of shards in the node order, samples
    in shard order (write_tiny_shards numbers keys over the shard list)."""
    first = list(itertools.accumulate(counts, initial=0))
    parts = epoch_order(node_parts(counts, order, seed), seed, epoch)
    return [f"s{first[i] + j:07d}" for i, a, b in parts for j in range(a, b)]


def epoch_keys(counts, order, seed, epoch, world, bs, remainder="pad"):
    """Every key a whole epoch delivers, by hand: node n's ranks read its share of the sequence
    (node_shares), cut to their spans (drop) or padded with the share's first keys again (pad)."""
    sequence = sequence_keys(counts, order, seed, epoch)
    nodes = order[0]
    span = rank_batches(len(sequence), world, bs, remainder) * bs * world // nodes
    out, start = Counter(), 0
    for own in node_shares(len(sequence), nodes):
        share = sequence[start : start + own]
        out.update(share[i % own] for i in range(span))
        start += own
    return out


# ---------------------------------------------------------------- (a) the pure order


def owners(parts: list, counts: list[int]) -> dict[int, list[tuple[int, int, int]]]:
    """shard -> its (first, stop, node) runs in order, asserting that the nodes' parts cover every
    sample of every shard exactly once (no gap, no overlap): per run, not per sample, so a
    layout of a million samples checks in milliseconds."""
    runs: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(counts))}
    for node, block in enumerate(parts):
        for i, a, b in block:
            if b > a:
                runs[i].append((a, b, node))
    for i, count in enumerate(counts):
        runs[i].sort()
        reached = 0
        for a, b, _ in runs[i]:
            assert a <= reached, f"shard {i}: samples {reached}..{a - 1} on no node"
            assert a >= reached, f"shard {i}: samples {a}..{reached - 1} on two nodes"
            reached = b
        assert reached == count, f"shard {i}: {reached} of its {count} samples on a node"
    return runs


def owned_by(owner: dict[int, list[tuple[int, int, int]]], shard: int, first: int, stop: int) -> set[int]:
    """The nodes holding samples first..stop-1 of a shard."""
    runs = owner[shard]
    k = max(bisect.bisect_right(runs, (first, float("inf"), 0)) - 1, 0)
    nodes = set()
    while k < len(runs) and runs[k][0] < stop:
        if runs[k][1] > first:
            nodes.add(runs[k][2])
        k += 1
    return nodes


LAYOUTS = [
    # (counts, nodes, ranks per node, batch size, seed)
    (COUNTS, 2, 2, 3, 0),
    (COUNTS, 3, 1, 2, 5),
    ([10] * 40, 4, 2, 4, 1),
    ([1251 + (i * 37) % 21 - 10 for i in range(1000)], 8, 8, 32, 7),
    ([0, 5, 0, 40, 3, 3, 3, 3, 3, 3], 2, 3, 1, 2),  # empty shards, one shard larger than a node's share
    (list(range(1, 30)), 5, 1, 2, 9),
    ([10] * 64, 4, 4, 7, 4),  # padding (32 samples) larger than a shard
]


@pytest.mark.parametrize("counts,nodes,per_node,bs,seed", LAYOUTS)
def test_the_node_order_keeps_every_sample_on_one_node_balanced_and_under_its_ranks(counts, nodes, per_node, bs, seed):
    total, world = sum(counts), nodes * per_node
    order = layout_order(counts, world, per_node, bs)
    span = order[1]  # samples of a node's ranks' spans
    assert order == (nodes, rank_batches(total, world, bs, "pad") * bs * per_node)
    parts = node_parts(counts, order, seed)
    owner = owners(parts, counts)  # every sample of every shard on exactly one node
    assert [sum(b - a for _, a, b in block) for block in parts] == node_shares(total, nodes)
    assert max(node_shares(total, nodes)) - min(node_shares(total, nodes)) <= 1
    split = [i for i, runs in owner.items() if len({node for _, _, node in runs}) > 1]
    assert len(split) <= nodes - 1  # only the shards a cut falls in are shared, each by two nodes
    for epoch in range(3):
        order_e = epoch_order(parts, seed, epoch)
        assert sorted(order_e) == sorted(p for b in parts for p in b)  # a permutation of the parts
        shards = EpochShards(counts, order_e)
        sequence = EpochSequence.of(shards.total, order=order)
        for node in range(nodes):  # the node's ranks read its own samples only, padding included
            for rank in range(node * per_node, (node + 1) * per_node):
                runs = sequence.runs(rank * span // per_node, (rank + 1) * span // per_node)
                assert sum(b - a for a, b, _ in runs) == span // per_node
                _, (pieces,) = shards.reads(runs)
                assert set().union(*(owned_by(owner, i, a, b) for i, a, b in pieces)) <= {node}
            padding = sum(b - a for a, b, tag in sequence.runs(node * span, (node + 1) * span) if tag >= total)
            assert padding == span - node_shares(total, nodes)[node] <= per_node * bs  # a batch per rank at most


def test_one_node_is_the_global_order_and_shard_order_global_ignores_the_nodes():
    for epoch in range(4):
        whole = [(i, 0, n) for i, n in enumerate(COUNTS)]
        assert epoch_order(node_parts(COUNTS, GLOBAL, 3), 3, epoch) == shard_order(whole, 3, epoch, 1)
    assert order_nodes("global", 6, 4) == 1 and order_nodes("node", 8, 4) == 2 and order_nodes("node", 3, 1) == 3
    assert layout_order(COUNTS, 8, 4, 3, "global") == layout_order(COUNTS, 4, 4, 3) == GLOBAL


def test_a_layout_the_node_order_cannot_take_is_refused_in_one_line(tiny_shards):
    with pytest.raises(UserError, match=r"^shard_order=node: only applies with loader.split=samples"):
        cfg(mode="repeat")
    with pytest.raises(UserError, match=r"^shard_order=node: only applies with loader.split=samples"):
        cfg(split="shards")
    with pytest.raises(UserError, match=r"^shard_order=sorted: global or node$"):
        cfg(shard_order="sorted")
    with pytest.raises(UserError, match=r"^node_ranks=0: must be >= 1$"):
        cfg(node_ranks=0)
    spec = str(tiny_shards(COUNTS))
    with pytest.raises(UserError) as exc:
        Loader(spec, cfg(node_ranks=2), rank=0, world=3)
    assert "\n" not in str(exc.value)
    assert str(exc.value).startswith("loader.shard_order=node: 3 ranks are not whole nodes of 2 ranks each")
    assert cfg(mode="repeat", split="samples").by_samples  # repeat mode takes it with split=samples


def test_the_ranks_per_node_are_read_from_torchrun_in_the_one_place_that_reads_its_env(monkeypatch):
    """wdsdist/cluster/distributed.py reads LOCAL_WORLD_SIZE beside RANK and WORLD_SIZE (the trainer
    hands Dist.local_world to the loader as node_ranks: tests/train/test_config_sources.py)."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "two")):
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=r"^environment variable LOCAL_WORLD_SIZE='two' is not an integer$"):
        distributed.init("cpu")
    assert distributed.Dist(0, 1, 0, torch.device("cpu")).local_world == 1


# ---------------------------------------------------------------- (b) the real loader, 2 nodes x 2 ranks


@pytest.mark.parametrize("workers", [0, 2])
def test_two_nodes_of_two_ranks_deliver_every_key_once_per_epoch_but_the_padding(tiny_shards, workers):
    spec, world, bs = str(tiny_shards(COUNTS)), 4, 3
    c = cfg(node_ranks=2, workers=workers)
    loaders = [Loader(spec, c, rank=r, world=world) for r in range(world)]
    k = rank_batches(sum(COUNTS), world, bs, "pad")
    order = layout_order(COUNTS, world, 2, bs)
    first = list(itertools.accumulate(COUNTS, initial=0))
    own = [{f"s{first[i] + j:07d}" for i, a, b in block for j in range(a, b)} for block in node_parts(COUNTS, order, 3)]
    for epoch in range(3):
        keys = Counter()
        for rank, loader in enumerate(loaders):
            batches = list(loader)
            assert len(batches) == len(loader) == k  # equal batches per rank
            got = [key for b in batches for key in b["key"]]
            keys.update(got)
            assert set(got) <= own[rank // 2]  # a node's ranks read its own samples, padding included
        assert keys == epoch_keys(COUNTS, order, c.seed, epoch, world, bs)


def test_a_training_config_with_the_node_order_evaluates_whole_shards_per_rank(tiny_shards):
    """The evaluation pass splits whole shards (split=shards), where the node order does not apply:
    a config that trains with it still evaluates, every key once over the ranks."""
    spec = str(tiny_shards(COUNTS))
    keys = [k for r in range(2) for b in EvalLoader(spec, cfg(node_ranks=1), rank=r, world=2) for k in b["key"]]
    assert sorted(keys) == sorted(sequence_keys(COUNTS, GLOBAL, 0, 0))  # the global order: every key


# ---------------------------------------------------------------- (c) two nodes, two caches, one store


class Counting(http.server.SimpleHTTPRequestHandler):
    """Files under the folder it serves (whole: Range is ignored); ``sent`` counts the bytes of
    each path's bodies."""

    sent: dict[str, int]
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        data = source.read()
        outputfile.write(data)
        with self.lock:
            self.sent[self.path] = self.sent.get(self.path, 0) + len(data)


@pytest.fixture
def stores():
    """A factory: serve(root) -> (base URL, the dict of bytes sent per path)."""
    with Servers() as servers:

        def serve(root: Path):
            sent: dict[str, int] = {}
            handler = type("Store", (Counting,), {"sent": sent})
            return servers.start(lambda *a: handler(*a, directory=str(root))), sent

        yield serve


def _node(jobs, rank, world, out) -> None:
    """One node (one rank): each job (spec, shard order, cache folder), 3 epochs; the keys of each."""
    try:
        result = []
        for spec, order, folder in jobs:
            c = cfg(shard_order=order, cache_dir=folder, batch_size=4, shuffle_buffer=0)
            loader = Loader(spec, c, rank=rank, world=world)
            result.append([[key for b in loader for key in b["key"]] for _ in range(3)])
        out.put((rank, result))
    except BaseException as exc:  # noqa: BLE001 (the parent fails with it)
        out.put((rank, repr(exc)))


def run_all(processes: list, out) -> dict:
    """Start ``processes``, each of which puts (its rank, its result) on ``out``: the results."""
    for process in processes:
        process.start()
    results = dict(out.get(timeout=WAIT) for _ in processes)
    for process in processes:
        process.join(WAIT)
    return results


def test_with_a_cache_per_node_the_node_order_fetches_the_data_set_about_once(tmp_path, stores):
    """2 nodes (1 rank each), 20 shards of 12 samples, 3 epochs: with the node order each node's
    cache takes its own 10 shards once; with the global order each epoch hands a node a new
    half of the shards, so over three epochs the store sends each node most of the data set."""
    counts = [12] * 20
    index = write_tiny_shards(tmp_path / "data", counts, "s", size=16)
    dataset = sum(p.stat().st_size for p in index.parent.glob("*.tar"))
    runs = {order: stores(index.parent) for order in ("global", "node")}
    out = FORK.Queue()
    nodes = [
        FORK.Process(
            target=_node,
            args=(
                [
                    (f"{base}/s.index.json", order, str(tmp_path / f"cache-{order}-{rank}"))
                    for order, (base, _) in runs.items()
                ],
                rank,
                2,
                out,
            ),
        )
        for rank in range(2)
    ]
    results = run_all(nodes, out)
    assert all(isinstance(r, list) for r in results.values()), results
    sent = {}
    for job, (order, (_, counted)) in enumerate(runs.items()):
        epoch_layout = layout_order(counts, 2, 1, 4, order)
        for epoch in range(3):  # every epoch exact: no padding in this layout
            keys = results[0][job][epoch] + results[1][job][epoch]
            assert Counter(keys) == epoch_keys(counts, epoch_layout, 3, epoch, 2, 4)
        sent[order] = sum(n for path, n in counted.items() if path.endswith(".tar"))
    print(f"store sent over 3 epochs: {sent} bytes; the data set is {dataset} bytes")
    assert dataset <= sent["node"] <= 1.1 * dataset
    assert sent["global"] > 1.5 * dataset


# ---------------------------------------------------------------- (c2) uneven shards: the plan is what the store sends

UNEVEN = [9 + (i * 5) % 7 for i in range(16)]  # 16 shards of 9 .. 15 samples
EGRESS_LAYOUTS = [
    # (nodes, ranks per node, batch size)
    (2, 2, 3),
    (3, 1, 4),
    (4, 2, 2),
]


def _offsets_of(offsets):
    """The table read_span gets from an index written with offset_every=1."""
    return SampleOffsets(1, b"".join(o.to_bytes(8, "little") for o in offsets))


def _rank(spec, rank, world, node_ranks, bs, folder, out) -> None:
    """One rank of a node whose cache is ``folder``: 3 epochs; its keys and batch counts."""
    try:
        c = cfg(node_ranks=node_ranks, cache_dir=folder, batch_size=bs, shuffle_buffer=0)
        loader = Loader(spec, c, rank=rank, world=world)
        epochs = [[key for b in loader for key in b["key"]] for _ in range(3)]
        out.put((rank, (epochs, len(loader))))
    except BaseException as exc:  # noqa: BLE001 (the parent fails with it)
        out.put((rank, repr(exc)))


def run_nodes(bases, sent, node_ranks, bs, caches):
    """Every rank of the nodes, node n reading its store (``bases[n]``) through its cache folder
    (``caches[n]``): each rank's (keys per epoch, batches per epoch), and the bytes of .tar each
    store sent meanwhile (``sent``: what the stores count in)."""
    before = [sum(n for path, n in counted.items() if path.endswith(".tar")) for counted in sent]
    out, world = FORK.Queue(), len(bases) * node_ranks
    ranks = []
    for r in range(world):
        node = r // node_ranks
        args = (f"{bases[node]}/u.index.json", r, world, node_ranks, bs, str(caches[node]), out)
        ranks.append(FORK.Process(target=_rank, args=args))
    results = run_all(ranks, out)
    assert all(isinstance(r, tuple) for r in results.values()), results
    after = [sum(n for path, n in counted.items() if path.endswith(".tar")) for counted in sent]
    return results, [b - a for a, b in zip(before, after, strict=True)]


@pytest.mark.parametrize("nodes,per_node,bs", EGRESS_LAYOUTS)
def test_over_uneven_shards_each_node_fetches_its_own_samples_once_as_simdist_plans(tmp_path, nodes, per_node, bs):
    """Each node's cache fetches its whole shards and, at a cut, its part of the shard another node
    reads the rest of (one ranged read of that part's bytes, from the index's offsets): over three
    epochs the stores send the data set exactly once, each node what simdist's plan says, and a
    warm rerun nothing. Every epoch delivers every key once but each node's padding, its own."""
    root = tmp_path / "data"
    write_tiny_shards(root, UNEVEN, "u", size=16)
    tars = sorted(root.glob("u-*.tar"))
    offsets = [local_sample_offsets(str(t)) for t in tars]
    shards = [(str(t), n) for t, n in zip(tars, UNEVEN, strict=True)]
    write_index(str(root / "u.index.json"), shards, offsets=offsets, offset_every=1)
    sizes = [t.stat().st_size for t in tars]
    world = nodes * per_node
    caches = [tmp_path / f"cache-{n}" for n in range(nodes)]
    stores = [counting_store(root) for _ in range(nodes)]
    counted = [c for _, c in stores]
    with Servers() as servers:
        bases = [servers.start(handler) for handler, _ in stores]
        results, sent = run_nodes(bases, counted, per_node, bs, caches)
        again = run_nodes(bases, counted, per_node, bs, caches)[1] if nodes == 2 else [0] * nodes

    order = layout_order(UNEVEN, world, per_node, bs)
    k = rank_batches(sum(UNEVEN), world, bs, "pad")
    for epoch in range(3):
        keys = Counter(key for rank in range(world) for key in results[rank][0][epoch])
        assert keys == epoch_keys(UNEVEN, order, 3, epoch, world, bs)
    assert {len(results[r][0][e]) for r in range(world) for e in range(3)} == {k * bs}  # equal batches
    assert {results[r][1] for r in range(world)} == {k}

    def part_bytes(i, first, stop):
        lo, hi = part_span(Shard(str(tars[i]), UNEVEN[i], _offsets_of(offsets[i])), (first, stop))
        return (sizes[i] if hi is None else hi) - lo

    plan = simdist.node_egress(
        UNEVEN, sizes, world=world, node_ranks=per_node, batch_size=bs, nepochs=3, seed=3,
        shard_order="node", cache_bytes=1 << 40, part_bytes=part_bytes,
    )  # fmt: skip
    assert sent == [sum(row[n] for row in plan.cached) for n in range(nodes)]  # plan == measured, per node
    assert sum(sent) == sum(sizes)  # the data set once: each sample's bytes fetched by one node, once
    assert all(row == (0,) * nodes for row in plan.cached[1:])  # nothing after the first epoch
    assert again == [0] * nodes  # a warm rerun sends nothing


# ---------------------------------------------------------------- (d) elastic resume onto another node count


def run_layout(spec, world, workers, node_ranks, states, at=None):
    """Every rank's loader on this layout (resumed from ``states``, every old rank's entry), ``at``
    batches of each (None: the epoch)."""
    out, saved = [], []
    for rank in range(world):
        loader = make_loader(spec, rank, world, cfg(workers=workers, node_ranks=node_ranks), states)
        out.append(list(itertools.islice(iter(loader), at)))
        saved.append(loader.state_dict())
    return out, saved


RESIZES = [
    # (old world, old ranks per node, old workers, new world, new ranks per node, new workers, batches before)
    (2, 1, 2, 1, 1, 1, 4),  # 2 nodes -> 1
    (1, 1, 0, 4, 2, 0, 9),  # 1 node -> 2 nodes of 2 ranks
    (2, 1, 0, 2, 2, 0, 5),  # the same ranks, now on one node: the epoch keeps its order
]


@pytest.mark.parametrize("old_world,old_per,old_workers,world,per,workers,at", RESIZES)
def test_a_resume_on_another_node_count_delivers_the_interrupted_epoch_once(
    tiny_shards, old_world, old_per, old_workers, world, per, workers, at
):
    spec, total, bs = str(tiny_shards(COUNTS)), sum(COUNTS), 3
    old_order, new_order = layout_order(COUNTS, old_world, old_per, bs), layout_order(COUNTS, world, per, bs)
    assert old_order != new_order
    before, states = run_layout(spec, old_world, old_workers, old_per, None, at)
    assert all(s["order"] == list(old_order) for s in states)
    resized = states
    # Part of the rest, a checkpoint on the new layout, then the rest of the epoch from it: the
    # interrupted epoch keeps the old order through both resumes.
    middle, states2 = run_layout(spec, world, workers, per, resized, 1)
    assert all(s["orders"] == {"0": list(old_order)} for s in states2)
    after, states3 = run_layout(spec, world, workers, per, states2)
    assert all(s["point"]["epoch"] == 1 and "orders" not in s for s in states3)
    sequence = sequence_keys(COUNTS, old_order, 3, 0)
    positions, keys = [], Counter()
    for part in (before, middle, after):
        for batches in part:
            for b in batches:
                assert [sequence[p % total] for p in b["pos"].tolist()] == b["key"]  # positions name the old order
                positions += b["pos"].tolist()
                keys.update(b["key"])
    assert set(keys) == set(sequence)  # every key of the interrupted epoch
    assert max(Counter(p for p in positions if p < total).values()) == 1  # none twice as itself
    assert sum(n - 1 for n in keys.values()) <= sum(p >= total for p in positions) < 2 * max(world, old_world) * bs
    # The next epoch is whole, in the new node count's order.
    nxt, _ = run_layout(spec, world, workers, per, states3)
    got = Counter(k for batches in nxt for b in batches for k in b["key"])
    assert got == epoch_keys(COUNTS, new_order, 3, 1, world, bs)


@pytest.mark.parametrize("version", [1, 2])
def test_a_state_of_the_earlier_node_cut_in_the_middle_of_an_epoch_is_refused_in_one_line(tiny_shards, version):
    """Versions 1 and 2 of the loader state cut the nodes at whole shards, so their positions in
    the middle of a node-ordered epoch name other samples now: refused, naming the way on; at an
    epoch's end nothing is in flight and it resumes."""
    spec = str(tiny_shards(COUNTS))
    _, states = run_layout(spec, 2, 0, 1, None, 2)  # every rank's entry, two batches into epoch 0
    with pytest.raises(UserError, match=r"^the loader state was saved in the middle of epoch 0 with "):
        LoaderState.from_dict([dict(s, version=version) for s in states])
    with pytest.raises(UserError, match=r"^the loader state was saved in the middle of epoch 0 with "):
        LoaderState.from_dict(gathered([dict(s, version=version) for s in states], 2, 0) | {"version": version})
    assert LoaderState.from_dict(states).first.point.epoch == 0  # today's version reads it
    _, ended = run_layout(spec, 2, 0, 1, None)
    assert LoaderState.from_dict([dict(s, version=version) for s in ended]).first.point.epoch == 1
