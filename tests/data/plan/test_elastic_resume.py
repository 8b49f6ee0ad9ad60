"""Elastic resume, the pure part (issue 14 item 4): an interrupted epoch's remaining positions,
from a checkpoint's per-worker progress on one layout, re-split over another; every position
of the epoch delivered exactly once across the resize, but the stated padding (or drop)."""

import itertools
import random
from collections import Counter

import pytest

from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import shard_order, shuffled_offsets
from wdsdist.data.plan.resume import ResumePoint, WorkerProgress, remaining_after, round_robin_progress, saved_progress
from wdsdist.data.plan.sequence import EpochSequence, EpochShards, virtual_to_real, whole_epoch
from wdsdist.data.plan.splits import Layout, plan_samples, rank_batches, sample_span, span_pieces
from wdsdist.data.plan.state import SHARED
from wdsdist.errors import UserError

COUNTS = [7, 13, 0, 5, 11, 9, 6, 12]  # 63 samples, uneven, one empty shard
CUMULATIVE = list(itertools.accumulate(COUNTS, initial=0))
N = CUMULATIVE[-1]


SHARDS = EpochShards(COUNTS, range(len(COUNTS)))  # the shards in their own order


def pieces_of(ranges, rank, layout, worker):
    """(shard, first, stop) pieces a worker reads of an epoch's remaining ``ranges``."""
    sequence = EpochSequence(N, tuple(ranges))
    _, (pieces,) = SHARDS.reads(sequence.runs(*sequence.span(layout, rank, worker)))
    return pieces


def deliver(ranges, world, nworkers, bs, remainder):
    """Every (rank, worker)'s real positions on this layout, and the batches per rank, checking
    that each worker gets whole batches of contiguous virtual positions, each rank the same."""
    sequence, layout = EpochSequence(N, tuple(ranges)), Layout(world, nworkers, bs, remainder)
    batches, out = sequence.batches(layout), {}
    for rank in range(world):
        spans = [sequence.span(layout, rank, worker) for worker in range(nworkers)]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # a rank's span, in order
        assert spans[-1][1] - spans[0][0] == batches * bs  # every rank the same batches: none hangs
        for worker, (lo, hi) in enumerate(spans):
            positions = []
            for shard, first, stop in pieces_of(ranges, rank, layout, worker):
                assert 0 <= first < stop <= COUNTS[shard]
                positions += [CUMULATIVE[shard] + i for i in range(first, stop)]
            assert len(positions) == hi - lo and len(positions) % bs == 0
            out[rank, worker] = positions
    return out, batches


def left_after(ranges, progress):
    return remaining_after(EpochSequence(N, tuple(ranges)), progress).ranges


def shuffled_progress(rng, ranges, world, nworkers, bs, remainder, consumed):
    """Round-robin progress, with a few positions beyond each worker's prefix consumed early (as a
    shuffle buffer lets them out) and the prefix's last ones still held back."""
    batches = plan_batches(ranges, world, bs, remainder)
    out = []
    for rank in range(world):
        layout = Layout(world, nworkers, bs, remainder)
        for worker, p in enumerate(round_robin_progress(EpochSequence(N, ranges), layout, rank, consumed[rank])):
            _, stop = sample_span(rank, world, worker, nworkers, bs, batches)
            done = max(p.start, p.done - rng.randint(0, 3))
            window = range(done + 1, min(stop, p.done + 4))
            beyond = frozenset(rng.sample(window, min(len(window), rng.randint(0, 3))))
            out.append(WorkerProgress(p.start, done, beyond))
    return out


def plan_batches(ranges, world, bs, remainder):
    return rank_batches(sum(b - a for a, b in ranges), world, bs, remainder)


def consumed_positions(ranges, progress):
    """Real positions the progress consumed, one entry per delivery (padding: its original again)."""
    out = []
    for p in progress:
        for lo, hi in p.consumed():
            for a, b, _ in virtual_to_real(ranges, lo, hi):
                out += range(a, b)
    return out


