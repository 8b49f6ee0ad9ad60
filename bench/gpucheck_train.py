"""gpu-check's training parts: (a) the default job, (b) a resumed torchrun run, (c) ImageNet-size
JPEGs through train.py; each run's rates read from its own log, beside pure compute.

Pure compute is the trainer's own step (``step.train_step``) on random uint8 images already on
the device, with the model, optimizer and device conversion built by the trainer's builders from
the same config train.py composes: what the run would reach if data cost nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# A metrics line of train.log: "step 40/300 loss ... 5123 samples/s data-wait 3% ..."
WINDOW = re.compile(r"^step (\d+)(?:/\d+)? loss .*? (\d+(?:\.\d+)?) samples/s data-wait (\d+)%", re.MULTILINE)
PLAN_WORKERS = re.compile(r"^plan: .* over \d+ ranks x (\d+) workers", re.MULTILINE)
LOADER_LINE = re.compile(r"^loader: .*$", re.MULTILINE)  # how many workers and why, where it decodes
FIRST_STEP = re.compile(r"the first step is done in ([\d.]+)s")  # trainer.compile: its compile time inside
HOST_LINE = re.compile(
    r"host time per batch: decode ([\d.]+) ms \(([\d.]+) ms of it its thread's CPU\), "
    r"resize ([\d.]+) ms, hand-over ([\d.]+) ms"
)
HOST_PHASES = ("decode", "decode_cpu", "resize", "hand_over")


# ---------------------------------------------------------------- reading a run


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
    launch = ["-m", "wdsdist.train.launch", "--nproc_per_node=1", f"--master_port={free_port()}"] if torchrun else []
    # The rehearsal forks its runs (gpucheck_fork.py), torchrun's worker too: torchrun runs
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


# ---------------------------------------------------------------- pure compute


def composed(overrides: list[str]) -> Any:
    """The config train.py would run with these overrides (Hydra's compose on conf/)."""
    from hydra import compose, initialize_config_dir

    from wdsdist.train import config

    config.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def pure_compute(overrides: list[str], device: str, steps: int) -> float:
    """Samples/s of the trainer's own step on random images already on the device."""
    import torch

    from wdsdist.train.distributed import Dist
    from wdsdist.train.evaluate import OnDevice
    from wdsdist.train.model import build_optimizer, seeded_model
    from wdsdist.train.step import train_step

    cfg = composed(overrides)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    dist = Dist(rank=0, world=1, local_rank=0, device=dev)
    model, _ = seeded_model(cfg, dist)
    lr = cfg.optim.lr * cfg.trainer.batch_size / 256
    run = SimpleNamespace(cfg=cfg, ddp_model=model, opt=build_optimizer(cfg, model, lr), on_device=OnDevice(cfg, dist))
    run.model, run.mix, run.ema, run.lr_at = model, None, None, lambda step: lr
    run.sync = lambda now: contextlib.nullcontext()
    b, s = cfg.trainer.batch_size, cfg.data.image_size
    # As the loader hands them over: uint8, channels_last.
    images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8, device=dev)
    batch = {"image": images.contiguous(memory_format=torch.channels_last)}
    batch["label"] = torch.randint(0, cfg.data.num_classes, (b,), device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    model.train()
    for step in range(max(2, steps // 3)):  # cudnn's autotuning and the allocator settle here
        train_step(run, [batch], [0.0], step)
    sync()
    t0 = time.perf_counter()
    for step in range(steps):
        train_step(run, [batch], [0.0], step)
    sync()
    rate = b * steps / (time.perf_counter() - t0)
    del run, model, batch, images
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def beside(row: dict, pure: float | None) -> dict:
    row["pure_compute"] = pure
    rate = row.get("steady_samples_per_s")
    row["of_pure"] = rate / pure if rate and pure else None
    return row


# ---------------------------------------------------------------- the parts


def synthetic_data(check: Any) -> list[str]:
    """The default data set, written under the work folder instead of data/."""
    d = check.work / "synthetic"
    return [
        "data=synthetic",
        f"data.train_shards={d}/synthetic-train.index.json",
        f"data.val_shards={d}/synthetic-val.index.json",
        *check.sizes.synthetic_extra,
    ]


def default_job(check: Any, part: dict) -> None:
    """(a): train.py as it comes, its data and run folders under /tmp."""
    sizes = check.sizes
    overrides = [*synthetic_data(check), *sizes.default_extra]
    result = train_py(check, "a-default", overrides, sizes.steady_after)
    cfg = composed(overrides)
    row = {"run": "train.py " + (" ".join(sizes.default_extra) or "(defaults)")}
    row |= {"model": cfg.model.name, "image_size": cfg.data.image_size, "batch": cfg.trainer.batch_size}
    row |= run_row(result, sizes.steady_after, cfg.trainer.batch_size)
    part["steady_after"] = sizes.steady_after
    part["rows"].append(row)
    check.save()
    beside(row, pure_compute(overrides, sizes.device, sizes.compute_steps))
    if "error" in result:
        raise RuntimeError(result["error"])


def resume(check: Any, part: dict) -> None:
    """(b): N steps under torchrun, then trainer.resume=auto to 2N in the same run folder."""
    n = check.sizes.resume_steps
    common = [*synthetic_data(check), *check.sizes.resume_extra]
    for steps, extra in ((n, []), (2 * n, ["trainer.resume=auto"])):
        result = train_py(check, "b-resume", [*common, *extra, f"trainer.steps={steps}"], 0, torchrun=True)
        s = result["summary"] or {}
        flags = " --run-path --start-method=fork" if check.preloaded else ""  # the rehearsal's (train_py)
        row = {"run": f"torchrun --nproc_per_node=1{flags} train.py {' '.join(extra + [f'trainer.steps={steps}'])}"}
        row |= {"status": "failed" if "error" in result else "ok", "wall_s": result["wall_s"]}
        row |= {"steps": s.get("steps"), "resumed_from_step": s.get("resumed_from_step"), "error": result.get("error")}
        part["rows"].append(row)
        check.save()
        if "error" in result:
            raise RuntimeError(result["error"])
    last = part["rows"][-1]
    part["resumed"] = last["resumed_from_step"] == n and last["steps"] == 2 * n
    part["verdict"] = (
        f"resumed at step {last['resumed_from_step']} (expected {n}) and ended at step {last['steps']} "
        f"(expected {2 * n}): {'as it should' if part['resumed'] else 'NOT as it should'}"
    )


def imagenet_size(check: Any, part: dict) -> None:
    """(c): each model at the big image size, CPU decode at the trainer's worker default and GPU
    decode with few workers, beside the model's pure compute."""
    from gpucheck_loader import gpu_rows  # bench/, beside this file

    sizes = check.sizes
    index = check.work / "photos" / "photos.index.json"
    device = ["trainer.device=cpu"] if check.cpu else []
    part["steady_after"] = sizes.warmup
    for model in sizes.models:
        common = ["data=shards", "data.num_classes=10", f"data.train_shards={index}", "data.val_shards=null"]
        common += [f"model.name={model}", f"data.image_size={sizes.image_size}", f"trainer.batch_size={sizes.batch}"]
        common += [f"trainer.steps={sizes.steps}", "trainer.ckpt_every=0", "trainer.eval_every=0"]
        common += [f"trainer.log_every={sizes.log_every}", *device]
        pure = pure_compute(common, sizes.device, sizes.compute_steps)
        check.say(f"  pure compute, {model}: {pure:.0f} samples/s")
        configs = [("cpu", sizes.cpu_workers, {})] if sizes.cpu_rows else []
        configs += [("cpu (compiled)", sizes.cpu_workers, {})] if sizes.compile_rows else []
        configs += [(label, str(w), options) for label, w, options in gpu_rows(sizes)]
        for decode, workers, options in configs:
            row = {"model": model, "decode": decode, "workers": workers, "pure_compute": pure}
            part["rows"].append(row)
            if not decode.startswith("cpu") and check.cpu:
                row |= {"status": "skipped", "error": "GPU decode needs CUDA (--cpu rehearsal)"}
                continue
            if check.left() < 30:  # a row needs its warm-up and steady steps: none begun so late
                row |= {"status": "skipped", "error": f"the time budget ({sizes.budget_s:.0f} s) is spent"}
                continue
            extra = [f"trainer.workers={workers}"] + [f"loader.{k}={v}" for k, v in options.items()]
            compiled = decode.endswith("(compiled)")
            extra += ["trainer.compile=true"] if compiled else []
            # The rehearsal traces with dynamo's eager backend: inductor's code generation is the GPU
            # run's to time, and its compile workers do not end in a run forked from the preloaded Python.
            env = {"WDSDIST_TEST_COMPILE_BACKEND": "eager"} if compiled and check.cpu else None
            name = f"c-{model}-{re.sub(r'[^a-z0-9]+', '-', decode)}-{workers}"
            result = train_py(check, name, common + extra, sizes.warmup, env=env)
            row |= run_row(result, sizes.warmup, sizes.batch)
            first = FIRST_STEP.search(result.get("log", ""))
            if first and compiled:  # the compile time is in it
                row["first_step_s"] = float(first.group(1))
            row["decode_busy"] = decode_busy(row, options.get("gpu_decode_threads", 1), sizes.batch)
            beside(row, pure)
            check.save()


def decode_busy(row: dict, threads: int, batch: int) -> float | None:
    """decode=gpu: the share of its decode threads' time spent in the decode call and the resize's
    launch at the steady rate (near 1: the decode threads are the limit), from the trainer's host
    time per batch."""
    host, rate = row.get("host_ms"), row.get("steady_samples_per_s")
    if not host or not rate:
        return None
    return (host["decode"] + host["resize"]) / 1000 * rate / batch / threads


def accuracy(check: Any, part: dict) -> None:
    """(f): the default job's val top-1 with decode=cpu and with decode=gpu (training and
    evaluation through the same decoder), seed by seed, all runs at once on the one GPU (each
    on a few workers): what decode=gpu's pixels cost in accuracy, if anything."""
    sizes = check.sizes
    if check.cpu:
        part["verdict"] = "GPU decode needs CUDA (--cpu rehearsal)"
        return
    runs = {}
    for seed in sizes.accuracy_seeds:
        for decode in ("cpu", "gpu"):
            name = f"f-{decode}-{seed}"
            run_dir = check.work / "runs" / name
            args = [*synthetic_data(check), f"seed={seed}", "trainer.workers=2", f"loader.decode={decode}"]
            args += [f"outputs={check.work / 'outputs'}", f"run_dir={run_dir}", "trainer.ckpt_every=0"]
            (check.work / "runs").mkdir(parents=True, exist_ok=True)
            out = open(check.work / "runs" / f"{name}.out", "w")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            runs[(seed, decode)] = (proc, out, run_dir)
    check.say(f"  {len(runs)} runs of the default job at once: seeds {list(sizes.accuracy_seeds)}, decode cpu and gpu")
    for (seed, decode), (proc, out, run_dir) in runs.items():
        try:
            rc = proc.wait(timeout=max(30.0, check.left()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        out.close()
        summary = run_dir / "summary.json"
        top1 = json.loads(summary.read_text()).get("val_top1") if rc == 0 and summary.exists() else None
        row = {"seed": seed, "decode": decode, "val_top1": top1, "status": "ok" if top1 is not None else "failed"}
        if top1 is None:
            row["error"] = error_line(Path(out.name).read_text(errors="replace"))
        part["rows"].append(row)
    check.save()
    by = {
        d: [r["val_top1"] for r in part["rows"] if r["decode"] == d and r["val_top1"] is not None]
        for d in ("cpu", "gpu")
    }
    if all(len(v) == len(sizes.accuracy_seeds) for v in by.values()):
        mean = {d: sum(v) / len(v) for d, v in by.items()}
        part["mean"] = mean
        gap = 100 * (mean["gpu"] - mean["cpu"])
        part["verdict"] = (
            f"val top-1 over {len(by['cpu'])} seeds: decode=cpu {100 * mean['cpu']:.2f} %, decode=gpu "
            f"{100 * mean['gpu']:.2f} % ({gap:+.2f} points; target: within 0.5)"
        )
