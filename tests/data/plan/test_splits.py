"""The planner: pure counting, checked against hand-worked layouts and its own invariants."""

import pytest

from wdsdist.data.plan.splits import (
    nbatches_of,
    nearest_divisible,
    plan,
    split_by_rank,
    split_by_worker,
    suggest_dsrepeat,
)


def test_split_by_rank_and_worker_partition_the_list():
    items = list(range(23))
    world, nw = 3, 4
    seen = []
    for r in range(world):
        mine = split_by_rank(items, r, world)
        assert mine == items[r::world]
        for w in range(nw):
            seen += split_by_worker(mine, w, nw)
    assert sorted(seen) == items


@pytest.mark.parametrize("bad", [(0, 0), (3, 3), (-1, 2)])
def test_split_rejects_out_of_range_slots(bad):
    with pytest.raises(ValueError):
        split_by_rank([1, 2], *bad)


def test_classic_demo_layout_is_unequal_and_says_why():
    p = plan([100] * 10, world=3, nworkers=3, batch_size=10)
    assert p.batches == [40, 30, 30]
    assert [w.shards for w in p.ranks[0].workers] == [(0, 9), (3,), (6,)]
    assert not p.equal
    (problem,) = p.problems()
    assert "30..40" in problem and "nbatches=30" in problem and "9 or 18" in problem


def test_cut_and_dsrepeat():
    assert plan([100] * 10, 3, 3, 10, nbatches=26).batches == [26, 26, 26]
    short = plan([100] * 10, 3, 3, 10, nbatches=50)
    assert short.batches == [40, 30, 30]
    assert "dsrepeat=2" in short.problems()[0]
    assert suggest_dsrepeat(short, 50) == 2
    assert plan([100] * 10, 3, 3, 10, nbatches=50, dsrepeat=2).batches == [50, 50, 50]
    auto = plan([100] * 10, 3, 3, 10, nbatches="auto")
    assert auto.nbatches == 30 and auto.equal


def test_partial_batches_and_rebatching():
    # One rank, two workers of 15 and 10 samples, batch 4.
    counts = [15, 10]
    assert plan(counts, 1, 2, 4, partial=False, rebatch=False).batches == [3 + 2]
    assert plan(counts, 1, 2, 4, partial=True, rebatch=False).batches == [4 + 3]
    # Re-batching across workers merges the two partial batches: ceil(25 / 4).
    assert plan(counts, 1, 2, 4, partial=True, rebatch=True).batches == [7]
    assert plan([13, 10], 1, 2, 4, partial=True, rebatch=True).batches == [6]
    # Without partial batches workers emit only full ones, so re-batching keeps their count.
    assert plan([13, 10], 1, 2, 4, partial=False, rebatch=True).batches == [5]


def test_empty_rank_and_empty_worker_are_problems_with_numbers():
    (p,) = plan([5, 5], 3, 1, 2).problems()
    assert "1 of 3 ranks get no shard" in p and "at least 3 shards" in p
    (p,) = plan([5] * 4, 2, 3, 2).problems()
    assert "worker 2 gets no shard" in p and "at most 2 workers" in p


def test_nworkers_zero_is_one_worker():
    assert plan([10, 10, 10], 1, 0, 5).batches == plan([10, 10, 10], 1, 1, 5).batches == [6]


def test_nbatches_of_and_nearest_divisible():
    assert nbatches_of(25, 10, False) == 2 and nbatches_of(25, 10, True) == 3 and nbatches_of(20, 10, True) == 2
    assert nearest_divisible(10, 9) == "9 or 18"
    assert nearest_divisible(18, 9) == "18"
    assert nearest_divisible(4, 9) == "9"


def test_large_layout_plans_quickly_enough_to_be_interactive():
    # 100,000 shards x 1,024 ranks x 8 workers: a correctness check at scale (counts add up);
    # the time is reported by simdist's benchmark, not asserted here.
    p = plan([1000 + (i % 7) for i in range(100_000)], 1024, 8, 64, nbatches="auto")
    assert sum(len(r.shards) for r in p.ranks) == 100_000
    assert sum(r.samples for r in p.ranks) == p.total_samples
    assert p.equal and p.nbatches == min(r.available for r in p.ranks)
