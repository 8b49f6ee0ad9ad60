"""A run's model as any library reads it: ``model.safetensors`` and ``config.json`` in the run
directory, written at the end of every run (wdsdist/train/export.py describes the run), read back
by prediction and by ``model.weights=RUN_DIR``.

config.json names the architecture (``library``: torchvision or timm, ``architecture``: its
name), the classes in label order, the input size (evaluation's centre crop, data.eval_size),
evaluation's resize (the shorter side, before the centre crop: data.eval_resize), the mean and std
on the 0-1 scale, ``stem``: ``small`` where the ResNet's first convolution is 3x3 stride 1
(docs/predict.md shows plain torchvision loading it), and ``weights``: ``ema`` where the file
holds the EMA of the weights (trainer.ema), else ``model``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn as nn

from wdsdist.errors import UserError
from wdsdist.model.build import TIMM, Stem, make_model
from wdsdist.tools.outfolder import write_text, written_whole

FORMAT = "wds-distributed-model/1"
EVAL_RATIO = 0.875  # the loader's evaluation: shorter side to round(size / 0.875), then the centre crop


def write(run_dir: str, model: nn.Module, config: dict[str, Any]) -> str:
    """model.safetensors (``model``'s weights) and config.json (``config``), each written whole
    (a temporary file, then renamed)."""
    from safetensors.torch import save_file

    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    path = os.path.join(run_dir, "model.safetensors")
    with written_whole(path) as tmp:
        save_file(weights, tmp, metadata={"format": "pt"})
    write_text(os.path.join(run_dir, "config.json"), json.dumps(config, indent=1) + "\n")
    return path


def load(folder: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model a folder's model.safetensors and config.json describe, built and loaded."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(folder, "config.json"), os.path.join(folder, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise UserError(f"{folder}: no {os.path.basename(path)} there (a run writes it when it ends)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("format") != FORMAT:
        raise UserError(f"{config_path}: not a model config of this trainer (format {config.get('format')!r})")
    return model_of(config, load_file(weights_path), config_path), config


def model_of(config: dict[str, Any], weights: dict[str, torch.Tensor], where: str) -> nn.Module:
    """The model a config describes, with these weights; one line where they do not fit it."""
    prefix = TIMM if config["library"] == "timm" else ""
    stem = Stem.small if config.get("stem") == "small" else Stem.imagenet
    size = config.get("train_size", config["image_size"])  # the stem follows the training size
    model = make_model(prefix + config["architecture"], config["num_classes"], size, stem)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        said = first[1] if len(first) > 1 else first[0]
        raise UserError(f"{where}: the weights do not fit {config['architecture']}: {said.strip()}") from None
    return model.eval()
