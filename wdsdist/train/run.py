"""One rank's part of a training run, as ``setup()`` builds it and the loop uses it, and what the
run says about itself: the start-up lines, summary.json, the hyperparameters. These read ``Run``,
so they live beside it; the reporter (report.py) is handed only what it prints."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig

from wdsdist.cluster import distributed, faults
from wdsdist.cluster.distributed import Dist
from wdsdist.data import CACHE_COUNTS, LoaderConfig
from wdsdist.train import recipe
from wdsdist.train.checkpoint import Checkpointer, Generation
from wdsdist.train.ema import Ema
from wdsdist.train.evaluate import Evaluator, OnDevice
from wdsdist.train.feed import Feed
from wdsdist.train.mixing import BatchMix
from wdsdist.train.model import lr_at
from wdsdist.train.report import Reporter, Window, epoch_line, fmt_time, plan_line


@dataclass
class Run:
    """What ``setup()`` builds and the loop uses: one rank's part of a training run."""

    cfg: DictConfig
    dist: Dist
    run_dir: str
    started: float  # perf_counter() at the start of setup
    stop: faults.StopRequest
    watchdog: faults.Watchdog
    model: nn.Module  # the model itself: checkpoints, evaluation, fingerprints
    ddp_model: nn.Module  # what trains: DDP around the model, or the model on one rank (compiled: trainer.compile)
    opt: torch.optim.Optimizer
    base_lr: float  # optim.lr scaled to the global batch
    steps: int
    start: int  # the step resumed at, or 0
    resume_path: str | None
    on_device: OnDevice
    report: Reporter
    feed: Feed
    window: Window
    evaluator: Evaluator
    checkpointer: Checkpointer
    generation: Generation  # which start of the job in its run directory
    # Several data sets: each source's name and setting (the loader's mix), in the order of batch["source"]
    sources: tuple[tuple[str, str], ...] = ()
    # The run resumed in the middle of an epoch: that epoch's counts are of the part after the resume
    resumed_mid_epoch: bool = False
    compiled: bool = False  # trainer.compile: ddp_model (and what is evaluated) compiled
    mix: BatchMix | None = None  # trainer.mixup / trainer.cutmix
    ema: Ema | None = None  # trainer.ema

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.base_lr, self.steps, self.cfg.optim.warmup)

    def sync(self, now: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on a micro-batch whose gradients are not reduced yet (not ``now``)."""
        if now or self.dist.world == 1:
            return contextlib.nullcontext()
        return self.ddp_model.no_sync()


# ---------------------------------------------------------------- the start and the end of a run


def global_batch(cfg: DictConfig, dist: Dist) -> int:
    """The samples of one optimizer step over all ranks (what the learning rate scales with)."""
    return cfg.trainer.batch_size * dist.world * cfg.trainer.accum_steps


def report_start(
    run: Run, resume_warnings: list[str], stale: list[str], compile_why: str = "", weight_lines: Iterable[str] = ()
) -> None:
    """The start-up lines: the pretrained start, what runs where, from which checkpoint, the
    recipe and the loader's plan."""
    cfg, dist, report = run.cfg, run.dist, run.report
    for line in weight_lines:
        report.line(line)
    restarts = distributed.restart_count()
    again = f", restart {restarts} of torchrun" if restarts else ""
    if not restarts and run.generation.restarted:  # a node came or went: torchrun counts no restart
        again = ", re-formed by torchrun"
    for warning in resume_warnings:
        report.line(warning, console=False)
    if stale:
        report.line(f"removed {len(stale)} file(s) a killed writer left: {', '.join(stale)}", console=False)
    report.line(
        f"run dir {run.run_dir}: {cfg.model.name} on {dist.world} x {dist.device.type}, {run.steps} steps of "
        f"{cfg.trainer.batch_size} per rank (global {global_batch(cfg, dist)}), lr {run.base_lr:.4g}, "
        f"loader.mode={cfg.loader.mode.value}"
        + again
        + (f", resumed from {run.resume_path} at step {run.start}" if run.resume_path else "")
    )
    report.line(loader_line(run.feed.loader.config, run.feed.loader.gpu_decoder))
    for line in recipe.recipe_lines(cfg, compile_why):
        report.line(line)
    if run.on_device.amp_note:
        report.line(run.on_device.amp_note)
    specs = [s.shards for s in cfg.data.sources] if cfg.data.sources is not None else [cfg.data.train_shards]
    note = outage_note(cfg.trainer.timeout_s, cfg.data.http_timeout, cfg.data.http_retry_s, " ".join(map(str, specs)))
    if note:
        report.line(note)
    if run.sources:
        report.line(
            f"data.sources: {', '.join(f'{name} ({setting})' for name, setting in run.sources)}, "
            f"loader.mix={cfg.loader.mix}",
            console=False,
        )
    if cfg.trainer.resume == "auto" and run.resume_path is None:
        report.line(f"trainer.resume=auto: no checkpoint in {run.run_dir} yet, starting at step 0")
    resize = run.feed.loader.resize
    if resize is not None:  # an elastic resume: what became of the interrupted epoch
        report.line(f"{resize.line()}; {run.steps} steps in all now (the learning rate schedule follows them)")
    report_plan(run)
    if run.steps > run.start:
        report.line(
            f"startup {fmt_time(time.perf_counter() - run.started)}; training from step {run.start} to {run.steps} "
            f"(the first batch comes once the loader's workers have started)"
        )


def loader_line(cfg: LoaderConfig, gpu_decoder: str | None = None) -> str:
    """The training loader's workers and why (workers=auto), and where it decodes (by which decoder)."""
    why = cfg.workers_why or "trainer.workers"
    where = (
        f"on the GPU, in the training process, by {gpu_decoder}"
        if cfg.decode == "gpu"
        else "on the CPU, in the workers"
    )
    share = cfg.gpu_decode_share if cfg.decode == "gpu" else 1.0
    rest = f", {1 - share:.0%} of them in the workers (loader.gpu_decode_share={share:g})" if share < 1 else ""
    workers = f"{cfg.workers} worker{'s' if cfg.workers != 1 else ''}"
    decode = f"loader.decode={cfg.decode}" if cfg.decode_why is None else f"loader.decode={cfg.decode_why}"
    return f"loader: {workers} per rank ({why}); JPEGs decoded {where} ({decode}){rest}"


def report_plan(run: Run) -> None:
    """The loader's plan in the log, and under split=samples each epoch's padding (or drop) in
    TensorBoard, an elastic resume's re-split epoch with its own first."""
    report, plan, resize = run.report, run.feed.loader.plan, run.feed.loader.resize
    if plan is not None and plan.split == "samples":
        report.line(plan_line(plan), console=False)
        # The padding (or drop) is the same every epoch; one point per epoch, so it sits beside the curves.
        per_epoch = plan.batches[0]
        starts: Iterable[int] = ()
        if resize is not None and per_epoch:
            # A re-split epoch has its own padding (or drop), and the whole ones start after it.
            step = run.start
            for _, remaining, batches in resize.epochs:
                rest = batches * resize.world * resize.batch_size - remaining
                report.scalars(step, {"data/padded_samples": max(rest, 0), "data/dropped_samples": max(-rest, 0)})
                step += batches
            starts = range(step, run.steps, per_epoch)
        elif per_epoch:
            starts = (epoch * per_epoch for epoch in range(run.start // per_epoch, -(-run.steps // per_epoch)))
        for step in starts:
            report.scalars(step, {"data/padded_samples": plan.padded, "data/dropped_samples": plan.dropped})
    elif plan is not None:
        report.line(
            f"plan: {plan.nshards} shards, {plan.total_samples} samples over {plan.world} ranks x {plan.nworkers} "
            f"workers; batches per rank per pass {plan.min_available}..{plan.max_available}"
            + (f", cut to {plan.nbatches}" if plan.nbatches is not None else ""),
            console=False,
        )


def report_epoch(run: Run, step: int, whole: bool = True) -> None:
    """Collective (epoch mode, every rank at the same step): the epoch just ended (or, ``whole``
    False, the one under way when the run ends), samples per source in TensorBoard and a line."""
    ended = run.window.end_epoch()
    if ended.epoch is None:
        return
    note = ""
    if run.resumed_mid_epoch:
        note = f" (counted from the resume at step {run.start})"
        run.resumed_mid_epoch = False
    names = [name for name, _ in run.sources]
    counts = ended.sources
    scalars = {f"data/epoch_source/{name}": n for name, n in zip(names, counts, strict=True)}
    run.report.scalars(step, scalars | {"data/epoch_lost_samples": ended.lost})
    if names:
        run.report.line(epoch_line(ended.epoch, step, run.sources, counts, whole, note))
    if ended.lost:
        run.report.line(f"epoch {ended.epoch}{note}: {ended.lost_line()}")


def outage_note(timeout_s: float, http_timeout: float, http_retry_s: float, shards: str) -> str | None:
    """A note when remote shards' reads may ride out a store outage longer than the watchdog
    waits for a silent rank: it would give up on that rank first."""
    rides_out = http_timeout + http_retry_s
    if "://" not in shards or http_retry_s == 0 or timeout_s >= rides_out:
        return None
    return (
        f"note: trainer.timeout_s={timeout_s:g} is below data.http_timeout + data.http_retry_s ({rides_out:g} s): "
        f"a rank riding out a store outage that long is given up on first"
    )


def summarize(run: Run, step: int, fingerprints: list[tuple[int, str]]) -> dict:
    """summary.json. The last step always ends a metrics window, so the window's totals are the run's."""
    totals, last_eval = run.window.totals, run.evaluator.result or {}
    return {
        "run_dir": run.run_dir,
        "world": run.dist.world,
        "steps": step,
        "resumed_from_step": run.start if run.resume_path else None,
        "seconds": round(time.perf_counter() - run.started, 2),
        "samples_per_s": totals.samples / totals.seconds if totals.seconds else None,
        "data_wait": totals.wait / totals.seconds if totals.seconds else None,
        "val_top1": last_eval.get("top1"),
        "val_loss": last_eval.get("loss"),
        # trainer.ema: the EMA's top-1 and loss on data.val_shards (model.safetensors holds its weights)
        "val_top1_ema": run.evaluator.results.get("EMA", {}).get(None, {}).get("top1"),
        "val_loss_ema": run.evaluator.results.get("EMA", {}).get(None, {}).get("loss"),
        "val_samples": last_eval.get("samples"),
        "val_class_samples": last_eval.get("class_samples"),
        "val_class_correct": last_eval.get("class_correct"),
        "val_weakest": last_eval.get("weakest"),  # [name, top-1] of the lowest classes
        "classes": list(run.cfg.data.classes),
        "skipped_samples": totals.bad_samples,
        "skipped_shards": len(totals.failed_shards),  # distinct shards
        "skipped_shard_reads": totals.bad_reads,  # failed reads of them (every pass over a bad shard fails)
        # All ranks' node caches (loader.cache_dir): hits, misses, bytes from the store, ...; None without one.
        "cache": dict(zip(CACHE_COUNTS, totals.cache, strict=True)) if any(totals.cache) else None,
        # Several data sets: all ranks' samples trained of each source in this run; None with one.
        "source_samples": dict(zip(run.window.names, totals.sources, strict=True)) if run.sources else None,
        # data.val_sources: the last evaluation of each (top1, loss, samples, class_samples).
        "val_sources": run.evaluator.sources or None,
        "rank_steps": [s for s, _ in fingerprints],
        "rank_params": [f for _, f in fingerprints],
        "checkpoint": run.checkpointer.path,
    }


def hparams_of(run: Run) -> dict[str, Any]:
    """The hyperparameters TensorBoard's HParams dashboard compares runs by."""
    cfg = run.cfg
    return {
        "model": cfg.model.name,
        "optim": cfg.optim.name.value,
        "lr": run.base_lr,
        "batch_size": cfg.trainer.batch_size,
        "global_batch": global_batch(cfg, run.dist),
        "accum_steps": cfg.trainer.accum_steps,
        "world": run.dist.world,
        "steps": run.steps,
        "image_size": recipe.hparam_size(cfg),
        "loader_mode": cfg.loader.mode.value,
        "data": cfg.data.name,
    }
