"""A contender's memory for bench.py: its process tree's peak RSS, PSS and where the PSS lies
(TreeMemory), and the page cache's copy of its environment's libraries dropped before it runs
(evict_libraries), so that every contender's libraries come in the same way."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from pathlib import Path


class TreeMemory:
    """Memory of this process plus all its descendants (the DataLoader workers).

    ``peak_rss``: the summed RSS, sampled every 50 ms from /proc/PID/statm, which the kernel
    answers from counters. The sampler runs in the measured process, and its CPU time counts in
    the row's CPU per sample: so it keeps each process's statm open (a read: 1.5 us) and walks
    the tree for new processes only every ``WALK`` samples. Sampling every 20 ms, opening the
    files and walking the tree each time, it took 29 ms of CPU a second here (1.4 % of two
    cores, which the bare loops (d) and (e) do not pay); now 4.5 ms.

    ``account()``: each process's PSS, in which pages shared between the main process and its
    forked workers (torch's libraries, mostly) count once in all rather than once per process; it needs
    /proc/PID/smaps_rollup, which walks the page tables (17-24 ms a process here), so it is read
    only outside the timed window. Sampling smaps_rollup every 20 ms during the run took most of
    a core and halved the loader's measured rate.
    """

    def __init__(self, interval: float = 0.05):
        self.peak_rss, self.interval, self._stop = 0, interval, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree() -> list[int]:
        pids, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue  # it ended meanwhile
        return pids

    def _sum(self, name: str, parse) -> int:
        """A /proc/PID/NAME figure summed over the tree (processes that end meanwhile count 0)."""
        total = 0
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/{name}") as f:
                    total += parse(f)
            except (OSError, IndexError, ValueError, StopIteration):
                pass
        return total

    def cpu(self) -> float:
        """CPU seconds (user + system) used so far by the tree: its live processes (all their
        threads) and the children they reaped (the workers of a loader's past epochs). Per sample,
        it holds on a busy machine where wall time does not: another tenant's load stretches a
        loader's wall time, not the CPU time its work takes."""
        tick = os.sysconf("SC_CLK_TCK")
        # /proc/PID/stat fields 14-17 (utime, stime, cutime, cstime), counted after the ")" that
        # ends the command name. A child's time moves into cutime when reaped: counted once.
        return self._sum("stat", lambda f: sum(map(int, f.read().rsplit(")", 1)[1].split()[11:15]))) / tick

    ACCOUNT = {"Pss": "pss", "Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem", "Private_Dirty": "private"}

    def account(self) -> list[dict]:
        """Where the PSS lies, process by process (this one first, then its descendants): PSS and
        its anonymous, file-backed and shared-memory parts, and the pages it wrote itself
        (Private_Dirty), in MB, from /proc/PID/smaps_rollup."""
        rows = []
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[0][:-1] in self.ACCOUNT}
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
            rows.append({"pid": pid} | {name: fields.get(key, 0) / 1024 for key, name in self.ACCOUNT.items()})
        return rows

    WALK = 4  # samples between two walks of the tree (a worker started meanwhile waits 0.2 s at most)

    def _run(self) -> None:
        statm: dict[int, int] = {}  # pid -> its /proc/PID/statm, open
        try:
            for tick in itertools.count():
                if tick % self.WALK == 0:
                    pids = set(self._tree())
                    for pid in statm.keys() - pids:
                        os.close(statm.pop(pid))
                    for pid in pids - statm.keys():
                        with contextlib.suppress(OSError):  # it ended meanwhile
                            statm[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
                total = 0
                for pid, fd in list(statm.items()):
                    try:
                        total += int(os.pread(fd, 128, 0).split()[1]) * self._page
                    except (OSError, IndexError, ValueError):  # it ended (and its pid may be reused)
                        os.close(statm.pop(pid))
                self.peak_rss = max(self.peak_rss, total)
                if self._stop.is_set():
                    return
                time.sleep(self.interval)  # cheaper than Event.wait's timed lock (a third less CPU here)
        finally:
            for fd in statm.values():
                os.close(fd)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def evict_libraries(python: str) -> int:
    """Drop the page cache's copy of every shared library in ``python``'s environment (clean pages
    no process maps; posix_fadvise DONTNEED, no root needed), so that each contender's libraries
    come in through its own page faults. A library's pages count in a process's PSS as they are
    mapped, and how many a fault maps depends on how the page cache got them: the same
    ``import torch, torchvision`` held 529 MB of library pages in one venv on this machine and
    325 MB after the kernel's caches were dropped (bench/results/2026-11-28-cpu-loader.md).
    Returns the files advised."""
    prefix = Path(python).parent.parent  # the venv (its bin/python links to the base interpreter)
    advised = 0
    for folder, _, files in os.walk(prefix / "lib"):
        for name in files:
            if ".so" not in name:
                continue
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    advised += 1
                finally:
                    os.close(fd)
    return advised
