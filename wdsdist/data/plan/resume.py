# A long module: the tracker that writes the loader state and the elastic functions
# that read it (resize_state in elastic.py applies them) share one format, documented once, here.
"""A rank loader's exact position: which samples of which epochs each of its workers delivered.

Every sample carries an id (epoch, worker, position in the worker's shuffled stream); the
position built from the ids consumed is the loader state a checkpoint keeps, and a resumed
loader skips exactly those samples, before decoding them.

With loader.split=samples each batch also carries every sample's position in the epoch's sample
sequence (``batch["pos"]``: the shards in the epoch's seeded order, read as one sequence; from
N on, the padding: position - N again). A same-layout resume stays the seq-based skip above
(bit-exact: each worker's shuffled stream replays and drops what was consumed).

Elastic resume (the pure functions at the end of this module; elastic.py applies them to a
checkpoint's loader states, and RankLoader and the trainer resume from the result):
  - state: per old worker, its span [a, b) of the interrupted epoch (splits.sample_span, from
    world, workers, batch size and the counts), the prefix [a, c) of it consumed, and the
    positions beyond c consumed out of order (at most the shuffle buffer plus the cross-worker
    shuffle and the batches in flight): O(ranks x workers) numbers plus the pending items,
    never O(samples). The tracker can follow ``pos`` beside ``seq`` to keep them; today's
    seq-based state names them too, since the shuffle buffer's permutation depends only on
    its seed and the stream's length: replaying a worker's shuffle over its span's position
    numbers maps seq to pos (tests/test_sample_split.py holds this). A shard that fails mid-span
    leaves a placeholder at each position it did not deliver (stream.FAILED), so the stream keeps
    its length and its shuffle; placeholders and undecodable samples ride on the next row as
    runs of skipped seqs, which the tracker counts consumed (as runs: an index may claim
    millions of samples a shard does not hold).
  - resume on W' ranks x w' workers: the remaining positions of the interrupted epoch are
    [0, N) minus {p mod N : p consumed}, as ranges in position order (O(ranks x workers)
    ranges and the scattered pending points). They are one shorter sequence of M samples, split
    by the same rule (rank_batches(M, W', B, remainder), sample_span): each new worker's span
    maps through the range list's cumulative lengths (bisect) to positions, and through the
    epoch's shard order to (shard, first, stop) pieces that read_span reads. Every sample of
    the interrupted epoch is then delivered exactly once plus the padding (< W' x B, the
    remaining sequence's first samples), every rank the same k' batches, so none hangs.
  - the epochs after it are whole epochs on the new layout; the trainer's step count becomes
    steps done + k' + the remaining epochs x k_new.
  - repeat mode: workers run across epochs, so a worker may be one epoch ahead; each epoch in
    flight is re-split the same way, in epoch order, before fresh epochs begin.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wdsdist.data.plan.splits import rank_batches, sample_span, span_pieces

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


# ---------------------------------------------------------------- elastic resume: pure functions
#
# An epoch's sequence, as the loader splits it, is the positions of the epoch's sample sequence
# (shards in the epoch's seeded order) still to be delivered, as sorted disjoint ranges of
# [0, N): ((0, N),) for a whole epoch, fewer after an elastic resume. A worker's span, its
# consumed prefix and the padding are "virtual" positions v in [0, k x world x B) of the ranges
# read one after another (length M); v >= M is the padding, v mod M again. With the whole
# epoch's ranges virtual and real positions coincide, so the split of a fresh epoch is
# unchanged. All of it is arithmetic on ranges: nothing here is O(samples).

Ranges = tuple[tuple[int, int], ...]


def whole_epoch(total: int) -> Ranges:
    return ((0, total),) if total > 0 else ()


def ranges_length(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def virtual_to_real(
    ranges: Ranges, start: int, stop: int, cumulative: Sequence[int] | None = None
) -> Iterator[tuple[int, int, int]]:
    """The real positions of virtual positions [start, stop) of ``ranges`` read in order (from M
    on, wrapping to their start: the padding), as (real start, real stop, virtual start) pieces.
    ``cumulative``: the ranges' lengths cumulated (ranges_cumulative), when calling often."""
    if cumulative is None:
        cumulative = ranges_cumulative(ranges)
    total = cumulative[-1]
    if total <= 0:
        return
    v = start
    while v < stop:
        at = v % total
        i = bisect.bisect_right(cumulative, at) - 1
        real = ranges[i][0] + at - cumulative[i]
        take = min(cumulative[i + 1] - at, stop - v)
        yield real, real + take, v
        v += take


def ranges_cumulative(ranges: Ranges) -> list[int]:
    return list(itertools.accumulate((b - a for a, b in ranges), initial=0))


