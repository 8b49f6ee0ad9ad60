"""What a child forked from the tests' preloaded Python (tests/preloaded.py) spends on ending:
the CPU and the pages it copies when it ends by sys.exit (the interpreter's whole exit), by
tests/preloaded.py's exit_as_python_does, or by os._exit; with and without gc.freeze() first.
Prints a Markdown table: ./run bench/training/childexit.py"""

from __future__ import annotations

import gc
import os
import resource
import sys
from pathlib import Path

import hydra  # noqa: F401  (what tests/preloaded.py imports)
import omegaconf  # noqa: F401
import torch  # noqa: F401
import torchvision  # noqa: F401
import webdataset  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from preloaded import exit_as_python_does  # noqa: E402

ENDS = {
    "sys.exit": lambda: sys.exit(0),
    "exit_as_python_does": lambda: exit_as_python_does(0),
    "os._exit": lambda: os._exit(0),
}


def child(how: str) -> tuple[float, int]:
    """One forked child ended ``how``: its CPU seconds and minor page faults."""
    pid = os.fork()
    if pid == 0:
        ENDS[how]()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.waitpid(pid, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, after.ru_minflt - before.ru_minflt


def main() -> None:
    print("| gc.freeze() | the child ends by | CPU (s, median of 3) | minor page faults |")
    print("|---|---|---|---|")
    for freeze in (False, True):
        if freeze:
            gc.freeze()
        for how in ENDS:
            runs = sorted(child(how) for _ in range(3))
            print(f"| {'yes' if freeze else 'no'} | `{how}` | {runs[1][0]:.2f} | {runs[1][1]:,} |")


if __name__ == "__main__":
    main()
