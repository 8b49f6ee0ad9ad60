"""./run fuzz: the randomized exactness test (tests/data/test_exactness.py) on new random cases.

    ./run fuzz --examples 300          # 300 examples, one process per core
    ./run fuzz --minutes 60            # as many as an hour allows
    ./run fuzz --examples 10000 --jobs 2 --seed 7

Each process draws its own cases (hypothesis, seeded from --seed and its number) in rounds of
ROUND examples and prints a line every 30 seconds. A failing case is shrunk to a small one and
printed with the line that replays it; keep it as an ``@example`` in tests/data/test_exactness.py.
Exit 0 when every example held, 1 when one failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

ROUND = 100  # examples per hypothesis run: each run's first cases are its simplest


def worker(job: int, examples: int, minutes: float | None, seed: int) -> int:
    """One process: rounds of new cases until ``examples`` ran or the time is up."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import seed as seeded
    from hypothesis import strategies as st
    from hypothesis.errors import HypothesisException

    from tests.helpers.exactness import check_case
    from tests.helpers.exactness_cases import cases

    warnings.filterwarnings("ignore", message="This DataLoader will create")  # the cases' workers
    logging.getLogger("wdsdist.data.delivery.workers").setLevel(logging.ERROR)  # damaged cases skip on purpose
    start = time.monotonic()
    stop = start + minutes * 60 if minutes else None
    counts = {"examples": 0, "refused": 0, "lost": 0, "unreadable": 0, "failed": 0}
    said = [start]

    def one(case, data) -> None:  # noqa: ANN001 (hypothesis' values)
        now = time.monotonic()
        # Once a case failed, hypothesis replays and shrinks it: past the quota or the time too (a
        # replay refused here would be reported as a flaky assumption, and the failure lost).
        assume(counts["failed"] or counts["examples"] < examples and (stop is None or now < stop))
        if now - said[0] >= 30:
            said[0] = now
            print(f"fuzz[{job}]: {counts['examples']} examples, {_clock(now - start)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="fuzz-") as root:
            try:
                outcome = check_case(case, lambda n: data.draw(st.integers(0, n), label="checkpoint after"), Path(root))
            except Exception as exc:
                counts["failed"] |= not isinstance(exc, HypothesisException)
                raise
        counts["examples"] += 1
        counts["refused"] += outcome == "refused"
        counts["lost"] += outcome == "held" and bool(case.damaged or case.unreadable)
        counts["unreadable"] += outcome == "held" and bool(case.unreadable)

    rounds = 0
    while counts["examples"] < examples and (stop is None or time.monotonic() < stop):
        run = settings(
            max_examples=ROUND,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
            report_multiple_bugs=False,
        )(seeded(seed * 1_000_003 + job * 10_007 + rounds)(given(case=cases(), data=st.data())(one)))
        rounds += 1
        try:
            run()
        except Exception:  # noqa: BLE001 (hypothesis' report of the shrunk case is the message)
            traceback.print_exc()
            print(f"fuzz[{job}]: FAILED after {counts['examples']} examples, {_clock(time.monotonic() - start)}")
            return 1
    took = time.monotonic() - start
    print(
        f"fuzz[{job}]: done: {counts['examples']} examples ({counts['refused']} refused at start, as the model "
        f"says; {counts['lost']} with lost samples, {counts['unreadable']} with an unreadable shard), {_clock(took)}",
        flush=True,
    )
    return 0


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {s:02d} s" if hours else f"{minutes} min {s:02d} s"


def main() -> int:
    p = argparse.ArgumentParser(prog="./run fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=300, help="examples in all (default 300)")
    p.add_argument("--minutes", type=float, help="stop after this long (the examples so far count)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the cores)")
    p.add_argument("--seed", type=int, default=int(time.time()), help="draws the cases (default: the clock)")
    p.add_argument("--job", type=int, help=argparse.SUPPRESS)  # one process's number (internal)
    args = p.parse_args()
    if args.examples < 1 or args.jobs < 1 or (args.minutes is not None and args.minutes <= 0):
        p.error("--examples and --jobs must be >= 1, --minutes > 0")
    if args.job is not None:
        return worker(args.job, args.examples, args.minutes, args.seed)
    print(f"fuzz: {args.examples} examples in {args.jobs} processes, seed {args.seed}", flush=True)
    share = [args.examples // args.jobs + (j < args.examples % args.jobs) for j in range(args.jobs)]
    start = time.monotonic()
    procs = []
    for job, n in enumerate(share):
        if not n:
            continue
        cmd = [sys.executable, "-m", "tests.helpers.fuzz", "--job", str(job), "--examples", str(n)]
        cmd += ["--seed", str(args.seed)] + (["--minutes", str(args.minutes)] if args.minutes else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    lines: list[str] = []
    threads = [threading.Thread(target=_relay, args=(proc, lines)) for proc in procs]
    for t in threads:
        t.start()
    failed = False
    while any(proc.poll() is None for proc in procs):
        if any(proc.poll() not in (None, 0) for proc in procs):
            failed = True
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        time.sleep(1)
    for t in threads:
        t.join()
    failed = failed or any(proc.returncode for proc in procs)
    done = sum(_held(lines, f"fuzz[{job}]: ") for job in range(len(share)))
    took = _clock(time.monotonic() - start)
    said = re.findall(r"(\d+) with lost samples, (\d+) with an unreadable", "".join(lines))  # the done lines
    lost = [sum(int(a) for a, _ in said), sum(int(b) for _, b in said)]
    damaged = f" ({lost[0]} with lost samples, {lost[1]} with an unreadable shard)" if said else ""
    print(f"fuzz: {'FAILED' if failed else 'passed'}: {done} examples held{damaged} in {took} (seed {args.seed})")
    return 1 if failed else 0


def _held(lines: list[str], prefix: str) -> int:
    """The examples one process saw hold: its count when it ended, else the last it said."""
    said = [line[len(prefix) :] for line in lines if line.startswith(prefix)]
    counts = [int(text.split()[0]) for text in said if text.split()[0].isdigit()]
    counts += [int(text.split()[1]) for text in said if text.startswith("done: ")]
    counts += [int(text.split()[2]) for text in said if text.startswith("FAILED after")]
    return max(counts, default=0)


def _relay(proc: subprocess.Popen, lines: list[str]) -> None:
    """A process's output, line by line, as it comes (the tests' warnings left out)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if "UserWarning: This DataLoader will create" in line or "check_worker_number_rationality" in line:
            continue
        lines.append(line)
        print(line, end="", flush=True)


if __name__ == "__main__":
    sys.exit(main())
