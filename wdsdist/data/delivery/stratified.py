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


def stratified(
    rows: Iterator[tuple], stream: Any, size: int, collation: Callable, partial: bool, cap: int
) -> Iterator[dict]:
    """loader.mix=stratified: the worker's n-th batch of an epoch holds as many rows of each
    source as the n-th batch of its span of the mixed sequence (ShardStream.stripes: each
    source's share, rounded), taken from its shuffled rows sorted into one queue per source.
    Where a queue runs dry (its rows failed, or a resumed epoch left other counts) or rows wait
    past ``cap``, the batch is made up from the other queues, and later batches follow the
    epoch's shares. ``stream``: the worker's ShardStream (its mix, epochs and stripes)."""
    queues: list[deque] = [deque() for _ in stream.mix.sources]  # type: ignore[union-attr]
    carry = [0.0] * len(queues)
    rows = iter(rows)
    ended, epoch, made = False, None, 0

    def pull() -> bool:
        nonlocal epoch, made
        row = next(rows, None)
        if row is None:
            return False
        if row[2][0] != epoch:
            epoch, made = row[2][0], 0
        queues[int(stream.mix_epoch(epoch).sources(row[2][3]))].append(row)
        return True

    ended = not pull()
    while not ended or any(queues):
        if not any(queues):
            ended = not pull()
            continue
        plan = stream.stripes.get(epoch)
        if plan is not None and made < len(plan) and sum(plan[made]) == size:
            want = list(plan[made])
        else:
            mixed = stream.mix_epoch(epoch)
            want = quotas([n / mixed.total for _, n in mixed.windows], carry, size)
        while not ended and sum(map(len, queues)) < cap and any(len(q) < w for q, w in zip(queues, want, strict=True)):
            ended = not pull()
        take = [min(len(q), w) for q, w in zip(queues, want, strict=True)]
        short = size - sum(take)
        for i in sorted(range(len(queues)), key=lambda i: take[i] - len(queues[i])):
            extra = min(short, len(queues[i]) - take[i])
            take[i] += extra
            short -= extra
        batch = [q.popleft() for q, n in zip(queues, take, strict=True) for _ in range(n)]
        if len(batch) < size and not partial:
            return
        made += 1
        yield collation(batch)
