"""Batch mixing on the device (trainer.mixup, trainer.cutmix): torchvision's v2.MixUp and
v2.CutMix, and with both, one of the two per batch (v2.RandomChoice, as torchvision's
classification reference does).

Their draws (which of the two, mixup's weight, cutmix's box) come from torch's CPU generator
seeded by (seed, rank, step, micro-batch), and the caller's generator state is put back after,
so a resumed run mixes each batch as the uninterrupted one did. The targets are soft: each row's
label weights are the shares of its pixels (cutmix: the box's area), and cross-entropy takes
them with label smoothing (F.cross_entropy smooths probability targets too).
"""

from __future__ import annotations

import hashlib

import torch
from torchvision.transforms import v2


def mix_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """The seed of one micro-batch's mix draws: a hash of what names it, never the generator's history."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}:{micro}:mix".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BatchMix:
    """``mix(images, labels, step, micro)`` -> (mixed float images, soft targets N x num_classes)."""

    def __init__(self, mixup: float, cutmix: float, num_classes: int, seed: int, rank: int):
        ops: list[v2.Transform] = []
        if mixup > 0:
            ops.append(v2.MixUp(alpha=mixup, num_classes=num_classes))
        if cutmix > 0:
            ops.append(v2.CutMix(alpha=cutmix, num_classes=num_classes))
        if not ops:
            raise ValueError("BatchMix needs mixup > 0 or cutmix > 0")
        self.op = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)
        self.seed, self.rank = seed, rank
        self.what = " or ".join(f"{name} (alpha {a:g})" for name, a in (("mixup", mixup), ("cutmix", cutmix)) if a)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, step: int, micro: int = 0):
        with torch.random.fork_rng(devices=[]):  # the draws are on the CPU's generator, the pixels anywhere
            torch.default_generator.manual_seed(mix_seed(self.seed, self.rank, step, micro))
            return self.op(images, labels)
