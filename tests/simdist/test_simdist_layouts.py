"""Plan mode and real mode print identical per-rank lines, on many layouts.

Real mode runs the training loader with real DataLoader worker processes over tiny shards of
varied sizes; plan mode derives the lines from sample counts. Any difference is a bug in the
planner, in simdist's model of the delivery order, or in the loader.
"""

from __future__ import annotations

import random

import pytest

from wdsdist import simdist
from wdsdist.data.plan.splits import plan
from wdsdist.data.sources.shardspec import expand

COUNTS = [7, 19, 3, 25, 12, 1, 16, 9, 22, 5, 14, 11]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    index = simdist.write_synthetic_shards(COUNTS, str(tmp_path_factory.mktemp("layouts")), "lay")
    return expand(index)


def layout(shards, n: int) -> simdist.Layout:
    return simdist.Layout(tuple(COUNTS[:n]), f"first {n} shards", tuple(shards[:n]))


S = simdist.Settings
HAND_PICKED = [
    (10, S(size=3, nworkers=3, batch_size=4)),
    (12, S(size=2, nworkers=3, batch_size=5, partial=True)),  # short batches in the round-robin order
    (12, S(size=2, nworkers=3, batch_size=5, partial=True, nbatches=9)),  # the cut falls among them
    (11, S(size=3, nworkers=2, batch_size=3, nbatches="auto")),
    (9, S(size=3, nworkers=1, batch_size=4, nbatches=12, dsrepeat=2)),
    (8, S(size=2, nworkers=2, batch_size=4, nbatches=20, repeat=2, nepochs=2)),
    (12, S(size=2, nworkers=2, batch_size=6, partial=True, cross_shuffle=8)),  # re-batched across workers
    (12, S(size=2, nworkers=2, batch_size=6, cross_shuffle=8)),
    (7, S(size=2, nworkers=0, batch_size=3, partial=True)),  # loading in the main process
    (5, S(size=2, nworkers=3, batch_size=2)),  # a worker with no shard: refused in both modes
    (4, S(size=2, nworkers=2, batch_size=40)),  # batches larger than any worker's data
    (3, S(size=3, nworkers=1, batch_size=1, dsrepeat=3, partial=True, nbatches="auto")),
]


def seeded_layouts(n: int, seed: int = 20240611):
    rng = random.Random(seed)
    for _ in range(n):
        yield (
            rng.randint(1, len(COUNTS)),
            S(
                size=rng.randint(1, 4),
                nworkers=rng.randint(0, 3),
                batch_size=rng.randint(1, 7),
                partial=rng.random() < 0.5,
                nbatches=rng.choice([None, None, "auto", rng.randint(1, 12)]),
                dsrepeat=rng.choice([1, 1, 2, 3]),
                repeat=rng.choice([1, 1, 2]),
                cross_shuffle=rng.choice([0, 0, 5]),
                seed=rng.randint(0, 9),
            ),
        )


@pytest.mark.parametrize("n, settings", HAND_PICKED + list(seeded_layouts(12)))
def test_plan_and_real_print_the_same_rank_lines(shards, n, settings):
    sim = simdist.simulate_plan(layout(shards, n), settings)
    real = simdist.simulate_real(sim)
    expected = simdist.rank_lines(sim.expected, verbose=True)
    assert len(real.epochs) == settings.nepochs
    for epoch in real.epochs:
        assert simdist.rank_lines(epoch, verbose=True) == expected
    ok, _ = simdist.verdict(real.epochs)
    assert ok == simdist.verdict([sim.expected])[0]
    for c in real.coverage:
        assert c.delivered == sum(r.samples for r in sim.expected)
        if settings.dsrepeat == settings.repeat == 1:
            assert c.duplicated == 0


def test_delivered_counts_are_the_planners():
    """With one loader pass per epoch, simdist's per-rank batch counts are splits.plan's, cut included."""
    rng = random.Random(7)
    for _ in range(400):
        counts = [rng.randint(0, 60) for _ in range(rng.randint(1, 40))]
        s = S(
            size=rng.randint(1, 9),
            nworkers=rng.randint(0, 6),
            batch_size=rng.randint(1, 16),
            partial=rng.random() < 0.5,
            nbatches=rng.choice([None, rng.randint(1, 50)]),
            dsrepeat=rng.randint(1, 3),
            cross_shuffle=rng.choice([0, 10]),
        )
        sim = simdist.simulate_plan(simdist.Layout(tuple(counts), "random"), s)
        p = plan(
            counts,
            s.size,
            s.nworkers,
            s.batch_size,
            partial=s.partial,
            dsrepeat=s.dsrepeat,
            rebatch=s.cross_shuffle > 0,
            nbatches=s.nbatches,
        )
        for mine, theirs in zip(sim.expected, p.ranks, strict=True):
            if not mine.refused:
                assert mine.batches == theirs.batches
                assert mine.samples == min(theirs.samples, mine.samples)
