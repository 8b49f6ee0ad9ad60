"""``predict.py`` (``wds-predict``): a trained model's top-k classes for image files, folders or
shards, with the class names, as a table, CSV or JSON lines; or the model exported to ONNX.

    predict.py outputs/RUN ~/photos/new/                 # a table, top 5
    predict.py outputs/RUN a.jpg b.png --format jsonl --top-k 3
    predict.py outputs/RUN/latest.pt 'data/val-{000000..000003}.tar' --format csv
    predict.py outputs/RUN --export onnx                 # RUN/model.onnx, checked against torch

The model: a run directory or a folder with model.safetensors and config.json (what every run
writes when it ends), else its latest checkpoint; or a checkpoint file. Preprocessing is the
evaluation's (wdsdist.data.decode_eval: the same functions as the evaluation loader). An image
that cannot be read is named on stderr and skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from wdsdist.data import DataError, EvalLoader, LoaderConfig, UserError, decode_eval
from wdsdist.errors import CliParser, run_cli
from wdsdist.train import export
from wdsdist.train.config import Stem
from wdsdist.train.model import make_model

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".ppm", ".tif", ".tiff")
SHARD_MARKS = (".tar", ".index.json", "{", "://")


class Classifier(nn.Module):
    """The model with its normalisation: uint8-scale float images (0-255) in, logits out."""

    def __init__(self, model: nn.Module, mean: list[float], std: list[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images - self.mean) / self.std)


def load_model(path: str) -> tuple[Classifier, dict[str, Any]]:
    """A run directory, an export folder or a checkpoint file, as a Classifier and its config."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        model, config = export.load(path)
    else:
        ckpt_path = os.path.join(path, "latest.pt") if os.path.isdir(path) else path
        if not os.path.isfile(ckpt_path):
            raise UserError(f"{path}: no model.safetensors, config.json or latest.pt there")
        model, config = from_checkpoint(ckpt_path)
    return Classifier(model, config["mean"], config["std"]).eval(), config


def from_checkpoint(path: str) -> tuple[nn.Module, dict[str, Any]]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values only
        cfg = ckpt["config"]
        data, name, weights = cfg["data"], cfg["model"]["name"], ckpt["model"]
        if ckpt.get("ema") is not None:  # trainer.ema: the average is what a run ships (export.py)
            weights = ckpt["ema"]["model"]
    except Exception as exc:  # noqa: BLE001 (not a checkpoint of ours, whatever the reason)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise UserError(f"{path}: not a checkpoint of this trainer ({type(exc).__name__}: {first[:200]})") from None
    classes = ckpt.get("classes") or data.get("classes") or [str(i) for i in range(data["num_classes"])]
    conv = weights.get("conv1.weight")
    stem = Stem.small if conv is not None and tuple(conv.shape[2:]) == (3, 3) else Stem.imagenet
    # data.image_size: pixels, or a schedule of [from, size] pairs (the model is built for the largest)
    trained = data["image_size"] if isinstance(data["image_size"], int) else max(s for _, s in data["image_size"])
    model = make_model(name, data["num_classes"], trained, stem)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise UserError(f"{path}: its weights do not fit {name}: {str(exc).splitlines()[-1].strip()}") from None
    size = data.get("eval_size") or trained
    resize = data.get("eval_resize") or round(size / export.EVAL_RATIO)
    config = {"classes": classes, "image_size": size, "resize": resize, "mean": data["mean"], "std": data["std"]}
    return model.eval(), config | {"num_classes": len(classes), "architecture": name}


def image_files(inputs: list[str]) -> Iterator[str]:
    """The image files the inputs name, folders walked in sorted order."""
    for item in inputs:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs.sort()
                yield from (os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMAGE_SUFFIXES))
        else:
            yield item


def is_shards(item: str) -> bool:
    return not os.path.isdir(item) and any(mark in item for mark in SHARD_MARKS)


