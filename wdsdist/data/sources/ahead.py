"""Read-ahead into the node cache (``loader.cache_ahead``): while a worker reads one shard, a thread
of its own fetches the next shards of the worker's plan into the cache (cache.py), so that the
worker's opens find them there. Without it a worker asks the store for a shard only when it opens
it, one request at a time, and waits for each.

The worker's plan is what it iterates: ``ReadAhead`` hands the worker its items in order and peeks
at the next ``depth`` of them once the worker has opened the current one (``opened``), so the first
shard is never fetched against read-ahead's, and the first batch waits for nothing of it. The
thread fetches in plan order, never more than ``depth`` shards past the worker; each one fetched
stays pinned (cache.Pin) until the worker has opened it, so that read-ahead's next fetch never
evicts it. Where the cache has no room, read-ahead stops until the worker opens its next shard; it
never reads from the store for the worker. Where that shard is the very next one and the store was
not asked (cache.NoRoomYet), it looks again after a while (from ``RETRY_S``, doubling to
``RETRY_MAX_S``): the room comes when the worker lets an earlier shard go, which no open announces
(a shard's file stays open until its late-read members are decoded, tar/lateread.py), and waiting
for the next open would leave the next shard to the worker. A worker that reaches a shard
read-ahead is fetching waits for that download (the entry's download lock), rather than starting a
second one. A failed fetch is counted (cache.Counts.ahead_failed) and passed over, never retried
nor warned about: the worker's own open meets the error and reports it as without read-ahead. The
thread ends with the worker's pass over its plan, or when the stream is closed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from wdsdist.data.sources import cache
from wdsdist.data.sources.cachefiles import Span
from wdsdist.data.sources.opener import Access, fetch_ahead

T = TypeVar("T")
RETRY_S, RETRY_MAX_S = 0.05, 1.0  # the next shard, when the cache had no room for it: look again after


class ReadAhead(Generic[T]):
    """A worker's plan (``items``, each naming its shard through ``url_of``: its URL, and the span
    of its bytes the cache keeps as one entry, or None: all of it), iterated once, with the next
    ``depth`` remote shards fetched into ``access.cache_dir`` in the background (0, or no cache:
    nothing is)."""

    def __init__(
        self, items: Iterable[T], url_of: Callable[[T], tuple[str, Span | None]], access: Access, depth: int
    ) -> None:
        self.items = iter(items)
        self.url_of, self.access = url_of, access
        self.depth = depth if access.cache_dir is not None else 0
        self.peeked: deque[T] = deque()  # the worker's next items, taken from ``items`` early
        self.at = -1  # the position in the plan of the item the worker took last
        self.open = -1  # the position of the last shard the worker has opened (or failed to)
        self.planned = -1  # the last position handed to the thread (or passed over: local)
        self.todo: deque[tuple[int, str, Span | None]] = deque()  # (position, url, span) for the thread
        self.pins: dict[int, cache.Pin] = {}  # position -> its entry, fetched, not opened yet
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                if self.peeked:
                    item = self.peeked.popleft()
                else:
                    try:
                        item = next(self.items)
                    except StopIteration:
                        return
                with self.cond:
                    self.at += 1
                yield item
        finally:
            self.close()

    def opened(self) -> None:
        """The worker has opened the shard of its current item (or failed to): its own lock holds
        that entry now, and read-ahead goes on to the next ``depth`` shards."""
        if not self.depth or self.stop.is_set():
            return
        while len(self.peeked) < self.depth:
            try:
                self.peeked.append(next(self.items))
            except StopIteration:
                break
        with self.cond:
            self.open = self.at
            for position in [p for p in self.pins if p <= self.at]:
                self.pins.pop(position).close()
            for offset, item in enumerate(self.peeked, start=self.at + 1):
                if offset > self.planned:
                    url, span = self.url_of(item)
                    if cache.cacheable(url):
                        self.todo.append((offset, url, span))
                    self.planned = offset
            if not self.todo:
                return
            self.cond.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="wdsdist-cache-ahead", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        retry = RETRY_S
        while True:
            with self.cond:
                while not self.todo and not self.stop.is_set():
                    self.cond.wait()
                if self.stop.is_set():
                    return
                position, url, span = self.todo.popleft()
                if position <= self.open:
                    retry = RETRY_S
                    continue  # the worker has opened it already (a download of it, its own)
            try:
                pin = fetch_ahead(url, self.access, self.stop, span)
            except cache.CacheFull as full:
                with self.cond:
                    if isinstance(full, cache.NoRoomYet) and position == self.open + 1:  # look again (above)
                        self.todo.appendleft((position, url, span))
                        if not self.stop.is_set():  # close() may have notified while we fetched
                            self.cond.wait(retry)  # or until the worker opens a shard
                        retry = min(2 * retry, RETRY_MAX_S)
                    else:  # no room now: try again once the worker has moved on
                        self.todo.clear()
                        self.planned = min(self.planned, position - 1)
                continue
            retry = RETRY_S
            if pin is None:
                continue
            with self.cond:
                # The worker may have opened it meanwhile (it waited for this download): its own
                # lock holds the entry now, and a pin kept would leave it unevictable until the
                # worker's next open.
                if self.stop.is_set() or position <= self.open:
                    pin.close()
                else:
                    self.pins[position] = pin

    def close(self) -> None:
        """Stop: the thread ends within one read of the store, and every pin is let go."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        with self.cond:
            pins, self.pins = list(self.pins.values()), {}
        for pin in pins:
            pin.close()
