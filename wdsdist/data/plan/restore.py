"""Resuming, decided in one place: a saved ``LoaderState`` and the loader now (its layout, options,
shards and sources) -> what this rank delivers next (``Restored``), or one line saying why not.

Every outcome of a resume is here, and ``Loader`` and ``RankLoader`` only apply the answer:
  - the same layout (ranks and workers): exact. Each worker passes over what it had delivered,
    and the next batch comes from the worker whose turn it was (``turn``), so the batches are
    the uninterrupted run's, batch for batch;
  - another layout, split=samples: the epochs in flight are re-split (``_resplit``): their
    remaining positions, found by replaying the old workers' shuffles and mapping them through
    the epoch's sequence (padding delivered before the checkpoint included), are cut into equal
    spans of the new layout; later epochs are whole;
  - another layout, split=shards: repeat and resampled mode start a fresh stream, reseeded with
    the step count (said in one line); epoch mode refuses;
  - refusals (UserError, one line naming the field and both values): other shards or sample
    counts, other sources, another seed, and in the middle of an epoch another batch size,
    split, mode, remainder, shuffle buffer, dsrepeat or cross-worker shuffle: each changes what
    the saved positions mean. Where no epoch is in flight those may change (the next epoch is
    read with the new ones); several data sets may change their weights there too (mix.carry_over).
Pure: numbers in, numbers out; every rank computes the same from the same checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from wdsdist.data.options import LoaderConfig, LoaderMode
from wdsdist.data.plan.mix import Mix, MixEpoch, carry_over, differences
from wdsdist.data.plan.order import GLOBAL, NodeOrder, node_order, shuffled_offsets
from wdsdist.data.plan.resume import ResumePoint, remaining_after, saved_progress
from wdsdist.data.plan.sequence import EpochSequence, Ranges
from wdsdist.data.plan.splits import Layout
from wdsdist.data.plan.state import LoaderState, RankState, counts_digest
from wdsdist.errors import UserError

# Options the saved positions mean something only with: refused when they change in the middle of
# an epoch (each worker's stream, its spans and its batches come from them), and why.
IN_FLIGHT = {
    "batch_size": "each worker's span is whole batches",
    "split": "it decides what each worker reads",
    "mode": "it decides how workers go from epoch to epoch",
    "remainder": "it decides the epoch's padding",
    "shuffle_buffer": "a resumed worker replays its shuffle",
    "dsrepeat": "it decides each worker's shards",
    "cross_shuffle": "it decides how batches are made",
}
# What an elastic re-split needs from every rank's entry (states older versions wrote may lack it).
NEEDED = ("batch_size", "split", "remainder", "shuffle_buffer", "seed", "samples", "counts")


@dataclass(frozen=True)
class Resize:
    """What an elastic resume does, for the startup line."""

    old_world: int
    old_workers: int
    world: int
    workers: int
    batch_size: int
    start: int  # the epoch the new layout starts in
    # The epochs re-split, from ``start`` on: (epoch, samples left of it, batches per rank). Epoch
    # mode has one at most (none: resumed at an epoch's start); in repeat mode a worker may have
    # been an epoch ahead of another, so there may be more.
    epochs: tuple[tuple[int, int, int], ...] = ()

    @property
    def remaining(self) -> int:
        return self.epochs[0][1] if self.epochs else 0

    @property
    def batches(self) -> int:
        return self.epochs[0][2] if self.epochs else 0

    @property
    def delivered(self) -> int:
        return self.batches * self.world * self.batch_size

    def line(self) -> str:
        old, new = Layout(self.old_world, self.old_workers, 1), Layout(self.world, self.workers, 1)
        layout = f"resize: {old.text()} -> {new.text()}"
        if not self.epochs:
            return f"{layout}, at the start of epoch {self.start}: nothing to re-split"
        parts = []
        for epoch, remaining, batches in self.epochs:
            rest = batches * self.world * self.batch_size - remaining
            extra = f"padding {rest}" if rest >= 0 else f"dropping {-rest}"
            parts.append(
                f"epoch {epoch}: {remaining} samples remain, {batches} batches of {self.batch_size} per rank, {extra}"
            )
        return f"{layout}, " + "; ".join(parts)


@dataclass(frozen=True)
class Restored:
    """What a rank delivers next. ``point``: where each of its workers stands (None: nothing
    delivered); ``batches``: of ``point``'s epoch, delivered already; ``turn``: the worker whose
    batch comes next; ``elastic``: epochs re-split (their positions still to deliver);
    ``orders``: epochs read in another layout's shard order; ``seed``: a reseeded stream's;
    ``mix``: the sources to read with; ``steps``, ``before_resume``, ``resume_epoch``: the run's
    steps, and the batches of ``resume_epoch`` delivered before an elastic resume; ``notes``:
    (logging level, line) to say once (rank 0)."""

    point: ResumePoint | None = None
    batches: int = 0
    turn: int = 0
    elastic: dict[int, Ranges] = field(default_factory=dict)
    orders: dict[int, NodeOrder] = field(default_factory=dict)
    seed: int | None = None
    mix: Mix | None = None
    resize: Resize | None = None
    steps: int = 0
    before_resume: int = 0
    resume_epoch: int = -1
    notes: tuple[tuple[int, str], ...] = ()


def restore(
    saved: LoaderState,
    rank: int,
    world: int,
    cfg: LoaderConfig,
    counts: Sequence[int] | None,
    nshards: int,
    mix: Mix | None = None,
    where: str = "the loader state",
) -> Restored:
    """Rank ``rank`` of ``world`` resumed from ``saved`` with ``cfg`` over shards of ``counts``
    (None: not known, split=shards) and ``nshards``, reading ``mix`` (several data sets) or not;
    ``where`` names the checkpoint in the refusals (UserError, one line)."""
    first = saved.first
    mix, notes = _carried_mix(saved, mix, where)
    _check_data(first, counts, nshards, where)
    notes += _check_options(saved, cfg, where)
    base = Restored(mix=mix, steps=saved.steps, resume_epoch=first.point.epoch, notes=notes)
    layout = Layout(world, cfg.workers, cfg.batch_size, str(cfg.remainder))
    if len(saved.ranks) == world and first.workers == cfg.workers:
        return _same_layout(saved, rank, layout, cfg, counts, base, where)
    if any(r is None for r in saved.ranks):
        raise UserError(f"{where} holds one rank's position only (saved without torch.distributed): same layout only")
    what = f"{where} was saved with {Layout(first.world, first.workers, 1).text()}, now {layout.text()}"
    if cfg.by_samples and counts is not None:
        return _resplit(saved, rank, layout, counts, base, what)
    if cfg.mode == LoaderMode.epoch:
        raise UserError(
            f"{what}: loader.mode=epoch resumes on another layout only with loader.split=samples "
            f"(with split=shards: the same ranks and workers)"
        )
    line = f"{what}: the loader starts a fresh, reseeded stream (loader.split=samples would resume it exactly)"
    return replace(base, seed=cfg.seed + saved.steps, notes=(*notes, (logging.WARNING, line)))


def _same_layout(
    saved: LoaderState, rank: int, layout: Layout, cfg: LoaderConfig, counts: Sequence[int] | None, base: Restored,
    where: str,
) -> Restored:  # fmt: skip
    mine = saved.ranks[rank]
    if mine is None:
        raise UserError(f"{where} lacks rank {rank}'s position (saved without torch.distributed)")
    # An epoch in flight goes on in the shard order it began in (loader.shard_order changed).
    orders = dict(mine.orders)
    own = GLOBAL if counts is None else own_order(cfg, sum(counts), layout.world)
    if mine.split == "samples" and mine.order != own:
        for epoch in {mine.point.epoch, *(e for epochs in mine.point.workers.values() for e in epochs)}:
            orders.setdefault(epoch, mine.order)
    turn = mine.turn
    if turn is None:  # an older state: the DataLoader's turn as an epoch's batches give it
        turn = mine.batches % layout.nworkers if cfg.mode == LoaderMode.epoch else 0
    return replace(
        base,
        point=mine.point,
        batches=mine.batches,
        seed=mine.stream_seed,  # a reseeded stream goes on with its seed
        turn=0 if cfg.rebatch else turn % layout.nworkers,
        elastic=mine.elastic,
        orders=orders,
        before_resume=saved.before_resume,
    )


def _resplit(
    saved: LoaderState, rank: int, layout: Layout, counts: Sequence[int], base: Restored, what: str
) -> Restored:
    """Another layout, split=samples: each epoch in flight re-split over ``layout`` (the module)."""
    states: list[RankState] = list(saved.ranks)  # type: ignore[arg-type]
    first = states[0]
    missing = [key for key in NEEDED if any(getattr(s, key) is None for s in states)]
    if missing:
        raise UserError(
            f"{what}, and its loader state lacks what a re-split needs ({', '.join(missing)}; written by an older "
            f"version): resume it with {first.world} ranks x {first.workers} workers"
        )
    if first.split != "samples":
        raise UserError(f"{what}: only a run with loader.split=samples resumes on another layout")
    old = Layout(first.world, first.workers, first.batch_size, first.remainder)  # type: ignore[arg-type]
    points = [s.point for s in states]
    begun = {e for p in points for epochs in p.workers.values() for e in epochs}
    lo = min([p.epoch for p in points] + sorted(begun))
    resplit: list[tuple[int, EpochSequence]] = []
    # to the newest epoch a worker began, or one an earlier re-split left and nobody began yet
    for epoch in range(lo, max([*begun, *first.elastic], default=lo) + 1):
        started = any(e >= epoch for e in begun) or any(p.epoch > epoch for p in points)
        if not started and epoch not in first.elastic:
            continue  # begun by no worker: whole on the new layout
        sequence = _sequence(first, epoch, counts, base.mix)
        if started:
            replay = _replay(first, epoch)
            sequence = remaining_after(sequence, saved_progress(points, epoch, sequence, old, replay))
        resplit.append((epoch, sequence))
    start = lo
    while resplit and not resplit[0][1].batches(layout):
        start = resplit.pop(0)[0] + 1  # nothing left of it (with drop: less than a batch per rank)
    summary = tuple((e, s.length, s.batches(layout)) for e, s in resplit)
    resize = Resize(old.world, old.workers, layout.world, layout.workers, layout.batch_size, start, summary)
    before = first.batches + saved.before_resume if resplit and resplit[0][0] == first.point.epoch else 0
    return replace(
        base,
        point=ResumePoint(start),
        elastic={e: s.ranges for e, s in resplit},
        # A re-split epoch's positions name samples through the shard order it began in.
        orders={e: first.orders.get(e, first.order) for e, _ in resplit},
        resize=resize,
        before_resume=before,
        resume_epoch=first.point.epoch,
    )


def _sequence(first: RankState, epoch: int, counts: Sequence[int], mix: Mix | None) -> EpochSequence:
    """The saved run's sequence of ``epoch`` (its padding through the mix, for several data sets;
    node by node in the order the epoch began in)."""
    if mix is None:
        return EpochSequence.of(sum(counts), first.elastic.get(epoch), order=first.orders.get(epoch, first.order))
    mixed = MixEpoch(mix, first.seed, epoch, first.batch_size)  # type: ignore[arg-type]
    return EpochSequence.of(mixed.total, first.elastic.get(epoch), mixed.padding)


def _replay(first: RankState, epoch: int):  # noqa: ANN202 (a callable, as saved_progress takes it)
    seed, buffer = first.seed, first.shuffle_buffer
    return lambda rank, worker, n: shuffled_offsets(seed, buffer, rank, worker, epoch, n)  # type: ignore[arg-type]


def own_order(cfg: LoaderConfig, total: int, world: int) -> NodeOrder:
    """The nodes this layout's order keeps shares for (order.node_order)."""
    return node_order(cfg.shard_order, total, world, cfg.node_ranks, cfg.batch_size, cfg.remainder)


