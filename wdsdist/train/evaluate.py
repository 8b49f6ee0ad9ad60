"""Exact evaluation over every validation sample once, and the batch as the model takes it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import Dist
from wdsdist.cluster.faults import Watchdog
from wdsdist.train.report import Reporter


class OnDevice:
    """A loader batch as the model takes it (batches leave the loader as uint8): uint8 NCHW from the loader ->
    normalised float on the device (channels_last on CUDA if asked), under bf16 autocast where
    the GPU has bf16 units. ``amp_note`` says why autocast is off when it was asked for."""

    def __init__(self, cfg: DictConfig, dist: Dist):
        cuda = dist.device.type == "cuda"
        self.device = dist.device
        self.mean = torch.tensor(cfg.data.mean, device=dist.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(cfg.data.std, device=dist.device).view(1, 3, 1, 1) * 255
        self.memory_format = torch.channels_last if cuda and cfg.trainer.channels_last else torch.contiguous_format
        capability = torch.cuda.get_device_capability(dist.device) if cuda else None
        self.bf16, self.amp_note = distributed.bf16_autocast(cfg.trainer.amp, capability)
        self.cpu_bf16 = not cuda and cfg.trainer.amp_cpu

    def images(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True).float()
        return ((x - self.mean) / self.std).contiguous(memory_format=self.memory_format)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.to(self.device, non_blocking=True)

    def autocast(self) -> AbstractContextManager:
        if self.cpu_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else nullcontext()


def evaluate(
    model: nn.Module,
    loader: Any,
    dist: Dist,
    on_device: OnDevice,
    num_classes: int,
    beat: Callable[[str], None] | None = None,
) -> dict:
    """Top-1 and loss over every validation sample exactly once: each rank sums its own share
    (shares may be unequal or empty) and the sums are all-reduced; no batches are padded.
    ``beat(phase)`` tells the watchdog of each batch and of the wait for the other ranks."""
    beat = beat or (lambda phase: None)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    total = torch.zeros(num_classes, dtype=torch.int64, device=dist.device)
    correct = torch.zeros(num_classes, dtype=torch.int64, device=dist.device)
    with torch.no_grad():
        for batch in loader:
            beat("eval")
            labels = on_device.labels(batch["label"])
            with on_device.autocast():
                logits = model(on_device.images(batch["image"]))
            eval_sums(logits, labels, loss_sum, total, correct)
    model.train()
    beat("eval-wait")
    distributed.all_reduce_sum(loss_sum)
    distributed.all_reduce_sum(total)
    distributed.all_reduce_sum(correct)
    n = int(total.sum())
    return {
        "top1": float(correct.sum()) / max(n, 1),
        "loss": float(loss_sum) / max(n, 1),
        "samples": n,
        "class_samples": total.tolist(),
        "class_correct": correct.tolist(),
    }


def weakest(result: dict, names: list[str], n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` classes of lowest top-1 in an evaluation (classes it had no sample of left out)."""
    per = [
        (c / t, i) for i, (c, t) in enumerate(zip(result["class_correct"], result["class_samples"], strict=True)) if t
    ]
    return [(names[i], top1) for top1, i in sorted(per)[:n]]


def eval_sums(
    logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor, total: torch.Tensor, correct: torch.Tensor
) -> None:
    """Add a batch's summed loss and its per-class sample and correct counts, in place. Only
    operations whose output shape does not depend on the values: bincount and boolean-mask
    indexing read the data back to the host, stalling the GPU's queue several times a batch."""
    loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
    total.scatter_add_(0, labels, torch.ones_like(labels))
    correct.scatter_add_(0, labels, (logits.argmax(1) == labels).to(correct.dtype))


