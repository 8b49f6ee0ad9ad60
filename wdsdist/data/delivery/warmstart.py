"""A rank's first batch, made on all of its workers' cores (``loader.warm_start``).

Every worker makes whole batches alone, one image after another, so the first batch takes one
core as long as 64 decodes (bench/results/2026-11-24-peers.md), while the other workers spend the
rank's other cores on batches wanted later. With ``warm_start``, worker 0 (the leader, whose
batch comes first) decodes the images of its first batch on one thread per worker of the rank,
and the other workers (the followers) start decoding only once the main process has that batch
(batches.opened sets the gate), or the leader's stream has ended. Their shards open and their
shuffle buffers fill meanwhile. A leader that takes longer than ``WAIT_S`` (a slow
server, an unusually large batch) stops holding them: a first batch that slow is not made much
sooner by the others waiting, and a follower waiting in its first ``iter()`` cannot hear the
DataLoader shutting down (which gives a worker 5 s to end before it terminates it).

The batches stay the same, image for image: the random draws of every sample are made on the
worker's own thread in stream order (decode.prepare_sample), the threads only make pixels, and
the rows come back in order. Only JPEGs that jpegcrop takes are decoded on the threads; other
images are decoded by prepare_sample itself.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from wdsdist.data.cores import cores
from wdsdist.errors import DataError

WAIT_S = 3.0  # the longest a follower waits for the leader's first batch


def threads_for(nworkers: int) -> int:
    """The leader's threads: one per worker of the rank, at most one per core it may run on."""
    return max(1, min(nworkers, cores()))


class WarmStart:
    """Runs a worker's prepared samples (``(seq, sample, prepared)``, where prepared is the
    function prepare_sample returned, a DataError it raised, or a marker passed through) and
    gives ``(seq, sample, done)`` in order, done being ``(image, label)``, the DataError, or the
    marker. The leader runs the first ``rows`` rows' functions on ``threads`` threads, a window
    of as many as rows are still to come ahead; a follower first waits for ``gate``, which the
    main process opens when it has the first batch, and the leader when its stream ends."""

    def __init__(self, gate: Any | None, *, leader: bool, rows: int, threads: int, wait_s: float = WAIT_S):
        self.gate, self.leader, self.wait_s = gate, leader, wait_s
        self.rows_left = rows if leader and threads > 1 else 0
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="warm") if self.rows_left else None
        self.waited = leader or gate is None
        if not self.rows_left:
            self.done()  # a leader with nothing to do sooner holds nobody

    def row(self) -> None:
        """A row was made. After the leader's ``rows``-th its threads go once the row after it
        is asked for (its batch has been stacked then); the gate stays as it is, for the main
        process to open."""
        if self.rows_left:
            self.rows_left -= 1

    def wait(self) -> None:
        """A follower waits (once, ``wait_s`` at most) for the gate before its first decode."""
        if not self.waited:
            self.waited = True
            self.gate.wait(self.wait_s)  # type: ignore[union-attr]

    def ahead(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the leader's threads before its rows (nothing without threads)."""
        if self.pool is not None:
            self.pool.submit(fn)

    def done(self) -> None:
        """The leader's stream ended or failed: nobody waits for it any more."""
        if self.leader and self.gate is not None:
            self.gate.set()
        self._stop_threads()

    def _stop_threads(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def run(self, items: Iterable[tuple]) -> Iterator[tuple]:
        items, pending = iter(items), collections.deque()
        try:
            while True:
                while self.rows_left and len(pending) < self.rows_left:
                    item = next(items, None)
                    if item is None:
                        break
                    seq, sample, prepared = item
                    if callable(prepared):
                        prepared = self.pool.submit(prepared)  # type: ignore[union-attr]
                    pending.append((seq, sample, prepared))
                if pending:
                    seq, sample, prepared = pending.popleft()
                    yield seq, sample, _outcome(prepared.result if isinstance(prepared, Future) else prepared)
                    if not self.rows_left and self.pool is not None:
                        self._stop_threads()
                    continue
                item = next(items, None)
                if item is None:
                    return
                seq, sample, prepared = item
                if callable(prepared):
                    self.wait()
                yield seq, sample, _outcome(prepared)
        finally:
            for _, _, prepared in pending:
                if isinstance(prepared, Future):
                    prepared.cancel()


def _outcome(prepared: Callable | Any) -> Any:
    """The image and label a prepared function makes, or the DataError it raises; a DataError
    or a marker as it is."""
    if not callable(prepared):
        return prepared
    try:
        return prepared()
    except DataError as error:
        return error
