"""gpu-check's runs of train.py (gpucheck/train.py's parts): a run launched, plain or under
torchrun, forked from the rehearsal's preloaded Python where there is one, the machine's busy
cores sampled while it trains, and its rates, data-wait, workers and host time read from its log.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# A metrics line of train.log: "step 40/300 loss ... 5123 samples/s data-wait 3% ..."
WINDOW = re.compile(r"^step (\d+)(?:/\d+)? loss .*? (\d+(?:\.\d+)?) samples/s data-wait (\d+)%", re.MULTILINE)
PLAN_WORKERS = re.compile(r"^plan: .* over \d+ ranks x (\d+) workers", re.MULTILINE)
LOADER_LINE = re.compile(r"^loader: .*$", re.MULTILINE)  # how many workers and why, where it decodes
FIRST_STEP = re.compile(r"the first step is done in ([\d.]+)s")  # trainer.compile: its compile time inside
HOST_LINE = re.compile(
    r"host time per batch: decode ([\d.]+) ms \(([\d.]+) ms of it its thread's CPU\), "
    r"resize ([\d.]+) ms, augmentations ([\d.]+) ms, hand-over ([\d.]+) ms"
)
HOST_PHASES = ("decode", "decode_cpu", "resize", "augment", "hand_over")


def windows(log: str) -> list[tuple[int, float, float]]:
    """(step, samples/s, data-wait fraction) of each metrics line, in order."""
    return [(int(s), float(r), int(w) / 100) for s, r, w in WINDOW.findall(log)]


def steady(lines: list[tuple[int, float, float]], after: int, global_batch: int, start: int = 0) -> dict:
    """The rate and data-wait over the windows that begin at or after step ``after``: the
    samples of those windows over their summed time (each window's time is its samples over
    its rate), the wait weighted by time."""
    samples = seconds = waited = 0.0
    prev = start
    for step, rate, wait in lines:
        if prev >= after and rate > 0:
            n = (step - prev) * global_batch
            samples, seconds, waited = samples + n, seconds + n / rate, waited + wait * n / rate
        prev = step
    if not seconds:
        return {"steady_samples_per_s": None, "steady_data_wait": None}
    return {"steady_samples_per_s": samples / seconds, "steady_data_wait": waited / seconds}


def proc_stat() -> tuple[int, int, int]:
    """(busy jiffies, all jiffies, CPUs) of the whole machine."""
    lines = Path("/proc/stat").read_text().splitlines()
    values = [int(v) for v in lines[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8]), sum(1 for ln in lines if re.match(r"cpu\d", ln))


class CpuWatch:
    """The machine's busy cores while a run trains: /proc/stat sampled a few times a second,
    with the moment each metrics line of the run's log appeared, so the busy cores of the
    steady windows (after the warm-up) can be told from those of the whole run."""

    def __init__(self, log: Path, period: float = 0.25):
        self.log, self.period = log, period
        self.samples: list[tuple[float, int, int]] = []  # (time, busy, all)
        self.own: list[tuple[float, float]] = []  # (time, CPU seconds of the training process itself)
        self.pid: int | None = None
        self.seen: dict[int, float] = {}  # step of a metrics line -> when it was first seen
        self.cpus = proc_stat()[2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        busy, total, _ = proc_stat()
        now = time.perf_counter()
        self.samples.append((now, busy, total))
        if self.pid is not None:
            try:
                fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.own.append((now, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")))
            except (OSError, IndexError, ValueError):
                pass
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return
        for step, _, _ in windows(text):
            self.seen.setdefault(step, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def cores(self, t0: float, t1: float) -> float | None:
        """Busy cores on average between t0 and t1 (the samples nearest inside)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
        return (b1 - b0) / (a1 - a0) * self.cpus

    def busy(self, after: int) -> dict:
        whole = self.cores(self.samples[0][0], self.samples[-1][0]) if self.samples else None
        start = self.seen.get(after)
        last = max(self.seen.values(), default=None)
        calm = self.cores(start, last) if start is not None and last is not None else None
        return {"cores_busy": calm, "cores_busy_whole_run": whole, "own_cpu_s": self.own_cpu(start, last)}

    def own_cpu(self, t0: float | None, t1: float | None) -> float | None:
        """CPU seconds the training process itself (its threads, not its workers) spent between t0 and t1."""
        inside = [s for s in self.own if t0 is not None and t1 is not None and t0 <= s[0] <= t1]
        return inside[-1][1] - inside[0][1] if len(inside) >= 2 else None

    def steps_between(self, after: int) -> tuple[int, int] | None:
        """The first and last step of the steady windows whose CPU own_cpu measures."""
        start, last = self.seen.get(after), max(self.seen.values(), default=None)
        if start is None or last is None:
            return None
        return after, max(step for step, t in self.seen.items() if t == last)