def test_a_whole_epochs_resplit_is_the_fresh_split():
    ranges = whole_epoch(N)
    for world, nworkers, bs, remainder in itertools.product((1, 2, 3), (1, 2, 3), (1, 4), ("pad", "drop")):
        p = plan_samples(COUNTS, world, nworkers, bs, remainder=remainder)
        layout = Layout(world, nworkers, bs, remainder)
        assert EpochSequence(N, ranges).batches(layout) == p.ranks[0].batches
        for rank in range(world):
            for worker in range(nworkers):
                pieces = pieces_of(ranges, rank, layout, worker)
                span = span_pieces(CUMULATIVE, *p.ranks[rank].workers[worker].span)
                assert pieces == [(slot, first, stop) for slot, first, stop, _ in span]


OLD = [(2, 2, 4), (3, 1, 4), (1, 2, 3), (4, 3, 2)]
NEW = [(3, 1, 4), (1, 2, 4), (2, 2, 3), (4, 3, 1), (1, 1, 5)]


@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("old", OLD)
def test_across_a_resize_every_position_once_but_the_padding(old, remainder):
    rng = random.Random(f"{old}{remainder}")
    world, nworkers, bs = old
    ranges = whole_epoch(N)
    k = plan_batches(ranges, world, bs, remainder)
    for consumed_batches in sorted({0, 1, k // 2, k - 1, k}):
        progress = shuffled_progress(rng, ranges, world, nworkers, bs, remainder, [consumed_batches] * world)
        old_seen = consumed_positions(ranges, progress)
        left = left_after(ranges, progress)
        assert len(left) <= 1 + len(progress) + sum(len(p.beyond) for p in progress)  # O(ranks x workers)
        assert not set(old_seen) & {i for a, b in left for i in range(a, b)}
        m = sum(b - a for a, b in left)
        for world2, nworkers2, bs2 in NEW:
            new, k2 = deliver(left, world2, nworkers2, bs2, remainder)
            delivered = k2 * world2 * bs2
            counts = Counter(old_seen) + Counter(i for positions in new.values() for i in positions)
            assert set(counts) <= set(range(N))
            old_dups = sum(n - 1 for n in Counter(old_seen).values())
            if remainder == "pad":
                padding = delivered - m
                assert 0 <= padding < world2 * bs2
                assert set(counts) == set(range(N))  # every sample at least once
                assert sum(n - 1 for n in counts.values()) == old_dups + padding
            else:
                assert old_dups == 0 and max(counts.values(), default=1) == 1  # no sample twice
                assert 0 <= N - len(counts) == m - delivered < world2 * bs2


def test_a_second_resize_in_the_resumed_epoch():
    """2x2 -> 3x1 -> 1x2: the resumed epoch's progress is in its own virtual positions."""
    rng = random.Random(1)
    first = whole_epoch(N)
    progress = shuffled_progress(rng, first, 2, 2, 4, "pad", [3, 3])
    seen = consumed_positions(first, progress)
    second = left_after(first, progress)
    k2 = plan_batches(second, 3, 4, "pad")
    progress2 = shuffled_progress(rng, second, 3, 1, 4, "pad", [k2 // 2] * 3)
    seen += consumed_positions(second, progress2)
    third = left_after(second, progress2)
    new, k3 = deliver(third, 1, 2, 4, "pad")
    counts = Counter(seen) + Counter(i for positions in new.values() for i in positions)
    assert set(counts) == set(range(N))
    before = sum(n - 1 for n in Counter(seen).values())
    padding = k3 * 1 * 4 - sum(b - a for a, b in third)
    assert 0 <= padding < 4 and sum(n - 1 for n in counts.values()) == before + padding


def test_at_an_epoch_boundary_nothing_remains():
    ranges = whole_epoch(N)
    k = plan_batches(ranges, 2, 4, "pad")
    progress = [p for r in range(2) for p in round_robin_progress(EpochSequence(N, ranges), Layout(2, 2, 4), r, k)]
    left = left_after(ranges, progress)
    assert left == ()
    empty = EpochSequence(N, left)
    assert empty.batches(Layout(3, 1, 4)) == 0 and empty.runs(*empty.span(Layout(3, 1, 4), 0, 0)) == []


def test_round_robin_progress_follows_the_dataloaders_turns():
    # 63 samples, 1 rank, 3 workers, batch 4, pad: 16 batches, workers hold 6, 5, 5.
    ranges = whole_epoch(N)
    layout = Layout(1, 3, 4)
    got = [
        [(p.done - p.start) // 4 for p in round_robin_progress(EpochSequence(N, ranges), layout, 0, k)]
        for k in (4, 15, 16)
    ]
    assert got == [[2, 1, 1], [5, 5, 5], [6, 5, 5]]


def test_the_state_stays_small_for_a_huge_epoch():
    """10^12 samples, 1,024 ranks x 8 workers: the remaining positions are ranges, not samples."""
    total = 10**12
    epoch = EpochSequence.of(total)
    progress = [p for r in range(1024) for p in round_robin_progress(epoch, Layout(1024, 8, 256), r, 1000)]
    left = remaining_after(epoch, progress)
    assert len(left.ranges) <= 1024 * 8 + 1
    assert left.length == total - 1024 * 1000 * 256
    layout = Layout(512, 4, 256)
    batches = left.batches(layout)
    assert batches == -(-(total - 1024 * 1000 * 256) // (512 * 256))
    _, (pieces,) = EpochShards([total // 2, total // 2], [0, 1]).reads(left.runs(*left.span(layout, 5, 3)))
    assert sum(stop - first for _, first, stop in pieces) in (batches // 4 * 256, (batches // 4 + 1) * 256)


def test_a_second_resize_of_a_huge_epoch_stays_arithmetic():
    total, bs = 10**12, 256
    first = EpochSequence.of(total)
    progress = [p for r in range(1024) for p in round_robin_progress(first, Layout(1024, 8, bs), r, 1000)]
    second = remaining_after(first, progress)
    progress2 = [p for r in range(512) for p in round_robin_progress(second, Layout(512, 4, bs), r, 10)]
    third = remaining_after(second, progress2)
    assert len(third.ranges) <= len(second.ranges) + 512 * 4
    assert third.length == total - 1024 * 1000 * bs - 512 * 10 * bs


@pytest.mark.parametrize("cross, at", [(0, 3), (6, 4), (0, 11)])
def test_a_loaders_saved_state_names_the_positions_it_delivered(tiny_shards, cross, at):
    """The real loader, 2 ranks x 2 workers, stopped after ``at`` batches per rank (11: the epoch's
    end): the checkpoint's seq-based points give exactly the positions its batches carried, and
    the rest re-split over 3 ranks x 1 worker delivers every key of the epoch once but the padding."""
    counts = [7, 13, 5, 11, 9, 6, 12]
    total, seed, bs = sum(counts), 3, 3
    shards = str(tiny_shards(counts))
    c = LoaderConfig(
        batch_size=bs, workers=2, mode="epoch", split="samples", image_size=8, with_keys=True, shuffle_buffer=20,
        cross_shuffle=cross, seed=seed,
    )  # fmt: skip
    seen, points = [], []
    for rank in range(2):
        loader = make_loader(shards, rank, 2, c)
        for b in itertools.islice(iter(loader), at):
            seen += b["pos"].tolist()
        points.append(ResumePoint.from_state(loader.state_dict()["point"]))
    epoch = whole_epoch(total)
    if at == 11:  # the epoch ended: the state moved on to the next one
        assert all(p.epoch == 1 and not p.workers for p in points)
    progress = saved_progress(
        points, 0, EpochSequence.of(total), Layout(2, 2, bs), lambda r, w, n: shuffled_offsets(seed, 20, r, w, 0, n)
    )
    assert sorted(consumed_positions(epoch, progress)) == sorted(p % total for p in seen)
    left = remaining_after(EpochSequence.of(total), progress)
    first = list(itertools.accumulate(counts, initial=0))
    order = shard_order(range(len(counts)), seed, 0, 1)
    shards = EpochShards(counts, order)
    sequence = [f"s{first[i] + j:07d}" for i in order for j in range(counts[i])]
    keys = Counter(sequence[p % total] for p in seen)
    new = Counter()
    for rank in range(3):
        _, (pieces,) = shards.reads(left.runs(*left.span(Layout(3, 1, bs), rank, 0)))
        new.update(f"s{first[shard] + j:07d}" for shard, lo, hi in pieces for j in range(lo, hi))
    assert set(keys + new) == set(sequence)
    padding = sum(new.values()) - left.length
    assert 0 <= padding < 3 * bs
    assert sum(n - 1 for n in (keys + new).values()) == sum(n - 1 for n in keys.values()) + padding


def damaged_shards(tiny_shards, counts):
    """tiny_shards(counts), then: sample 3 of shard 1 made undecodable (its key kept), shard 4
    cut mid-way (its first samples read, then the read fails)."""
    import webdataset as wds

    from tests.conftest import jpeg

    index = tiny_shards(counts)
    root = index.parent
    first = list(itertools.accumulate(counts, initial=0))
    with wds.TarWriter(str(root / "tiny-000001.tar")) as w:
        for j in range(counts[1]):
            n = first[1] + j
            data = b"\xff\xd8 not a jpeg" if j == 3 else jpeg(n)[0]
            w.write({"__key__": f"s{n:07d}", "jpg": data, "cls": "1"})
    cut = root / "tiny-000004.tar"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    return str(index), {f"s{first[1] + 3:07d}"}, {f"s{first[4] + j:07d}" for j in range(counts[4])}


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_samples_and_a_failed_shard_keep_the_saved_state_small_and_exact(tiny_shards, workers):
    """A sample that fails to decode and a shard that fails mid-span are counted consumed (their
    rows stand-ins): the saved state stays a prefix (no skip set growing with every later
    sample), names exactly the positions delivered or lost, and a resume delivers the rest of the
    good keys once."""
    counts = [7, 13, 5, 11, 9, 6, 12]
    total, bs, seed = sum(counts), 3, 5
    spec, undecodable, cut = damaged_shards(tiny_shards, counts)
    c = LoaderConfig(
        batch_size=bs, workers=workers, mode="epoch", split="samples", image_size=8, with_keys=True,
        shuffle_buffer=4, seed=seed, max_bad=1.0,
    )  # fmt: skip
    first = list(itertools.accumulate(counts, initial=0))
    order = shard_order(range(len(counts)), seed, 0, 1)
    sequence = [f"s{first[i] + j:07d}" for i in order for j in range(counts[i])]

    def real(batches) -> list[str]:  # the keys of rows that are neither padding nor stand-ins
        return [k for b in batches for k, p in zip(b["key"], b["pos"].tolist(), strict=True) if p < total]

    loader = make_loader(spec, 0, 1, c)
    batches = list(loader)
    keys = real(batches)
    lost = set(sequence) - set(keys)  # the undecodable one and the cut shard's tail
    assert len(keys) == len(set(keys)) and undecodable < lost <= undecodable | cut
    assert sum(int(b["bad"][:, 0].sum()) for b in batches) == len(lost)
    state = loader.state_dict()
    for entry in state["point"]["workers"].values():
        for _start, skip in entry.values():
            assert len(skip) < bs + c.shuffle_buffer  # before the fix: every seq after the first hole
    # Mid-epoch: a checkpoint after 6 batches names what they delivered plus what was lost
    # before them, and a same-layout resume delivers every other good key once.
    loader = make_loader(spec, 0, 1, c)
    before = real(itertools.islice(iter(loader), 6))
    saved = loader.state_dict()
    progress = saved_progress(
        [ResumePoint.from_state(saved["point"])], 0, EpochSequence.of(total), Layout(1, workers, bs),
        lambda rank, worker, n: shuffled_offsets(seed, 4, rank, worker, 0, n),
    )  # fmt: skip
    consumed = {sequence[p % total] for p in consumed_positions(whole_epoch(total), progress)}
    assert set(before) <= consumed and consumed - set(before) <= lost
    after = real(make_loader(spec, 0, 1, c, saved))
    assert not set(before) & set(after) and len(after) == len(set(after))
    assert set(sequence) - set(before) - set(after) == lost


# ---------------------------------------------------------------- the loader, resumed on another layout


def loader_cfg(workers, **kw):
    base = dict(batch_size=3, workers=workers, mode="epoch", split="samples", image_size=8, with_keys=True,
                shuffle_buffer=20, seed=3)  # fmt: skip
    return LoaderConfig(**(base | kw))


def sequence_of(counts, seed, epoch):
    first = list(itertools.accumulate(counts, initial=0))
    return [f"s{first[i] + j:07d}" for i in shard_order(range(len(counts)), seed, epoch, 1) for j in range(counts[i])]


def run_layout(spec, world, workers, states, at=None, **kw):
    """Every rank's loader on this layout (resumed from ``states``, every old rank's entry),
    ``at`` batches of each (None: the epoch); the batches per rank, and the new states."""
    out, saved = [], []
    for rank in range(world):
        loader = make_loader(spec, rank, world, loader_cfg(workers, **kw), states)
        out.append(list(itertools.islice(iter(loader), at)))
        saved.append(loader.state_dict())
    return out, saved


def check_positions(batches, sequence):
    """Each batch position names its sample: position mod N; from N on, padding."""
    total = len(sequence)
    for rank_batches_ in batches:
        for b in rank_batches_:
            for pos, key in zip(b["pos"].tolist(), b["key"], strict=True):
                assert sequence[pos % total] == key


RESIZES = [
    # (old world, old workers, new world, new workers, batches before the checkpoint, remainder, cross_shuffle)
    (2, 2, 3, 1, 4, "pad", 0),
    (3, 1, 1, 2, 3, "pad", 0),
    (2, 2, 3, 1, 6, "drop", 5),
    (3, 1, 1, 2, 1, "drop", 0),
    (1, 0, 2, 2, 9, "pad", 4),
    (2, 2, 1, 3, 10, "pad", 0),  # 2 batches left for 3 workers: one reads nothing
    (2, 2, 3, 1, "end", "pad", 0),  # at the epoch's end: the next epoch runs whole on the new layout
    (3, 1, 1, 2, 0, "pad", 0),  # at the epoch's start
]


@pytest.mark.parametrize("old_world,old_workers,world,workers,at,remainder,cross", RESIZES)
def test_a_resized_loader_delivers_every_key_of_the_epoch_once_but_the_padding(
    tiny_shards, old_world, old_workers, world, workers, at, remainder, cross
):
    counts = [7, 13, 5, 11, 9, 6, 12]
    total, bs = sum(counts), 3
    spec = str(tiny_shards(counts))
    kw = dict(remainder=remainder, cross_shuffle=cross)
    k_old = rank_batches(total, old_world, bs, remainder)
    before, states = run_layout(spec, old_world, old_workers, None, k_old if at == "end" else at, **kw)
    sequence = sequence_of(counts, 3, 0)
    check_positions(before, sequence)
    seen = Counter(k for r in before for b in r for k in b["key"])
    loaders = [make_loader(spec, r, world, loader_cfg(workers, **kw), states) for r in range(world)]
    resize = loaders[0].resize
    after = [list(loader) for loader in loaders]
    assert len({len(r) for r in after}) == 1  # every rank the same batches: none hangs
    if at in ("end", 0):
        assert resize.batches == 0 and resize.start == (1 if at == "end" else 0)
        epoch = resize.start
        assert {int(b["id"][0, 0]) for r in after for b in r} == {epoch}  # a whole epoch on the new layout
        assert len(after[0]) == rank_batches(total, world, bs, remainder)
        if at == "end":
            assert Counter(seen) == Counter(sequence) + Counter(sequence[: k_old * old_world * bs - total])
        check_positions(after, sequence_of(counts, 3, epoch))
        return
    assert len(after[0]) == resize.batches == rank_batches(resize.remaining, world, bs, remainder)
    state = loaders[0].state_dict()  # at the resumed epoch's end: the next epoch is whole, no ranges kept
    assert state["point"] == {"epoch": 1, "workers": {}} and "elastic" not in state
    check_positions(after, sequence)
    new = Counter(k for r in after for b in r for k in b["key"])
    padded_positions = sum(int((b["pos"] >= total).sum()) for r in after for b in r)
    both = seen + new
    rest = resize.delivered - resize.remaining
    if remainder == "pad":
        assert set(both) == set(sequence)  # every key of the epoch at least once
        assert 0 <= rest < world * bs and padded_positions == rest
        assert sum(n - 1 for n in both.values()) == sum(n - 1 for n in seen.values()) + rest
    else:
        assert max(both.values()) == 1  # never twice
        assert 0 <= -rest < world * bs and len(both) == total + rest  # the old layout's drop is left, not lost
    # The next epoch is whole on the new layout.
    nxt = [list(loader) for loader in loaders]
    assert [len(r) for r in nxt] == [rank_batches(total, world, bs, remainder)] * world
    assert {int(b["id"][0, 0]) for r in nxt for b in r} == {1}
    keys = Counter(k for r in nxt for b in r for k in b["key"])
    assert set(keys) == set(sequence) if remainder == "pad" else max(keys.values()) == 1


def test_a_resumed_epoch_resumes_again_exactly_on_its_layout_and_on_a_third(tiny_shards):
    """2x2 -> 3x1 after 4 batches; 3x1 stopped after 2 more: on 3x1 it goes on bit for bit as if
    never stopped; on 1x2 (a second resize) the epoch still ends with every key once but padding."""
    counts = [7, 13, 5, 11, 9, 6, 12]
    total, bs = sum(counts), 3
    spec = str(tiny_shards(counts))
    sequence = sequence_of(counts, 3, 0)
    first, states = run_layout(spec, 2, 2, None, 4)
    straight, _ = run_layout(spec, 3, 1, states)
    second, states2 = run_layout(spec, 3, 1, states, 2)
    assert "elastic" in states2[0] and all(s["elastic"] == SHARED for s in states2[1:])  # one copy
    rest, _ = run_layout(spec, 3, 1, states2)
    for r in range(3):
        assert [b["key"] for b in second[r] + rest[r]] == [b["key"] for b in straight[r]]
    third, _ = run_layout(spec, 1, 2, states2)
    check_positions(third, sequence)
    seen = Counter(k for part in (first, second, third) for r in part for b in r for k in b["key"])
    assert set(seen) == set(sequence)
    positions = [p for part in (first, second, third) for r in part for b in r for p in b["pos"].tolist()]
    assert max(Counter(p for p in positions if p < total).values()) == 1  # no position twice as itself
    # Duplicates are padding only (a padding copy delivered before its original stands in for it).
    assert 0 < sum(n - 1 for n in seen.values()) <= sum(p >= total for p in positions) < (2 + 3 + 1) * bs


@pytest.mark.parametrize(
    "change,message",
    [
        ({"batch_size": 4}, "in the middle of epoch 0 with batch_size=3, now 4: keep it"),
        ({"seed": 4}, "with seed=3, now 4: keep it (each epoch's order comes from it)"),
        ({"remainder": "drop"}, "in the middle of epoch 0 with remainder=pad, now drop: keep it"),
        ({"shards": [7, 13, 5, 11, 9, 6, 11]}, "over other shards (63 samples in 7 shards then, 62 samples in 7"),
        ({"older": "samples"}, "lacks what a re-split needs (samples; written by an older version)"),
        ({"older": "split"}, "lacks what a re-split needs (split, samples, counts; written by an older version)"),
    ],
)
def test_a_resize_that_cannot_be_exact_is_refused_in_one_line(tiny_shards, change, message):
    counts = [7, 13, 5, 11, 9, 6, 12]
    spec = str(tiny_shards(counts))
    _, states = run_layout(spec, 2, 0, None, 2)
    if "older" in change:
        drop = {"samples": ["samples"], "split": ["split", "samples", "counts"]}[change["older"]]
        states = [{k: v for k, v in s.items() if k not in drop} for s in states]
    if "shards" in change:
        spec = str(tiny_shards(change["shards"], prefix="other"))
    kw = {k: v for k, v in change.items() if k in ("batch_size", "seed", "remainder")}
    with pytest.raises(UserError) as exc:
        make_loader(spec, 0, 3, loader_cfg(1, **kw), states, where="ckpt-0000002.pt")
    text = str(exc.value)
    assert "\n" not in text and text.startswith("ckpt-0000002.pt was saved")
    assert message in text


def check_once_but_padding(positions, total):
    """Every position of the epoch delivered, none twice as itself; duplicates are padding only
    (a padding copy delivered before its original stands in for it: the original is not re-sent)."""
    assert max(Counter(p for p in positions if p < total).values()) == 1
    assert set(p % total for p in positions) == set(range(total))
    assert len(positions) - total <= sum(p >= total for p in positions)


def per_epoch_positions(batches_by_rank):
    """epoch -> the positions delivered in it (repeat mode: a batch may span two epochs)."""
    out = {}
    for batches in batches_by_rank:
        for b in batches:
            for (epoch, _, _), pos in zip(b["id"].tolist(), b["pos"].tolist(), strict=True):
                out.setdefault(epoch, []).append(pos)
    return out


@pytest.mark.parametrize("at,world,workers", [(12, 3, 1), (8, 3, 1), (10, 1, 3)])
def test_repeat_mode_re_splits_each_epoch_in_flight_then_runs_whole_ones(tiny_shards, at, world, workers):
    """Repeat mode, 2x2 -> 3x1 (or 1x3): workers run across epochs. After 12 batches per rank (of
    11 an epoch) worker 1 is in epoch 1 and worker 0 at the end of epoch 0: epoch 1 is re-split,
    then epoch 2 runs whole; after 8 (or 10), epoch 0 is re-split, then epoch 1 runs whole. Every
    position of each epoch once as itself, duplicates only padding. After 10, 2 batches are left
    for 3 workers: one has nothing of epoch 0 and goes on to epoch 1 (not an error: no read failed)."""
    counts = [7, 13, 5, 11, 9, 6, 12]
    total, bs = sum(counts), 3
    spec = str(tiny_shards(counts))
    kw = dict(mode="repeat")
    before, states = run_layout(spec, 2, 2, None, at, **kw)
    loaders = [make_loader(spec, r, world, loader_cfg(workers, **kw), states) for r in range(world)]
    resize = loaders[0].resize
    assert [e for e, _, _ in resize.epochs] == ([1] if at == 12 else [0]) and resize.start == resize.epochs[0][0]
    k_whole = rank_batches(total, world, bs, "pad")
    take = sum(k for _, _, k in resize.epochs) + k_whole  # the re-split epochs, then epoch 2 (or 1) whole
    after = [list(itertools.islice(iter(loader), take)) for loader in loaders]
    seen, new = per_epoch_positions(before), per_epoch_positions(after)
    last = resize.epochs[-1][0] + 1  # the first epoch on the new layout
    for epoch in range(last + 1):
        positions = seen.get(epoch, []) + new.get(epoch, [])
        check_once_but_padding(positions, total)
        assert sum(p >= total for p in positions) < 2 * bs + world * bs  # the two layouts' padding at most
    assert len(new[last]) == k_whole * world * bs  # a whole epoch on the new layout
    assert all(batches == rank_batches(remaining, world, bs, "pad") for _, remaining, batches in resize.epochs)
