"""The job's one progress bar, on rank 0: every rank's images, counted through the job's store."""

from __future__ import annotations

import sys
import threading
from typing import Any

from wdsdist.cluster import distributed


def done_key() -> str:
    """The job's store key that counts its images: one per start under torchrun --max-restarts,
    whose agent's store outlives the workers (a restarted job counts from 0)."""
    return f"wdsdist/predict/images/{distributed.restart_count()}"


class Progress:
    """One bar on rank 0 for the whole job: every rank's images, read from the job's store by a
    thread, so it moves while rank 0 waits for the others."""

    def __init__(self, dist: distributed.Dist, total: int):
        self.bar, self.stop = None, threading.Event()
        self.thread = None
        if dist.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="image", file=sys.stderr, dynamic_ncols=True)
            watcher = distributed.watch_store(5.0)
            if watcher is not None:
                self.thread = threading.Thread(target=self._watch, args=(watcher,), daemon=True)

    def __enter__(self) -> Progress:
        if self.thread is not None:
            self.thread.start()
        return self

    def _watch(self, store: Any) -> None:
        while True:
            stopped = self.stop.wait(0.5)  # once more after the stop: the bar ends at the job's count
            try:
                self.bar.n = int(store.add(done_key(), 0))  # type: ignore[union-attr]
                self.bar.refresh()  # type: ignore[union-attr]
            except RuntimeError:
                return
            if stopped:
                return

    def advance(self, n: int) -> None:
        if self.bar is not None and self.thread is None:
            self.bar.update(n)

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.bar is not None:
            self.bar.close()