def batches(inputs: list[str], cfg: LoaderConfig, skipped: list[str]) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, uint8 images) batches: files decoded here, shards read by the evaluation loader."""
    names, images = [], []
    for item in inputs:
        if is_shards(item):
            for batch in EvalLoader(item, cfg, rank=0, world=1):
                yield [f"{item}#{key}" for key in batch["key"]], batch["image"]
            continue
        for path in image_files([item]):
            try:
                with open(path, "rb") as f:
                    images.append(decode_eval(f.read(), cfg, path))
                names.append(path)
            except (OSError, DataError) as exc:
                skipped.append(path)
                print(f"predict: {exc if isinstance(exc, DataError) else f'{path}: {exc}'}; skipped", file=sys.stderr)
            if len(images) == cfg.batch_size:
                yield names, torch.stack(images)
                names, images = [], []
    if images:
        yield names, torch.stack(images)


def top_k(logits: torch.Tensor, classes: list[str], k: int) -> list[list[tuple[str, int, float]]]:
    probs = logits.float().softmax(1)
    p, i = probs.topk(min(k, probs.shape[1]), dim=1)
    return [
        [(classes[c], c, v) for v, c in zip(pr.tolist(), ir.tolist(), strict=True)] for pr, ir in zip(p, i, strict=True)
    ]


def write(rows: list[tuple[str, list]], fmt: str, out: Any) -> None:
    if fmt == "jsonl":
        for name, top in rows:
            hits = [{"class": c, "label": i, "p": round(p, 6)} for c, i, p in top]
            out.write(json.dumps({"image": name, "top": hits}, ensure_ascii=False) + "\n")
    elif fmt == "csv":
        writer = csv.writer(out)
        k = len(rows[0][1]) if rows else 0
        writer.writerow(["image", *[f"{w}{j + 1}" for j in range(k) for w in ("class", "p")]])
        for name, top in rows:
            writer.writerow([name, *[x for c, _, p in top for x in (c, f"{p:.6f}")]])
    else:
        width = max((len(name) for name, _ in rows), default=5)
        for name, top in rows:
            out.write(f"{name:<{width}}  " + "  ".join(f"{c} {100 * p:5.1f}%" for c, _, p in top) + "\n")


def export_onnx(model: Classifier, config: dict, out: str) -> float | None:
    """The model (normalisation inside: 0-255 float images in) as ONNX at ``out``; the largest
    difference from torch's logits through onnxruntime on random images, where it is installed."""
    size = config["image_size"]
    sample = torch.rand(2, 3, size, size) * 255
    try:
        torch.onnx.export(
            model, (sample,), out, input_names=["image"], output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False,
        )  # fmt: skip
    except ImportError as exc:
        raise UserError(f"--export onnx: {exc} (pip install 'wds-distributed[onnx]')") from None
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"image": sample.numpy()})[0]
    with torch.no_grad():
        want = model(sample)
    return float((torch.from_numpy(got) - want).abs().max())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CliParser(prog="predict.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a run directory, a folder with model.safetensors + config.json, or a checkpoint")
    p.add_argument("inputs", nargs="*", help="image files, folders, or shard specs (index JSON, tar patterns)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--format", choices=["table", "csv", "jsonl"], default="table")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto (a GPU where there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--export", choices=["onnx"], help="write the model as ONNX instead of predicting")
    p.add_argument("--out", help="the ONNX file (default MODEL/model.onnx); or the predictions' file (default stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, config = load_model(args.model)
    if args.export:
        folder = args.model if os.path.isdir(args.model) else os.path.dirname(args.model)
        out = args.out or os.path.join(folder, "model.onnx")
        diff = export_onnx(model, config, out)
        checked = f"; onnxruntime's logits within {diff:.2e} of torch's" if diff is not None else ""
        print(f"wrote {out}{checked}", file=sys.stderr)
        return 0
    if not args.inputs:
        raise UserError("predict.py: give image files, folders or shard specs to classify")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model = model.to(device)
    size, resize = config["image_size"], config.get("resize")  # evaluation's crop and resize (config.json)
    cfg = LoaderConfig(
        batch_size=args.batch_size, image_size=size, eval_resize=resize, train=False, workers=0, with_keys=True
    )
    from tqdm import tqdm

    rows, skipped = [], []
    with torch.no_grad(), tqdm(unit="image", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for names, images in batches(args.inputs, cfg, skipped):
            logits = model(images.to(device).float())
            rows += zip(names, top_k(logits.cpu(), config["classes"], args.top_k), strict=True)
            bar.update(len(names))
    out = open(args.out, "w", newline="", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    try:
        write(rows, args.format, out)
    finally:
        if args.out:
            out.close()
    print(f"predict: {len(rows)} images classified" + (f", {len(skipped)} skipped" if skipped else ""), file=sys.stderr)
    return 0 if rows or not skipped else 1


def run() -> None:
    """The console script (wds-predict): one-line errors (wdsdist.errors.run_cli)."""
    run_cli(main)