def share_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's statistics, as in the checkpoint) on every rank, in one
    broadcast per dtype instead of one per buffer (about 160 for ResNet-50)."""
    distributed.broadcast_tensors(list(model.buffers()))


def params_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Evaluator:
    """Owns the evaluation schedule: every ``trainer.eval_every`` steps before the last, and once
    at the end. A collective: every rank calls ``maybe_eval`` with the same arguments.

    ``models``: what is evaluated, by name: "model" (the one that trains) and, with trainer.ema,
    "EMA" (its average); each on every loader. ``result`` is the model's on data.val_shards,
    ``sources`` its per source of data.val_sources, ``results`` everything by model name."""

    def __init__(
        self,
        cfg: DictConfig,
        dist: Dist,
        models: dict[str, nn.Module],
        loaders: dict[str | None, Any],  # None: data.val_shards'; a name: that of data.val_sources; empty: none
        on_device: OnDevice,
        steps: int,
        report: Reporter,
        watchdog: Watchdog,
    ):
        self.dist, self.models, self.loaders, self.on_device = dist, models, loaders, on_device
        self.report, self.watchdog = report, watchdog
        self.every, self.steps, self.num_classes = cfg.trainer.eval_every, steps, cfg.data.num_classes
        self.names = list(cfg.data.classes or map(str, range(cfg.data.num_classes)))
        self.result: dict | None = None  # the last evaluation's of data.val_shards
        self.sources: dict[str, dict] = {}  # the last evaluation's of each of data.val_sources
        self.results: dict[str, dict[str | None, dict]] = {}  # model name -> loader name -> result

    def maybe_eval(self, step: int, last: bool = False) -> None:
        if not self.loaders:
            return
        if last or (self.every and step % self.every == 0 and step < self.steps):
            self.run(step)

    def run(self, step: int) -> None:
        t0 = time.perf_counter()
        names = ", ".join("data.val_shards" if name is None else name for name in self.loaders)
        self.report.line(
            f"evaluating at step {step}: {names}" + (f" ({', '.join(self.models)})" if len(self.models) > 1 else "")
        )

        def beat(phase: str) -> None:
            self.watchdog.beat(step, phase)

        for model_name, model in self.models.items():
            if self.dist.world > 1:
                share_buffers(model)
            self.results[model_name] = {
                name: evaluate(model, loader, self.dist, self.on_device, self.num_classes, beat=beat)
                for name, loader in self.loaders.items()
            }
        ours = dict(self.results["model"])
        self.result = ours.pop(None, None)
        self.sources = ours
        parts = [self._said(name, by_loader, step) for name, by_loader in self.results.items()]
        samples = sum(r["samples"] for r in self.results["model"].values())
        self.report.line(
            f"eval at step {step}: {'; '.join(p for p in parts if p)} ({samples} samples, "
            f"{time.perf_counter() - t0:.1f}s)"
        )

    def _said(self, model_name: str, by_loader: dict[str | None, dict], step: int) -> str:
        """One model's results in TensorBoard (the EMA's tags end in _ema), and as words."""
        tag = "" if model_name == "model" else f"_{model_name.lower()}"
        head = "" if model_name == "model" else f"{model_name}: "
        scalars, parts = {}, []
        result = by_loader.get(None)
        if result is not None:
            scalars |= {f"val/top1{tag}": result["top1"], f"val/loss{tag}": result["loss"]}
            low = weakest(result, self.names)
            result["weakest"] = low
            if not tag:
                scalars |= {f"val/weakest/{name}": top1 for name, top1 in low}
            worst = ", ".join(f"{name} {100 * top1:.1f}%" for name, top1 in low)
            parts.append(f"val top-1 {100 * result['top1']:.2f}% loss {result['loss']:.4f} (weakest: {worst})")
        others = {name: r for name, r in by_loader.items() if name is not None}
        for name, r in others.items():
            scalars |= {f"val/top1{tag}/{name}": r["top1"], f"val/loss{tag}/{name}": r["loss"]}
        if others:
            each = (f"{name} {100 * r['top1']:.2f}% ({r['samples']})" for name, r in others.items())
            parts.append(f"val top-1 per source: {', '.join(each)}")
        self.report.scalars(step, scalars)
        return head + "; ".join(parts)
