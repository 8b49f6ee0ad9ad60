"""The prediction row of ``./run bench.py``: predict.py --out-dir's images/s over the data set,
beside what bounds it, each in its own process:

- ``predict``: predict.py's job (wdsdist.predict.job) on one rank: the loader's workers
  decode, the main process runs the model, parts are written as they are settled;
- ``predict-loader``: the same loader alone (split=samples, evaluation's resize and centre crop,
  the same workers and batch), nothing done with its batches;
- ``predict-model``: the same model alone on random uint8 batches, as many threads as cores.

Each rate is taken after the first batch (the workers' and the model's start-up are not in it).
The row's figure is predict / the slower of the other two: 1.0 would be a job that loses nothing
to running both at once. On a CPU-only machine the loader's workers and the model's threads
share the cores, so the figure also says how much the decoding takes from the model.

The model is an untrained ResNet-18 at 224 pixels (written once into the data set's folder as a
run exports it): the weights do not change its speed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

ARCH, SIZE, CLASSES = "resnet18", 224, 10


def model_folder(data: Path) -> str:
    """An untrained ResNet-18 as a run's export (config.json + model.safetensors), made once."""
    folder = data / f"predict-{ARCH}"
    if (folder / "config.json").exists():
        return str(folder)
    import torch
    from safetensors.torch import save_file

    from wdsdist.model.build import make_model
    from wdsdist.model.saved import EVAL_RATIO, FORMAT

    torch.manual_seed(0)
    model = make_model(ARCH, CLASSES, SIZE)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config = {
        "format": FORMAT, "library": "torchvision", "architecture": ARCH, "num_classes": CLASSES,
        "classes": [f"class{i:02d}" for i in range(CLASSES)], "image_size": SIZE, "resize": round(SIZE / EVAL_RATIO),
        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "stem": "default", "weights": "model",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


def loader_config(workers: int, batch: int):
    from wdsdist.data import LoaderConfig

    return LoaderConfig(
        batch_size=batch, image_size=SIZE, eval_size=SIZE, train=False, workers=workers, with_keys=True,
        shuffle_buffer=0, mode="epoch", split="samples", partial=True, reuse_buffers=False,
    )  # fmt: skip


def run(name: str, info: dict, workers: int, batch: int, limit_seconds: float) -> dict:
    """One of the three contenders; its images/s after the first batch."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if name == "predict":
        return predict(info, workers, batch)
    if name == "predict-loader":
        return loader_alone(info, workers, batch)
    return model_alone(info, batch, limit_seconds)


def predict(info: dict, workers: int, batch: int) -> dict:
    from dataclasses import replace

    from wdsdist.predict.cli import options
    from wdsdist.predict.job import run_job

    model = model_folder(Path(info["index"]).parent.parent)
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as out:
        opts = options([model, info["index"], "--out-dir", out, "--workers", str(workers)])
        start = time.perf_counter()
        line, status = run_job(replace(opts, batch_size=batch, device="cpu"))
        wall = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"predict.py failed: {line}")
        steady = json.loads((Path(out) / "manifest.json").read_text())["timing"]
    return {"samples_per_s": steady["images"] / steady["seconds"], "images": steady["images"], "wall_s": wall}


def loader_alone(info: dict, workers: int, batch: int) -> dict:
    from wdsdist.data import Loader

    loader = Loader(info["index"], loader_config(workers, batch))
    n, first = 0, None
    for got in loader:
        if first is None:
            first = time.perf_counter()
        else:
            n += len(got["key"])
    return {"samples_per_s": n / (time.perf_counter() - first), "images": n}


def model_alone(info: dict, batch: int, limit_seconds: float) -> dict:
    import torch

    from wdsdist.model.classify import load_model

    model, _ = load_model(model_folder(Path(info["index"]).parent.parent))
    images = torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8)
    n, start = 0, None
    with torch.no_grad():
        while start is None or time.perf_counter() - start < limit_seconds:
            model(images.float())
            if start is None:
                start = time.perf_counter()
            else:
                n += batch
    return {"samples_per_s": n / (time.perf_counter() - start), "images": n}


def ratio_line(rounds: dict[str, list[dict]]) -> str | None:
    """predict / the slower of the loader alone and the model alone, round by round (a shared
    machine's load moves between rounds, not within one), in words: the median and the range."""
    names = ("predict", "predict-loader", "predict-model")
    if not all(rounds.get(n) for n in names):
        return None
    ratios, bounds = [], []
    for p, lo, mo in zip(*(rounds[n] for n in names), strict=False):
        if all("samples_per_s" in r for r in (p, lo, mo)):
            bound = min(lo["samples_per_s"], mo["samples_per_s"])
            ratios.append(p["samples_per_s"] / bound)
            bounds.append("loader" if lo["samples_per_s"] <= mo["samples_per_s"] else "model")
    if not ratios:
        return None
    order, slower = sorted(ratios), max(set(bounds), key=bounds.count)
    median = order[(len(order) - 1) // 2]
    return (
        f"prediction: predict.py / the slower of its loader alone and its model alone (the {slower}), round by "
        f"round: median {median:.2f}, range {order[0]:.2f}-{order[-1]:.2f} ({len(ratios)} rounds)"
    )
