"""What a node's cache (cache.py) did, counted per process: every batch carries the counts added
since the one before (delivery/batches.py), so a trainer sums its batches' to count a rank's."""

from __future__ import annotations

import os
import threading
from dataclasses import astuple, dataclass, fields, replace


@dataclass
class Counts:
    """What the cache did in this process."""

    hits: int = 0  # shard opens served from the cache
    misses: int = 0  # shard opens that fetched their shard into the cache
    fetched_bytes: int = 0  # bytes fetched from the store into the cache
    evicted_bytes: int = 0  # bytes of entries removed to stay under the limit
    corrupt: int = 0  # entries found damaged (a size other than their sidecar's, no sidecar), fetched again
    bypassed: int = 0  # shard opens read from the store because the cache could not take them
    ahead: int = 0  # shards fetched by read-ahead (loader.cache_ahead) before their worker opened them
    ahead_failed: int = 0  # read-ahead fetches the store failed (the worker's own open then meets the error)


CACHE_COUNTS = tuple(f.name for f in fields(Counts))
"""The names of the node cache's counts, in the order of a batch's ``cache`` tensor: shard opens
served from the cache (hits), opens that fetched their shard into it (misses), bytes fetched from
the store into it, bytes evicted, damaged entries found (fetched again), and opens read from the
store because the cache could not take the shard (bypassed); then what read-ahead did
(``loader.cache_ahead``): shards it fetched (ahead; their bytes are in fetched_bytes, their opens
are hits) and fetches of it the store failed (ahead_failed)."""
_counts = Counts()
_taken = Counts()
_guard = threading.Lock()


def _forget_after_fork() -> None:
    # A DataLoader worker counts what it does itself (a copy of its parent's counts would be
    # reported twice), and must not wait on a lock another parent thread held at the fork.
    global _counts, _taken, _guard
    _counts, _taken, _guard = Counts(), Counts(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def counts() -> Counts:
    """This process's counts since it began (a DataLoader worker's: since it was forked)."""
    with _guard:
        return replace(_counts)


def take_counts() -> tuple[int, ...]:
    """The counts added since the last call in this process, in ``CACHE_COUNTS`` order."""
    global _taken
    with _guard:
        now = replace(_counts)
        delta = tuple(a - b for a, b in zip(astuple(now), astuple(_taken), strict=True))
        _taken = now
    return delta


def count(**added: int) -> None:
    """Add to this process's counts (``Counts``' names)."""
    with _guard:
        for name, n in added.items():
            setattr(_counts, name, getattr(_counts, name) + n)
