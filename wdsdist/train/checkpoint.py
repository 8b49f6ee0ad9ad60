"""Checkpoints: atomic files in the run directory, pruning, finding the one to resume from, restoring.

A checkpoint holds the model, the optimizer, every rank's RNG state and loader position, the step
and the resolved config. The learning rate is a function of the step (``trainer.lr_at``), so there
is no scheduler state to save; checkpoints written before that still carry a "scheduler" entry,
which loads and is ignored.
"""
# A long module on purpose: writing a checkpoint and finding the one to resume from share the
# run directory's rules (names, generations, what a torn file looks like); apart, they would drift.

from __future__ import annotations

import glob
import json
import os
import random
import re
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import Dist
from wdsdist.cluster.faults import Watchdog
from wdsdist.data import Loader
from wdsdist.errors import JobError, UserError
from wdsdist.tools.outfolder import write_text
from wdsdist.train.ema import Ema
from wdsdist.train.report import Reporter

CKPT_FORMAT = "wdsdist-checkpoint-v1"


# ---------------------------------------------------------------- files


def _atomic_save(obj: Any, path: str, may_write: Any = None) -> None:
    """Write PATH.tmpPID, flush it to disk, then rename it over PATH: a crash at any moment leaves
    the old file or the new one, never a torn one (a killed writer leaves only the .tmp file).
    ``may_write``, called just before the rename, may still refuse it by raising."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if may_write is not None:
            may_write()
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


# ---------------------------------------------------------------- generations: who may write


JOB_FILE = "job.json"


@dataclass(frozen=True)
class Generation:
    """Which start of the job this is in its run directory (1, 2, ...), the fence for its writes:
    once a later start (torchrun re-forming the job after a node came or went) has begun, an
    earlier one still running somewhere (a node cut off from the others) writes nothing more."""

    number: int
    restarted: bool  # a later start of the same torchrun job, whatever torchrun's restart count says


def _read_job(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, JOB_FILE), encoding="utf-8") as f:
            job = json.loads(f.read(4096))
        return job if isinstance(job, dict) and isinstance(job.get("generation"), int) else {}
    except (OSError, ValueError):
        return {}


def same_job(run_dir: str, run_id: str | None) -> bool:
    """Whether the run directory's last start was this torchrun job (its rendezvous id): a node
    joining or leaving re-forms the job without counting a restart, and must still resume."""
    return run_id is not None and _read_job(run_dir).get("run_id") == run_id


def begin_generation(run_dir: str, run_id: str | None, restarted: bool) -> Generation:
    """Rank 0, before this start writes anything else: the next generation, recorded."""
    number = _read_job(run_dir).get("generation", 0) + 1
    write_text(os.path.join(run_dir, JOB_FILE), json.dumps({"run_id": run_id, "generation": number}) + "\n")
    return Generation(number, restarted)


def check_generation(run_dir: str, generation: Generation) -> None:
    """Before a write that moves the run on (a checkpoint, latest.pt): refuse it, with one line,
    when a later start of the job owns the run directory (no split brain)."""
    newer = _read_job(run_dir).get("generation", 0)
    if newer > generation.number:
        raise JobError(
            f"a later start of this job (generation {newer}) owns {run_dir}: this one (generation "
            f"{generation.number}) was cut off from it and stops without writing"
        )


def _step_of(path: str) -> int:
    return int(re.findall(r"\d+", os.path.basename(path))[0])


def checkpoints(run_dir: str) -> list[str]:
    """ckpt-STEP.pt files of a run directory, oldest first."""
    found = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*.pt")) if re.search(r"ckpt-\d+\.pt$", p)]
    return sorted(found, key=_step_of)


# ---------------------------------------------------------------- saving


def rng_state(dist: Dist) -> dict:
    """This rank's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(dist.device) if dist.device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
    }


def set_rng_state(state: dict, dist: Dist) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and dist.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], dist.device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached"],
        )
    )


def save_checkpoint(
    run_dir: str,
    step: int,
    dist: Dist,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: Loader,
    cfg: DictConfig,
    keep: int,
    generation: Generation,
    pins: dict[str, str] | None = None,
    ema: Ema | None = None,
) -> str | None:
    """Collective: every rank hands in its loader position and RNG state; rank 0 writes, unless a
    later start of the job owns the run directory (``check_generation``). ``pins``: what each data
    spec was read as (pins.py), taken again on a resume; ``ema``: rank 0's EMA of the weights."""
    loaders = loader.state_dict()  # every rank's position
    rngs = distributed.all_gather_object(rng_state(dist))
    if not dist.is_main:
        return None
    ckpt = {
        "format": CKPT_FORMAT,
        "step": step,
        "generation": generation.number,  # which start of the job wrote it
        "world": dist.world,
        "workers": cfg.trainer.workers,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": rngs,
        "loader": loaders,
        "pins": dict(pins or {}),
        "ema": ema.state_dict() if ema is not None else None,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "classes": list(OmegaConf.select(cfg, "data.classes") or ()),  # label i's name (also in the config)
    }
    name = f"ckpt-{step:07d}.pt"
    check_generation(run_dir, generation)
    _atomic_save(ckpt, os.path.join(run_dir, name), lambda: check_generation(run_dir, generation))
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


