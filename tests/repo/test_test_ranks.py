"""tests/preloaded.py's children: they end as an interpreter ends (its threads joined, atexit
handlers, output flushed, SystemExit's status), and its ranks (run_script(..., ranks=N)), which
the suite's multi-rank jobs use where torchrun itself is not the point: each rank gets torchrun's
environment, their output shares one stdout, and a failed rank stops the others and sets the
job's exit status."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import run_script

ENDS = """
import atexit, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=False))
def late():
    time.sleep(0.3)
    sys.stdout.write("the thread ended after the script")  # no newline, not flushed
threading.Thread(target=late).start()
print("unflushed", end="", file=sys.stderr)
sys.exit(CODE)
"""


@pytest.mark.parametrize("code", ["None", "7", "'gone: no data'"])
def test_a_child_ends_as_a_fresh_interpreter_does(code):
    """Same status, same output in the same order (the thread's before atexit's, the SystemExit
    message after what stderr held unflushed) as the script run by a Python of its own."""
    script = ENDS.replace("CODE", code)
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    proc = run_script("-c", script)
    assert (proc.returncode, proc.stdout, proc.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "atexit ran" in proc.stdout and "the thread ended" in proc.stdout and proc.stderr.startswith("unflushed")


SHOW = """
import os, sys
print(" ".join(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")))
"""

FAIL_ONE = r"""
import os, signal, sys, time
rank = os.environ["RANK"]
if rank == "1":
    time.sleep(0.5)
    os.write(2, b"rank 1 fails\n")  # one write: the ranks share the file
    sys.exit(3)
def stopped(*_):
    os.write(2, f"rank {rank} stopped\n".encode())
    sys.exit(143)
signal.signal(signal.SIGTERM, stopped)
time.sleep(120)  # as a peer waits for a rank that is gone: the server stops it
"""


def test_each_rank_gets_torchruns_environment_and_their_output_is_one():
    proc = run_script("-c", SHOW, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, ranks=3)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"{r} {r} 3 3 29999" for r in range(3)]


def test_a_failed_rank_stops_the_others_and_is_the_jobs_exit_status():
    # (a job still running at the timeout would raise TimeoutExpired here)
    proc = run_script("-c", FAIL_ONE, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998"}, ranks=3, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert sorted(proc.stderr.splitlines()) == ["rank 0 stopped", "rank 1 fails", "rank 2 stopped"]
