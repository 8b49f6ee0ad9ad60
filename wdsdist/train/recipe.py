"""The recipe's options that are more than a number: their checks in config terms, and what they
come to for the loader and the start-up lines.

``data.image_size`` is pixels, or a schedule of ``[from, size]`` pairs (progressive resizing, FFCV's
160 -> 192 px): each size holds from a fraction of training on. In repeat mode that fraction is of
``trainer.steps``, and the loader switches at that step's first batch on every rank; in epoch
mode it is of ``trainer.epochs``, and a size holds for whole epochs (FFCV's way), so every rank
switches at an epoch's first step. The loader counts in its own units (batches, or epochs:
LoaderConfig.size_schedule), so a resume continues at the right size.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from wdsdist.data import LoaderMode
from wdsdist.errors import UserError

COMPILES = (False, True, "auto")
_SIZE_RULE = "pixels (>= 8), or [[from, size], ...]: from a fraction of training in [0, 1), the first 0, rising"


def sizes(cfg: DictConfig) -> list[tuple[float, int]]:
    """data.image_size as (from, size) pairs (one pair for plain pixels, which the loader's own
    rule checks); UserError naming it."""
    value = cfg.data.image_size
    pairs = _pairs(value)
    if pairs is None:
        raise UserError(f"data.image_size={_shown(value)}: {_SIZE_RULE}")
    return pairs


def _pairs(value: Any) -> list[tuple[float, int]] | None:
    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    if number(value) and int(value) == value:
        return [(0.0, int(value))]
    if not isinstance(value, list | ListConfig) or not value:
        return None
    if not all(isinstance(p, list | ListConfig) and len(p) == 2 and all(map(number, p)) for p in value):
        return None
    pairs = [(float(first), int(size)) for first, size in value]
    froms = [first for first, _ in pairs]
    whole = all(int(size) == size for _, size in value)
    ok = whole and froms[0] == 0 and froms == sorted(set(froms)) and froms[-1] < 1
    return pairs if ok and min(size for _, size in pairs) >= 8 else None


def _shown(value: Any) -> str:
    return str(OmegaConf.to_container(value) if isinstance(value, ListConfig) else value).replace(" ", "")


def hparam_size(cfg: DictConfig) -> int | str:
    """data.image_size for TensorBoard's HParams: the pixels, or the schedule as text (160>192)."""
    pairs = sizes(cfg)
    return pairs[0][1] if len(pairs) == 1 else ">".join(str(size) for _, size in pairs)


def largest(cfg: DictConfig) -> int:
    """The largest training size (the model's, the buffers')."""
    return max(size for _, size in sizes(cfg))


def schedule(cfg: DictConfig) -> tuple[tuple[int, int], ...]:
    """data.image_size's schedule in the loader's units (LoaderConfig.size_schedule): epochs in
    epoch mode, else the rank's batches (steps x trainer.accum_steps); empty for plain pixels."""
    pairs = sizes(cfg)
    if len(pairs) == 1:
        return ()
    t = cfg.trainer
    by_epochs = cfg.loader.mode == LoaderMode.epoch
    out: dict[int, int] = {}
    for first, size in pairs:
        at = math.ceil(first * t.epochs) if by_epochs else math.ceil(first * t.steps) * t.accum_steps
        out[at] = size  # two fractions on one epoch or step: the later one holds
    return tuple(sorted(out.items()))


def schedule_line(cfg: DictConfig) -> str | None:
    """The start-up line that says which size holds when; None for plain pixels."""
    planned = schedule(cfg)
    if not planned:
        return None
    unit = "epoch" if cfg.loader.mode == LoaderMode.epoch else "step"
    per = 1 if unit == "epoch" else cfg.trainer.accum_steps
    parts = [f"{size} px from {unit} {first // per}" for first, size in planned]
    return f"data.image_size: {', '.join(parts)} (every rank switches at that {unit}'s first batch)"


class Sized:
    """The data section as the loader's rules read it: image_size its largest size."""

    def __init__(self, section: Any, size: int):
        self._section, self.image_size = section, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._section, name)


