"""A rank loader's exact position: which samples of which epochs each of its workers delivered.

Every sample carries an id (epoch, worker, position in the worker's shuffled stream); the
position built from the ids consumed is the loader state a checkpoint keeps, and a resumed
loader skips exactly those samples, before decoding them.

With loader.split=samples each batch also carries every sample's position in the epoch's sample
sequence (``batch["pos"]``: the shards in the epoch's seeded order, read as one sequence; from
N on, the padding: position - N again). A same-layout resume stays the seq-based skip above
(bit-exact: each worker's shuffled stream replays and drops what was consumed).

Elastic resume (issue 14 item 4; the design this state is shaped for, not built yet):
  - state: per old worker, its span [a, b) of the interrupted epoch (splits.sample_span, from
    world, workers, batch size and the counts), the prefix [a, c) of it consumed, and the
    positions beyond c consumed out of order (at most the shuffle buffer plus the cross-worker
    shuffle and the batches in flight): O(ranks x workers) numbers plus the pending items,
    never O(samples). The tracker can follow ``pos`` beside ``seq`` to keep them; today's
    seq-based state names them too, since the shuffle buffer's permutation depends only on
    its seed and the stream's length: replaying a worker's shuffle over its span's position
    numbers maps seq to pos (tests/test_sample_split.py holds this), unless a shard failed
    mid-span (then its samples are missing, which the resume must count as consumed).
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ResumePoint:
    """Where each worker of a rank stands: for each epoch it has begun and not left behind,
    every sample before ``start`` and every one listed in ``skip`` was consumed.

    In epoch mode every worker is in ``epoch``. In repeat mode a worker runs from one epoch
    into the next without stopping (a batch may hold the end of one and the start of the next),
    so each worker has its own epochs; ``epoch`` is where a worker with no entry starts.
    """

    epoch: int
    workers: dict[int, dict[int, tuple[int, frozenset[int]]]] = field(default_factory=dict)

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "workers": {
                str(w): {str(e): [s, sorted(k)] for e, (s, k) in epochs.items()} for w, epochs in self.workers.items()
            },
        }

    @classmethod
    def from_state(cls, state: dict) -> ResumePoint:
        epoch, workers = int(state["epoch"]), {}
        for w, entry in state["workers"].items():
            if isinstance(entry, list):  # written before workers had epochs of their own: [start, skip]
                entry = {str(epoch): entry}
            workers[int(w)] = {int(e): (int(s), frozenset(int(i) for i in k)) for e, (s, k) in entry.items()}
        return cls(epoch, workers)

    def first_epoch(self, worker: int) -> int:
        return min(self.workers.get(worker) or [self.epoch])


class ConsumedTracker:
    """Follows the ids of consumed samples to give the loader's exact position.

    A worker's samples of one epoch all arrive before any of its next (a worker's batches come
    in order, and the cross-worker shuffle empties at each epoch's end), so once its next epoch
    shows, the one before is done and forgotten: a resumed worker would otherwise read through
    it again.
    """

    def __init__(self, epoch: int):
        self.base = epoch  # where a worker that delivered nothing yet starts
        self.epoch = epoch  # the newest epoch consumed from (epoch mode: the epoch)
        self.batches = 0  # batches consumed since self.epoch began (counts in epoch mode)
        self.open: dict[int, list] = {}  # worker -> [its epoch, start, seen beyond start]

    def load(self, point: ResumePoint, batches: int) -> None:
        self.base = self.epoch = point.epoch
        self.batches = batches
        self.open = {w: [e, s, set(k)] for w, eps in point.workers.items() for e, (s, k) in eps.items()}

    def update(self, ids: torch.Tensor) -> None:
        rows = ids.tolist()
        newest = max(e for e, _, _ in rows)
        if newest > self.epoch:
            self.epoch, self.batches = newest, 0
        self.batches += 1
        for epoch, worker, seq in rows:
            entry = self.open.get(worker)
            if entry is None or epoch > entry[0]:
                entry = self.open[worker] = [epoch, 0, set()]
            elif epoch < entry[0]:
                continue  # an epoch this worker has left behind
            seen = entry[2]
            seen.add(seq)
            while entry[1] in seen:
                seen.discard(entry[1])
                entry[1] += 1

    def point(self) -> ResumePoint:
        workers = {w: {e: (s, frozenset(k))} for w, (e, s, k) in self.open.items()}
        return ResumePoint(self.base, workers)
