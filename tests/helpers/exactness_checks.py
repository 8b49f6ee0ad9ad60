"""The randomized exactness test's checks of what the loader delivered against the model
(tests/helpers/exactness.py runs a case and calls them).

With split=samples each row is held to the position it stands for (``meant``: its seq's in its
worker's stream, as the model splits and the shuffle orders it): the row of a good position is
that position, the row of a lost one a stand-in (model.stand_in) that counts the loss."""

from __future__ import annotations

from collections import Counter

from tests.helpers import model as m
from tests.helpers.exactness_cases import Case
from tests.helpers.exactness_data import Got, RankRun, Sequence, Shards
from wdsdist.data.plan import seeds


def check_steps(
    case: Case,
    seq: Sequence,
    shards: Shards,
    real: list[Got],
    meant: list[tuple[int, ...]],
    want: list[m.Step],
    groups: Counter,
) -> None:
    """A rank's batches against the model's (``groups``: every (worker, epoch, tag) the model's
    workers read, in whole epochs, to hold shuffled batches to); ``meant``: split=samples, the
    positions the rows stand for (check_rows holds each row to its own)."""
    assert len(real) == len(want), f"{len(real)} batches delivered, the model says {len(want)}"
    # Without a shuffle buffer each batch is the model's; mix=stratified makes a batch of each
    # source's rows together, and in a re-split epoch its own batches to the shares (test_mix)
    exact = case.buffer == 0 and case.mix != "stratified"
    for i, (g, w) in enumerate(zip(real, want, strict=True)):
        assert (g.worker, g.epoch) == (w.worker, w.epoch), (
            f"batch {i}: worker, epoch {(g.worker, g.epoch)}, model {(w.worker, w.epoch)}"
        )
        mine = g.labels if case.split == "shards" else meant[i]
        assert not exact or mine == w.tags, f"batch {i}: {mine}, the model says {w.tags}"
        if case.split == "samples":
            named = tuple(seq.sample(e, t) for e, t in zip(g.epochs, g.tags, strict=True))
            assert g.labels == named, f"batch {i}: samples {g.labels}, its positions name {named}"
            check_rows(case, seq, shards, g, meant[i], f"batch {i}")
        if g.sources is not None:
            assert g.sources == tuple(shards.source[x] for x in g.labels), f"batch {i}: sources {g.sources}"
    if exact:
        return
    rows = Counter(
        (g.worker, e, x)
        for i, g in enumerate(real)
        for e, x in zip(g.epochs, g.labels if case.split == "shards" else meant[i], strict=True)
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


def check_rows(case: Case, seq: Sequence, shards: Shards, g: Got, meant: tuple[int, ...], where: str) -> None:
    """Each row of a batch against the position it stands for: a good one's row is itself and
    counts no loss; a lost one's is its stand-in (model.stand_in; the same wherever that loss is
    filled), a good sample, and counts the loss where the position is read as itself. The batch
    names the damaged samples its rows count, and only unreadable shards as failed reads."""
    names = []
    for e, p, t, lost in zip(g.epochs, meant, g.tags, g.lost, strict=True):
        n, gone = seq.total(e), seq.lost(e)
        if p % n not in gone:
            assert (t, lost) == (p, 0), f"{where}: position {p} of epoch {e}, delivered as {t}, {lost} losses counted"
            continue
        first = seeds.sample_fill(case.seed, e, p % n) % n
        filled = m.stand_in(n, first, gone, one_source=seq.mix is None)
        assert t >= n and t % n not in gone and t == (filled or t), (
            f"{where}: lost position {p} of epoch {e} filled by {t}, the model says {filled or 'a good padding tag'}"
        )
        assert seq.stood.setdefault((e, p % n), t) == t, f"{where}: epoch {e} position {p}: another stand-in"
        assert lost == m.counted(p, n, gone), f"{where}: epoch {e} position {p}: {lost} losses counted"
        if lost and seq.sample(e, p) in shards.damaged:
            names.append(shards.name(seq.sample(e, p)))
    assert list(g.named) == names, f"{where}: bad_samples {list(g.named)}, the losses counted {names}"
    assert set(g.failed) <= {shards.urls[s] for s in shards.unreadable}, f"{where}: bad_shards {g.failed}"
    assert bool(sum(g.reads)) == bool(g.failed), f"{where}: {sum(g.reads)} failed reads, bad_shards {g.failed}"


def check_coverage(case: Case, seq: Sequence, delivered: dict[int, list[int]], epochs: range) -> None:
    """Every epoch: each position once as itself; pad: none missing; drop: none twice (the
    positions the rows stand for; check_rows and check_losses hold the rows themselves)."""
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


def check_losses(seq: Sequence, shards: Shards, runs: dict[int, list[tuple[int, int, int]]], failed: set[str]) -> None:
    """Every epoch's rows (``runs``: epoch -> (position meant, tag, losses counted) of each row
    delivered): each good position once as itself, no lost one as itself, and as many losses
    counted as lost positions read as themselves (one read as padding only is not counted).
    ``failed``: the shards the batches named; among them, every unreadable one that a delivered
    row stands for."""
    for epoch, rows in sorted(runs.items()):
        n, gone = seq.total(epoch), seq.lost(epoch)
        itself = Counter(t for _, t, _ in rows if t < n)
        assert not set(itself) & gone, f"epoch {epoch}: lost positions {sorted(set(itself) & gone)} delivered"
        assert not itself or max(itself.values()) == 1, f"epoch {epoch}: a good position twice as itself"
        reached = {p for p, _, _ in rows if p < n and p in gone}
        assert sum(c for _, _, c in rows) == len(reached), (
            f"epoch {epoch}: {sum(c for _, _, c in rows)} losses counted, {len(reached)} lost positions read"
        )
        for p in {p % n for p, _, _ in rows} & gone:
            shard = shards.shard_of(seq.sample(epoch, p))
            assert shard not in shards.unreadable or shards.urls[shard] in failed, (
                f"epoch {epoch}: position {p} of unreadable {shards.urls[shard]} filled, never named in bad_shards"
            )