def merge_ranges(pieces: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, disjoint, non-empty ranges covering the union of ``pieces``."""
    out: list[list[int]] = []
    for a, b in sorted(p for p in pieces if p[1] > p[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def subtract_ranges(ranges: Ranges, taken: Ranges) -> Ranges:
    """``ranges`` minus ``taken`` (both sorted and disjoint)."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in ranges:
        while j < len(taken) and taken[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(taken) and taken[k][0] < b:
            if taken[k][0] > cur:
                out.append((cur, taken[k][0]))
            cur = max(cur, taken[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return tuple(out)


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


def remaining_after(ranges: Ranges, progress: Iterable[WorkerProgress]) -> Ranges:
    """The positions of an epoch still to deliver once these workers' consumed positions are
    taken from ``ranges`` (a consumed padding position takes its original: v mod M). The
    result has at most len(ranges) + one range per worker + the scattered ``beyond`` points."""
    cumulative = ranges_cumulative(ranges)
    taken = merge_ranges(
        (a, b) for p in progress for lo, hi in p.consumed() for a, b, _ in virtual_to_real(ranges, lo, hi, cumulative)
    )
    return subtract_ranges(ranges, taken)


def resplit_positions(
    ranges: Ranges, rank: int, world: int, worker: int, nworkers: int, batch_size: int, remainder: str
) -> tuple[int, list[tuple[int, int, int]]]:
    """One worker's share of an epoch's remaining ``ranges`` on a (new) layout: (the batches every
    rank delivers, its real positions as (start, stop, virtual start) runs in reading order). The
    remaining positions are one sequence of M samples split by the rule of a whole epoch
    (splits.rank_batches, splits.sample_span), so every rank gets the same batches and the
    padding is below world x batch_size whatever the workers. A run never straddles the
    remaining sequence's end: from a virtual start of M on, a run is padding as a whole."""
    batches = rank_batches(ranges_length(ranges), world, batch_size, remainder)
    start, stop = sample_span(rank, world, worker, nworkers, batch_size, batches)
    return batches, list(virtual_to_real(ranges, start, stop))


def resplit_pieces(
    ranges: Ranges,
    cumulative: Sequence[int],
    rank: int,
    world: int,
    worker: int,
    nworkers: int,
    batch_size: int,
    remainder: str,
) -> tuple[int, list[tuple[int, int, int, int]]]:
    """resplit_positions read through the epoch's shard order: (the batches every rank delivers,
    the pieces to read). ``cumulative`` is the epoch's shard order's sample counts, cumulated
    (splits.span_pieces); a piece is (slot, first, stop, virtual position of its first sample)."""
    batches, runs = resplit_positions(ranges, rank, world, worker, nworkers, batch_size, remainder)
    pieces = []
    for real_start, real_stop, v in runs:
        for slot, first, last, position in span_pieces(cumulative, real_start, real_stop):
            pieces.append((slot, first, last, v + position - real_start))
    return batches, pieces


def round_robin_progress(
    ranges: Ranges, rank: int, world: int, nworkers: int, batch_size: int, remainder: str, consumed: int
) -> list[WorkerProgress]:
    """Where each worker of a rank stands after the rank consumed ``consumed`` batches of an
    epoch of ``ranges``, with no shuffle: the DataLoader takes batches from its workers in turn,
    passing over those that ended (sample_span gives the first workers the extra batches). What
    simdist's plan mode checkpoints; a real loader's progress comes from its batches' positions."""
    batches = rank_batches(ranges_length(ranges), world, batch_size, remainder)
    each, extra = divmod(batches, nworkers)
    consumed = min(max(consumed, 0), batches)
    out = []
    for worker in range(nworkers):
        if consumed <= each * nworkers:
            taken = consumed // nworkers + (worker < consumed % nworkers)
        else:
            taken = each + (worker < consumed - each * nworkers)
        start, _ = sample_span(rank, world, worker, nworkers, batch_size, batches)
        out.append(WorkerProgress(start, start + taken * batch_size))
    return out


def saved_progress(
    points: Sequence[ResumePoint],
    epoch: int,
    ranges: Ranges,
    nworkers: int,
    batch_size: int,
    remainder: str,
    order: Callable[[int, int, int], Iterable[int]] | None = None,
) -> list[WorkerProgress]:
    """Every old worker's progress through ``epoch`` (whose sequence was ``ranges``), in virtual
    positions, from the old ranks' saved points (one per rank, in rank order) on the layout
    they were saved with. A worker reads its span's positions in order, but its seq numbers
    count its *shuffled* stream: ``order(rank, worker, length)`` gives the span offset of each
    seq, in seq order (order.iter_shuffled_offsets replays the shuffle; None: no shuffle); a
    failed shard keeps its positions in the stream as placeholders, so that holds with bad data
    too. A worker with no entry for ``epoch`` delivered nothing of it, or all of it if it is
    past it. Replaying costs O(span) time, transiently, up to the last seq consumed; the result
    is small."""
    world = len(points)
    batches = rank_batches(ranges_length(ranges), world, batch_size, remainder)
    out = []
    for rank, point in enumerate(points):
        for worker in range(nworkers):
            start, stop = sample_span(rank, world, worker, nworkers, batch_size, batches)
            epochs = point.workers.get(worker, {})
            if epoch in epochs:
                done, beyond = epochs[epoch]
                runs = point.runs_of(worker, epoch)
                if order is None:
                    shifted = tuple((start + a, start + b) for a, b in runs)
                    out.append(WorkerProgress(start, start + done, frozenset(start + s for s in beyond), shifted))
                    continue
                # The replay runs only as far as the last seq consumed (half the cost mid-epoch).
                last = max([done - 1, *beyond, *(b - 1 for _, b in runs)])
                offsets = list(itertools.islice(order(rank, worker, stop - start), last + 1))
                in_runs = (offsets[s] for a, b in runs for s in range(a, min(b, len(offsets))))
                taken = sorted({*offsets[:done], *(offsets[s] for s in beyond), *in_runs})
                prefix = 0
                while prefix < len(taken) and taken[prefix] == prefix:
                    prefix += 1
                out.append(WorkerProgress(start, start + prefix, frozenset(start + o for o in taken[prefix:])))
            elif epochs and min(epochs) > epoch or point.epoch > epoch:
                out.append(WorkerProgress(start, stop))
            else:
                out.append(WorkerProgress(start, start))
    return out