def error_line(text: str) -> str:
    """The line a failed run names its failure by: its last ``error:`` line, else its last."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.lower().startswith("error") or "Error:" in ln]
    return (said or lines or ["no output"])[-1][:400]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_py(
    check: Any, name: str, overrides: list[str], after: int, torchrun: bool = False, env: dict | None = None
) -> dict:
    """Run train.py (under torchrun if asked, with ``env`` added to the environment) into
    WORK/runs/NAME and read what it says."""
    run_dir = check.work / "runs" / name
    args = [*overrides, f"outputs={check.work / 'outputs'}", f"run_dir={run_dir}"]
    launch = ["-m", "wdsdist.cluster.launch", "--nproc_per_node=1", f"--master_port={free_port()}"] if torchrun else []
    # The rehearsal forks its runs (gpucheck/fork.py), torchrun's worker too: torchrun runs
    # train.py in a process forked from its agent instead of a fresh `python -u train.py`.
    launch += ["--run-path", "--start-method=fork"] if torchrun and check.preloaded else []
    script = str(ROOT / "train.py") if torchrun and check.preloaded else "train.py"  # --run-path: a full path
    check.say(f"  {'torchrun' if torchrun else 'train.py'} {' '.join(overrides)}")
    (check.work / "runs").mkdir(parents=True, exist_ok=True)
    out_path = check.work / "runs" / f"{name}.out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.perf_counter()
    with open(out_path, "w") as out, CpuWatch(run_dir / "train.log") as watch:
        if check.preloaded:
            proc = check.preloaded.start([*launch, script, *args], env, out_path)
        else:
            cmd = [sys.executable, *launch, script, *args]
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        watch.pid = proc.pid  # plain train.py: the process that trains (torchrun's agent is not)
        try:
            rc = proc.wait(timeout=max(30.0, check.left()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    wall = time.perf_counter() - t0
    text = out_path.read_text(errors="replace")
    log = (run_dir / "train.log").read_text(errors="replace") if (run_dir / "train.log").exists() else ""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if rc == 0 and summary_path.exists() else None
    result = {"run_dir": str(run_dir), "wall_s": wall, "summary": summary, "windows": windows(log), "log": log}
    result |= watch.busy(after)
    result["own_steps"] = watch.steps_between(after)
    host = HOST_LINE.search(log)
    if host:
        result["host_ms"] = {k: float(v) for k, v in zip(HOST_PHASES, host.groups(), strict=True)}
    plan = PLAN_WORKERS.search(log)
    result["workers_used"] = int(plan.group(1)) if plan else None
    said = LOADER_LINE.search(log)
    result["loader_line"] = said.group(0) if said else None
    if rc != 0:
        result["error"] = f"timed out after {wall:.0f} s" if rc is None else error_line(text)
    done = f"failed: {result['error']}" if "error" in result else (result["loader_line"] or "done")
    check.say(f"  {done} ({wall:.1f} s)")
    return result


def run_row(result: dict, after: int, global_batch: int) -> dict:
    """A table row's measures of a train.py run."""
    s = result["summary"] or {}
    row = {"status": "failed" if "error" in result else "ok", "wall_s": result["wall_s"]}
    if "error" in result:
        row["error"] = result["error"]
    row |= {"samples_per_s": s.get("samples_per_s"), "data_wait": s.get("data_wait"), "val_top1": s.get("val_top1")}
    row |= steady(result["windows"], after, global_batch, start=s.get("resumed_from_step") or 0)
    row |= {k: result[k] for k in ("cores_busy", "cores_busy_whole_run", "workers_used", "loader_line")}
    row["host_ms"] = result.get("host_ms")
    steps, own = result.get("own_steps"), result.get("own_cpu_s")
    if steps and own is not None and steps[1] > steps[0]:  # the training process's CPU per 256 images
        row["own_cpu_ms_per_256"] = 1000 * own / ((steps[1] - steps[0]) * global_batch) * 256
    return row
