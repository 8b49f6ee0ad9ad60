#!/usr/bin/env python3
"""Start-up and step rate against the world size: the same tiny job (squeezenet1_1 on 32-pixel
images, batch 4 per rank, CPU, gloo) at each --sizes, on loopback (one torchrun, N processes)
and, with --netns (root), across 4 network-namespace nodes of tests/helpers/cluster.py (4 agents,
N/4 processes each, c10d rendezvous on a head namespace). ``./run worldsize.py`` (see --help).

Start-up is the wall time from launching torchrun to rank 0's first step (faults.trace_for_test
marks it): interpreters, rendezvous, process group, model, loaders. Steps/s is rank 0's
training rate over its metric windows (summary.json), every rank taking each step. On a machine
with fewer cores than ranks the ranks share them: what grows faster than the world is the
cost to find.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402
from tests.conftest import write_tiny_shards  # noqa: E402
from tests.helpers import cluster  # noqa: E402
from tests.helpers.training import free_port  # noqa: E402

COUNTS = [64] * 8


def job(index: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"data.train_shards={index}",
        "data.val_shards=null",
        "data.synthetic=null",
        "data.image_size=32",
        "data.num_classes=10",
        "model.name=squeezenet1_1",
        "trainer.workers=1",
        "trainer.batch_size=4",
        "trainer.log_every=10",
        f"trainer.steps={steps}",
        f"run_dir={run_dir}",
    ]


def first_step(trace: Path, proc: subprocess.Popen | None, started: float, timeout: float = 600) -> float:
    """Seconds from ``started`` until rank 0 traced its first step."""
    mark = trace / "start-1" / "rank-0.txt"
    while not mark.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) before its first step")
        if time.monotonic() - started > timeout:
            raise TimeoutError("no first step")
        time.sleep(0.02)
    return time.monotonic() - started


def result(where: str, world: int, startup: float, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rate = summary["samples_per_s"] / (4 * world)
    return {"where": where, "world": world, "startup_s": round(startup, 2), "steps_per_s": round(rate, 2)}


def loopback(world: int, index: Path, work: Path, steps: int) -> dict:
    trace, run_dir = work / "trace", work / "run"
    trace.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WDSDIST_TEST_TRACE": str(trace), "PYTHONPATH": str(ROOT)}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    started = time.monotonic()
    proc = subprocess.Popen([*cmd, "train.py", *job(index, run_dir, steps)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    startup = first_step(trace, proc, started)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"loopback world {world}: exit {proc.returncode}: {err[-2000:]}")
    return result("loopback", world, startup, run_dir)


def namespaces(world: int, index: Path, work: Path, steps: int, nodes: int = 4) -> dict:
    trace, run_dir = work / "trace", work / "run"
    trace.mkdir(parents=True)
    env = {"WDSDIST_TEST_TRACE": str(trace)}
    with cluster.Cluster(nodes, work / "cluster") as c:
        started = time.monotonic()
        agents = [
            c.agent(n, job(index, run_dir, steps), nnodes=str(nodes), nproc=world // nodes, max_restarts=0, env=env)
            for n in range(nodes)
        ]
        startup = first_step(trace, agents[0], started)
        for n, proc in enumerate(agents):
            if proc.wait(600) != 0:
                raise RuntimeError(f"{nodes} namespaces, world {world}: node {n} exit {proc.returncode}: "
                                   f"{c.log(f'agent-{n}')[-2000:]}")  # fmt: skip
    return result(f"{nodes} namespaces", world, startup, run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="world sizes (default 1,2,4,8)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each layout; the table shows the median")
    parser.add_argument("--netns", action="store_true", help="also across 4 network namespaces (root)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.netns and (why := cluster.unavailable()) is not None:
        print(f"error: --netns {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="wdsdist-worldsize-"))
    try:
        index = write_tiny_shards(work / "shards", COUNTS, "train", size=32)
        layouts = [("loopback", w) for w in sizes]
        layouts += [("namespaces", w) for w in sizes if args.netns and w >= 4 and w % 4 == 0]
        rows = []
        for r in range(args.rounds):
            for kind, world in layouts:
                where = work / f"{kind}-{world}-{r}"
                run = loopback if kind == "loopback" else namespaces
                rows.append(run(world, index, where, args.steps))
                print(json.dumps(rows[-1]), flush=True)
                shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{platform.node()}, {cpu_model()}: {os.cpu_count()} CPUs, {args.steps} steps, median of {args.rounds} rounds"
    )
    print("| where | world | start-up s | steps/s |\n|---|---:|---:|---:|")
    for where, world in dict.fromkeys((row["where"], row["world"]) for row in rows):
        same = [row for row in rows if row["where"] == where and row["world"] == world]
        startup = statistics.median(row["startup_s"] for row in same)
        rate = statistics.median(row["steps_per_s"] for row in same)
        print(f"| {where} | {world} | {startup:.1f} | {rate:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
