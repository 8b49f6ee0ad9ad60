"""What the loader sets up in its DataLoader worker processes, and at the trainer's exit.

Workers keep a fixed malloc threshold (a persistent worker stays flat), keep what they inherited
out of their garbage collector's reach (they share its pages with their parent, and keep sharing
them), leave SIGTERM to the trainer and die with it; each skipped shard or sample is one warning
line, up to a limit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import multiprocessing
import signal
import sys

log = logging.getLogger(__name__)

_warned = [0]
_malloc_pinned = [False]


def pin_malloc_threshold(nbytes: int = 1 << 20) -> None:
    """Fix glibc's mmap threshold in this process (once).

    glibc raises the threshold each time a large block (a decoded image) is freed, after which
    such blocks come from the heap, which fragments: a persistent worker then grows by tens of
    MB every epoch. A fixed 1 MiB threshold keeps workers flat at no cost in speed
    (bench/results/2026-11-21-loader.md); 128 KiB would cost a large share of the decode rate
    in mmap calls.
    """
    if _malloc_pinned[0] or not sys.platform.startswith("linux"):
        return
    _malloc_pinned[0] = True
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to pin


def warn_skip(error: Exception, limit: int = 20) -> None:
    """One line per skipped shard or sample, up to ``limit`` per worker; they are all counted."""
    _warned[0] += 1
    if _warned[0] <= limit:
        log.warning("skipped: %s", error)
    elif _warned[0] == limit + 1:
        log.warning("more skipped samples; counts go on in the logs")


def worker_init(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the trainer: a signal sent to the whole process group
    (Slurm signals every process of a job step) must not kill them under a trainer that is
    finishing its step and writing a checkpoint. They still end with it: the kernel kills them
    when it exits (PR_SET_PDEATHSIG; strictly, when the thread that started them ends, so a
    loader is iterated from the thread that lives as long as it), and at its normal exit
    ``_end_workers`` does.

    First, what the worker inherited is frozen for its garbage collector (``gc.freeze``, which
    moves the collector's lists in a few writes). A forked worker shares its parent's pages until
    it writes one, and a full collection writes into every object it tracks: unfrozen, a worker's
    first one copied the parent's whole Python heap (torch, torchvision and what they import:
    about 80 MB here) into the worker, some hundred batches in
    (bench/results/2026-11-28-cpu-loader.md). The inherited objects are the parent's, alive
    there; the worker never needs to collect them. The parent's collector is left as it is."""
    gc.freeze()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # Linux only; elsewhere DataLoader's own watchdog notices
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


@atexit.register
def _end_workers() -> None:
    """At the trainer's exit, kill the DataLoader workers still running: they ignore the SIGTERM
    that multiprocessing would send them and then wait for in vain. (Registered after
    multiprocessing's own exit handler, so it runs before it.)"""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # DataLoader's handler would call this a crash
    for child in children:
        child.kill()
