"""Pretrained starts (``model.weights``): where the weights come from, what preprocessing they
bring, and how they go into a model whose class count may differ.

- ``DEFAULT`` or a torchvision weights name (``IMAGENET1K_V1``, ``ResNet50_Weights.IMAGENET1K_V2``):
  torchvision's file, from torch's cache (fetched there if it can be; offline, one line names the
  file and where to get it). For a timm model, timm's own pretrained weights.
- a local ``.safetensors`` or ``.pt`` state dict; a run's checkpoint or a run directory's exported
  ``model.safetensors``, whose ``config.json`` beside it brings its mean, std and image size.
- ``hf://ORG/NAME[@REVISION]``: a model repo on the Hub (model.safetensors + config.json), read at
  one commit, which the run records in place of the revision.

The classifier head is replaced, and one line says so, where the class count differs; any other
key that does not fit stops the run in one line naming it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torchvision

from wdsdist.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Pretrained:
    """Where the weights are, and the preprocessing they were trained with (None: not known)."""

    spec: str
    path: str | None = None  # a local file; None: torchvision's, or timm's own
    torchvision: Any = None  # a torchvision weights enum member
    mean: list[float] | None = None
    std: list[float] | None = None
    image_size: int | None = None
    pinned: str | None = None  # a Hub model: the spec at the commit read
    notes: list[str] = field(default_factory=list)


HUB = re.compile(r"hf://([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([^/@]+))?")


def find(spec: str, model_name: str) -> Pretrained:
    """What ``model.weights=spec`` names, checked without reading the weights (a Hub model's files
    are fetched into the Hub's cache here, at the commit its revision names now)."""
    if spec.startswith("hf://"):
        return _hub(spec)
    if os.path.exists(spec):
        return _local(spec)
    if spec.endswith((".safetensors", ".pt", ".pth")) or os.sep in spec:
        raise UserError(f"model.weights={spec}: no such file")
    if model_name.startswith("timm/"):
        if spec != "DEFAULT":
            raise UserError(f"model.weights={spec}: a timm model takes DEFAULT (timm's pretrained weights) or a file")
        return Pretrained(spec)
    try:
        weights = torchvision.models.get_weight(spec) if "." in spec else _named(model_name, spec)
    except (ValueError, KeyError, AttributeError) as exc:
        raise UserError(f"model.weights={spec}: not torchvision weights of {model_name} ({exc})") from None
    pre = weights.transforms()
    size = getattr(pre, "crop_size", [None])[0]
    return Pretrained(spec, torchvision=weights, mean=list(pre.mean), std=list(pre.std), image_size=size)


def _hub(spec: str) -> Pretrained:
    """A model repo on the Hub with model.safetensors and config.json (this trainer's export, or
    timm's), through huggingface_hub: its token and HF_ENDPOINT, as for data sets. ``pinned`` is
    the spec at the commit read, which the run records."""
    match = HUB.fullmatch(spec)
    if not match:
        raise UserError(f"model.weights={spec}: a Hub model is hf://ORG/NAME[@REVISION]")
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError:
        raise UserError(
            f"model.weights={spec}: huggingface_hub is not installed (pip install 'wds-distributed[hf]')"
        ) from None
    repo, rev = match.group(1), match.group(2) or "main"
    try:
        commit = HfApi().model_info(repo, revision=rev).sha
        path = hf_hub_download(repo, "model.safetensors", revision=commit)
        hf_hub_download(repo, "config.json", revision=commit)
    except Exception as exc:  # noqa: BLE001 (no such repo or file, a gated repo, offline: one line each)
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"model.weights={spec}: {type(exc).__name__}: {said}") from None
    found = _local(path)
    found.spec, found.pinned = spec, f"hf://{repo}@{commit}"
    return found


def _named(model_name: str, name: str) -> Any:
    enum = torchvision.models.get_model_weights(model_name)
    return enum.DEFAULT if name == "DEFAULT" else enum[name]


def _local(spec: str) -> Pretrained:
    folder = spec if os.path.isdir(spec) else os.path.dirname(spec) or "."
    path = os.path.join(spec, "model.safetensors") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise UserError(f"model.weights={spec}: no model.safetensors in that folder")
    found = Pretrained(spec, path=path)
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):  # a run's export, or timm's pretrained_cfg: its preprocessing
        with open(config, encoding="utf-8") as f:
            meta = json.load(f)
        timm = meta.get("pretrained_cfg") or {}
        size = meta.get("image_size") or (timm.get("input_size") or [None, None])[1]
        found.mean, found.std, found.image_size = (
            meta.get("mean") or timm.get("mean"),
            meta.get("std") or timm.get("std"),
            size,
        )
    return found


def state_dict(found: Pretrained) -> dict[str, torch.Tensor]:
    """The weights themselves; UserError in one line where they cannot be had."""
    if found.torchvision is not None:
        return _torchvision_file(found)
    assert found.path is not None
    try:
        if found.path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(found.path)
        loaded = torch.load(found.path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (an unreadable file, whatever the reader raises)
        raise UserError(f"model.weights={found.spec}: cannot read it: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):  # a checkpoint of ours
        loaded = loaded["model"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise UserError(f"model.weights={found.spec}: not a state dict (name -> tensor)")
    return loaded


def _torchvision_file(found: Pretrained) -> dict[str, torch.Tensor]:
    url = found.torchvision.url
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    try:
        return torch.hub.load_state_dict_from_url(url, map_location="cpu", progress=False, check_hash=True)
    except Exception as exc:  # noqa: BLE001 (offline, a proxy, a truncated file: the same way out)
        raise UserError(
            f"model.weights={found.spec}: {os.path.basename(url)} is not in torch's cache ({cached}) and cannot be "
            f"fetched ({type(exc).__name__}); put {url} there, or give model.weights=FILE"
        ) from None


def head_name(model: nn.Module) -> str:
    """The classifier head's module name: timm's own, else the model's last Linear layer."""
    getter = getattr(model, "get_classifier", None)
    if callable(getter):
        head = getter()
        for name, module in model.named_modules():
            if module is head:
                return name
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise UserError("model.weights: the model has no Linear head to fit to data.num_classes")
    return linears[-1]


def load_into(model: nn.Module, weights: dict[str, torch.Tensor], spec: str) -> list[str]:
    """The weights in ``model``, its head kept new where the class count differs; the lines to say."""
    mine = model.state_dict()
    head = head_name(model) + "."
    said = []
    unfit = [k for k, v in weights.items() if k in mine and mine[k].shape != v.shape]
    if unfit and all(k.startswith(head) for k in unfit):
        before = weights[head + "weight"].shape[0] if head + "weight" in weights else "?"
        weights = {k: v for k, v in weights.items() if not k.startswith(head)}
        outputs = mine[head + "weight"].shape[0]
        said.append(
            f"model.weights={spec}: its head ({head[:-1]}, {before} outputs) replaced by a new one of {outputs}"
        )
    elif unfit:
        k = unfit[0]
        raise UserError(
            f"model.weights={spec}: {k} is {list(weights[k].shape)} there and {list(mine[k].shape)} in the model "
            "(another model.name, or model.stem?)"
        )
    missing = [k for k in mine if k not in weights and not k.startswith(head)]
    extra = [k for k in weights if k not in mine]
    if missing or extra:
        what = f"{len(missing)} of the model's keys missing (first {missing[0]})" if missing else ""
        what += ("; " if what else "") + (f"{len(extra)} unknown keys (first {extra[0]})" if extra else "")
        raise UserError(f"model.weights={spec}: not weights of this model: {what}")
    model.load_state_dict(weights, strict=False)
    return said
