"""Splitting shards over ranks and workers, and planning batch counts: pure functions, no I/O.

The loader (pipeline.py), the trainer's startup check and simdist all call these, so the
plan is by construction what the loader does; tests hold plan == loader counts.

How a rank's batches come about (the loader's order of operations):
  rank r gets shards[r::world]; its worker w gets those shards[w::nworkers];
  a worker reads its shards ``dsrepeat`` times and batches inside the worker
  (``partial`` keeps the last short batch); the rank's loader optionally re-batches across
  workers (``rebatch``: unbatched -> shuffle -> batched, same batch size and ``partial``);
  in epoch mode every rank is then cut to ``nbatches``.

The sample-level split (``plan_samples``, loader.split=samples): each epoch the shards, in a
seeded order new every epoch, are one sequence of N samples; it is padded (the sequence's first
samples again; with loader.shard_order=node each node's own first, sequence.py) or cut to
k x world x batch_size samples, rank r holds positions
r*k*B .. (r+1)*k*B - 1 and its workers whole batches of that, contiguous. Every rank delivers k
batches; the padding (or drop) is below world x batch_size and does not depend on the workers.
"""

# A long module: the shard split and the sample split share their batch arithmetic, and the
# loader, the trainer's startup check and simdist call both from here.

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
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
    span: tuple[int, int] | None = None  # split=samples: [start, stop) in the epoch's sample sequence


