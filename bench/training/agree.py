#!/usr/bin/env python3
"""The cost of the trainer's per-step agreement on stop flags, with 2, 4 and 8 CPU ranks on
loopback. Run with ``./run agree.py`` (see --help).

The trainer agrees on a few control integers with an all-reduce (MAX) over gloo on the CPU:
in loader.mode=epoch every step, blocking (``distributed.agree_max``: whether any rank ran out
or was asked to stop), in repeat and resampled modes started a step ahead and read after the
step's work (``distributed.Agreement``). Both are timed here as the trainer calls them, each
rank doing ``--step-ms`` of other work (sleeping, so the ranks do not compete for the cores)
between calls, as a training step would. The table gives, per world size, the time a rank
spends inside the call per step: median, 90th percentile and mean over ranks and steps, and
the mean as a share of a 100 ms step (a fast ResNet-50 step). Gloo between nodes adds the
network's round trips, which loopback does not show.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, iters: int, warmup: int, step_s: float, out) -> None:
    import torch
    import torch.distributed as dist

    from wdsdist.cluster import distributed

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        times: dict[str, list[float]] = {"blocking": [], "overlapped": []}
        for i in range(warmup + iters):  # epoch mode: the whole all-reduce on every step
            time.sleep(step_s)
            t0 = time.perf_counter()
            distributed.agree_max([0, 0, 1])
            if i >= warmup:
                times["blocking"].append(time.perf_counter() - t0)
        distributed.barrier()
        pending = None
        for i in range(warmup + iters):  # repeat mode: read last step's, start this step's
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()
            pending = distributed.Agreement([0])
            if i >= warmup:
                times["overlapped"].append(time.perf_counter() - t0)
            time.sleep(step_s)
        pending.result()
        out.put((rank, times))
    finally:
        dist.destroy_process_group()


def measure(world: int, iters: int, warmup: int, step_ms: float) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, iters, warmup, step_ms / 1000, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    report = {}
    for mode in ("blocking", "overlapped"):
        us = sorted(t * 1e6 for r in range(world) for t in results[r][mode])
        report[mode] = {
            "median_us": statistics.median(us),
            "p90_us": us[int(0.9 * (len(us) - 1))],
            "mean_us": statistics.fmean(us),
        }
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="world sizes (default: 2 4 8)")
    p.add_argument("--iters", type=int, default=300, help="steps timed per mode (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=30, help="steps before timing (default: %(default)s)")
    p.add_argument("--step-ms", type=float, default=5.0, help="other work per step, ms (default: %(default)s)")
    p.add_argument("--json", default=str(ROOT / "outputs" / "bench" / "agree.json"), help="JSON output")
    args = p.parse_args()

    results = {}
    for world in args.ranks:
        print(f"{world} ranks ...", file=sys.stderr, flush=True)
        results[world] = measure(world, args.iters, args.warmup, args.step_ms)

    print(
        f"\nagreement per step, gloo on loopback, {args.iters} steps of {args.step_ms:g} ms other work, "
        f"{os.cpu_count()} cores, {cpu_model()}"
    )
    header = f"{'ranks':>5} {'mode':12} {'median':>10} {'p90':>10} {'mean':>10} {'of 100 ms':>10}"
    print(header)
    print("-" * len(header))
    for world, r in results.items():
        for mode, m in r.items():
            print(
                f"{world:5} {mode:12} {m['median_us']:8.0f} us {m['p90_us']:7.0f} us {m['mean_us']:7.0f} us "
                f"{m['mean_us'] / 1e5 * 100:9.2f}%"
            )
    report = {"config": vars(args) | {"cores": os.cpu_count(), "cpu": cpu_model()}, "results": results}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
