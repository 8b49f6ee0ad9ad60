"""The training loop: DDP under torchrun, exact evaluation, TensorBoard, atomic checkpoints.

One function, ``train(cfg)``, reads top to bottom like a script: set up ranks and the run
directory, write the default data if needed, build loaders, model and optimizer, resume, then
loop over steps. Rank 0 prints, logs and writes; every rank takes part in the collectives.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from omegaconf import DictConfig, OmegaConf

from wdsdist.data.index import read_index
from wdsdist.data.options import LoaderConfig
from wdsdist.data.pipeline import RankLoader, make_eval_loader, make_loader, resolve_shards
from wdsdist.data.shardspec import Shard
from wdsdist.errors import DataError, UserError
from wdsdist.tools.shards import check_local_output, from_synthetic
from wdsdist.train import distributed, faults
from wdsdist.train.config import LoaderMode, OptimName, Stem, check
from wdsdist.train.distributed import Dist

CKPT_FORMAT = "wdsdist-checkpoint-v1"


# ---------------------------------------------------------------- startup helpers


def on_all_ranks(d: Dist, fn: Any) -> Any:
    """Run ``fn`` on every rank; if it raised UserError on any rank, every rank stops together
    and rank 0 prints the distinct messages once (instead of one copy per rank)."""
    try:
        result, error = fn(), None
    except UserError as exc:
        result, error = None, str(exc)
    errors = distributed.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    if not d.is_main:
        raise SystemExit(2)
    by_message: dict[str, list[int]] = {}
    for rank, message in failed:
        by_message.setdefault(message, []).append(rank)
    if len(by_message) == 1 and len(failed) == d.world:
        raise UserError(failed[0][1])
    parts = []
    for message, ranks in list(by_message.items())[:3]:
        who = ", ".join(map(str, ranks[:4])) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {who}: {message}")
    raise UserError("; ".join(parts))


def resolve_run_dir(cfg: DictConfig, d: Dist) -> str:
    """One run directory for all ranks: run_dir if given, the directory being resumed, the
    torchrun rendezvous id (shared by every node and restart), or a timestamp from rank 0."""
    if cfg.run_dir:
        return str(cfg.run_dir)
    resume = cfg.trainer.resume
    if resume not in (None, "auto") and os.path.isdir(resume):
        return str(resume)
    name = distributed.shared_run_id()
    if name is None:
        # torchrun without --rdzv_id: the first attempt's name, kept in torchrun's store, so a
        # restart (--max-restarts) continues in the same directory.
        name = distributed.first_value("run_name", _fresh_name(cfg.outputs)) if d.is_main else None
        name = distributed.broadcast_object(name)
    return os.path.join(cfg.outputs, name)


def _fresh_name(outputs: str) -> str:
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    name, n = stamp, 1
    while os.path.exists(os.path.join(outputs, name)):
        n += 1
        name = f"{stamp}-{n}"
    return name


def ensure_synthetic(cfg: DictConfig) -> None:
    """Write the synthetic train/val shards where data.*_shards point, if they are not there."""
    s = cfg.data.synthetic
    if s is None:
        return
    jobs = [("data.train_shards", cfg.data.train_shards, "train", s.train_samples)]
    if cfg.data.val_shards:
        jobs.append(("data.val_shards", cfg.data.val_shards, "val", s.val_samples))
    for key, index, split, n in jobs:
        check_local_output(index, f"{key}={index}")
        if not index.endswith(".index.json"):
            raise UserError(
                f"{key}={index}: with data.synthetic set it must name the index to write (DIR/PREFIX.index.json); "
                f"set data.synthetic=null to train on other shards"
            )
        want = {"seed": s.seed, "split": split, "size": s.size}
        if os.path.exists(index):
            desc = read_index(index)
            if desc.get("synthetic") is None:
                raise UserError(f"{key}={index} is not synthetic data: set data.synthetic=null to train on it")
            if desc["synthetic"] == want and desc["nsamples"] == n:
                continue
        outdir, prefix = os.path.dirname(index) or ".", os.path.basename(index)[: -len(".index.json")]
        print(f"writing {n} synthetic {split} images ({s.size}x{s.size}) to {outdir}/ (once)", flush=True)
        from_synthetic(
            n, outdir, prefix, maxcount=s.shard_samples, maxsize=1 << 30, seed=s.seed, split=split, size=s.size
        )


def loader_config(cfg: DictConfig, d: Dist, seed: int) -> LoaderConfig:
    # data and loader extend the loader's own option classes: their fields pass over by name.
    t = cfg.trainer
    return LoaderConfig.from_sections(
        cfg.data, cfg.loader, batch_size=t.batch_size, workers=t.workers, seed=seed, pin_memory=d.device.type == "cuda"
    )


def shards_of(key: str, spec: str, lcfg: LoaderConfig) -> list[Shard]:
    """The shards a data key names; an error names the key (a spec matching nothing, missing
    shards in strict mode, a refused pipe: URL)."""
    try:
        return resolve_shards(spec, lcfg)
    except UserError as exc:
        raise UserError(f"{key}: {exc}") from None


def in_config_terms(fn: Any, *args: Any) -> Any:
    """The loader's layout errors (shared with simdist.py) with the trainer's key names."""
    try:
        return fn(*args)
    except UserError as exc:
        raise UserError(re.sub(r"(?<![\w.])(nbatches|dsrepeat)(?=[<>=])", r"loader.\1", str(exc))) from None


# ---------------------------------------------------------------- model and optimizer


def _has_resnet_stem(model: nn.Module) -> bool:
    return isinstance(getattr(model, "conv1", None), nn.Conv2d) and isinstance(
        getattr(model, "maxpool", None), nn.Module
    )


def build_model(cfg: DictConfig) -> nn.Module:
    """A torchvision classification model with data.num_classes outputs, its stem sized to the images."""
    name, size = cfg.model.name, cfg.data.image_size
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        close = ", ".join(difflib.get_close_matches(name, names, n=3))
        hint = f"; did you mean {close}?" if close else "; see torchvision.models.list_models()"
        raise UserError(f"model.name={name}: not a torchvision classification model{hint}")
    kwargs: dict[str, Any] = {"num_classes": cfg.data.num_classes}
    if name.startswith("vit_"):
        kwargs["image_size"] = size
    try:
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.name={name}: cannot build it for this data: {exc}") from None
    stem = cfg.model.stem
    small = stem == Stem.small or (stem == Stem.auto and size < 112 and _has_resnet_stem(model))
    if small:
        if not _has_resnet_stem(model):
            raise UserError(f"model.stem=small: {name} has no ResNet stem (conv1 + maxpool) to replace")
        # ImageNet's stem (7x7 stride-2 convolution, then max-pool) shrinks images 4x before the
        # first block, 32 pixels to 8; a 3x3 stride-1 convolution with the max-pool shrinks them 2x.
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def build_optimizer(cfg: DictConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == OptimName.sgd:
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=o.momentum,
            nesterov=o.nesterov and o.momentum > 0,
            weight_decay=o.weight_decay,
        )
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay)


def build_scheduler(opt: torch.optim.Optimizer, steps: int, warmup_frac: float) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over the first warmup_frac of the steps, then cosine down to zero."""
    warmup = int(steps * warmup_frac)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ---------------------------------------------------------------- checkpoints