def options_of(cfg: LoaderConfig) -> dict:
    """The options a state records and a resume compares (``IN_FLIGHT`` and the seed)."""
    return {
        "mode": str(cfg.mode),
        "split": "samples" if cfg.by_samples else "shards",
        "batch_size": cfg.batch_size,
        "remainder": str(cfg.remainder),
        "shuffle_buffer": cfg.shuffle_buffer,
        "seed": cfg.seed,
        "dsrepeat": cfg.dsrepeat,
        "cross_shuffle": cfg.cross_shuffle,
        "recipe": recipe_of(cfg),
    }


RECIPE = ("augment", "augment_n", "augment_m", "random_erase", "size_schedule", "image_size", "crop_scale")


def recipe_of(cfg: LoaderConfig) -> str:
    """The options a training sample's pixels are drawn with, as one string a state records."""
    return "; ".join(f"{key}={getattr(cfg, key)}" for key in RECIPE)


def _recipe_change(then: str, now: str) -> str:
    """The recipe's options that differ, "key old -> new" each."""
    old, new = (dict(p.split("=", 1) for p in s.split("; ")) for s in (then, now))
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in new if old.get(k) != new[k])


def _check_options(saved: LoaderState, cfg: LoaderConfig, where: str) -> tuple[tuple[int, str], ...]:
    """Refuse (UserError, one line) options that change what the saved position means; the note
    for a recipe changed at an epoch's end."""
    first, now = saved.first, options_of(cfg)
    if first.seed is not None and first.seed != cfg.seed:
        raise UserError(
            f"{where} was saved with seed={first.seed}, now {cfg.seed}: keep it (each epoch's order comes from it)"
        )
    changed = first.recipe is not None and cfg.train and first.recipe != now["recipe"]
    if changed and saved.in_flight:
        raise UserError(
            f"{where} was saved in the middle of epoch {first.point.epoch}, and the recipe changed "
            f"({_recipe_change(first.recipe, now['recipe'])}): keep it (each sample's pixels are drawn with it), "
            f"or resume from a checkpoint at an epoch's end"
        )
    if not saved.in_flight:
        if changed:
            change = _recipe_change(first.recipe, now["recipe"])
            line = f"the recipe changes from epoch {first.point.epoch} on: {change}"
            return ((logging.INFO, line),)
        return ()
    for key, why in IN_FLIGHT.items():
        then = getattr(first, key)
        if then is not None and then != now[key]:
            raise UserError(
                f"{where} was saved in the middle of epoch {first.point.epoch} with {key}={then}, now {now[key]}: "
                f"keep it ({why}), or resume from a checkpoint at an epoch's end"
            )
    return ()


