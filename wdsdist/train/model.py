"""The model, its optimizer and the learning rate of each step."""

from __future__ import annotations

import difflib
import math
import random
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torchvision
from omegaconf import DictConfig

from wdsdist.errors import UserError
from wdsdist.train import distributed
from wdsdist.train.config import OptimName, Stem
from wdsdist.train.distributed import Dist


def _has_resnet_stem(model: nn.Module) -> bool:
    return isinstance(getattr(model, "conv1", None), nn.Conv2d) and isinstance(
        getattr(model, "maxpool", None), nn.Module
    )


def build_model(cfg: DictConfig) -> nn.Module:
    """A torchvision classification model with data.num_classes outputs, its stem sized to the images."""
    name, size = cfg.model.name, cfg.data.image_size
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        close = ", ".join(difflib.get_close_matches(name, names, n=3))
        hint = f"; did you mean {close}?" if close else "; see torchvision.models.list_models()"
        raise UserError(f"model.name={name}: not a torchvision classification model{hint}")
    kwargs: dict[str, Any] = {"num_classes": cfg.data.num_classes}
    if name.startswith("vit_"):
        kwargs["image_size"] = size
    try:
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.name={name}: cannot build it for this data: {exc}") from None
    stem = cfg.model.stem
    small = stem == Stem.small or (stem == Stem.auto and size < 112 and _has_resnet_stem(model))
    if small:
        if not _has_resnet_stem(model):
            raise UserError(f"model.stem=small: {name} has no ResNet stem (conv1 + maxpool) to replace")
        # ImageNet's stem (7x7 stride-2 convolution, then max-pool) shrinks images 4x before the
        # first block, 32 pixels to 8; a 3x3 stride-1 convolution with the max-pool shrinks them 2x.
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def seeded_model(cfg: DictConfig, dist: Dist) -> nn.Module:
    """The model on this rank's device, the same initial weights on every rank (DDP also
    broadcasts rank 0's); then per-rank seeds, so augmentations and loader workers differ."""
    torch.manual_seed(cfg.seed)
    model = distributed.on_all_ranks(lambda: build_model(cfg))
    cuda = dist.device.type == "cuda"
    model = model.to(dist.device)
    if cuda and cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    torch.manual_seed(cfg.seed + dist.rank)
    random.seed(cfg.seed + dist.rank)
    np.random.seed(cfg.seed + dist.rank)
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return model


def build_optimizer(cfg: DictConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    optim = cfg.optim
    if optim.name == OptimName.sgd:
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=optim.momentum,
            nesterov=optim.nesterov and optim.momentum > 0,
            weight_decay=optim.weight_decay,
        )
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)


def lr_at(step: int, base_lr: float, steps: int, warmup_frac: float) -> float:
    """The learning rate of a step: linear warmup over the first warmup_frac of the steps, then
    cosine down to zero. A pure function of the step (nanoGPT's ``get_lr``), so a resumed run
    needs no scheduler state; the same values, in the same floating-point order, as the LambdaLR
    it replaced (base_lr times the factor)."""
    warmup = int(steps * warmup_frac)
    if step < warmup:
        factor = (step + 1) / (warmup + 1)
    else:
        progress = (step - warmup) / max(1, steps - warmup)
        factor = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return base_lr * factor


def wrap_ddp(model: nn.Module, dist: Dist) -> nn.Module:
    """DDP around the model on more than one rank; the model itself on one."""
    if dist.world == 1:
        return model
    # Gradients as views into DDP's buckets: no second copy of them, one copy less per step.
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
        process_group=distributed.group_for(dist.device),
        gradient_as_bucket_view=True,
    )
