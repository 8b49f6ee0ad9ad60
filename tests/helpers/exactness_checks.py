"""The randomized exactness test's checks of what the loader delivered against the model
(tests/helpers/exactness.py runs a case and calls them)."""

from __future__ import annotations

from collections import Counter

from tests.helpers import model as m
from tests.helpers.exactness_cases import Case
from tests.helpers.exactness_data import Got, RankRun, Sequence, Shards


def check_steps(case: Case, seq: Sequence, shards: Shards, real: list[Got], want: list[m.Step], groups: Counter):
    """A rank's batches against the model's (``groups``: every (worker, epoch, tag) the model's
    workers read, in whole epochs, to hold shuffled batches to)."""
    assert len(real) == len(want), f"{len(real)} batches delivered, the model says {len(want)}"
    # Without a shuffle buffer each batch is the model's; mix=stratified makes a batch of each
    # source's rows together, and in a re-split epoch its own batches to the shares (test_mix)
    exact = case.buffer == 0 and case.mix != "stratified"
    for i, (g, w) in enumerate(zip(real, want, strict=True)):
        assert (g.worker, g.epoch) == (w.worker, w.epoch), (
            f"batch {i}: worker, epoch {(g.worker, g.epoch)}, model {(w.worker, w.epoch)}"
        )
        mine = g.labels if case.split == "shards" else g.tags
        assert not exact or mine == w.tags, f"batch {i}: {mine}, the model says {w.tags}"
        if case.split == "samples":
            named = tuple(seq.sample(e, t) for e, t in zip(g.epochs, g.tags, strict=True))
            assert g.labels == named, f"batch {i}: samples {g.labels}, its positions name {named}"
        if g.sources is not None:
            assert g.sources == tuple(shards.source[x] for x in g.labels), f"batch {i}: sources {g.sources}"
    if exact:
        return
    rows = Counter(
        (g.worker, e, x)
        for g in real
        for e, x in zip(g.epochs, g.labels if case.split == "shards" else g.tags, strict=True)
    )
    for (worker, epoch, x), n in rows.items():  # a shuffle reorders within a worker's epoch only
        assert n <= groups[worker, epoch, x], (
            f"worker {worker} epoch {epoch}: {x} {n} times, the model {groups[worker, epoch, x]}"
        )
    # where the model's batches so far hold a worker's whole epoch, the run's hold all of it too
    size = Counter((w, e) for w, e, _ in groups.elements())
    taken = Counter((w.worker, e) for w in want for e in (w.epochs or (w.epoch,) * len(w.tags)))
    for key in (k for k, n in taken.items() if n == size[k]):
        got = sum(n for (w, e, _), n in rows.items() if (w, e) == key)
        assert got == size[key], f"worker {key[0]} epoch {key[1]}: {got} of its {size[key]} samples delivered"


def check_coverage(case: Case, seq: Sequence, delivered: dict[int, list[int]], epochs: range) -> None:
    """Every epoch: each position once as itself; pad: none missing; drop: none twice."""
    for epoch in epochs:
        n, tags = seq.total(epoch), delivered.get(epoch, [])
        itself = Counter(t for t in tags if t < n)
        assert not itself or max(itself.values()) == 1, f"epoch {epoch}: a position twice as itself"
        if case.remainder == "pad":
            missing = set(range(n)) - {t % n for t in tags}
            assert not missing, f"epoch {epoch}: positions {sorted(missing)[:10]} never delivered"
        else:
            assert all(t < n for t in tags) and len(tags) == len(set(tags)), f"epoch {epoch}: drop repeated one"


def check_pixels(case: Case, runs: list[RankRun], steps_taken: int, pixels: dict[tuple[int, int, int], int]) -> None:
    """Each batch at its planned size (the size schedule: by epoch, or by the rank's batches since
    the run began); with split=samples, a sample's pixels at a size the same whenever and wherever
    it is delivered (its draws come from its epoch and position: seeds.sample_draws)."""
    for rank, run in enumerate(runs):
        for i, g in enumerate(run.steps):
            want = case.size_at(g.epoch, steps_taken + i)
            assert g.size == want, (
                f"rank {rank} batch {steps_taken + i} (epoch {g.epoch}): size {g.size}, planned {want}"
            )
            if case.split != "samples":
                continue
            for e, t, crc in zip(g.epochs, g.tags, g.pixels, strict=True):
                # keyed by size too: in repeat mode a sample's size is its batch's, which the layout decides
                assert pixels.setdefault((e, t, g.size), crc) == crc, f"epoch {e} position {t}: other pixels"
