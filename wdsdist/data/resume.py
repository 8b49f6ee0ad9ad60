"""A rank loader's exact position: which samples of which epochs each of its workers delivered.

Every sample carries an id (epoch, worker, position in the worker's shuffled stream); the
position built from the ids consumed is the loader state a checkpoint keeps, and a resumed
loader skips exactly those samples, before decoding them.
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
