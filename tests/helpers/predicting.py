"""A small model folder for predict.py's tests, and how they read an output folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.config import compose_config

CLASSES = [f"c{i}" for i in range(10)]


def model_folder(folder: Path, seed: int = 0, name: str = "resnet18") -> Path:
    """model.safetensors and config.json of an untrained ``name`` for 16-pixel images (seeded), as
    a run exports them: what predict.py loads. No training: which classes it picks does not matter
    to the tests, only that every run of it picks the same."""
    from wdsdist.train import export
    from wdsdist.train.model import build_model

    overrides = [
        "data.image_size=16",
        "data.num_classes=10",
        f"model.name={name}",
        f"data.classes=[{','.join(CLASSES)}]",
    ]
    cfg = compose_config(overrides)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    export.export(str(folder), cfg, model, step=1)
    return folder


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
