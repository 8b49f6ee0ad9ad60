"""The model a run trains: built from the config, the same start on every rank, wrapped for DDP;
its optimizer and the learning rate of each step."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig

from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import Dist
from wdsdist.errors import UserError
from wdsdist.model import weights
from wdsdist.model.build import TIMM, Stem, make_model, timm_model
from wdsdist.train import recipe
from wdsdist.train.config import OptimName


def build_model(cfg: DictConfig) -> nn.Module:
    """The config's model (model.name) with data.num_classes outputs, its stem sized to the images."""
    return make_model(cfg.model.name, cfg.data.num_classes, recipe.largest(cfg), Stem(cfg.model.stem))


def pretrained(cfg: DictConfig, given: set[str]) -> weights.Pretrained | None:
    """model.weights, found; its mean, std and image size set in ``cfg`` where the command line
    (``given``) did not set them."""
    if not cfg.model.weights:
        return None
    found = weights.find(str(cfg.model.weights), cfg.model.name)
    if found.pinned is not None:  # a Hub model: the run (its config, its checkpoints) names the commit
        cfg.model.weights = found.pinned
        found.notes.append(f"read at {found.pinned}")
    for key, value in (("mean", found.mean), ("std", found.std), ("image_size", found.image_size)):
        if value is not None and f"data.{key}" not in given and cfg.data[key] != value:
            cfg.data[key] = value
            found.notes.append(f"data.{key}={value}: model.weights'")
    return found


def seeded_model(cfg: DictConfig, dist: Dist, start: weights.Pretrained | None = None) -> tuple[nn.Module, list[str]]:
    """The model on this rank's device, the same initial weights on every rank (DDP also
    broadcasts rank 0's), loaded from ``start`` if given; then per-rank seeds, so augmentations
    and loader workers differ. Also the lines to say about the weights."""
    torch.manual_seed(cfg.seed)
    said: list[str] = []

    def built() -> nn.Module:
        if start is not None and start.path is None and start.torchvision is None:  # timm's own
            return timm_model(cfg.model.name.removeprefix(TIMM), cfg.data.num_classes, pretrained=True)
        model = build_model(cfg)
        if start is not None:
            said.extend(weights.load_into(model, weights.state_dict(start), start.spec))
        return model

    model = distributed.on_all_ranks(built)
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
    if start is not None:
        said.insert(
            0,
            f"model.weights={start.spec}: a pretrained start" + (f" ({'; '.join(start.notes)})" if start.notes else ""),
        )
    return model, said


# The normalisation layers whose weights optim.norm_weight_decay covers (torchvision's reference's list)
NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def param_groups(cfg: DictConfig, model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one per (weight decay, frozen) pair, in the model's order.
    A bias takes optim.bias_weight_decay, a normalisation layer's weight optim.norm_weight_decay
    (each where given; else optim.weight_decay, as torchvision's reference sets them); with
    model.freeze_steps, all but the head are in groups that ``frozen_until`` keeps at learning rate
    0 until then (train_step). A frozen group, not requires_grad: DDP fixes which parameters it
    reduces when it wraps the model. With the defaults this is one group of model.parameters()."""
    optim = cfg.optim
    head = weights.head_name(model) + "." if cfg.model.freeze_steps > 0 else None
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a shared weight: in its first module's group
                continue
            seen.add(id(p))
            decay = optim.weight_decay
            if name == "bias" and optim.bias_weight_decay is not None:
                decay = optim.bias_weight_decay
            elif isinstance(module, NORMS) and optim.norm_weight_decay is not None:
                decay = optim.norm_weight_decay
            full = f"{module_name}.{name}" if module_name else name
            groups.setdefault((decay, head is not None and not full.startswith(head)), []).append(p)
    frozen = {"frozen_until": cfg.model.freeze_steps}
    return [
        {"params": params, "weight_decay": decay, **(frozen if is_frozen else {})}
        for (decay, is_frozen), params in groups.items()
    ]


def build_optimizer(cfg: DictConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer over ``param_groups``."""
    optim, params = cfg.optim, param_groups(cfg, model)
    if optim.name == OptimName.sgd:
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=optim.momentum,
            nesterov=optim.nesterov and optim.momentum > 0,
            weight_decay=optim.weight_decay,
        )
    return torch.optim.AdamW(params, lr=lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)


def synced_batchnorm(model: nn.Module, cfg: DictConfig, dist: Dist) -> nn.Module:
    """trainer.sync_bn: BatchNorm over every rank's batch (SyncBatchNorm, before DDP wraps it).
    torch's SyncBatchNorm syncs GPU tensors only: on the CPU with several ranks, refused in one
    line; one rank has nothing to sync."""
    if not cfg.trainer.sync_bn or dist.world == 1:
        return model
    if dist.device.type != "cuda":
        raise UserError("trainer.sync_bn=true: torch's SyncBatchNorm syncs GPU tensors only; this run is on the CPU")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def compiled(module: nn.Module) -> nn.Module:
    """torch.compile's module (trainer.compile); its first call compiles. WDSDIST_TEST_COMPILE_BACKEND
    (a test hook) names another backend than inductor, to trace without generating code."""
    return torch.compile(module, backend=os.environ.get("WDSDIST_TEST_COMPILE_BACKEND") or "inductor")


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