@dataclass(frozen=True)
class RankPlan:
    rank: int
    shards: tuple[int, ...]
    samples: int  # samples read per epoch, dsrepeat included
    workers: tuple[WorkerPlan, ...]
    available: int  # batches the rank's loader can yield per epoch
    batches: int  # batches delivered per epoch (after the nbatches cut)
    span: tuple[int, int] | None = None  # split=samples: [start, stop) in the epoch's sample sequence


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
    split: str = "shards"  # "shards": whole shards per rank and worker; "samples": spans of the epoch's sequence
    remainder: str | None = None  # split=samples: "pad" or "drop"
    padded: int = 0  # split=samples, pad: samples per epoch delivered again (the sequence's or each node's first)
    dropped: int = 0  # split=samples, drop: samples per epoch not delivered (the sequence's or each node's last)

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
        if self.split == "samples":
            return self._sample_problems()
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
                f"end of the epoch: use split=samples (equal spans of the epoch's samples), cut with "
                f"nbatches={lo} (or auto), or use {nearest_divisible(self.nshards, self.world * self.nworkers)} shards"
            )
        return out

    def _sample_problems(self) -> list[str]:
        need = self.world * self.nworkers * self.batch_size
        available = self.ranks[0].available
        if self.total_samples >= need and self.nbatches is not None and self.nbatches > available:
            return [
                f"nbatches={self.nbatches} is more than every rank delivers with split=samples ({available} "
                f"batches of {self.batch_size} per rank per epoch, from {self.total_samples} samples): "
                f"use nbatches<={available}"
            ]
        if self.total_samples >= need:
            return []
        fewer = max(1, self.total_samples // (self.world * self.batch_size))
        return [
            f"{self.total_samples} samples are fewer than {self.world} ranks x {self.nworkers} workers x "
            f"batch size {self.batch_size} = {need}: every worker needs a batch per epoch; use at most "
            f"{fewer} workers, a batch size of at most {max(1, self.total_samples // (self.world * self.nworkers))}, "
            f"or more data"
        ]


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


# ---------------------------------------------------------------- the sample-level split

REMAINDERS = ("pad", "drop")


def rank_batches(total: int, world: int, batch_size: int, remainder: str) -> int:
    """Batches every rank delivers per epoch under split=samples: the epoch's ``total`` samples
    padded up (pad) or cut down (drop) to a multiple of world x batch_size. The worker count does
    not enter: the padding is the same however many workers read."""
    slot = world * batch_size
    return -(-total // slot) if remainder == "pad" else total // slot


@dataclass(frozen=True)
class Layout:
    """The numbers a split of the epoch's sample sequence travels with: ranks, workers per rank
    (0, loading in the main process, is one), the batch size and what the split does with the
    epoch's remainder (``pad`` or ``drop``)."""

    world: int
    workers: int
    batch_size: int
    remainder: str = "pad"

    @property
    def nworkers(self) -> int:
        return max(self.workers, 1)

    def batches(self, total: int) -> int:
        """Batches every rank delivers of a sequence of ``total`` samples (``rank_batches``)."""
        return rank_batches(total, self.world, self.batch_size, str(self.remainder))

    def span(self, rank: int, worker: int, batches: int) -> tuple[int, int]:
        """[start, stop) of a worker's span when every rank delivers ``batches`` (``sample_span``)."""
        return sample_span(rank, self.world, worker, self.nworkers, self.batch_size, batches)

    def text(self) -> str:
        """'2 ranks x 3 workers', as the lines about a layout name it."""
        ranks, workers = "rank" + "s" * (self.world != 1), "worker" + "s" * (self.workers != 1)
        return f"{self.world} {ranks} x {self.workers} {workers}"


def sample_span(rank: int, world: int, worker: int, nworkers: int, batch_size: int, batches: int) -> tuple[int, int]:
    """[start, stop) of one worker's span in the epoch's sample sequence: rank r holds batches
    r*k .. (r+1)*k - 1 of it, and its workers hold whole batches of that, in order, so every
    worker yields full batches only and no re-batching is needed to keep the padding fixed."""
    _check_slot("rank", rank, world)
    _check_slot("worker", worker, nworkers)
    each, extra = divmod(batches, nworkers)
    first = rank * batches + worker * each + min(worker, extra)
    return first * batch_size, (first + each + (worker < extra)) * batch_size


def span_pieces(cumulative: Sequence[int], start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
    """The pieces of [start, stop) of the epoch's sample sequence, shard by shard: (slot, first,
    stop, position) read samples first..stop-1 of the shard at ``slot`` of the epoch's shard
    order, the first of them at ``position`` of the sequence. ``cumulative[i]`` is the number of
    samples before slot i, ``cumulative[-1]`` all of them; positions from there on wrap to the
    sequence's start (the padding). Arithmetic only: no per-sample lists."""
    total = cumulative[-1]
    if total <= 0:
        return
    position = start
    while position < stop:
        at = position % total
        slot = bisect.bisect_right(cumulative, at) - 1
        first = at - cumulative[slot]
        take = min(cumulative[slot + 1] - at, stop - position)
        yield slot, first, first + take, position
        position += take


def _slots(cumulative: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    return tuple(dict.fromkeys(slot for slot, _, _, _ in span_pieces(cumulative, start, stop)))


def plan_samples(
    nsamples: Sequence[int],
    world: int,
    nworkers: int,
    batch_size: int,
    *,
    remainder: str = "pad",
    rebatch: bool = True,
    nbatches: int | str | None = None,
) -> Plan:
    """The sample-level split's plan: every rank the same span length, so the same batches.

    Shards in RankPlan/WorkerPlan are slots of the epoch's shard order (the order is new every
    epoch; which shards fill a slot is the loader's business), so with uneven shards the shards
    a span touches vary per epoch while its sample counts do not.
    """
    for name, value in (("world", world), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if nworkers < 0:
        raise ValueError(f"nworkers must be >= 0, got {nworkers}")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {', '.join(REMAINDERS)}, got {remainder!r}")
    workers = max(nworkers, 1)
    total = sum(nsamples)
    batches = rank_batches(total, world, batch_size, remainder)
    cumulative = list(itertools.accumulate(nsamples, initial=0))
    ranks = []
    for rank in range(world):
        plans = []
        for worker in range(workers):
            start, stop = sample_span(rank, world, worker, workers, batch_size, batches)
            span = (start, stop)
            plans.append(
                WorkerPlan(worker, _slots(cumulative, start, stop), stop - start, (stop - start) // batch_size, span)
            )
        span = (rank * batches * batch_size, (rank + 1) * batches * batch_size)
        ranks.append(RankPlan(rank, _slots(cumulative, *span), span[1] - span[0], tuple(plans), batches, batches, span))
    cut = _resolve_cut(nbatches, ranks)
    if cut is not None:
        ranks = [replace(r, batches=min(r.available, cut)) for r in ranks]
    delivered = world * batches * batch_size
    return Plan(
        nshards=len(nsamples),
        world=world,
        nworkers=workers,
        batch_size=batch_size,
        partial=False,
        dsrepeat=1,
        rebatch=rebatch,
        nbatches=cut,
        ranks=tuple(ranks),
        total_samples=total,
        split="samples",
        remainder=remainder,
        padded=max(0, delivered - total),
        dropped=max(0, total - delivered),
    )