def _check_data(first: RankState, counts: Sequence[int] | None, nshards: int, where: str) -> None:
    then = (first.shards, first.samples, first.counts)
    now = (nshards, None if counts is None else sum(counts), None if counts is None else counts_digest(counts))
    if all(a is None or b is None or a == b for a, b in zip(then, now, strict=True)):
        return
    old = f"{first.samples} samples" if first.samples is not None else "shards"
    old += f" in {first.shards} shards" if first.shards is not None else ""
    new = f"{now[1]} samples in {nshards} shards" if now[1] is not None else f"{nshards} shards"
    same = " (other sample counts per shard)" if then[:2] == now[:2] else ""
    raise UserError(f"{where} was saved over other shards ({old} then, {new} now){same}: resume on the same shards")


def _carried_mix(saved: LoaderState, mix: Mix | None, where: str) -> tuple[Mix | None, tuple[tuple[int, str], ...]]:
    """The sources a resume reads with: the checkpoint's mix going on (its origin), or new
    weights from the epoch it ended (a curriculum, said in one line); other changes refused."""
    state = saved.first.mix
    if mix is None and state is None:
        return None, ()
    if mix is None:
        raise UserError(f"{where} was saved reading several data sets ({state.sources}): give the same sources")  # type: ignore[union-attr]
    if state is None:
        raise UserError(f"{where} was saved reading one data set: resume it without data.sources")
    notes: tuple[tuple[int, str], ...] = ()
    if state.spec is not None:
        boundary = not any(r is not None and (r.point.workers or r.batches) for r in saved.ranks)
        mix, line = carry_over(state.spec, state.digest, mix, saved.first.point.epoch, boundary, where)
        notes = ((logging.INFO, line),) if line is not None else ()
    if state.digest not in (mix.digest(), mix.previous):
        changed = differences(state.sources, mix.describe())
        raise UserError(
            f"{where} was saved with other data.sources ({changed or 'epoch_samples'}): give the same sources"
        )
    return mix, notes