def rng_state(d: Dist) -> dict:
    """This rank's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
    }


def set_rng_state(state: dict, d: Dist) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and d.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], d.device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


def write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _atomic_save(obj: Any, path: str) -> None:
    """Write PATH.tmpPID, flush it to disk, then rename it over PATH: a crash at any moment leaves
    the old file or the new one, never a torn one (a killed writer leaves only the .tmp file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


def _fsync_dir(path: str) -> None:
    """Make renames in a directory durable (a power cut must not undo latest.pt's new target)."""
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_tmp(run_dir: str) -> list[str]:
    """Remove what writers killed mid-write left behind (NAME.tmpPID); nothing reads these."""
    stale = [
        p
        for p in glob.glob(os.path.join(run_dir, "*.tmp*")) + glob.glob(os.path.join(run_dir, ".latest.pt.tmp*"))
        if re.search(r"\.tmp\d+$", p)
    ]
    for p in stale:
        with suppress(OSError):
            os.remove(p)
    return stale


def _point_latest(run_dir: str, name: str) -> None:
    """latest.pt -> NAME, replaced atomically (a symlink; a copy where links are not possible)."""
    latest, tmp = os.path.join(run_dir, "latest.pt"), os.path.join(run_dir, f".latest.pt.tmp{os.getpid()}")
    try:
        os.symlink(name, tmp)
    except OSError:
        with open(os.path.join(run_dir, name), "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    os.replace(tmp, latest)


def _step_of(path: str) -> int:
    return int(re.findall(r"\d+", os.path.basename(path))[0])


def checkpoints(run_dir: str) -> list[str]:
    """ckpt-STEP.pt files of a run directory, oldest first."""
    found = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*.pt")) if re.search(r"ckpt-\d+\.pt$", p)]
    return sorted(found, key=_step_of)


def save_checkpoint(run_dir: str, step: int, d: Dist, model: nn.Module, opt, sched, loader: RankLoader, cfg, keep: int):
    """Collective: every rank hands in its loader position and RNG state; rank 0 writes."""
    gathered = distributed.all_gather_object((loader.state_dict(), rng_state(d)))  # one collective
    loaders, rngs = [g[0] for g in gathered], [g[1] for g in gathered]
    if not d.is_main:
        return None
    ckpt = {
        "format": CKPT_FORMAT,
        "step": step,
        "world": d.world,
        "workers": cfg.trainer.workers,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rngs,
        "loader": loaders,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }
    name = f"ckpt-{step:07d}.pt"
    _atomic_save(ckpt, os.path.join(run_dir, name))
    _point_latest(run_dir, name)  # before any pruning: latest.pt never names a deleted file
    _fsync_dir(run_dir)
    for old in prunable(run_dir, step, keep):
        with suppress(FileNotFoundError):
            os.remove(old)
    return os.path.join(run_dir, name)


def prunable(run_dir: str, step: int, keep: int) -> list[str]:
    """The checkpoints to delete once ckpt-STEP.pt is written, so that ``keep`` remain: that one
    always stays, as the newest. Checkpoints with a higher step than the one just written come
    from an earlier trajectory (a resume from an older checkpoint), so they count as older than
    every checkpoint of this one and go first; step numbers alone would delete the new one."""
    others = [p for p in checkpoints(run_dir) if _step_of(p) != step]
    oldest_first = [p for p in others if _step_of(p) > step] + [p for p in others if _step_of(p) < step]
    return oldest_first[: max(0, len(oldest_first) - (keep - 1))]


def refuse_foreign_run_dir(run_dir: str, resume: str | None, restarted: bool) -> None:
    """A fresh run (no trainer.resume, not a torchrun restart) in a directory that holds
    checkpoints would mix two runs: its pruning and latest.pt would fight the old run's files,
    and a later trainer.resume=auto could continue the wrong one. Refuse it, saying how to go on."""
    if resume is not None or restarted:
        return
    found = checkpoints(run_dir)
    if not found and not os.path.lexists(os.path.join(run_dir, "latest.pt")):
        return
    newest = f"{os.path.basename(found[-1])}, step {_step_of(found[-1])}" if found else "latest.pt"
    raise UserError(
        f"run directory {run_dir} already holds another run's checkpoints (newest: {newest}): "
        f"set trainer.resume=auto to continue that run, or give this one its own run_dir "
        f"(under torchrun: its own --rdzv_id)"
    )


def find_resume(resume: str | None, run_dir: str, restarted: bool = False) -> list[str]:
    """The checkpoints to resume from, the one to try first first.

    A directory (``auto``: the run directory) gives its latest.pt, then its ckpt-STEP.pt files
    newest first, so a torn or corrupt latest falls back to the one before; a file is tried
    alone. After a torchrun restart the run directory's own checkpoints come first, whatever
    ``resume`` says: the restarted workers continue the interrupted run.
    """
    if restarted and (os.path.exists(os.path.join(run_dir, "latest.pt")) or checkpoints(run_dir)):
        resume = "auto"
    if resume is None:
        return []
    if resume != "auto" and not os.path.isdir(resume):
        return [resume]
    where = run_dir if resume == "auto" else resume
    found = [os.path.join(where, "latest.pt")] if os.path.exists(os.path.join(where, "latest.pt")) else []
    seen = {os.path.realpath(p) for p in found}
    found += [p for p in reversed(checkpoints(where)) if os.path.realpath(p) not in seen]
    if not found and resume != "auto":
        raise UserError(f"trainer.resume={resume}: no latest.pt or ckpt-STEP.pt in that directory")
    return found


def load_first(candidates: list[str]) -> tuple[str, dict, list[str]]:
    """The first candidate that loads, its contents, and a warning for each one before it that
    did not (torn, truncated, foreign); an error only when none loads."""
    warnings, errors = [], []
    for path in candidates:
        try:
            return path, load_checkpoint(path), warnings
        except UserError as exc:
            if len(candidates) == 1:
                raise
            reason = str(exc).removeprefix("trainer.resume: ")
            errors.append(reason)
            target = f" (latest.pt -> {os.readlink(path)})" if os.path.islink(path) else ""
            warning = f"warning: {reason}{target}; trying the checkpoint before it"
            print(warning, file=sys.stderr, flush=True)
            warnings.append(warning)
    raise UserError(f"trainer.resume: none of {len(candidates)} checkpoints loads; the newest: {errors[0]}")


def load_checkpoint(path: str) -> dict:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: name it
        reason = next((line for line in str(exc).splitlines() if line.strip()), exc.__class__.__name__)
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            reason = "the file is empty"
        raise UserError(f"trainer.resume: cannot load {path}: {reason}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise UserError(f"trainer.resume: {path} is not a checkpoint of this trainer")
    return ckpt


def restore(ckpt: dict, path: str, d: Dist, cfg, model: nn.Module, opt, sched) -> int:
    """Load model, optimizer, scheduler and this rank's RNG; returns the step to continue at."""
    base_lrs = list(sched.base_lrs)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise UserError(f"{path} does not fit model.name={cfg.model.name}: {str(exc).splitlines()[0]}") from None
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path}: optimizer state does not fit optim.name={cfg.optim.name.value}: {exc}") from None
    sched.load_state_dict(ckpt["scheduler"])
    # The learning rate follows this run's config and global batch, not the saved one's.
    for group, lr, factor in zip(opt.param_groups, base_lrs, sched.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(sched.last_epoch)
    sched.base_lrs = list(base_lrs)
    sched._last_lr = [group["lr"] for group in opt.param_groups]
    step = int(ckpt["step"])
    if ckpt["world"] == d.world:
        set_rng_state(ckpt["rng"][d.rank], d)
    else:  # another layout: new per-rank streams, not a replay of the first steps'
        torch.manual_seed(cfg.seed + d.rank + 1000 * step)
    return step


def loader_state_for(ckpt: dict, path: str, d: Dist, cfg) -> dict | None:
    """This rank's saved loader position, or None (with a warning) when the layout changed in a
    mode that can start a fresh stream; epoch mode refuses, since its epochs would not add up."""
    same = ckpt["world"] == d.world and ckpt["workers"] == cfg.trainer.workers
    if same:
        return ckpt["loader"][d.rank]
    what = f"{ckpt['world']} ranks x {ckpt['workers']} workers, now {d.world} x {cfg.trainer.workers}"
    if cfg.loader.mode == LoaderMode.epoch:
        raise UserError(f"{path} was saved with {what}: loader.mode=epoch resumes only with the same ranks and workers")
    if d.is_main:
        print(f"warning: {path} was saved with {what}: the loader starts a fresh, reseeded stream", file=sys.stderr)
    return None


# ---------------------------------------------------------------- evaluation


def evaluate(model: nn.Module, loader, d: Dist, to_input, num_classes: int, autocast, beat=None) -> dict:
    """Top-1 and loss over every validation sample exactly once: each rank sums its own share
    (shares may be unequal or empty) and the sums are all-reduced; no batches are padded.
    ``beat(phase)`` tells the watchdog of each batch and of the wait for the other ranks."""
    beat = beat or (lambda phase: None)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    total = torch.zeros(num_classes, dtype=torch.int64, device=d.device)
    correct = torch.zeros(num_classes, dtype=torch.int64, device=d.device)
    with torch.no_grad():
        for batch in loader:
            beat("eval")
            labels = batch["label"].to(d.device, non_blocking=True)
            with autocast():
                logits = model(to_input(batch["image"]))
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
    }


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


# ---------------------------------------------------------------- reporting (rank 0)


class Reporter:
    """Rank 0's outputs: a progress bar in a terminal or plain lines in logs, train.log, TensorBoard."""

    def __init__(self, d: Dist, run_dir: str, steps: int, start: int):
        self.main, self.steps = d.is_main, steps
        self.bar = self.tb = self.log = None
        if not self.main:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.log = open(os.path.join(run_dir, "train.log"), "a", encoding="utf-8")
        self.tb = SummaryWriter(log_dir=run_dir)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, text: str, *, console: bool = True) -> None:
        if not self.main:
            return
        self.log.write(text + "\n")
        self.log.flush()
        if not console:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def tick(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def progress(self, step: int, text: str) -> None:
        """A progress bar update in a terminal, else a plain line."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.line(f"step {step} {text}", console=False)
        else:
            self.line(f"step {step}/{self.steps} {text}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)

    def images(self, tag: str, images: torch.Tensor, step: int) -> None:
        if self.tb is not None:
            grid = torchvision.utils.make_grid(images[:64], nrow=8, padding=2)
            self.tb.add_image(tag, grid, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        if self.tb is None:
            return
        from torch.utils.tensorboard.summary import hparams as hp

        exp, ssi, sei = hp(hparams, metrics)
        writer = self.tb._get_file_writer()
        for summary in (exp, ssi, sei):
            writer.add_summary(summary)
        self.scalars(0, metrics)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.log is not None:
            self.log.close()


@dataclass
class Window:
    """Training metrics since the last log line, summed on the device to avoid a sync per step."""

    loss: torch.Tensor
    correct: torch.Tensor
    bad: torch.Tensor  # samples and shards the loader skipped (bad data)
    samples: int = 0
    wait: float = 0.0  # seconds spent waiting for the loader
    start: float = 0.0
    paused: float = 0.0  # seconds of evaluation and checkpoints, not training

    @classmethod
    def new(cls, device: torch.device) -> Window:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(zero.clone(), zero.clone(), torch.zeros(2, dtype=torch.int64), start=time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused


# ---------------------------------------------------------------- the run


def _skipped_text(samples: int, shards: int, reads: int, sep: str) -> str:
    text = f"{samples} samples{sep} {shards} shards"
    return text + (f" ({reads} failed reads of them)" if reads != shards else "")


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def train(cfg: DictConfig) -> dict:
    """Train as configured; returns the summary (also written to RUN_DIR/summary.json)."""
    # Collectives outside the watched loop (start-up, the last summary) time out here; inside it
    # the watchdog names a stalled rank after trainer.timeout_s, well before.
    d = distributed.init(cfg.trainer.device.value, timeout_s=max(2 * cfg.trainer.timeout_s, 300.0))
    stop = faults.StopRequest()
    watchdog = faults.Watchdog(
        d.rank, d.world, cfg.trainer.timeout_s, distributed.store(), f"wdsdist/{distributed.restart_count()}", stop
    )
    try:
        on_all_ranks(d, lambda: check(cfg))
        return _train(cfg, d, stop, watchdog)
    finally:
        watchdog.close()
        stop.uninstall()
        distributed.cleanup()


def _train(cfg: DictConfig, d: Dist, stop: faults.StopRequest, watchdog: faults.Watchdog) -> dict:
    t_start = time.perf_counter()
    t = cfg.trainer
    run_dir = resolve_run_dir(cfg, d)
    restarts = distributed.restart_count()
    on_all_ranks(d, lambda: refuse_foreign_run_dir(run_dir, t.resume, restarts > 0) if d.is_main else None)
    on_all_ranks(d, lambda: ensure_synthetic(cfg) if d.is_main else None)
    stale: list[str] = []
    if d.is_main:
        os.makedirs(run_dir, exist_ok=True)
        stale = remove_stale_tmp(run_dir)
        write_text(os.path.join(run_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))

    # Identical initial weights on every rank (DDP also broadcasts rank 0's), then per-rank seeds
    # so augmentations and loader workers differ between ranks.
    torch.manual_seed(cfg.seed)
    model = on_all_ranks(d, lambda: build_model(cfg))
    cuda = d.device.type == "cuda"
    model = model.to(d.device)
    if cuda and t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    torch.manual_seed(cfg.seed + d.rank)
    random.seed(cfg.seed + d.rank)
    np.random.seed(cfg.seed + d.rank)
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    global_batch = t.batch_size * d.world
    lr = cfg.optim.lr * global_batch / 256
    opt = build_optimizer(cfg, model, lr)

    # Rank 0 picks the checkpoint (falling back past corrupt ones) and the others load the same.
    candidates = on_all_ranks(d, lambda: find_resume(t.resume, run_dir, restarted=restarts > 0))
    resume_path, ckpt, resume_warnings = None, None, []
    if candidates:
        found = on_all_ranks(d, lambda: load_first(candidates) if d.is_main else None)
        resume_path = distributed.broadcast_object(found[0] if d.is_main else None)
        ckpt = on_all_ranks(d, lambda: found[1] if d.is_main else load_checkpoint(resume_path))
        resume_warnings = found[2] if d.is_main else []
    loader_state = on_all_ranks(d, lambda: loader_state_for(ckpt, resume_path, d, cfg)) if ckpt else None
    seed = cfg.seed
    if ckpt is not None and loader_state is None:
        seed = cfg.seed + int(ckpt["step"])  # a fresh stream must not replay the first samples

    # Every rank builds (and so checks) its own loader: a layout that would hang stops here.
    lcfg = loader_config(cfg, d, seed)
    train_shards = on_all_ranks(d, lambda: shards_of("data.train_shards", cfg.data.train_shards, lcfg))
    train_loader = on_all_ranks(
        d, lambda: in_config_terms(make_loader, train_shards, d.rank, d.world, lcfg, loader_state)
    )
    eval_loader = None
    if cfg.data.val_shards:
        val_shards = on_all_ranks(d, lambda: shards_of("data.val_shards", cfg.data.val_shards, lcfg))
        eval_loader = on_all_ranks(d, lambda: make_eval_loader(val_shards, d.rank, d.world, lcfg))
    steps = t.steps
    if t.epochs is not None:
        steps = t.epochs * train_loader.epoch_batches
    sched = build_scheduler(opt, steps, cfg.optim.warmup)

    start = 0
    if ckpt is not None:
        start = on_all_ranks(d, lambda: restore(ckpt, resume_path, d, cfg, model, opt, sched))
        del ckpt
    if d.world > 1:
        # Gradients as views into DDP's buckets: no second copy of them, one copy less per step.
        ddp_model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[d.local_rank] if cuda else None,
            process_group=distributed.group_for(d.device),
            gradient_as_bucket_view=True,
        )
    else:
        ddp_model = model

    mean = torch.tensor(cfg.data.mean, device=d.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(cfg.data.std, device=d.device).view(1, 3, 1, 1) * 255
    memory_format = torch.channels_last if cuda and t.channels_last else torch.contiguous_format

    def to_input(images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW from the loader -> normalised float on the device (DESIGN principle 4)."""
        x = images.to(d.device, non_blocking=True).float()
        return ((x - mean) / std).contiguous(memory_format=memory_format)

    bf16, amp_note = distributed.bf16_autocast(t.amp, torch.cuda.get_device_capability(d.device) if cuda else None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()

    report = Reporter(d, run_dir, steps, start)
    for warning in resume_warnings:
        report.line(warning, console=False)
    if stale:
        report.line(f"removed {len(stale)} file(s) a killed writer left: {', '.join(stale)}", console=False)
    report.line(
        f"run dir {run_dir}: {cfg.model.name} on {d.world} x {d.device.type}, {steps} steps of "
        f"{t.batch_size} per rank (global {global_batch}), lr {lr:.4g}, loader.mode={cfg.loader.mode.value}"
        + (f", restart {restarts} of torchrun" if restarts else "")
        + (f", resumed from {resume_path} at step {start}" if resume_path else "")
    )
    if amp_note:
        report.line(amp_note)
    if t.resume == "auto" and resume_path is None:
        report.line(f"trainer.resume=auto: no checkpoint in {run_dir} yet, starting at step 0")
    if train_loader.plan is not None:
        p = train_loader.plan
        report.line(
            f"plan: {p.nshards} shards, {p.total_samples} samples over {p.world} ranks x {p.nworkers} workers; "
            f"batches per rank per pass {p.min_available}..{p.max_available}"
            + (f", cut to {p.nbatches}" if p.nbatches is not None else ""),
            console=False,
        )
    if steps > start:
        report.line(f"startup {_fmt_time(time.perf_counter() - t_start)}; training", console=False)

    last_eval: dict | None = None
    stop.install()
    watchdog.start()

    def run_eval(step: int) -> dict | None:
        if eval_loader is None:
            return None
        if d.world > 1:
            share_buffers(model)
        t0 = time.perf_counter()
        result = evaluate(
            model, eval_loader, d, to_input, cfg.data.num_classes, autocast, beat=lambda p: watchdog.beat(step, p)
        )
        report.scalars(step, {"val/top1": result["top1"], "val/loss": result["loss"]})
        report.line(
            f"eval at step {step}: val top-1 {100 * result['top1']:.2f}% loss {result['loss']:.4f} "
            f"({result['samples']} samples, {time.perf_counter() - t0:.1f}s)"
        )
        return result

    def checkpoint(step: int) -> str | None:
        watchdog.beat(step, "checkpoint")
        path = save_checkpoint(run_dir, step, d, model, opt, sched, train_loader, cfg, t.keep)
        report.line(f"checkpoint {path}", console=False)
        return path

    # ---- the loop
    step, saved_at, last_ckpt = start, None, None
    win = Window.new(d.device)
    train_time, train_samples, train_wait = 0.0, 0, 0.0
    skipped = torch.zeros(2, dtype=torch.int64)  # this rank's bad samples and failed shard reads, whole run
    skipped_logged = [0, 0]  # all ranks' totals, as of the last log line
    # A bad shard fails on every pass over it (repeat mode): its URL, not its reads, counts it once.
    failed_shards: set[str] = set()  # this rank's, since the last log line
    failed_logged: set[str] = set()  # all ranks', as of the last log line
    images_logged = False
    ended_without_step = False
    stop_all = False
    epoch_mode = cfg.loader.mode == LoaderMode.epoch
    pending: distributed.Agreement | None = None  # repeat and resampled modes: the stop flags in flight
    it = iter(train_loader)
    ddp_model.train()
    while step < steps:
        watchdog.beat(step, "data")
        faults.stall_for_test(d.rank, step)
        t0 = time.perf_counter()
        batch = next(it, None)  # None: this rank's epoch is over (epoch mode)
        if batch is None and not epoch_mode:  # a pass that gave not one batch: this rank alone restarts
            it = iter(train_loader)
            batch = next(it, None)
            if batch is None:
                raise DataError(
                    f"rank {d.rank} delivers not one batch of {t.batch_size} (loader.mode={cfg.loader.mode.value}): "
                    f"its shards lost too many samples; see the warnings"
                )
        wait = time.perf_counter() - t0
        watchdog.beat(step, "step")
        if epoch_mode:
            # Every rank learns, in one small all-reduce, whether any rank was asked to stop and
            # whether any rank ran out: a rank that skipped bad data runs out first, and every
            # rank then ends the epoch with it instead of waiting for it forever.
            stop_all, out_any, have_any = distributed.agree_max([stop.requested, batch is None, batch is not None])
        else:
            # No rank runs out here, so only the stop flags are agreed on, and that all-reduce
            # runs while the step trains: every rank reads the one started a step ago, the same
            # value everywhere, so all still stop at one step (one step after the signal).
            stop_all = pending.result() == [1] if pending is not None else False
            pending = distributed.Agreement([int(stop.requested)])
            out_any = have_any = False
        if out_any:
            if ended_without_step:
                # Every rank agreed on this: rank 0 says it once, the others leave quietly.
                if not d.is_main:
                    raise SystemExit(2)
                raise DataError(
                    f"epoch {train_loader.tracker.epoch}: a rank delivers not one batch of {t.batch_size} "
                    f"(its shards lost too many samples; see the warnings)"
                )
            if have_any:
                out = [r for r, none in enumerate(distributed.all_gather_object(batch is None)) if none]
                report.line(
                    f"epoch {train_loader.tracker.epoch} ends early at step {step} on every rank: "
                    f"rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} ran out of data before the plan's "
                    f"{train_loader.epoch_batches} batches (bad samples or shards skipped; see the warnings)"
                )
            train_loader.end_epoch()
            it = iter(train_loader)
            ended_without_step = True
            if stop_all:
                break
            continue
        ended_without_step = False
        labels = batch["label"]  # in [0, num_classes): the loader skips (or in strict mode stops at) others
        bad = batch["bad"].sum(0) if "bad" in batch else torch.zeros(2, dtype=torch.int64)
        skipped += bad
        win.bad += bad
        failed_shards.update(batch.get("bad_shards", ()))
        if not images_logged:
            report.images("train/batch", batch["image"], step)
            images_logged = True
        x = to_input(batch["image"])
        y = labels.to(d.device, non_blocking=True)
        with autocast():
            logits = ddp_model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=cfg.optim.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        report.tick(step)
        win.loss += loss.detach().double() * len(y)
        win.correct += (logits.detach().argmax(1) == y).sum()
        win.samples += len(y)
        win.wait += wait

        if step % t.log_every == 0 or step == steps or stop_all:
            elapsed = win.elapsed()
            stats = torch.stack(
                [win.loss, win.correct, torch.tensor(win.samples, dtype=torch.float64, device=d.device)]
            )
            extra = [win.wait, elapsed, *win.bad.tolist()]
            stats = torch.cat([stats, torch.tensor(extra, dtype=torch.float64, device=d.device)])
            distributed.all_reduce_sum(stats)
            loss_sum, correct, samples, wait_sum, elapsed_sum, bad_samples, bad_reads = stats.tolist()
            skipped_logged = [skipped_logged[0] + int(bad_samples), skipped_logged[1] + int(bad_reads)]
            if bad_reads:  # a shard failed on some rank: the one case worth gathering names for
                failed_logged.update(*distributed.all_gather_object(sorted(failed_shards)))
                failed_shards = set()
            wall = elapsed_sum / d.world
            values = {
                "train/loss": loss_sum / samples,
                "train/acc": correct / samples,
                "train/lr": sched.get_last_lr()[0],
                "perf/samples_per_s": samples / wall,
                "perf/data_wait": wait_sum / elapsed_sum,
                # All ranks, since the start of this run: samples skipped, distinct shards that
                # failed, and failed reads of them (a bad shard fails on every pass over it).
                "data/bad_samples": skipped_logged[0],
                "data/bad_shards": len(failed_logged),
                "data/bad_shard_reads": skipped_logged[1],
            }
            report.scalars(step, values)
            report.progress(
                step,
                f"loss {values['train/loss']:.4f} acc {100 * values['train/acc']:.1f}% lr {values['train/lr']:.4g} "
                f"{values['perf/samples_per_s']:.0f} samples/s data-wait {100 * values['perf/data_wait']:.0f}%"
                + (
                    f" skipped {_skipped_text(skipped_logged[0], len(failed_logged), skipped_logged[1], ',')}"
                    if skipped_logged[0] or skipped_logged[1]
                    else ""
                ),
            )
            train_time += wall
            train_samples += int(samples)
            train_wait += wait_sum / d.world
            win = Window.new(d.device)
        t0 = time.perf_counter()
        if t.eval_every and step % t.eval_every == 0 and step < steps and not stop_all:
            last_eval = run_eval(step)
        if t.ckpt_every and step % t.ckpt_every == 0:
            last_ckpt, saved_at = checkpoint(step), step
        win.paused += time.perf_counter() - t0
        if stop_all:
            break
    if pending is not None:
        pending.result()  # the last flags in flight: read, so nothing is left on the control group

    if stop_all and step < steps:  # SIGTERM: a checkpoint of this step, then a prompt exit (see faults.EXIT_STOPPED)
        if saved_at != step:
            last_ckpt = checkpoint(step)
        report.line(
            f"stopped by SIGTERM at step {step} of {steps}: checkpoint {last_ckpt}; "
            f"rerun with trainer.resume=auto to continue"
        )
        report.close()
        raise SystemExit(faults.EXIT_STOPPED)

    last_eval = run_eval(step) if eval_loader is not None else last_eval
    if saved_at != step:  # the same decision on every rank: saving is a collective
        last_ckpt = checkpoint(step)

    # Every rank reports its own step and weights: they must agree after DDP.
    fingerprints = distributed.all_gather_object((step, params_fingerprint(model)))
    bad_total = distributed.all_reduce_sum(skipped.to(d.device)).tolist()
    failed_logged.update(*distributed.all_gather_object(sorted(failed_shards)))
    summary = {
        "run_dir": run_dir,
        "world": d.world,
        "steps": step,
        "resumed_from_step": start if resume_path else None,
        "seconds": round(time.perf_counter() - t_start, 2),
        "samples_per_s": train_samples / train_time if train_time else None,
        "data_wait": train_wait / train_time if train_time else None,
        "val_top1": last_eval["top1"] if last_eval else None,
        "val_loss": last_eval["loss"] if last_eval else None,
        "val_samples": last_eval["samples"] if last_eval else None,
        "val_class_samples": last_eval["class_samples"] if last_eval else None,
        "skipped_samples": bad_total[0],
        "skipped_shards": len(failed_logged),  # distinct shards
        "skipped_shard_reads": bad_total[1],  # failed reads of them (every pass over a bad shard fails)
        "rank_steps": [s for s, _ in fingerprints],
        "rank_params": [f for _, f in fingerprints],
        "checkpoint": last_ckpt,
    }
    if d.is_main:
        if len(set(fingerprints)) > 1:
            report.line(f"warning: ranks disagree at the end (step, weights): {fingerprints}")
        report.hparams(
            {
                "model": cfg.model.name,
                "optim": cfg.optim.name.value,
                "lr": lr,
                "batch_size": t.batch_size,
                "global_batch": global_batch,
                "world": d.world,
                "steps": steps,
                "image_size": cfg.data.image_size,
                "loader_mode": cfg.loader.mode.value,
                "data": cfg.data.name,
            },
            {"hparam/val_top1": summary["val_top1"] or 0.0, "hparam/val_loss": summary["val_loss"] or 0.0},
        )
        write_text(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=1) + "\n")
    parts = [f"done: {step} steps in {_fmt_time(summary['seconds'])}"]
    if summary["samples_per_s"]:
        parts.append(f"{summary['samples_per_s']:.0f} samples/s, data-wait {100 * summary['data_wait']:.1f}%")
    if last_eval:
        parts.append(f"val top-1 {100 * last_eval['top1']:.2f}% ({last_eval['samples']} samples)")
    if bad_total[0] or bad_total[1]:
        parts.append(f"skipped {_skipped_text(bad_total[0], len(failed_logged), bad_total[1], ' and')}")
    parts.append(f"run dir {run_dir}")
    report.line(", ".join(parts))
    report.close()
    return summary
