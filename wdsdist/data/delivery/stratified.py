"""loader.mix=stratified: batches made in the worker that each hold every source's count of its
stretch of the mixed sequence (plan/mix.py), from the worker's shuffled rows."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def quotas(shares: Sequence[float], carry: list[float], size: int) -> list[int]:
    """Each source's rows in the next batch of ``size``: its share, rounded so that the counts sum
    to ``size`` (largest remainders), what rounding gave or took carried to the next batch."""
    exact = [share * size + c for share, c in zip(shares, carry, strict=True)]
    want = [max(0, math.floor(x)) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (want[i] - exact[i], i))[: max(0, size - sum(want))]:
        want[i] += 1
    for i, x in enumerate(exact):
        carry[i] = x - want[i]
    return want


class _Epoch:
    """One epoch's rows of a worker, sorted into one queue per source as they are pulled."""

    def __init__(self, rows: Iterator[tuple], first: tuple, stream: Any, made: int):
        self.rows, self.ahead = rows, first  # ``ahead``: the next row, not queued yet
        self.epoch, self.made = first[2][0], made
        self.mixed = stream.mix_epoch(self.epoch)
        self.queues: list[deque] = [deque() for _ in stream.mix.sources]
        self.carry = [0.0] * len(self.queues)
        self.ended = False  # every row of the epoch is queued

    def pull(self) -> bool:
        """Queue the next row of this epoch; False once there is none (the next is a later epoch's)."""
        row = self.ahead
        if self.ended or row is None or row[2][0] != self.epoch:
            self.ended = True
            return False
        self.queues[int(self.mixed.sources(row[2][3]))].append(row)
        self.ahead = next(self.rows, None)
        return True


def stratified(
    rows: Iterator[tuple], stream: Any, size: int, collation: Callable, partial: bool, cap: int, made_before: dict
) -> Iterator[dict]:
    """loader.mix=stratified: the worker's n-th batch of an epoch holds as many rows of each
    source as the n-th batch of its span of the mixed sequence (ShardStream.stripes: each
    source's share, rounded), taken from its shuffled rows sorted into one queue per source.
    Where a queue runs dry (its rows failed, or a resumed epoch left other counts) or rows wait
    past ``cap``, the batch is made up from the other queues, and later batches follow the
    epoch's shares. A batch never mixes epochs: the rows an epoch's shares left over are its
    last batches, before the next epoch's (in repeat mode too), which is what the loader's
    position assumes (resume.ConsumedTracker). ``stream``: the worker's ShardStream (its mix,
    epochs and stripes); ``made_before``: epoch -> the batches a resumed worker had made of it
    (their rows are passed over, so its next batch is that stretch's)."""
    rows = iter(rows)
    first = next(rows, None)
    while first is not None:
        epoch = _Epoch(rows, first, stream, made_before.get(first[2][0], 0))
        for batch in _batches(epoch, stream, size, cap):
            if len(batch) < size and not partial:
                return
            yield collation(batch)
        first = epoch.ahead


def _batches(epoch: _Epoch, stream: Any, size: int, cap: int) -> Iterator[list]:
    """One epoch's batches, each to its stretch's counts where the rows allow."""
    queues = epoch.queues
    while any(queues) or epoch.pull():
        plan = stream.stripes.get(epoch.epoch)
        if plan is not None and epoch.made < len(plan) and sum(plan[epoch.made]) == size:
            want = list(plan[epoch.made])
        else:
            shares = [n / epoch.mixed.total for _, n in epoch.mixed.windows]
            want = quotas(shares, epoch.carry, size)
        while sum(map(len, queues)) < cap and any(len(q) < w for q, w in zip(queues, want, strict=True)):
            if not epoch.pull():
                break
        take = [min(len(q), w) for q, w in zip(queues, want, strict=True)]
        short = size - sum(take)
        for i in sorted(range(len(queues)), key=lambda i: take[i] - len(queues[i])):
            extra = min(short, len(queues[i]) - take[i])
            take[i] += extra
            short -= extra
        epoch.made += 1
        yield [q.popleft() for q, n in zip(queues, take, strict=True) for _ in range(n)]
