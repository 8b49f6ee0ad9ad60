"""The loader's promise as a reference model: plain Python over positions (no torch, no tar, no
workers), written from the documented rules, not from the loader's code.

An epoch (split=samples) is a sequence of N positions. On a layout of W ranks x w workers and
batch size B, the positions still to deliver (all N, or what a checkpoint left), in order, are
padded up to k x W x B, k = ceil(M / (W x B)) (pad), or cut down to it, k = floor (drop). The
padding repeats positions: for a whole epoch of several data sets, the ones the mix's padding
names (so a padded batch keeps each source's share); otherwise the positions' own first ones,
as often as it takes. Rank r delivers the r-th stretch of k x B; its workers hold whole batches
of it, in order, the first ones a batch more. Each delivered sample is tagged with its position,
plus N where it is padding. A rank's DataLoader takes the workers' batches in turn, from the
worker whose turn it is, passing over a worker that has none left (epoch mode: an epoch at a
time, from worker 0; repeat mode: each worker goes from epoch to epoch without end).

A resume on the same layout goes on as the uninterrupted run. On another layout every epoch in
flight is re-split: its positions not delivered in any form (a padding sample delivers the
position it repeats), in order, split as above, padded with their own first ones; later epochs
are whole. Epochs in flight run from the first epoch a checkpointed rank stood in (or, in repeat
mode, began its part in) to the newest one a worker delivered from, or an earlier re-split left
(begun or not); one that gives no batch (nothing left, or less than a batch per rank with drop)
at the front is over.

A position whose sample cannot be delivered (it cannot be decoded, or its shard cannot be read)
is lost, and its row is a stand-in: a good position q of the same epoch, tagged N + q like
padding, chosen from the epoch and the lost position (mod N) alone, so every layout and resume
fills a loss alike. The search starts at a position drawn from them (seeds.sample_fill, taken as
given) and takes the first good one from there (in a mix, where the search jumps past a shard
that fails, the first one only is said). The row counts the loss where the lost position is read
as itself, not where it is read again as padding, and delivers the lost position as a re-split
counts it. Nothing else changes: the batches, their workers and len() are the undamaged run's.

split=shards (repeat mode): rank r reads shards[r::W], its worker j those [j::w]; each epoch a
worker reads its shards in the epoch's order, and its batches run on across epochs.

This is what tests/data/test_exactness.py holds the real ``Loader`` to, on every layout it draws.
What defines the sequence itself is taken as given (the caller passes it in): a mix's padding
positions and epoch lengths, and the epoch's shard order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A layout: ranks and workers per rank (0: the main process, one worker)."""

    world: int
    workers: int

    @property
    def nworkers(self) -> int:
        return max(self.workers, 1)