class Checkpointer:
    """Owns the checkpoint schedule: every ``trainer.ckpt_every`` steps, and once at the end of a
    run (or at a stop) unless that step is saved already. Saving is a collective: every rank calls
    ``maybe_save`` with the same arguments."""

    def __init__(
        self,
        run_dir: str,
        dist: Dist,
        cfg: DictConfig,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        loader: Loader,
        report: Reporter,
        watchdog: Watchdog,
        generation: Generation,
        pins: dict[str, str] | None = None,
        ema: Ema | None = None,
    ):
        self.run_dir, self.dist, self.cfg, self.generation, self.pins = run_dir, dist, cfg, generation, pins
        self.ema = ema
        self.model, self.opt, self.loader = model, opt, loader
        self.report, self.watchdog = report, watchdog
        self.every = cfg.trainer.ckpt_every
        self.saved_at: int | None = None
        self.path: str | None = None  # the last one written (None on ranks other than 0)

    def maybe_save(self, step: int, last: bool = False) -> None:
        due = self.saved_at != step if last else bool(self.every) and step % self.every == 0
        if due:
            self.watchdog.beat(step, "checkpoint")
            keep = self.cfg.trainer.keep
            self.path = save_checkpoint(
                self.run_dir,
                step,
                self.dist,
                self.model,
                self.opt,
                self.loader,
                self.cfg,
                keep,
                self.generation,
                self.pins,
                self.ema,
            )
            self.saved_at = step
            self.report.line(f"checkpoint {self.path}", console=False)


# ---------------------------------------------------------------- the run directory and resuming


def resolve_run_dir(cfg: DictConfig, dist: Dist) -> str:
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
        name = distributed.first_value("run_name", _fresh_name(cfg.outputs)) if dist.is_main else None
        name = distributed.broadcast_object(name)
    return os.path.join(cfg.outputs, name)


def _fresh_name(outputs: str) -> str:
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    name, n = stamp, 1
    while os.path.exists(os.path.join(outputs, name)):
        n += 1
        name = f"{stamp}-{n}"
    return name


def load_resume(
    cfg: DictConfig, dist: Dist, run_dir: str, restarted: bool
) -> tuple[str | None, dict | None, list[str]]:
    """The checkpoint to resume from (path, contents, warnings about newer ones that did not
    load), or Nones. Rank 0 picks it, falling back past corrupt ones; the others load the same.
    ``restarted``: a later start of the same torchrun job, which continues from the run directory."""
    candidates = distributed.on_all_ranks(lambda: find_resume(cfg.trainer.resume, run_dir, restarted=restarted))
    if not candidates:
        return None, None, []
    found = distributed.on_all_ranks(lambda: load_first(candidates) if dist.is_main else None)
    path = distributed.broadcast_object(found[0] if dist.is_main else None)
    ckpt = distributed.on_all_ranks(lambda: found[1] if dist.is_main else load_checkpoint(path))
    return path, ckpt, found[2] if dist.is_main else []


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


def restore(
    ckpt: dict,
    path: str,
    dist: Dist,
    cfg: DictConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ema: Ema | None = None,
) -> int:
    """Load model, optimizer, the EMA and this rank's RNG; returns the step to continue at. The
    learning rate is not restored: every step sets it from the step and this run's config and
    global batch. A checkpoint without an EMA (trainer.ema turned on at the resume) starts one
    from the weights it holds."""
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise UserError(f"{path} does not fit model.name={cfg.model.name}: {str(exc).splitlines()[0]}") from None
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path}: optimizer state does not fit optim.name={cfg.optim.name.value}: {exc}") from None
    for group in opt.param_groups:
        group.pop("initial_lr", None)  # LambdaLR's, in checkpoints from before lr_at: nothing reads it now
    if ema is not None:
        if ckpt.get("ema") is not None:
            ema.load_state_dict(ckpt["ema"])
        else:
            ema.model.load_state_dict(model.state_dict())
    step = int(ckpt["step"])
    if ckpt["world"] == dist.world:
        set_rng_state(ckpt["rng"][dist.rank], dist)
    else:  # another layout: new per-rank streams, not a replay of the first steps'
        torch.manual_seed(cfg.seed + dist.rank + 1000 * step)
    return step
