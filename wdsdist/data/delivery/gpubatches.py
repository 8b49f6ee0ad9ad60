"""decode=gpu: the rank's batches decoded ahead of the caller, on threads of the training process.

A decode call returns only once its batch is decoded, and launching the batch's resize takes the
host a little more: on the training loop's own thread that time was spent between two steps,
with the next step not yet launched, and a fast model waited for it. Here threads take the next
batches from the workers and make their images while the loop launches the step before; the
decode releases the GIL, and so do the kernel launches. Each thread has a decoder of its own (its
stream and buffer): with two or more (loader.gpu_decode_threads), one batch's decode call overlaps
the next one's. A thread makes at most one batch ahead of those the caller has taken, so at most
as many batches wait as there are threads (their images on the device until taken).

The workers' iterator is advanced by one thread at a time, under a lock, and each batch is
numbered as it is taken from it; the caller gets the batches by number, in the workers' order, as
without the threads. What was consumed is counted by the caller as it takes the batches, so a
batch made ahead and not taken is not in a state (a resume makes it again). The threads end with
the iteration: when the caller stops early (an epoch cut to nbatches, a loop that breaks), they
are told to stop and waited for, so the workers' iterator is never advanced once the caller is
done with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

Decode = Callable[[dict], dict]
Setup = Callable[[], None]


class _Ahead:
    """The batches the threads made, by number, until the caller takes them."""

    def __init__(self, batches: Iterator[dict], threads: int):
        self.batches, self.threads = batches, threads
        self.lock = threading.Lock()  # the workers' iterator and the numbering
        self.ready = threading.Condition()  # ``made`` and ``taken``
        self.made: dict[int, tuple[str, object]] = {}
        self.numbered = self.taken = 0
        self.done = False  # the iterator ended or failed: no thread takes from it again
        self.stop = threading.Event()

    def next(self) -> tuple[int, dict] | None:
        """The next batch from the workers, numbered; None once they are done (the end, or an
        error, put in its place)."""
        with self.lock:
            if self.done or self.stop.is_set():
                return None
            number = self.numbered
            try:
                batch = next(self.batches)
            except StopIteration:
                self.done = True
                self.give(number, "end", None)
                return None
            except BaseException as exc:  # noqa: BLE001 (a worker's error: raised to the caller, in order)
                self.done = True
                self.give(number, "error", exc)
                return None
            self.numbered += 1
            return number, batch

    def give(self, number: int, kind: str, item: object) -> bool:
        """Puts a made batch (an error, the end) in its place once it is at most one batch per
        thread ahead of the caller; False when the caller has stopped."""
        with self.ready:
            while not self.stop.is_set() and number >= self.taken + self.threads:
                self.ready.wait(0.1)
            if self.stop.is_set():
                return False
            self.made[number] = (kind, item)
            self.ready.notify_all()
            return True

    def take(self) -> tuple[str, object]:
        with self.ready:
            while self.taken not in self.made:
                self.ready.wait()
            kind, item = self.made.pop(self.taken)
            self.taken += 1
            self.ready.notify_all()
            return kind, item

    def run(self, decode: Decode, setup: Setup) -> None:
        """One thread: batches taken and decoded until the workers are done or the caller stops."""
        try:
            setup()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, raised there)
            with self.lock:  # in the place of the next batch, which then no thread takes
                self.done, number = True, self.numbered
            self.give(number, "error", exc)
            return
        number = -1
        try:
            while (got := self.next()) is not None:
                number, batch = got
                if not self.give(number, "batch", decode(batch)):
                    return
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, raised there)
            self.give(number, "error", exc)

    def close(self, threads: list[threading.Thread]) -> None:
        self.stop.set()
        with self.ready:
            self.ready.notify_all()
        for thread in threads:
            thread.join()


def decoded_ahead(batches: Iterator[dict], decoders: Sequence[tuple[Decode, Setup]]) -> Iterator[dict]:
    """``decode(batch)`` of each of ``batches``, made ahead of the caller by a thread per
    ``(decode, setup)``; ``setup()`` runs first on its thread (the CUDA device is a thread's
    own). An error in a thread (a worker's, a decoder's) is raised here, in its batch's place."""
    ahead = _Ahead(batches, len(decoders))
    threads = [
        threading.Thread(target=ahead.run, args=pair, name=f"wdsdist-gpu-decode-{i}", daemon=True)
        for i, pair in enumerate(decoders)
    ]
    for thread in threads:
        thread.start()
    try:
        while True:
            kind, item = ahead.take()
            if kind == "end":
                return
            if kind == "error":
                raise item  # type: ignore[misc]
            yield item  # type: ignore[misc]
    finally:
        ahead.close(threads)
