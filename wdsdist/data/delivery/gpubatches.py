"""decode=gpu: the rank's batches decoded a batch ahead, on a thread of the training process.

nvJPEG's batched decode returns only once the batch is decoded, and launching each image's crop
takes the host a few microseconds more: on the training loop's own thread that time was spent
between two steps, with the next step not yet launched, and a fast model waited for it
(bench/results/2026-11-27-gpu-check.md). Here a thread takes the next batch from the
workers and makes its images while the loop launches the step before it; the decode releases
the GIL, and so do the kernel launches. One batch ahead, at most: the thread waits for the
caller to take the one it has made (its images on the device until then).

The caller gets each batch in the workers' order, as without the thread; what was consumed is
counted by the caller as it takes the batches, so a batch made ahead and not taken is not in a
state (a resume makes it again). The thread ends with the iteration: when the caller stops early
(an epoch cut to nbatches, a loop that breaks), it is told to stop and waited for, so the
DataLoader's iterator is never advanced by two threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

_END = object()


def decoded_ahead(batches: Iterator[dict], decode: Callable[[dict], dict], setup: Callable[[], None]) -> Iterator[dict]:
    """``decode(batch)`` of each of ``batches``, made by a thread one batch ahead of the caller;
    ``setup()`` runs first on that thread (the CUDA device is a thread's own). An error in the
    thread (a worker's, the decoder's) is raised here, in order."""
    made: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def give(item: object) -> bool:
        while not stop.is_set():
            try:
                made.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            setup()
            for batch in batches:
                if stop.is_set() or not give(("batch", decode(batch))):
                    return
            give(("end", _END))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, raised there)
            give(("error", exc))

    thread = threading.Thread(target=run, name="wdsdist-gpu-decode", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = made.get()
            if kind == "end":
                return
            if kind == "error":
                raise item  # type: ignore[misc]
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()
