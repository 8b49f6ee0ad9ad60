"""A rank loader's exact position: which samples of which epochs each of its workers delivered,
and where the old workers of a checkpoint stood in an epoch's sequence (for an elastic resume).

Every sample carries an id (epoch, worker, seq: its place in the worker's shuffled stream); the
``ConsumedTracker`` builds a ``ResumePoint`` from the ids consumed, which is what a checkpoint
keeps (state.py), and a resumed worker replays its stream and passes over exactly those seqs,
before decoding them: on the same layout the next batch is the uninterrupted run's.

A shard that fails mid-span leaves a placeholder at each position it did not deliver
(stream.FAILED), so a stream keeps its length and its shuffle; placeholders and undecodable
samples ride on the next row as runs of skipped seqs, which the tracker counts consumed (as
runs: an index may claim millions of samples a shard does not hold).

Elastic resume (restore.py applies these): an old worker's seqs map to its span's virtual
positions by replaying its shuffle (order.shuffled_offsets: its permutation depends on the seed
and the stream's length only), and through the epoch's sequence (sequence.EpochSequence) to real
positions; the epoch's remaining positions are the rest, as ranges: O(ranks x workers) numbers
plus the few positions a shuffle buffer let out early, never O(samples).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wdsdist.data.plan.sequence import EpochSequence, merge_ranges
from wdsdist.data.plan.splits import Layout

if TYPE_CHECKING:
    import torch


Run = tuple[int, int]  # seqs [first, stop) of one worker's stream


@dataclass
class ResumePoint:
    """Where each worker of a rank stands: for each epoch it has begun and not left behind,
    every sample before ``start``, every one listed in ``skip`` and every one in ``runs``
    (seqs [first, stop) skipped in a row, e.g. the positions of a shard that came short of its
    count) was consumed.

    In epoch mode every worker is in ``epoch``. In repeat mode a worker runs from one epoch
    into the next without stopping (a batch may hold the end of one and the start of the next),
    so each worker has its own epochs; ``epoch`` is where a worker with no entry starts.
    """

    epoch: int
    workers: dict[int, dict[int, tuple[int, frozenset[int]]]] = field(default_factory=dict)
    # worker -> epoch -> sorted disjoint runs beyond its start: an index may claim millions of
    # samples a shard does not hold, so they stay runs, never a set of every seq
    runs: dict[int, dict[int, tuple[Run, ...]]] = field(default_factory=dict)

    def state(self) -> dict:
        state: dict = {
            "epoch": self.epoch,
            "workers": {
                str(w): {str(e): [s, sorted(k)] for e, (s, k) in epochs.items()} for w, epochs in self.workers.items()
            },
        }
        runs = {str(w): {str(e): [list(r) for r in rs] for e, rs in eps.items() if rs} for w, eps in self.runs.items()}
        runs = {w: eps for w, eps in runs.items() if eps}
        if runs:
            state["runs"] = runs
        return state

    @classmethod
    def from_state(cls, state: dict) -> ResumePoint:
        epoch, workers = int(state["epoch"]), {}
        for w, entry in state["workers"].items():
            if isinstance(entry, list):  # written before workers had epochs of their own: [start, skip]
                entry = {str(epoch): entry}
            workers[int(w)] = {int(e): (int(s), frozenset(int(i) for i in k)) for e, (s, k) in entry.items()}
        runs = {
            int(w): {int(e): tuple(merge_ranges((int(a), int(b)) for a, b in rs)) for e, rs in eps.items()}
            for w, eps in state.get("runs", {}).items()
        }
        return cls(epoch, workers, runs)

    def first_epoch(self, worker: int) -> int:
        return min(self.workers.get(worker) or [self.epoch])

    def runs_of(self, worker: int, epoch: int) -> tuple[Run, ...]:
        return self.runs.get(worker, {}).get(epoch, ())


class ConsumedTracker:
    """Follows the ids of consumed samples to give the loader's exact position.

    A worker's samples of one epoch all arrive before any of its next (a worker's batches come
    in order, and the cross-worker shuffle empties at each epoch's end), so once its next epoch
    shows, the one before is done and forgotten: a resumed worker would otherwise read through
    it again.

    Per worker it keeps its epoch, the consumed prefix [0, start) of its seqs, the seqs consumed
    beyond it (``seen``: at most what the shuffle buffers and batches in flight hold back) and
    the skipped runs beyond it (``runs``: one per row that overtook an earlier row of its
    worker, whatever the run's length). A run that reaches the prefix moves it in one step.
    """

    def __init__(self, epoch: int):
        self.base = epoch  # where a worker that delivered nothing yet starts
        self.epoch = epoch  # the newest epoch consumed from (epoch mode: the epoch)
        self.batches = 0  # batches consumed since self.epoch began (counts in epoch mode)
        self.open: dict[int, list] = {}  # worker -> [its epoch, start, seen beyond start, runs beyond start]

    def load(self, point: ResumePoint, batches: int) -> None:
        self.base = self.epoch = point.epoch
        self.batches = batches
        self.open = {
            w: [e, s, set(k), list(point.runs_of(w, e))]
            for w, epochs in point.workers.items()
            for e, (s, k) in epochs.items()
        }
        for entry in self.open.values():
            self._advance(entry)

    def update(self, ids: torch.Tensor, skipped: Sequence[Sequence[tuple[int, int, int]]] | None = None) -> None:
        """Count a batch consumed: its rows' ids, and per row the runs (epoch, first seq, stop) its
        worker skipped before it (bad samples, positions of a failed or short shard), which are
        consumed too."""
        rows = ids.tolist()
        newest = max(e for e, _, _ in rows)
        if newest > self.epoch:
            self.epoch, self.batches = newest, 0
        self.batches += 1
        for i, (epoch, worker, seq) in enumerate(rows):
            for before, first, stop in skipped[i] if skipped else ():
                self._consume(before, worker, first, stop)
            self._consume(epoch, worker, seq, seq + 1)

    def _consume(self, epoch: int, worker: int, first: int, stop: int) -> None:
        entry = self.open.get(worker)
        if entry is None or epoch > entry[0]:
            entry = self.open[worker] = [epoch, 0, set(), []]
        elif epoch < entry[0]:
            return  # an epoch this worker has left behind
        if stop <= entry[1]:
            return  # consumed already (a run may hold seqs a resumed worker passed over)
        if first > entry[1]:
            if stop - first == 1:
                entry[2].add(first)
            else:
                entry[3].append((first, stop))
        elif entry[2] or entry[3]:
            self._advance(entry, stop)
        else:
            entry[1] = stop  # in order, nothing beyond: most rows

    @staticmethod
    def _advance(entry: list, to: int = 0) -> None:
        """Move the prefix to ``to`` at least, then over the seen seqs and runs that touch it, and
        forget what it passed."""
        begin, seen, runs = entry[1], entry[2], entry[3]
        entry[1] = max(begin, to)
        while True:
            while entry[1] in seen:
                entry[1] += 1
            reached = [r for r in runs if r[0] <= entry[1]] if runs else None
            if not reached:
                break
            runs[:] = [r for r in runs if r[0] > entry[1]]
            entry[1] = max(entry[1], *(b for _, b in reached))
        # O(min(seen, prefix moved)): a run may jump the prefix by millions
        if not seen:
            return
        if entry[1] - begin < len(seen):
            seen.difference_update(range(begin, entry[1]))
        else:
            entry[2] = {s for s in seen if s >= entry[1]}

    def point(self) -> ResumePoint:
        workers = {w: {e: (s, frozenset(k))} for w, (e, s, k, _) in self.open.items()}
        runs = {w: {e: merge_ranges(r)} for w, (e, _, _, r) in self.open.items() if r}
        return ResumePoint(self.base, workers, runs)


@dataclass(frozen=True)
class WorkerProgress:
    """How far one worker got through its span of an epoch, in virtual positions: every position
    in [start, done) and each of ``beyond`` was consumed (``beyond``: the ones the shuffle
    buffer, the cross-worker shuffle and the batches in flight let out early, so few)."""

    start: int
    done: int
    beyond: frozenset[int] = frozenset()
    runs: tuple[tuple[int, int], ...] = ()  # [a, b) consumed beyond ``done`` (skipped in a row)

    def consumed(self) -> list[tuple[int, int]]:
        # Runs of consecutive points as one range: behind a shuffle buffer's oldest pending item
        # most positions are consumed, so thousands of points make few ranges.
        out = [(self.start, self.done)]
        for p in sorted(p for p in self.beyond if not self.start <= p < self.done):
            if out[-1][1] == p:
                out[-1] = (out[-1][0], p + 1)
            else:
                out.append((p, p + 1))
        if self.runs:
            return list(merge_ranges([*out, *self.runs]))
        return out


def remaining_after(sequence: EpochSequence, progress: Iterable[WorkerProgress]) -> EpochSequence:
    """What remains of an epoch's ``sequence`` once these workers' consumed virtual positions are
    taken from it, each through the sequence's own map (a consumed padding slot takes the
    position it read again). The result has at most len(ranges) + one range per worker + the
    scattered ``beyond`` points."""
    return sequence.without(
        real for p in progress for lo, hi in p.consumed() if hi > lo for real in sequence.real(lo, hi)
    )


def round_robin_progress(sequence: EpochSequence, layout: Layout, rank: int, consumed: int) -> list[WorkerProgress]:
    """Where each worker of a rank stands after the rank consumed ``consumed`` batches of an
    epoch, with no shuffle: the DataLoader takes batches from its workers in turn, passing over
    those that ended (sample_span gives the first workers the extra batches). What simdist's
    plan mode checkpoints; a real loader's progress comes from its batches' positions."""
    batches = sequence.batches(layout)
    nworkers = layout.nworkers
    each, _ = divmod(batches, nworkers)
    consumed = min(max(consumed, 0), batches)
    out = []
    for worker in range(nworkers):
        if consumed <= each * nworkers:
            taken = consumed // nworkers + (worker < consumed % nworkers)
        else:
            taken = each + (worker < consumed - each * nworkers)
        start, _ = layout.span(rank, worker, batches)
        out.append(WorkerProgress(start, start + taken * layout.batch_size))
    return out


def saved_progress(
    points: Sequence[ResumePoint],
    epoch: int,
    sequence: EpochSequence,
    layout: Layout,
    order: Callable[[int, int, int], Iterable[int]] | None = None,
) -> list[WorkerProgress]:
    """Every old worker's progress through ``epoch`` (read as ``sequence``), in virtual
    positions, from the old ranks' saved points (one per rank, in rank order) on the ``layout``
    they were saved with. A worker reads its span's positions in order, but its seq numbers
    count its *shuffled* stream: ``order(rank, worker, length)`` gives the span offset of each
    seq, in seq order (order.shuffled_offsets replays the shuffle; None: no shuffle); a failed
    shard keeps its positions in the stream as placeholders, so that holds with bad data too.
    A worker with no entry for ``epoch`` delivered nothing of it, or all of it if it is past it.
    Replaying costs O(span) time, transiently, up to the last seq consumed; the result is small."""
    batches = sequence.batches(layout)
    out = []
    for rank, point in enumerate(points):
        for worker in range(layout.nworkers):
            start, stop = layout.span(rank, worker, batches)
            epochs = point.workers.get(worker, {})
            if epoch in epochs:
                replay = functools.partial(order, rank, worker) if order is not None else None
                out.append(_progress(point, worker, epoch, start, stop, replay))
            elif epochs and min(epochs) > epoch or point.epoch > epoch:
                out.append(WorkerProgress(start, stop))
            else:
                out.append(WorkerProgress(start, start))
    return out


def _progress(
    point: ResumePoint, worker: int, epoch: int, start: int, stop: int, order: Callable[[int], Iterable[int]] | None
) -> WorkerProgress:
    """One worker's saved progress through its span [start, stop) of ``epoch``."""
    done, beyond = point.workers[worker][epoch]
    runs = point.runs_of(worker, epoch)
    if order is None:
        shifted = tuple((start + a, start + b) for a, b in runs)
        return WorkerProgress(start, start + done, frozenset(start + s for s in beyond), shifted)
    # The replay runs only as far as the last seq consumed (half the cost mid-epoch).
    last = max([done - 1, *beyond, *(b - 1 for _, b in runs)])
    offsets = list(itertools.islice(order(stop - start), last + 1))
    in_runs = (offsets[s] for a, b in runs for s in range(a, min(b, len(offsets))))
    taken = sorted({*offsets[:done], *(offsets[s] for s in beyond), *in_runs})
    prefix = 0
    while prefix < len(taken) and taken[prefix] == prefix:
        prefix += 1
    return WorkerProgress(start, start + prefix, frozenset(start + o for o in taken[prefix:]))
