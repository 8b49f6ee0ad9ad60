"""loader.shard_order=node (issue 29): each node keeps its shards across epochs, so with a node
cache a run fetches the data set about once. The pure order (a permutation every epoch, a shard
on one node throughout, nodes balanced, rank spans in their node's block); every key once per
epoch but the padding through the real Loader; what the store sends to two nodes with a cache
each over three epochs, against the global order; an elastic resume onto another node count.

The stores are local HTTP servers that count the bytes they send; processes wait on queues,
never by time."""

from __future__ import annotations

import http.server
import itertools
import multiprocessing
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import write_tiny_shards
from tests.helpers.servers import Servers
from wdsdist.data import EvalLoader, Loader
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import GLOBAL, epoch_order, node_blocks, node_order, order_nodes, shard_order
from wdsdist.data.plan.splits import plan_samples, rank_batches
from wdsdist.errors import UserError
from wdsdist.train import distributed

WAIT = 120  # seconds a test waits for another process's answer before it fails (never a pause)
FORK = multiprocessing.get_context("fork")
COUNTS = [7, 13, 5, 11, 9, 6, 12, 8]  # 71 samples, uneven on purpose


def cfg(**kw):
    base = dict(batch_size=3, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=20, seed=3)
    return LoaderConfig(**(base | {"shard_order": "node"} | kw))


def layout_order(counts, world, node_ranks, bs, shard_order="node"):
    return node_order(shard_order, sum(counts), world, node_ranks, bs, "pad")


def sequence_keys(counts, order, seed, epoch):
    """The keys of the epoch's sample sequence by hand: shards in the node order, samples in
    shard order (write_tiny_shards numbers keys over the shard list)."""
    first = list(itertools.accumulate(counts, initial=0))
    order = epoch_order(node_blocks(counts, order, seed), seed, epoch)
    return [f"s{first[i] + j:07d}" for i in order for j in range(counts[i])]


# ---------------------------------------------------------------- (a) the pure order

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
def test_the_node_order_keeps_shards_on_their_node_balanced_and_under_their_ranks(counts, nodes, per_node, bs, seed):
    total, world, biggest = sum(counts), nodes * per_node, max(counts)
    order = layout_order(counts, world, per_node, bs)
    span = order[1]  # samples of a node's ranks' spans
    assert order == (nodes, rank_batches(total, world, bs, "pad") * bs * per_node)
    blocks = node_blocks(counts, order, seed)
    assert sorted(i for b in blocks for i in b) == list(range(len(counts)))  # each shard on one node
    cuts = list(itertools.accumulate((sum(counts[i] for i in b) for b in blocks), initial=0))
    for node in range(1, nodes):  # every cut within half a shard of the nodes' span boundary
        assert abs(cuts[node] - min(node * span, total)) <= biggest / 2
    for node in range(nodes - 1):  # so each node holds its span's samples give or take a shard
        assert abs(cuts[node + 1] - cuts[node] - min(span, total - node * span)) <= biggest
    for epoch in range(3):
        order = epoch_order(blocks, seed, epoch)
        assert sorted(order) == list(range(len(counts)))  # a permutation
        for node, block in enumerate(blocks):  # the node's shards hold its stretch of the sequence
            assert set(order[len(sum(blocks[:node], ())) :][: len(block)]) == set(block)
    # So position q of any epoch's sequence is on the node whose cuts hold it; the rank spans of
    # the existing split (the same every epoch) against them:
    p = plan_samples(counts, world, 1, bs)
    foreign_all = 0
    for node in range(nodes):
        foreign = 0
        for rank in range(node * per_node, (node + 1) * per_node):
            start, stop = p.ranks[rank].span
            runs = [cuts[node] <= q % total < cuts[node + 1] for q in range(start, stop)]
            foreign += runs.count(False)
            # What a rank reads of other nodes' shards lies at its span's ends, never in its middle.
            home = [i for i, at_home in enumerate(runs) if at_home]
            assert not home or all(runs[home[0] : home[-1] + 1])
        # The edges: half a shard at each cut; the last node also reads the padding.
        assert foreign <= (biggest / 2 + p.padded if node == nodes - 1 else biggest)
        foreign_all += foreign
    if len(counts) >= 1000:
        assert foreign_all < 0.01 * total  # at scale almost every sample is read on its node


def test_one_node_is_the_global_order_and_shard_order_global_ignores_the_nodes():
    for epoch in range(4):
        assert epoch_order(node_blocks(COUNTS, GLOBAL, 3), 3, epoch) == shard_order(range(len(COUNTS)), 3, epoch, 1)
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
    """wdsdist/train/distributed.py reads LOCAL_WORLD_SIZE beside RANK and WORLD_SIZE (the trainer
    hands Dist.local_world to the loader as node_ranks: tests/test_config_sources.py)."""
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
    blocks = node_blocks(COUNTS, order, c.seed)
    first = list(itertools.accumulate(COUNTS, initial=0))
    shard_of = {f"s{first[i] + j:07d}": i for i in range(len(COUNTS)) for j in range(COUNTS[i])}
    read = [set(), set()]  # the shards each node read, over the epochs
    for epoch in range(3):
        keys = Counter()
        for rank, loader in enumerate(loaders):
            batches = list(loader)
            assert len(batches) == len(loader) == k  # equal batches per rank
            got = [key for b in batches for key in b["key"]]
            keys.update(got)
            read[rank // 2].update(shard_of[key] for key in got)
        sequence = sequence_keys(COUNTS, order, c.seed, epoch)
        padding = k * world * bs - len(sequence)
        assert keys == Counter(sequence) + Counter(sequence[:padding])
    for node in range(2):  # a node's reads stay in its block but for the edges of the spans
        assert len(read[node] - set(blocks[node])) <= 2 * 3


def test_a_training_config_with_the_node_order_evaluates_whole_shards_per_rank(tiny_shards):
    """The evaluation pass splits whole shards (split=shards), where the node order does not apply:
    a config that trains with it still evaluates, every key once over the ranks."""
    spec = str(tiny_shards(COUNTS))
    keys = [k for r in range(2) for b in EvalLoader(spec, cfg(node_ranks=1), rank=r, world=2) for k in b["key"]]
    assert sorted(keys) == sorted(sequence_keys(COUNTS, GLOBAL, 0, 0))


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
    for node in nodes:
        node.start()
    results = dict(out.get(timeout=WAIT) for _ in nodes)
    for node in nodes:
        node.join(WAIT)
    assert all(isinstance(r, list) for r in results.values()), results
    sent = {}
    for job, (order, (_, counted)) in enumerate(runs.items()):
        epoch_layout = layout_order(counts, 2, 1, 4, order)
        for epoch in range(3):  # every epoch exact: no padding in this layout
            keys = results[0][job][epoch] + results[1][job][epoch]
            assert Counter(keys) == Counter(sequence_keys(counts, epoch_layout, 3, epoch))
        sent[order] = sum(n for path, n in counted.items() if path.endswith(".tar"))
    print(f"store sent over 3 epochs: {sent} bytes; the data set is {dataset} bytes")
    assert dataset <= sent["node"] <= 1.1 * dataset
    assert sent["global"] > 1.5 * dataset


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
    new = sequence_keys(COUNTS, new_order, 3, 1)
    padding = rank_batches(total, world, bs, "pad") * world * bs - total
    assert got == Counter(new) + Counter(new[:padding])