def per_rank(m: int, world: int, batch: int, remainder: str) -> int:
    """Batches every rank delivers of m positions."""
    return -(-m // (world * batch)) if remainder == "pad" else m // (world * batch)


def cyclic(order: Sequence[int]) -> Callable[[int], list[int]]:
    """Padding that repeats ``order``'s first positions, as often as it takes."""
    return lambda n: [order[i % len(order)] for i in range(n)] if order else []


def split(
    order: Sequence[int], total: int, padding: Callable[[int], Sequence[int]], shape: Shape, batch: int, remainder: str
) -> tuple[int, dict[tuple[int, int], list[tuple[int, ...]]]]:
    """Positions ``order`` of an epoch of ``total`` over ``shape``: k, and each (rank, worker)'s
    batches of tags. ``padding(n)``: the positions the first n padding slots repeat."""
    k = per_rank(len(order), shape.world, batch, remainder)
    want = k * shape.world * batch
    tags = list(order[:want]) + [total + p for p in padding(max(0, want - len(order)))]
    spans = {}
    for rank in range(shape.world):
        block = tags[rank * k * batch : (rank + 1) * k * batch]
        each, extra = divmod(k, shape.nworkers)
        for worker in range(shape.nworkers):
            first, count = worker * each + min(worker, extra), each + (worker < extra)
            spans[rank, worker] = [tuple(block[(first + i) * batch : (first + i + 1) * batch]) for i in range(count)]
    return k, spans


@dataclass(frozen=True)
class Step:
    """One batch a rank delivered: the epoch of its rows, the worker it came from, its tags
    (split=shards: its sample ids, and ``epochs`` each row's epoch)."""

    epoch: int
    worker: int
    tags: tuple[int, ...]
    epochs: tuple[int, ...] = ()


def in_turn(streams: Sequence[Sequence[Step]], endless: bool = False) -> list[Step]:
    """The DataLoader's order: a batch from each worker in turn, passing over a worker with none
    left. ``endless``: the streams are the start of streams without end (repeat mode), so the
    order holds only until the first of them runs out: it stops there."""
    out, cursors, w = [], [0] * len(streams), 0
    while any(c < len(s) for c, s in zip(cursors, streams, strict=True)):
        if cursors[w] < len(streams[w]):
            out.append(streams[w][cursors[w]])
            cursors[w] += 1
        elif endless:
            break
        w = (w + 1) % len(streams)
    return out


@dataclass
class Sequence_:
    """What defines the epochs (given): each epoch's length and its padding's positions."""

    total: Callable[[int], int]
    padding: Callable[[int], Callable[[int], Sequence[int]]]
    batch: int
    remainder: str


@dataclass
class Part:
    """A layout's part of a run from epoch ``start``: ``resplit`` holds the epochs it re-splits
    (their positions to deliver, in order); the others are whole."""

    seq: Sequence_
    shape: Shape
    mode: str
    start: int
    resplit: dict[int, list[int]]

    def epoch(self, epoch: int) -> tuple[int, dict[tuple[int, int], list[tuple[int, ...]]]]:
        s = self.seq
        if epoch in self.resplit:
            order = self.resplit[epoch]
            return split(order, s.total(epoch), cyclic(order), self.shape, s.batch, s.remainder)
        n = s.total(epoch)
        return split(range(n), n, s.padding(epoch), self.shape, s.batch, s.remainder)

    def batches(self, epoch: int) -> int:
        return self.epoch(epoch)[0]

    def groups(self, rank: int, through: int) -> Counter:
        """Each (worker, epoch, tag) the rank's workers read of epochs ``start`` .. ``through``, as
        many times as they read it: a shuffle reorders within these, never across."""
        return Counter(
            (w, e, t)
            for e in range(self.start, through + 1)
            for (r, w), batches in self.epoch(e)[1].items()
            if r == rank
            for batch in batches
            for t in batch
        )

    def steps(self, rank: int, through: int) -> list[Step]:
        """Rank ``rank``'s batches from the part's start: epoch mode, the epochs through
        ``through``; repeat mode, as long as every worker's stream through ``through`` lasts."""
        epochs = [(e, self.epoch(e)[1]) for e in range(self.start, through + 1)]
        nw = self.shape.nworkers
        if self.mode == "epoch":
            out: list[Step] = []
            for e, spans in epochs:
                out += in_turn([[Step(e, w, t) for t in spans[rank, w]] for w in range(nw)])
            return out
        streams = [[Step(e, w, t) for e, spans in epochs for t in spans[rank, w]] for w in range(nw)]
        return in_turn(streams, endless=True)


def stand(opened: dict[int, int], nworkers: int, base: int) -> int:
    """Where a checkpointed rank stands: the oldest epoch one of its workers delivered from last,
    once every worker has delivered (the epochs before it are over for all of them), else where
    it began (``base``)."""
    return min(opened.values()) if len(opened) >= nworkers else base


def resplit(
    seq: Sequence_,
    delivered: dict[int, list[int]],
    ranks: Sequence[tuple[int, Iterable[int]]],
    earlier: dict[int, list[int]],
    shape: Shape,
) -> tuple[int, dict[int, list[int]]]:
    """A checkpoint resumed on ``shape``: the epoch the new layout starts in and the epochs it
    re-splits (their positions to deliver, in order). ``delivered``: every tag of each epoch
    delivered so far, on every layout; ``ranks``: each old rank's (stand, the newest epoch each
    of its workers delivered from); ``earlier``: the epochs an earlier resume re-split."""
    stands = [s for s, _ in ranks]
    opened = [e for _, epochs in ranks for e in epochs]
    first = min(stands + opened)
    out = {}
    for epoch in range(first, max([*opened, *earlier], default=first) + 1):
        begun = any(e >= epoch for e in opened) or any(s > epoch for s in stands)
        if not begun and epoch not in earlier:
            continue
        n = seq.total(epoch)
        gone = {t % n for t in delivered.get(epoch, ())}
        out[epoch] = [p for p in earlier.get(epoch, range(n)) if p not in gone]
    start = first
    for epoch in sorted(out):
        if per_rank(len(out[epoch]), shape.world, seq.batch, seq.remainder):
            break
        start = epoch + 1
        del out[epoch]
    return start, out


def stand_in(n: int, first: int, lost: Container[int], one_source: bool) -> int | None:
    """The tag of the row that fills a lost position of an epoch of ``n`` positions, ``lost``
    of them, whose search starts at ``first``: n + the first good position from there, in turn
    (one data set); in a mix, past a lost ``first``, None (any good one)."""
    if first not in lost:
        return n + first
    if not one_source:
        return None
    q = first
    while q in lost:  # an epoch always has a good position (exactness_cases.damage)
        q = (q + 1) % n
    return n + q


def counted(tag: int, n: int, lost: Container[int]) -> int:
    """The losses the row of position ``tag`` counts: one where it is a lost position read as itself."""
    return int(tag < n and tag in lost)


def shard_rows(
    shards: Sequence[Sequence[int]],
    order: Callable[[Sequence[int], int], Sequence[int]],
    shape: Shape,
    rank: int,
    epochs: range,
) -> list[list[tuple[int, int]]]:
    """split=shards, repeat mode: each worker's (epoch, sample id) rows over ``epochs``.
    ``shards``: each shard's sample ids; ``order(shards, epoch)``: a worker's shards in the
    epoch's order."""
    mine = list(range(len(shards)))[rank :: shape.world]
    return [
        [(e, i) for e in epochs for s in order(mine[worker :: shape.nworkers], e) for i in shards[s]]
        for worker in range(shape.nworkers)
    ]


def shard_steps(
    shards: Sequence[Sequence[int]],
    order: Callable[[Sequence[int], int], Sequence[int]],
    shape: Shape,
    rank: int,
    batch: int,
    epochs: range,
) -> list[Step]:
    """split=shards, repeat mode: rank ``rank``'s batches over ``epochs``; a worker's batches run
    on across epochs."""
    streams = []
    for worker, rows in enumerate(shard_rows(shards, order, shape, rank, epochs)):
        chunks = [rows[i : i + batch] for i in range(0, len(rows) - batch + 1, batch)]
        streams.append([Step(c[0][0], worker, tuple(i for _, i in c), tuple(e for e, _ in c)) for c in chunks])
    return in_turn(streams, endless=True)
