"""An index that claims more samples than a shard holds (loader.split=samples numbers every claimed
position): the positions it does not deliver ride on rows as runs and sit in the loader state as
runs, a few numbers however many; and a claim no shard could hold is refused when the index loads."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from wdsdist.data import Loader
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import shard_order, shuffled_offsets
from wdsdist.data.plan.resume import ConsumedTracker, ResumePoint, saved_progress
from wdsdist.data.plan.sequence import EpochSequence
from wdsdist.data.plan.splits import Layout
from wdsdist.data.sources import shardspec
from wdsdist.errors import DataError, UserError

CLAIMED = 200_000  # what the index says the middle shard holds; it holds 10


def overclaimed(tiny_shards):
    """Shards of 7, 10 and 9 samples; the index says the second holds CLAIMED (in the epoch's
    order at seed 1 it comes between the others, so real samples follow its gap)."""
    shards = shardspec.expand(str(tiny_shards([7, 10, 9])))
    # Built by hand: such an index is refused for a local tar (tested below); a remote shard's
    # size is unknown at load, and one under the cap still reaches the loader like this.
    shards[1] = shardspec.Shard(shards[1].url, CLAIMED)
    return shards


def consumed(point: ResumePoint, worker: int, epoch: int, seq: int) -> bool:
    start, skip = point.workers[worker][epoch]
    return seq < start or seq in skip or any(a <= seq < b for a, b in point.runs_of(worker, epoch))


@pytest.mark.parametrize(("workers", "cross", "at"), [(0, 0, 6), (1, 10, 4)])
def test_a_shard_short_of_its_claimed_count_costs_a_row_one_run_and_the_state_a_few_numbers(
    tiny_shards, capfd, workers, cross, at
):
    shards = overclaimed(tiny_shards)
    # partial: a loader whose losses are skipped, not filled (prediction's); a training loader fills
    # them, and past max_bad stops (test_a_training_loader_stops_at_max_bad_on_an_overclaimed_shard)
    c = LoaderConfig(
        batch_size=3, workers=workers, mode="epoch", split="samples", image_size=8, with_keys=True,
        shuffle_buffer=4, seed=1, cross_shuffle=cross, partial=True,
    )  # fmt: skip
    loader = make_loader(shards, 0, 1, c)
    before = list(itertools.islice(iter(loader), at))
    # Before the fix the row after the gap carried ~200,000 (epoch, seq) pairs, and with the
    # cross-worker shuffle the state listed every one of them.
    assert all(len(row) <= 1 for b in before for row in b["skipped"])  # one epoch: one run a row
    state = loader.state_dict()
    assert len(json.dumps(state)) < 1000
    # The checkpoint falls after the gap was skipped: with the cross-worker shuffle, while the
    # row carrying it overtook an earlier row of its worker (the run waits beyond the prefix).
    point = ResumePoint.from_state(state["point"])
    assert consumed(point, 0, 0, CLAIMED // 2)
    assert bool(point.runs) == bool(cross)
    # An elastic resume maps the state to the epoch's positions (replaying the shuffle): they
    # are what was delivered, and the gap.
    assert shard_order(range(3), c.seed, 0, 1) == [0, 1, 2]
    keys = [f"s{i:07d}" for i in range(26)]
    sequence = keys[:17] + [None] * (CLAIMED - 10) + keys[17:]  # None: the positions the shard lacks
    (progress,) = saved_progress(
        [point], 0, EpochSequence.of(len(sequence)), Layout(1, 1, c.batch_size),
        lambda rank, worker, n: shuffled_offsets(c.seed, c.shuffle_buffer, rank, worker, 0, n),
    )  # fmt: skip
    taken = [sequence[p] for a, b in progress.consumed() for p in range(a, b)]
    assert set(taken) - {None} == {k for b in before for k in b["key"]} and taken.count(None) > CLAIMED - 100
    after = list(make_loader(shards, 0, 1, c, state))
    runs = [r for b in before + after for row in b["skipped"] for r in row]
    assert all(len(row) <= 1 for b in after for row in b["skipped"])
    assert all(len(r) == 3 for r in runs) and max(b - a for _, a, b in runs) > CLAIMED - 100
    keys_before = [k for b in before for k in b["key"]]
    keys_after = [k for b in after for k in b["key"]]
    assert len(set(keys_before + keys_after)) == len(keys_before + keys_after)  # nothing read twice
    assert len(keys_before + keys_after) > 26 - c.batch_size  # every real sample but a partial batch's
    assert "its count says 200000" in capfd.readouterr().err


def test_the_tracker_moves_its_prefix_over_a_run_in_one_step_and_keeps_one_beyond_it_as_two_numbers():
    def row(*ids):
        return torch.tensor([ids])

    t = ConsumedTracker(0)
    t.update(row(0, 0, 0))
    # A row far ahead overtook the row at seq 1 (the cross-worker shuffle) and carries the
    # run skipped before it: kept as one run beyond the prefix, not a million seqs.
    t.update(row(0, 0, 1_000_002), [((0, 2, 1_000_002),)])
    point = t.point()
    assert point.workers == {0: {0: (1, frozenset({1_000_002}))}}
    assert point.runs == {0: {0: ((2, 1_000_002),)}}
    assert len(json.dumps(point.state())) < 200 and ResumePoint.from_state(point.state()) == point
    # Elastic resume reads it as consumed positions, as ranges too.
    (progress,) = saved_progress([point], 0, EpochSequence.of(3_000_000), Layout(1, 1, 1))
    assert progress.consumed() == [(0, 1), (2, 1_000_003)]
    # A resumed tracker holds the same; the row that fills the hole moves the prefix over the
    # run and the seq beyond it.
    resumed = ConsumedTracker(0)
    resumed.load(point, 2)
    for tracker in (t, resumed):
        tracker.update(row(0, 0, 1))
        assert tracker.point().workers == {0: {0: (1_000_003, frozenset())}} and not tracker.point().runs
    # A run that starts at (or before) the prefix moves it at once and forgets the seqs it passed,
    # also those a resumed worker passed over inside it.
    t.update(row(0, 0, 1_000_010))
    t.update(row(0, 0, 2_000_000), [((0, 1_000_003, 2_000_000),)])
    assert t.point().workers == {0: {0: (2_000_001, frozenset())}}
    t.update(row(0, 0, 2_000_005), [((0, 1_999_990, 2_000_005),)])
    assert t.point().workers == {0: {0: (2_000_006, frozenset())}}
    # A run of an epoch the worker left is dropped; its next epoch's starts its prefix.
    t.update(row(1, 0, 5), [((0, 2_000_006, 3_000_000), (1, 0, 5))])
    t.update(row(1, 0, 9), [((0, 9, 10),)])
    assert t.point().workers == {0: {1: (6, frozenset({9}))}} and not t.point().runs


def write_index(folder, *entries):
    path = folder / "claims.index.json"
    path.write_text(json.dumps({"shardlist": list(entries)}))
    return path


def test_an_index_claiming_more_samples_than_a_local_tar_can_hold_is_warned_of_in_one_line(tiny_shards, capsys):
    """A claim a local tar cannot hold (cut short, or a stale index) is one bad file: one warning
    line at load naming it and the numbers, and the run goes on (the shard is read as far as it
    goes, the rest skipped and counted)."""
    folder = tiny_shards([5, 5]).parent
    size = (folder / "tiny-000001.tar").stat().st_size
    fits = size // 512  # each sample takes at least one 512-byte header
    good = {"url": "tiny-000000.tar", "nsamples": 5}
    index = write_index(folder, good, {"url": "tiny-000001.tar", "nsamples": fits})
    assert [s.nsamples for s in shardspec.expand(str(index))] == [5, fits]
    assert capsys.readouterr().err == ""
    index = write_index(folder, good, {"url": "tiny-000001.tar", "nsamples": 50_000_000 // 4})
    assert [s.nsamples for s in shardspec.expand(str(index))] == [5, 12_500_000]
    assert capsys.readouterr().err == (
        f"warning: {index}: shardlist[1]: 'tiny-000001.tar': nsamples 12500000 cannot fit in its {size} bytes "
        f"(each sample takes at least one 512-byte tar header: at most {fits}): the shard is cut short or the "
        f"index stale (rewrite it: makeshards.py --index SHARDS); what it lacks is skipped and counted\n"
    )
    # A missing shard and one that is no tar keep failing when read (skipped and counted), as
    # any bad shard; their claims are held to the cap.
    (folder / "garbage.tar").write_bytes(b"not a tar" * 100)
    index = write_index(
        folder, good, {"url": "missing.tar", "nsamples": 100_000}, {"url": "garbage.tar", "nsamples": 100_000}
    )
    assert [s.nsamples for s in shardspec.expand(str(index))] == [5, 100_000, 100_000]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.tar", "s3://bucket/x.tar", "missing.tar"])
def test_a_claim_beyond_the_cap_is_refused_where_the_size_is_unknown(tmp_path, url):
    cap = 1 << 24  # shardspec.MAX_SHARD_SAMPLES
    assert [s.nsamples for s in shardspec.expand(str(write_index(tmp_path, {"url": url, "nsamples": cap})))] == [cap]
    index = write_index(tmp_path, {"url": url, "nsamples": cap + 1})
    with pytest.raises(UserError) as err:
        shardspec.expand(str(index))
    assert str(err.value) == (
        f"{index}: shardlist[0]: {url!r}: nsamples {cap + 1} is more than the {cap} samples a shard may claim "
        f"(a corrupt or hostile index?)"
    )


def test_a_training_loader_stops_at_max_bad_on_an_overclaimed_shard(tiny_shards):
    """Its stand-ins fill the positions the shard lacks until they pass max_bad: then the rank
    stops, naming the shard, long before it reads 200,000 stand-ins."""
    c = LoaderConfig(batch_size=8, workers=0, mode="epoch", split="samples", image_size=8, seed=1, max_bad=0.0005)
    loader = Loader(overclaimed(tiny_shards), c, rank=0, world=1)
    delivered = 0
    with pytest.raises(DataError, match=r"samples lost, past max_bad=0.0005 of its \d+ samples: shard .*-000001\.tar"):
        for _ in loader:
            delivered += 1
    assert delivered < 20  # about 100 stand-ins: the limit, not the claim
