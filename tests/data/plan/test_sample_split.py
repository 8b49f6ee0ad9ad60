"""loader.split=samples: the epoch's sample sequence cut into equal spans; plan == loader, every
sample once per epoch but the stated padding (or drop), and positions that name each sample."""

import hashlib
import itertools
from collections import Counter

import pytest

from wdsdist.data.delivery.pipeline import RankLoader, check_layout, counted_shards, make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import shard_order
from wdsdist.data.plan.splits import plan_samples, sample_span, span_pieces
from wdsdist.data.sources import shardspec
from wdsdist.errors import UserError

COUNTS = [7, 13, 5, 11, 9, 6, 12]  # 63 samples, uneven on purpose


def cfg(**kw):
    base = dict(batch_size=3, workers=2, mode="epoch", split="samples", image_size=8, with_keys=True, shuffle_buffer=20)
    return LoaderConfig(**(base | kw))


def sequence_keys(counts, seed, epoch):
    """The keys of the epoch's sample sequence, worked out by hand: shards in the epoch's order,
    samples in shard order (tiny_shards numbers keys over the shard list)."""
    first = list(itertools.accumulate(counts, initial=0))
    order = shard_order(range(len(counts)), seed, epoch, 1)
    return [f"s{first[i] + j:07d}" for i in order for j in range(counts[i])]


