"""The rehearsal's launcher (``./run gpu-check --cpu``): train.py and torchrun started by forking a
Python that has torch, torchvision, Hydra and webdataset imported, not as fresh interpreters.

Importing those is most of what a small run costs on a CPU (4-5 s of a 2-core machine's CPU in
each of the rehearsal's six fresh interpreters, against a second or two of training), as
tests/preloaded.py found for the suite. The check's own process forks the preloaded Python
(``Preloaded``) right after its imports, before it computes anything or starts a thread (a fork
after OpenMP has run may hang the child); that one forks each run in turn, and each run is a
process of its own: its pid, cwd, environment, argv, ``__main__``, output file and exit status.
The project's own modules load in each run as in a fresh process, but for the few the check has
loaded by then (jpegcrop's, to name the machine). A GPU's check keeps its fresh interpreters: its
runs are the measurements.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Run:
    """A forked run, as much of ``subprocess.Popen`` as train_py uses: pid, wait, kill."""

    def __init__(self, pid: int, answers: int):
        self.pid, self._answers, self.returncode = pid, answers, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = _line(self._answers, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
            self.returncode = os.waitstatus_to_exitcode(int(status))
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, 9)


class Preloaded:
    """The forked Python that starts the rehearsal's runs, one at a time."""

    def __init__(self) -> None:
        import hydra  # noqa: F401  (what train.py and torchrun import anyway)
        import omegaconf  # noqa: F401
        import torch.distributed.run  # noqa: F401
        import torch.utils.tensorboard  # noqa: F401  (0.7 s of each run's CPU here)
        import torchvision  # noqa: F401
        import webdataset  # noqa: F401

        assert threading.active_count() == 1, "fork before any thread starts"
        (req_r, self._requests), (self._answers, ans_w) = os.pipe(), os.pipe()
        sys.stdout.flush(), sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._requests), os.close(self._answers)
            _serve(req_r, ans_w)
        os.close(req_r), os.close(ans_w)

    def start(self, argv: list[str], env: dict, out: Path) -> Run:
        """``python ARGV`` (``-m MODULE ...`` too) in ROOT, stdout and stderr to ``out``."""
        request = {"argv": argv, "env": env, "out": str(out)}
        os.write(self._requests, (json.dumps(request) + "\n").encode())
        return Run(int(_line(self._answers, 60)), self._answers)

    def close(self) -> None:
        os.close(self._requests)  # the server's end of input: it exits
        os.waitpid(self.pid, 0)
        os.close(self._answers)


def _line(fd: int, timeout: float | None) -> str | None:
    """The next line from a pipe (read a byte at a time: no line is read past); None after timeout."""
    text = b""
    while not text.endswith(b"\n"):
        if not select.select([fd], [], [], timeout)[0]:
            return None
        byte = os.read(fd, 1)
        if not byte:
            raise RuntimeError("the rehearsal's preloaded Python ended")
        text += byte
    return text.decode().strip()


def _serve(requests: int, answers: int) -> None:
    """In the preloaded Python: fork each request's run, answer its pid, then its wait status."""
    gc.freeze()  # the runs' collections would otherwise walk (and so copy) every preloaded page
    for line in os.fdopen(requests):
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(requests), os.close(answers)
            _run(request)
        os.write(answers, f"{pid}\n".encode())
        os.write(answers, f"{os.waitpid(pid, 0)[1]}\n".encode())
    os._exit(0)


def _run(request: dict) -> None:
    """In the forked run: become ``python ARGV`` in ROOT, run it, exit as Python would."""
    sys.path.insert(0, str(ROOT / "tests"))  # the suite's preloaded Python ends its children so too
    from preloaded import run_and_exit

    run_and_exit(lambda: _become(request))


def _become(request: dict) -> None:
    import random

    import numpy as np

    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1), os.dup2(out, 2)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as python -u's output, read while it runs
    random.seed(), np.random.seed()  # a fresh interpreter seeds these from the OS
    # A fresh `python train.py` or `python -m` has ROOT first, and not bench/ or tests/.
    own = (str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "gpucheck"), str(ROOT / "tests"))
    sys.path[:] = [str(ROOT), *(p for p in sys.path if p not in own)]
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
