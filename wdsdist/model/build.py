"""The architectures a run trains and leaves: torchvision's classification models by name, or
timm's (``timm/NAME``), with the stem sized to the images."""

from __future__ import annotations

import difflib
from enum import Enum
from typing import Any

import torch.nn as nn
import torchvision

from wdsdist.errors import UserError


class Stem(Enum):
    auto = "auto"  # small for images under 112 pixels (ResNet-style models), else imagenet
    imagenet = "imagenet"  # the model as torchvision builds it
    small = "small"  # 3x3 stride-1 first convolution: keeps the resolution of small images


def _has_resnet_stem(model: nn.Module) -> bool:
    return isinstance(getattr(model, "conv1", None), nn.Conv2d) and isinstance(
        getattr(model, "maxpool", None), nn.Module
    )


TIMM = "timm/"  # model.name=timm/NAME: a timm model (the [timm] extra)


def make_model(name: str, num_classes: int, size: int, stem: Stem = Stem.auto) -> nn.Module:
    """A torchvision classification model, or timm's (``timm/NAME``), with ``num_classes`` outputs;
    a ResNet's stem made small for images under 112 pixels (``stem``: auto) or as asked."""
    if name.startswith(TIMM):
        return timm_model(name.removeprefix(TIMM), num_classes)
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        close = ", ".join(difflib.get_close_matches(name, names, n=3))
        hint = f"; did you mean {close}?" if close else "; see torchvision.models.list_models(), or timm/NAME"
        raise UserError(f"model.name={name}: not a torchvision classification model{hint}")
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    if name.startswith("vit_"):
        kwargs["image_size"] = size
    try:
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.name={name}: cannot build it for this data: {exc}") from None
    small = stem == Stem.small or (stem == Stem.auto and size < 112 and _has_resnet_stem(model))
    if small:
        if not _has_resnet_stem(model):
            raise UserError(f"model.stem=small: {name} has no ResNet stem (conv1 + maxpool) to replace")
        # ImageNet's stem (7x7 stride-2 convolution, then max-pool) shrinks images 4x before the
        # first block, 32 pixels to 8; a 3x3 stride-1 convolution with the max-pool shrinks them 2x.
        model.conv1 = small_stem(model.conv1.out_channels)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def small_stem(channels: int) -> nn.Conv2d:
    """The small stem's first convolution (what an exported config.json's ``stem: small`` means)."""
    return nn.Conv2d(3, channels, kernel_size=3, stride=1, padding=1, bias=False)


def is_small_stem(model: nn.Module) -> bool:
    conv = getattr(model, "conv1", None)
    return isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and _has_resnet_stem(model)


def timm_model(name: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """timm's ``create_model``; UserError in one line without the [timm] extra or for an unknown name."""
    try:
        import timm
    except ImportError:
        extra = "pip install 'wds-distributed[timm]'"
        raise UserError(f"model.name=timm/{name}: timm is not installed ({extra})") from None
    if not timm.is_model(name):
        close = ", ".join(difflib.get_close_matches(name, timm.list_models(), n=3))
        raise UserError(f"model.name=timm/{name}: not a timm model" + (f"; did you mean {close}?" if close else ""))
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes)
    except Exception as exc:  # noqa: BLE001 (timm's fetch of pretrained weights: offline, no such file, ...)
        raise UserError(f"model.name=timm/{name}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