# Every (world, workers) pair once, the batch size, remainder and cross-worker shuffle rotating
# through theirs (each worker count costs process starts: the grid stays at seconds).
GRID = [
    (world, workers, [2, 3, 5][i % 3], ["pad", "drop"][i % 2], [0, 7][i // 2 % 2])
    for i, (world, workers) in enumerate(itertools.product([1, 2, 3, 4], [0, 1, 2, 3]))
]


@pytest.mark.parametrize("world,workers,bs,remainder,cross", GRID)
def test_plan_equals_loader_and_every_key_once_but_the_padding(tiny_shards, world, workers, bs, remainder, cross):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(batch_size=bs, workers=workers, remainder=remainder, cross_shuffle=cross, seed=3)
    p = plan_samples(COUNTS, world, workers, bs, remainder=remainder, rebatch=cross > 0)
    assert check_layout(counted_shards(shards, c), world, c) == p
    total, slots = sum(COUNTS), world * bs
    assert p.padded + p.dropped < slots and (p.padded == 0 or p.dropped == 0)
    assert total + p.padded - p.dropped == world * p.batches[0] * bs
    loaders = [RankLoader(counted_shards(shards, c), r, world, c, None, p) for r in range(world)]
    orders = []
    for epoch in range(2):
        seq = sequence_keys(COUNTS, 3, epoch)
        keys, positions, per_rank = Counter(), [], []
        for rank, loader in enumerate(loaders):
            batches = list(loader)
            per_rank.append(len(batches))
            assert all(len(b["key"]) == bs for b in batches)
            for b in batches:
                keys.update(b["key"])
                for pos, key in zip(b["pos"].tolist(), b["key"], strict=True):
                    assert seq[pos % total] == key  # the position names the sample
                    assert p.ranks[rank].span[0] <= pos < p.ranks[rank].span[1]
                    positions.append(pos)
        assert per_rank == p.batches == [p.batches[0]] * world
        assert sorted(positions) == list(range(world * p.batches[0] * bs))
        if remainder == "pad":
            assert set(keys) == set(seq) and sum(n - 1 for n in keys.values()) == p.padded
            assert {k for k, n in keys.items() if n == 2} == set(seq[: p.padded])  # the epoch's first ones
        else:
            assert max(keys.values()) == 1 and total - len(keys) == p.dropped
            assert set(seq) - set(keys) == set(seq[total - p.dropped :])  # the epoch's last ones
        orders.append(list(keys))
    assert orders[0] != orders[1]  # a new order every epoch


def test_padding_does_not_depend_on_the_worker_count():
    for world, bs in [(1, 4), (3, 10), (4, 7)]:
        plans = [plan_samples(COUNTS * 5, world, nw, bs) for nw in range(4)]
        assert len({(p.padded, p.batches[0]) for p in plans}) == 1
        spans = [w.span for r in plans[-1].ranks for w in r.workers]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous


def test_classic_demo_pads_20_or_drops_10():
    pad, drop = plan_samples([100] * 10, 3, 3, 10), plan_samples([100] * 10, 3, 3, 10, remainder="drop")
    assert pad.batches == [34] * 3 and pad.padded == 20 and pad.dropped == 0
    assert drop.batches == [33] * 3 and drop.dropped == 10 and drop.padded == 0
    assert [w.batches for w in pad.ranks[0].workers] == [12, 11, 11]


def test_span_pieces_wrap_and_skip_empty_shards():
    cumulative = [0, 5, 5, 12]  # the second shard is empty
    assert list(span_pieces(cumulative, 3, 9)) == [(0, 3, 5, 3), (2, 0, 4, 5)]
    assert list(span_pieces(cumulative, 10, 15)) == [(2, 5, 7, 10), (0, 0, 3, 12)]
    assert sample_span(1, 2, 1, 2, 4, 5) == ((5 + 3) * 4, (5 + 5) * 4)


def test_large_layout_plans_spans_arithmetically():
    p = plan_samples([1000 + (i % 7) for i in range(100_000)], 1024, 8, 64)
    assert p.equal and p.padded < 1024 * 64
    assert p.ranks[-1].span[1] == p.total_samples + p.padded


def test_too_few_samples_for_the_layout_is_refused_with_numbers(tiny_shards):
    shards = str(tiny_shards([5, 5, 5]))
    with pytest.raises(UserError, match=r"15 samples are fewer than 2 ranks x 2 workers x batch size 4 = 16"):
        make_loader(shards, 0, 2, cfg(batch_size=4))


def test_remote_shards_without_counts_are_refused_in_one_line():
    shards = [shardspec.Shard("http://127.0.0.1:9/a.tar"), shardspec.Shard("http://127.0.0.1:9/b.tar")]
    with pytest.raises(UserError, match=r"split=samples needs sample counts .* http://127.0.0.1:9/a.tar"):
        make_loader(shards, 0, 1, cfg())


@pytest.mark.parametrize("cross", [0, 6])
def test_same_layout_resume_continues_exactly(tiny_shards, cross):
    """Each worker's stream resumes where it stood (its batches the same, sample for sample);
    with the cross-worker shuffle the rest of the epoch is the same samples, reshuffled."""
    shards = str(tiny_shards(COUNTS))
    c = cfg(batch_size=3, workers=2, cross_shuffle=cross)
    whole = [(b["key"], b["pos"].tolist()) for b in make_loader(shards, 1, 2, c)]
    first = make_loader(shards, 1, 2, c)
    head = [(b["key"], b["pos"].tolist()) for b in itertools.islice(iter(first), 4)]
    resumed = make_loader(shards, 1, 2, c, state=first.state_dict())
    tail = [(b["key"], b["pos"].tolist()) for b in resumed]
    if cross:
        assert sorted(k for keys, _ in head + tail for k in keys) == sorted(k for keys, _ in whole for k in keys)
    else:
        assert sorted(head + tail) == sorted(whole)


def test_split_shards_is_the_loader_of_before_bit_for_bit(tiny_shards):
    """loader.split=shards delivers what the loader delivered before split=samples existed: the
    digest was taken with the code before it (keys, labels, ids; epoch and repeat mode, 2 ranks)."""
    shards = str(tiny_shards([7, 13, 5, 11, 9, 6]))
    digest = hashlib.sha256()
    for mode in ("epoch", "repeat"):
        for rank in range(2):
            kw = dict(batch_size=3, workers=2, mode=mode, split="shards", image_size=8, shuffle_buffer=10, seed=3)
            c = LoaderConfig(**kw, with_keys=True, nbatches="auto" if mode == "epoch" else None)
            loader = make_loader(shards, rank, 2, c)
            if mode == "epoch":
                batches = [b for _ in range(2) for b in loader]
            else:
                batches = list(itertools.islice(iter(loader), 15))
            for b in batches:
                digest.update(repr((b["key"], b["label"].tolist(), b["id"].tolist())).encode())
    assert digest.hexdigest()[:16] == "e4230ac2048fc55f"


def test_a_cut_above_the_epoch_is_refused_with_numbers(tiny_shards):
    shards = str(tiny_shards(COUNTS))
    with pytest.raises(UserError, match=r"nbatches=30 is more than every rank delivers with split=samples \(11 batch"):
        make_loader(shards, 0, 2, cfg(nbatches=30))
    assert make_loader(shards, 0, 2, cfg(nbatches="auto")).epoch_batches == 11  # ceil(63 / 6)


def test_a_samples_id_determines_its_position_by_replaying_the_shuffle(tiny_shards):
    """The shuffle buffer's permutation depends on its seed and the stream's length only, so
    (epoch, worker, seq) and the layout give the position: replayed over position numbers, the
    worker's shuffle yields batch["pos"]. A checkpoint's seq-based state thus names the consumed
    positions too (what an elastic resume re-splits; resume.py)."""
    import random

    import webdataset as wds

    shards = str(tiny_shards(COUNTS))
    world, rank, c = 2, 1, cfg(batch_size=3, workers=2, seed=5)
    loader = make_loader(shards, rank, world, c)
    for epoch in range(2):
        got = {}
        for b in loader:
            for (e, worker, seq), pos in zip(b["id"].tolist(), b["pos"].tolist(), strict=True):
                got[(worker, seq)] = pos
                assert e == epoch
        k = loader.plan.ranks[0].available
        for worker in range(2):
            start, stop = sample_span(rank, world, worker, 2, 3, k)
            rng = random.Random(f"{c.seed}:{epoch}:{rank}:{worker}:0:samples")
            replay = list(
                wds.filters.shuffle(c.shuffle_buffer, min(c.shuffle_buffer, 100), rng=rng)(iter(range(start, stop)))
            )
            assert {s: p for (w, s), p in got.items() if w == worker} == dict(enumerate(replay))
