"""Elastic resume (loader.split=samples): every old rank's saved loader state turned into one
rank's state on a new layout (another world size and/or worker count).

The interrupted epoch's remaining positions are worked out from all old ranks' states (each old
worker's seq-based progress mapped to span positions by replaying its shuffle:
``resume.saved_progress``), as ranges; the new rank's loader re-splits them by the equal-batches
rule (``resume.resplit_pieces``), read through the shard order the epoch began in (with
loader.shard_order=node, the old layout's: state "orders"), and goes on with whole epochs on
the new layout, in its own order. Every rank
computes the same from the same checkpoint, so they agree without talking. The state stays
O(ranks x workers) ranges; the replay costs O(samples of the epoch) time once, at startup.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import GLOBAL, iter_shuffled_offsets
from wdsdist.data.plan.resume import (
    Ranges,
    ResumePoint,
    ranges_length,
    remaining_after,
    saved_progress,
    whole_epoch,
)
from wdsdist.data.plan.splits import rank_batches
from wdsdist.errors import UserError

# What a loader state must hold for a re-split (RankLoader.state_dict writes them).
NEEDED = ("world", "workers", "batch_size", "split", "remainder", "shuffle_buffer", "seed", "samples", "counts")


# In a loader state's "elastic" on ranks other than 0: the ranges are rank 0's.
SHARED = "as rank 0"


def rank_state(states: Sequence[dict], rank: int) -> dict:
    """Rank ``rank``'s saved state for a resume on the same layout, with the ranges of an epoch
    re-split on an earlier resume (saved once, in rank 0's state) put back."""
    state = states[rank]
    if state.get("elastic") == SHARED:
        state = dict(state, elastic=states[0]["elastic"])
    return state


def counts_digest(counts: Sequence[int]) -> str:
    """A short fingerprint of the shards' sample counts, in order: an epoch's sample sequence is
    defined by them (and the seed), so a resume onto other shards is refused, not misread."""
    return hashlib.sha1(",".join(map(str, counts)).encode()).hexdigest()[:16]


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
        layout = f"resize: {_layout(self.old_world, self.old_workers)} -> {_layout(self.world, self.workers)}"
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


def _layout(world: int, workers: int) -> str:
    return f"{world} rank{'s' if world != 1 else ''} x {workers} worker{'s' if workers != 1 else ''}"


# One long function: the refusals, the per-epoch re-split and the summary read as
# one sequence of checks and steps; split apart, each piece would need most of the others' names.
def resize_state(
    saved: Sequence[dict],
    rank: int,
    world: int,
    cfg: LoaderConfig,
    counts: Sequence[int],
    where: str,
    totals: Callable[[int], int] | None = None,
) -> tuple[dict, Resize]:
    """This rank's loader state on ``world`` ranks x ``cfg.workers`` workers, from every old rank's
    saved state (in rank order); ``counts``: the shards' sample counts now; ``where`` names the
    checkpoint in errors; ``totals``: an epoch's sequence length where it is not the shards' sum
    (several data sets, plan/mix.py). Refuses (UserError, one line) what it cannot re-split exactly."""
    old_world, old_workers = len(saved), saved[0].get("workers", "?")
    layout = f"{where} was saved with {old_world} ranks x {old_workers} workers, now {world} x {cfg.workers}"
    missing = [key for key in NEEDED if any(key not in s for s in saved)]
    if missing:
        raise UserError(
            f"{layout}, and its loader state lacks what a re-split needs ({', '.join(missing)}; written by an "
            f"older version): resume it with {old_world} ranks x {old_workers} workers"
        )
    first = saved[0]
    if any(s["split"] != "samples" for s in saved):
        raise UserError(f"{layout}: only a run with loader.split=samples resumes on another layout")
    if first["batch_size"] != cfg.batch_size:
        raise UserError(f"{layout}, with trainer.batch_size={first['batch_size']}: keep that batch size")
    if first["samples"] != sum(counts) or first["counts"] != counts_digest(counts):
        raise UserError(
            f"{layout}, over other shards ({first['samples']} samples then, {sum(counts)} in {len(counts)} shards "
            f"now): resume on the same shards"
        )
    if first["seed"] != cfg.seed:
        raise UserError(f"{layout}, with seed {first['seed']} (each epoch's order comes from it): keep that seed")
    points = [ResumePoint.from_state(s["point"]) for s in saved]
    begun_epochs = {e for p in points for epochs in p.workers.values() for e in epochs}
    lo = min([p.epoch for p in points] + sorted(begun_epochs))
    saved_ranges = first.get("elastic") or {}
    # The old workers' seqs count their shuffled streams: replay each shuffle with the old run's
    # buffer and seed to map them to span positions.
    replay = replace(cfg, seed=first["seed"], shuffle_buffer=first["shuffle_buffer"])
    # Repeat mode: a worker may be an epoch ahead of another; each epoch in flight is re-split.
    resplit: list[tuple[int, Ranges]] = []
    for epoch in range(lo, max(begun_epochs, default=lo) + 1):
        elastic = saved_ranges.get(str(epoch))
        ranges: Ranges = (
            tuple((int(a), int(b)) for a, b in elastic)
            if elastic is not None
            else whole_epoch(totals(epoch) if totals else sum(counts))
        )
        begun = any(e >= epoch for e in begun_epochs) or any(p.epoch > epoch for p in points)
        if not begun and elastic is None:  # not begun by anyone: whole on the new layout
            continue
        if begun:
            if first["remainder"] != str(cfg.remainder):
                raise UserError(
                    f"{layout}, in the middle of epoch {epoch} with loader.remainder={first['remainder']}: keep it "
                    f"(or resume from a checkpoint at an epoch's end)"
                )
            progress = saved_progress(
                points,
                epoch,
                ranges,
                max(int(old_workers), 1),
                first["batch_size"],
                first["remainder"],
                lambda r, w, n, epoch=epoch: iter_shuffled_offsets(replay, r, w, epoch, n),
            )
            ranges = remaining_after(ranges, progress)
        resplit.append((epoch, ranges))
    start = lo
    while resplit and not rank_batches(ranges_length(resplit[0][1]), world, cfg.batch_size, str(cfg.remainder)):
        start = resplit.pop(0)[0] + 1  # nothing left of it (with drop: less than a batch per rank)
    summary = tuple(
        (e, ranges_length(r), rank_batches(ranges_length(r), world, cfg.batch_size, str(cfg.remainder)))
        for e, r in resplit
    )
    info = Resize(old_world, int(old_workers), world, cfg.workers, cfg.batch_size, start, summary)
    state: dict = {"point": ResumePoint(start).state(), "batches": 0}
    if resplit:
        state["elastic"] = {str(e): [list(r) for r in ranges] for e, ranges in resplit}
        # A re-split epoch's positions name samples through the shard order it began in: with
        # loader.shard_order=node, that of the old layout (older states: the global order).
        saved_orders, saved_order = first.get("orders") or {}, first.get("order", list(GLOBAL))
        state["orders"] = {str(e): [int(n) for n in saved_orders.get(str(e), saved_order)] for e, _ in resplit}
    return state, info
