"""A Python with torch, torchvision, webdataset and Hydra imported, which runs each script it is
sent in a forked child: a process of its own (pid, exit status, stdout and stderr files, cwd,
environment, argv, __main__), minus the 3-6 s a fresh interpreter spends importing those. The
suite starts a few hundred such scripts; tests/conftest.py's run_script sends them here. A child
ends as multiprocessing's do: what its work can see of an interpreter's exit, then os._exit
(``exit_as_python_does``). Modules named on its command line are imported as well (run_script's
``preload``: Lightning, for tests/lightning/test_lightning.py).

Protocol: one JSON request a line on stdin ({argv, cwd, env, stdout, stderr}: the files the
child writes); the answer is a line with the child's pid, then one with its wait status.

With ``ranks`` (N) in the request, N children run the script as the ranks of one job, with the
environment torchrun gives its workers on one node (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE; MASTER_ADDR and MASTER_PORT come with the request): rank 0 hosts the job's
store, as under a launcher without torchrun's agent store. Their output goes to the same two
files, as torchrun's workers share its. The answer is a line with their pids, then one with a
wait status: the first failed rank's, or rank 0's. As torchrun does, a rank's failure stops the
others (SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

# Only what train.py and makeshards.py import anyway; never the project's own modules
# (they load in the child as they would in a fresh process) nor anything that brings in boto3
# (torch.utils.tensorboard does), whose lazy import a test checks.
import hydra  # noqa: F401
import numpy as np
import omegaconf  # noqa: F401
import torch  # noqa: F401
import torchvision  # noqa: F401
import webdataset  # noqa: F401


def run_child(request: dict) -> None:
    """In the forked child: become the requested process, run it, exit as Python would."""
    import random
    import runpy
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):  # created by the server
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    # A fresh interpreter seeds these from the OS; forked children would all share the server's.
    random.seed()
    np.random.seed()
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":  # as python -m does: the cwd first on the path, argv[0] the module's file
        sys.argv, sys.path[0] = list(argv[1:]), os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv, sys.path[0] = list(argv), os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def start(request: dict, channels: tuple) -> int:
    """A forked child running the request; its pid."""
    pid = os.fork()
    if pid == 0:
        for channel in channels:
            channel.close()
        run_and_exit(lambda: run_child(request))
    return pid


def run_and_exit(work) -> None:
    """``work()`` as a script's run, then this process's exit with the status Python would give."""
    try:
        work()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_as_python_does(code)


def exit_code(exc: SystemExit) -> int:
    """The status the interpreter gives a SystemExit: None 0, an int itself, else printed and 1."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def exit_as_python_does(code: int) -> None:
    """The steps of an interpreter's exit that a process's work can see (its non-daemon threads
    joined, atexit handlers, stdio flushed), then os._exit, as multiprocessing's children end.
    The rest of a normal exit, tearing down every module of the preloaded Python, rewrote
    reference counts on all of its inherited pages: 1.5 s of CPU a child on this 2-core machine,
    over the few hundred scripts of the suite a third of its time
    (bench/results/2026-11-28-suite-child-exit.md)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)


def rank_request(request: dict, rank: int, ranks: int) -> dict:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "GROUP_RANK": 0}
    return request | {"env": request["env"] | {k: str(v) for k, v in env.items()}}


def wait_job(pids: list[int]) -> int:
    """The ranks' wait status: the first failed one's, else rank 0's; a failure stops the rest."""
    statuses: dict[int, int] = {}
    failed, deadline = None, None
    while len(statuses) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        if pid == 0:  # the others were told to stop and have not yet
            if time.monotonic() > deadline:
                for other in set(pids) - set(statuses):
                    os.kill(other, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
            continue
        statuses[pid] = status
        if status != 0 and failed is None:
            failed, deadline = status, time.monotonic() + 10
            for other in set(pids) - set(statuses):
                os.kill(other, signal.SIGTERM)
    return failed if failed is not None else statuses[pids[0]]


def serve() -> None:
    # The preloaded objects move to a generation the collector never scans: a child's collections
    # would otherwise walk (and so copy) every page of them.
    gc.freeze()
    channel_in, channel_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    for line in channel_in:
        request = json.loads(line)
        for path in (request["stdout"], request["stderr"]):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        ranks = request.get("ranks")
        if ranks is None:
            pid = start(request, (channel_in, channel_out))
            print(pid, file=channel_out, flush=True)
            _, status = os.waitpid(pid, 0)
            print(status, file=channel_out, flush=True)
            continue
        pids = [start(rank_request(request, rank, ranks), (channel_in, channel_out)) for rank in range(ranks)]
        print(" ".join(map(str, pids)), file=channel_out, flush=True)
        print(wait_job(pids), file=channel_out, flush=True)


if __name__ == "__main__":
    import importlib

    for name in sys.argv[1:]:  # what a caller asks for besides (run_script's ``preload``)
        importlib.import_module(name)
    serve()