def check(cfg: DictConfig) -> None:
    """The recipe's rules; each error names its key."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            raise UserError(f"{key}={_shown(OmegaConf.select(cfg, key))}: {rule}")

    need(t.accum_steps >= 1, "trainer.accum_steps", "must be >= 1")
    need(t.mixup >= 0, "trainer.mixup", "an alpha >= 0 (0: off)")
    need(t.cutmix >= 0, "trainer.cutmix", "an alpha >= 0 (0: off)")
    need(0 <= t.ema.decay < 1, "trainer.ema.decay", "in [0, 1) (0: no EMA)")
    need(t.ema.every >= 1, "trainer.ema.every", "must be >= 1 (steps)")
    need(t.compile in COMPILES and not isinstance(t.compile, float), "trainer.compile", "false, true or auto")
    need(o.clip_grad_norm is None or o.clip_grad_norm > 0, "optim.clip_grad_norm", "must be > 0, or null")
    for key in ("optim.norm_weight_decay", "optim.bias_weight_decay"):
        value = OmegaConf.select(cfg, key)
        need(value is None or value >= 0, key, "must be >= 0, or null (optim.weight_decay)")
    if len(sizes(cfg)) > 1:
        check_schedule(cfg, need)
    eval_size = d.eval_size or largest(cfg)
    need(
        not cfg.model.name.startswith("vit_") or (len(sizes(cfg)) == 1 and eval_size == largest(cfg)),
        "data.image_size" if len(sizes(cfg)) > 1 else "data.eval_size",
        f"{cfg.model.name} takes one input size: train and evaluate at one size",
    )


def check_schedule(cfg: DictConfig, need: Any) -> None:
    """A size schedule's rules beside the other options."""
    ld, key = cfg.loader, "data.image_size"
    if ld.mode == LoaderMode.epoch:
        need(cfg.trainer.epochs is not None, key, "a schedule in epoch mode counts epochs: give trainer.epochs")
    else:
        need(
            ld.cross_shuffle == 0 and ld.mix == "sample",
            key,
            "a schedule in repeat mode needs each batch from one worker: no loader.cross_shuffle, loader.mix=sample",
        )


def compile_choice(setting: Any, device_type: str) -> tuple[bool, str]:
    """Whether trainer.compile compiles here, and why in words. ``auto`` compiles only where it
    was measured to pay off: on the CPU it did not (bench/results/2026-11-29-recipe-tools.md), and
    on a GPU it has not been measured yet (./run gpu-check's compile rows)."""
    if setting is True:
        return True, "trainer.compile=true"
    if setting is False:
        return False, "trainer.compile=false"
    if device_type == "cpu":
        return False, "trainer.compile=auto: eager (on the CPU, compiling did not pay off where measured)"
    return False, "trainer.compile=auto: eager (compiling on a GPU is not measured yet)"


def recipe_lines(cfg: DictConfig, compile_why: str) -> list[str]:
    """The start-up lines for the recipe's tools in use (none with the defaults)."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    tools = []
    if d.augment != "none":
        tools.append(d.augment + (f" (n {d.augment_n}, m {d.augment_m})" if d.augment == "randaugment" else ""))
    if d.random_erase:
        tools.append(f"random erasing p {d.random_erase:g}")
    mixes = [f"{name} alpha {a:g}" for name, a in (("mixup", t.mixup), ("cutmix", t.cutmix)) if a]
    if mixes:
        tools.append(" or ".join(mixes) + " per batch")
    if t.ema.decay:
        tools.append(f"EMA decay {t.ema.decay:g} every {t.ema.every} step(s)" + (", warm-up" if t.ema.warmup else ""))
    if t.accum_steps > 1:
        tools.append(f"{t.accum_steps} micro-batches a step")
    if o.clip_grad_norm is not None:
        tools.append(f"gradient norm clipped to {o.clip_grad_norm:g}")
    for what, value in (("norms", o.norm_weight_decay), ("biases", o.bias_weight_decay)):
        if value is not None:
            tools.append(f"weight decay {value:g} on {what}")
    if t.sync_bn:
        tools.append("SyncBatchNorm")
    lines = [f"recipe: {', '.join(tools)}"] if tools else []
    if mixes:
        lines.append("train acc with mixing: a prediction counts as right where it names the larger share of its label")
    if (line := schedule_line(cfg)) is not None:
        lines.append(line)
    if d.eval_size is not None or d.eval_resize is not None:
        size = d.eval_size or largest(cfg)
        lines.append(
            f"evaluation: the shorter side resized to {d.eval_resize or round(size / 0.875)}, centre crop {size}"
        )
    if t.compile is not False:
        lines.append(compile_why)
    return lines
