"""The model predict.py runs: a run's (or a checkpoint's) network with its normalisation, its
top-k classes, its penultimate features, and a hash that names it in an output folder's manifest."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.nn as nn
import torchvision

from wdsdist.data import UserError
from wdsdist.model import saved, weights
from wdsdist.model.build import TIMM, Stem, make_model, timm_model


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
    """A run directory, an export folder or a checkpoint file, as a Classifier and its config; or
    a torchvision model's name (``resnet50``) or timm's (``timm/convnext_tiny``) that names no
    file, with its pretrained weights and their own classes and preprocessing."""
    if not os.path.exists(path) and (path.startswith(TIMM) or path in torchvision.models.list_models()):
        try:
            model, config = pretrained_model(path)
        except UserError as exc:
            raise UserError(f"{path}: its pretrained weights cannot be loaded: {exc}") from None
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        model, config = saved.load(path)
    else:
        ckpt_path = os.path.join(path, "latest.pt") if os.path.isdir(path) else path
        if not os.path.isfile(ckpt_path):
            raise UserError(f"{path}: no model.safetensors, config.json or latest.pt there")
        model, config = from_checkpoint(ckpt_path)
    return Classifier(model, config["mean"], config["std"]).eval(), config


def pretrained_model(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """torchvision's or timm's model ``name`` with its pretrained weights (torchvision's from
    torch's cache; offline without them, one line names the file)."""
    if name.startswith(TIMM):
        model = timm_model(name[len(TIMM) :], num_classes=1000, pretrained=True)
        pre = model.pretrained_cfg
        size = pre["input_size"][-1]
        classes = imagenet_names(getattr(model, "num_classes", 0))
        config = {"mean": list(pre["mean"]), "std": list(pre["std"]), "image_size": size}
        config |= {"resize": round(size / pre.get("crop_pct", saved.EVAL_RATIO)), "classes": classes}
    else:
        found = weights.find("DEFAULT", name)
        model = torchvision.models.get_model(name, weights=None)
        model.load_state_dict(weights.state_dict(found))
        pre = found.torchvision.transforms()
        config = {"mean": found.mean, "std": found.std, "image_size": found.image_size}
        config |= {"resize": pre.resize_size[0], "classes": found.torchvision.meta["categories"]}
    if not config["classes"]:
        out = last_linear(model).out_features
        config["classes"] = [str(i) for i in range(out)]
    return model.eval(), config | {"num_classes": len(config["classes"]), "architecture": name, "weights": "pretrained"}


def imagenet_names(n: int) -> list[str] | None:
    """ImageNet's class names (timm's own list) where the head has its 1000 classes."""
    try:
        from timm.data import ImageNetInfo

        names = ImageNetInfo().label_descriptions()
    except (ImportError, OSError):
        return None
    return list(names) if len(names) == n else None


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
    resize = data.get("eval_resize") or round(size / saved.EVAL_RATIO)
    config = {"classes": classes, "image_size": size, "resize": resize, "mean": data["mean"], "std": data["std"]}
    return model.eval(), config | {"num_classes": len(classes), "architecture": name}


def top_k(logits: torch.Tensor, classes: list[str], k: int) -> list[list[tuple[str, int, float]]]:
    probs = logits.float().softmax(1)
    p, i = probs.topk(min(k, probs.shape[1]), dim=1)
    return [
        [(classes[c], c, v) for v, c in zip(pr.tolist(), ir.tolist(), strict=True)] for pr, ir in zip(p, i, strict=True)
    ]


def model_hash(model: nn.Module, config: dict[str, Any]) -> str:
    """sha256 of the config and every weight (names, shapes, dtypes, bytes): what names a model in
    an output folder, so another model or other weights are told apart."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def last_linear(model: nn.Module) -> nn.Linear:
    """The classifier's last layer (torchvision's fc or classifier[-1], timm's head): its input is
    the penultimate features."""
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linear:
        raise UserError(f"--features: {type(model).__name__} has no Linear layer whose input to take")
    return linear[-1]


class Penultimate:
    """Catches the input of the model's last Linear on each forward (``features``)."""

    def __init__(self, model: nn.Module):
        self.features: torch.Tensor | None = None
        self.handle = last_linear(model).register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.features = inputs[0].flatten(1)
