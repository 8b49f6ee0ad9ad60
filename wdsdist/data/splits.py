"""Splitting shards over ranks and workers, and planning batch counts: pure functions, no I/O.

The loader (pipeline.py), the trainer's startup check and simdist all call these, so the
plan is by construction what the loader does; tests hold plan == loader counts.

How a rank's batches come about (the loader's order of operations):
  rank r gets shards[r::world]; its worker w gets those shards[w::nworkers];
  a worker reads its shards ``dsrepeat`` times and batches inside the worker
  (``partial`` keeps the last short batch); the rank's loader optionally re-batches across
  workers (``rebatch``: unbatched -> shuffle -> batched, same batch size and ``partial``);
  in epoch mode every rank is then cut to ``nbatches``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from wdsdist.data.options import parse_nbatches

T = TypeVar("T")


def split_by_rank(items: Sequence[T], rank: int, world: int) -> list[T]:
    """The node split: rank r of world gets items[r::world]."""
    _check_slot("rank", rank, world)
    return list(items[rank::world])


def split_by_worker(items: Sequence[T], worker: int, nworkers: int) -> list[T]:
    """The worker split inside a rank: worker w of nworkers gets items[w::nworkers]."""
    _check_slot("worker", worker, nworkers)
    return list(items[worker::nworkers])


def _check_slot(what: str, index: int, count: int) -> None:
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{what} {index} of {count} is out of range")


def nbatches_of(nsamples: int, batch_size: int, partial: bool) -> int:
    full, rest = divmod(nsamples, batch_size)
    return full + (1 if partial and rest else 0)


@dataclass(frozen=True)
class WorkerPlan:
    worker: int
    shards: tuple[int, ...]  # indices into the global shard list
    samples: int  # samples read per epoch, dsrepeat included
    batches: int  # batches the worker yields per epoch


@dataclass(frozen=True)
class RankPlan:
    rank: int
    shards: tuple[int, ...]
    samples: int  # samples read per epoch, dsrepeat included
    workers: tuple[WorkerPlan, ...]
    available: int  # batches the rank's loader can yield per epoch
    batches: int  # batches delivered per epoch (after the nbatches cut)


@dataclass(frozen=True)
class Plan:
    nshards: int
    world: int
    nworkers: int
    batch_size: int
    partial: bool
    dsrepeat: int
    rebatch: bool
    nbatches: int | None  # the cut, resolved ("auto" -> a number); None: no cut
    ranks: tuple[RankPlan, ...]
    total_samples: int  # samples in the data set (one pass, no dsrepeat)

    @property
    def batches(self) -> list[int]:
        return [r.batches for r in self.ranks]

    @property
    def equal(self) -> bool:
        return len(set(self.batches)) == 1

    @property
    def min_available(self) -> int:
        return min(r.available for r in self.ranks)

    @property
    def max_available(self) -> int:
        return max(r.available for r in self.ranks)

    def empty_workers(self) -> list[tuple[int, int]]:
        return [(r.rank, w.worker) for r in self.ranks for w in r.workers if not w.shards]

    def problems(self, *, epoch_mode: bool = True) -> list[str]:
        """Why this layout would hang or waste a rank, each with numbers and a fix."""
        out: list[str] = []
        empty_ranks = [r.rank for r in self.ranks if not r.shards]
        if empty_ranks:
            out.append(
                f"{len(empty_ranks)} of {self.world} ranks get no shard (rank {empty_ranks[0]} first): "
                f"{self.nshards} shards < world size {self.world}; use at least {self.world} shards"
            )
        elif self.empty_workers():
            rank, worker = self.empty_workers()[0]
            fewest = min(len(r.shards) for r in self.ranks)
            out.append(
                f"rank {rank} worker {worker} gets no shard: a rank has as few as {fewest} shards "
                f"for {self.nworkers} workers; use at most {max(fewest, 1)} workers, or at least "
                f"{self.world * self.nworkers} shards"
            )
        if out or not epoch_mode:
            return out
        if self.nbatches is not None and self.min_available < self.nbatches:
            short = [r for r in self.ranks if r.available < self.nbatches]
            fix = suggest_dsrepeat(self, self.nbatches)
            hint = f"use dsrepeat={fix}" if fix else "use more data"
            out.append(
                f"nbatches={self.nbatches} is more than {len(short)} ranks can deliver "
                f"(rank {short[0].rank}: {short[0].available} batches with dsrepeat={self.dsrepeat}); "
                f"use nbatches<={self.min_available} or {hint}"
            )
        elif not self.equal:
            lo, hi = self.min_available, self.max_available
            out.append(
                f"ranks deliver unequal batch counts per epoch ({lo}..{hi}); DDP would hang at the "
                f"end of the epoch: cut with nbatches={lo} (or auto), or use "
                f"{nearest_divisible(self.nshards, self.world * self.nworkers)} shards"
            )
        return out


def plan(
    nsamples: Sequence[int],
    world: int,
    nworkers: int,
    batch_size: int,
    *,
    partial: bool = False,
    dsrepeat: int = 1,
    rebatch: bool = True,
    nbatches: int | str | None = None,
) -> Plan:
    """Plan shards, samples and batches of every rank and worker from per-shard sample counts.

    ``nworkers`` 0 means loading in the main process, which is one worker.
    ``nbatches``: None (no cut), an int (cut every rank to it), or "auto" (the largest number
    every rank can deliver).
    """
    for name, value in (("world", world), ("batch_size", batch_size), ("dsrepeat", dsrepeat)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if nworkers < 0:
        raise ValueError(f"nworkers must be >= 0, got {nworkers}")
    workers = max(nworkers, 1)
    ranks = [
        _plan_rank(nsamples, rank, world, workers, batch_size, partial=partial, dsrepeat=dsrepeat, rebatch=rebatch)
        for rank in range(world)
    ]
    cut = _resolve_cut(nbatches, ranks)
    if cut is not None:
        ranks = [replace(r, batches=min(r.available, cut)) for r in ranks]
    return Plan(
        nshards=len(nsamples),
        world=world,
        nworkers=workers,
        batch_size=batch_size,
        partial=partial,
        dsrepeat=dsrepeat,
        rebatch=rebatch,
        nbatches=cut,
        ranks=tuple(ranks),
        total_samples=sum(nsamples),
    )


def _plan_rank(
    nsamples: Sequence[int],
    rank: int,
    world: int,
    nworkers: int,
    batch_size: int,
    *,
    partial: bool,
    dsrepeat: int,
    rebatch: bool,
) -> RankPlan:
    """One rank's shards, its workers' shares, and the batches its loader yields before any cut."""
    rank_shards = split_by_rank(range(len(nsamples)), rank, world)
    workers = []
    for worker in range(nworkers):
        shards = tuple(split_by_worker(rank_shards, worker, nworkers))
        samples = dsrepeat * sum(nsamples[i] for i in shards)
        workers.append(WorkerPlan(worker, shards, samples, nbatches_of(samples, batch_size, partial)))
    samples = sum(w.samples for w in workers)
    if rebatch and partial:
        available = nbatches_of(samples, batch_size, partial)
    else:
        # Without partial batches the workers emit only full ones, so re-batching keeps the count.
        available = sum(w.batches for w in workers)
    return RankPlan(rank, tuple(rank_shards), samples, tuple(workers), available, available)


def _resolve_cut(nbatches: int | str | None, ranks: Sequence[RankPlan]) -> int | None:
    """The cut as a number: "auto" is the most every rank reaches; None is no cut."""
    nbatches = parse_nbatches(nbatches)  # a bad cut raises ValueError
    if nbatches == "auto":
        return min(r.available for r in ranks)
    return nbatches


def suggest_dsrepeat(p: Plan, nbatches: int, limit: int = 1000) -> int | None:
    """The smallest dsrepeat with which every rank reaches nbatches, or None."""
    per_pass = [r.samples // p.dsrepeat for r in p.ranks]
    if min(per_pass) == 0:
        return None
    # Each rank's batch count grows about linearly with dsrepeat; start at the estimate.
    dsrepeat = max(1, math.ceil(nbatches * p.batch_size / min(per_pass)) - 1)
    while dsrepeat <= limit:
        if min(_available_with(p, dsrepeat)) >= nbatches:
            return dsrepeat
        dsrepeat += 1
    return None


def _available_with(p: Plan, dsrepeat: int) -> list[int]:
    out = []
    for r in p.ranks:
        worker_samples = [w.samples // p.dsrepeat * dsrepeat for w in r.workers]
        if p.rebatch and p.partial:
            out.append(nbatches_of(sum(worker_samples), p.batch_size, p.partial))
        else:
            out.append(sum(nbatches_of(s, p.batch_size, p.partial) for s in worker_samples))
    return out


def nearest_divisible(n: int, k: int) -> str:
    """Shard counts near n that divide evenly into k slots, as text: '96 or 104'."""
    lo = (n // k) * k
    hi = lo + k
    if lo == n:
        return str(n)
    return f"{lo} or {hi}" if lo > 0 else str(hi)
