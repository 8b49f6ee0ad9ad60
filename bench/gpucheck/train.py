"""gpu-check's training parts: (a) the default job, (b) a resumed torchrun run, (c) ImageNet-size
JPEGs through train.py; each run's rates read from its own log, beside pure compute.

Pure compute is the trainer's own step (``step.train_step``) on random uint8 images already on
the device, with the model, optimizer and device conversion built by the trainer's builders from
the same config train.py composes: what the run would reach if data cost nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

from bench.gpucheck.runs import FIRST_STEP, error_line, run_row, train_py  # noqa: E402

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

    from wdsdist.cluster.distributed import Dist
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
    decode with few workers, beside the model's pure compute; then each of ``augment_models`` so
    again with TrivialAugment (on the workers' crops, or on the device after the resize)."""
    from bench.gpucheck.loader import gpu_rows

    sizes = check.sizes
    index = check.work / "photos" / "photos.index.json"
    device = ["trainer.device=cpu"] if check.cpu else []
    part["steady_after"] = sizes.warmup
    pures: dict[str, float] = {}  # a model's pure compute: the augmentations are the loader's cost
    for model, augment in [(m, "none") for m in sizes.models] + [(m, AUGMENT) for m in sizes.augment_models]:
        common = ["data=shards", "data.num_classes=10", f"data.train_shards={index}", "data.val_shards=null"]
        common += [f"model.name={model}", f"data.image_size={sizes.image_size}", f"trainer.batch_size={sizes.batch}"]
        common += [f"trainer.steps={sizes.steps}", "trainer.ckpt_every=0", "trainer.eval_every=0"]
        common += [f"trainer.log_every={sizes.log_every}", *device]
        if model not in pures:
            pures[model] = pure_compute(common, sizes.device, sizes.compute_steps)
            check.say(f"  pure compute, {model}: {pures[model]:.0f} samples/s")
        pure = pures[model]
        configs = [("cpu", sizes.cpu_workers, {})] if sizes.cpu_rows else []
        configs += [("cpu (compiled)", sizes.cpu_workers, {})] if sizes.compile_rows and augment == "none" else []
        configs += [(label, str(w), options) for label, w, options in gpu_rows(sizes)]
        if augment != "none":  # the row's decode names it: "cpu + trivialaugment"
            configs = [(f"{label} + {augment}", w, options | {"augment": augment}) for label, w, options in configs]
        for decode, workers, options in configs:
            row = {"model": model, "decode": decode, "workers": workers, "pure_compute": pure}
            part["rows"].append(row)
            if not decode.startswith("cpu") and check.cpu:
                row |= {"status": "skipped", "error": "GPU decode needs CUDA (--cpu rehearsal)"}
                continue
            if check.left() < 30:  # a row needs its warm-up and steady steps: none begun so late
                row |= {"status": "skipped", "error": f"the time budget ({sizes.budget_s:.0f} s) is spent"}
                continue
            extra = [f"trainer.workers={workers}"] + [f"{section(k)}.{k}={v}" for k, v in options.items()]
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


AUGMENT = "trivialaugment"  # (c), (d): the recipe's policy in the augmented rows


def section(key: str) -> str:
    """The config section of a row's option: data.augment, else loader.KEY."""
    return "data" if key == "augment" else "loader"


def decode_busy(row: dict, threads: int, batch: int) -> float | None:
    """decode=gpu: the share of its decode threads' time spent in the decode call, the resize's
    launch and the augmentations' at the steady rate (near 1: the decode threads are the limit),
    from the trainer's host time per batch."""
    host, rate = row.get("host_ms"), row.get("steady_samples_per_s")
    if not host or not rate:
        return None
    return (host["decode"] + host["resize"] + host.get("augment", 0.0)) / 1000 * rate / batch / threads


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
