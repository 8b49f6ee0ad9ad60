"""What a run leaves for prediction and other libraries, at its end: the description of the
trained model (config.json) from the trainer's config, written with its weights by
wdsdist/model/saved.py."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from omegaconf import DictConfig

from wdsdist.model.build import TIMM, is_small_stem
from wdsdist.model.saved import EVAL_RATIO, FORMAT, write
from wdsdist.train import recipe
from wdsdist.train.ema import Ema


def config_of(cfg: DictConfig, model: nn.Module, step: int, ema: Ema | None = None) -> dict[str, Any]:
    name, trained = cfg.model.name, recipe.largest(cfg)
    size = cfg.data.eval_size or trained
    return {
        "format": FORMAT,
        "library": "timm" if name.startswith(TIMM) else "torchvision",
        "architecture": name.removeprefix(TIMM),
        "num_classes": cfg.data.num_classes,
        "classes": list(cfg.data.classes),
        "image_size": size,
        "resize": cfg.data.eval_resize or round(size / EVAL_RATIO),
        "train_size": trained,
        "mean": list(cfg.data.mean),
        "std": list(cfg.data.std),
        "stem": "small" if is_small_stem(model) else "default",
        "step": step,
        "weights": "ema" if ema is not None else "model",
        **({"ema": {"decay": ema.decay, "every": ema.every, "updates": ema.updates}} if ema is not None else {}),
    }


def export(run_dir: str, cfg: DictConfig, model: nn.Module, step: int, ema: Ema | None = None) -> str:
    """model.safetensors (``model``'s weights: the EMA's where ``ema`` is given) and config.json."""
    return write(run_dir, model, config_of(cfg, model, step, ema))
