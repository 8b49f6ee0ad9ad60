"""A Python with torch, torchvision, webdataset and Hydra imported, which runs each script it is
sent in a forked child: a process of its own (pid, exit status, stdout and stderr files, cwd,
environment, argv, __main__), minus the 3-6 s a fresh interpreter spends importing those. The
suite starts a few hundred such scripts; tests/conftest.py's run_script sends them here.

Protocol: one JSON request a line on stdin ({argv, cwd, env, stdout, stderr}: the files the
child writes); the answer is a line with the child's pid, then one with its wait status.
"""

from __future__ import annotations

import json
import os
import sys

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
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
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
    else:
        script = os.path.abspath(argv[0])
        sys.argv, sys.path[0] = list(argv), os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def serve() -> None:
    channel_in, channel_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    for line in channel_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            channel_in.close()
            channel_out.close()
            try:
                run_child(request)
            except SystemExit:
                raise  # the interpreter's own exit: the code, or the message on stderr and 1
            except BaseException:
                sys.excepthook(*sys.exc_info())
                sys.exit(1)
            sys.exit(0)  # then the interpreter's shutdown: atexit handlers, threads joined, stdio flushed
        print(pid, file=channel_out, flush=True)
        _, status = os.waitpid(pid, 0)
        print(status, file=channel_out, flush=True)


if __name__ == "__main__":
    serve()
