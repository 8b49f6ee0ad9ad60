"""A training sample's random draws: RandomResizedCrop's crop, then RandomHorizontalFlip's flip.

The draws must be the v2 transforms' own, number for number and in the same order on torch's
generator, so that one seed gives the same batches whether a JPEG is region-decoded, decoded
whole by torchvision (the transform draws for itself) or decoded on the GPU. ``make_params``
makes its few draws through new one-element tensors (``torch.empty(1).uniform_``,
``torch.exp``, ``torch.randint``, a 0-d tensor indexed per try), which costs several times the
arithmetic; ``CropDraw`` makes the same calls on two scratch tensors it keeps. It checks itself
against ``make_params`` once when made, on a forked generator, and uses ``make_params`` itself
wherever the two differ (another torchvision, a subclass that draws otherwise).
"""

from __future__ import annotations

import math

import torch
from torchvision.transforms import v2

_CHECKS = ((500, 375), (375, 500), (64, 64), (4000, 30), (30, 4000), (1, 1), (224, 224), (1024, 683))


class CropDraw:
    """``(width, height) -> (crop params, flip)``: the crop's ``make_params`` for an image of that
    size, then the flip's ``torch.rand(1) < p``; not thread-safe (nor is a shared generator's order)."""

    def __init__(self, crop: v2.RandomResizedCrop, flip: v2.RandomHorizontalFlip):
        self.crop, self.flip = crop, flip
        self._f = torch.empty(1)
        self._i = torch.empty(1, dtype=torch.int64)
        self._fast = False
        if type(crop).make_params is v2.RandomResizedCrop.make_params and hasattr(crop, "_log_ratio"):
            self._scale = (float(crop.scale[0]), float(crop.scale[1]))
            self._log_ratio = (float(crop._log_ratio[0]), float(crop._log_ratio[1]))
            self._ratio = (min(crop.ratio), max(crop.ratio))
            # ``torch.rand(1) < p`` compares in float32: p rounded to float32 first
            self._p = torch.tensor(float(flip.p), dtype=torch.float32).item()
            self._fast = self._agrees()

    @property
    def fast(self) -> bool:
        """Whether it draws on its scratch tensors (else through make_params itself)."""
        return self._fast

    def __call__(self, width: int, height: int) -> tuple[dict, bool]:
        if not self._fast:
            return self._slow(width, height)
        return self._crop(width, height), self._f.uniform_(0.0, 1.0).item() < self._p

    def _slow(self, width: int, height: int) -> tuple[dict, bool]:
        # Only the size matters to make_params: a zero-stride tensor of that shape costs nothing.
        p = self.crop.make_params([torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, height, width)])
        return p, bool(torch.rand(1) < self.flip.p)

    def _crop(self, width: int, height: int) -> dict:
        """RandomResizedCrop.make_params, call for call on the generator."""
        f, i = self._f, self._i
        area = height * width
        (s0, s1), (r0, r1) = self._scale, self._log_ratio
        for _ in range(10):
            target_area = area * f.uniform_(s0, s1).item()
            aspect_ratio = f.uniform_(r0, r1).exp_().item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = i.random_(0, height - h + 1).item()
                left = i.random_(0, width - w + 1).item()
                return {"top": top, "left": left, "height": h, "width": w}
        # Fallback to a central crop, as make_params does
        in_ratio = float(width) / float(height)
        if in_ratio < self._ratio[0]:
            w, h = width, int(round(width / self._ratio[0]))
        elif in_ratio > self._ratio[1]:
            h, w = height, int(round(height * self._ratio[1]))
        else:
            w, h = width, height
        return {"top": (height - h) // 2, "left": (width - w) // 2, "height": h, "width": w}

    def _agrees(self) -> bool:
        """Whether the scratch-tensor draws equal make_params's here (values and the generator's
        state after them), tried on a forked generator so the caller's stream is untouched."""
        self._fast = True
        # The CPU generator's own seed: torch.manual_seed would also queue a seed for each
        # accelerator, past fork_rng's restore, taking a stack trace per call where none is there.
        cpu = torch.default_generator
        with torch.random.fork_rng(devices=[]):
            for seed, (width, height) in enumerate(_CHECKS):
                cpu.manual_seed(seed)
                fast = self(width, height), torch.rand(1).item()
                cpu.manual_seed(seed)
                slow = self._slow(width, height), torch.rand(1).item()
                if fast != slow:
                    return False
        return True


def whole_image(width: int, height: int) -> tuple[dict, bool]:
    """decode=gpu's evaluation "draw": the whole image, never flipped. Its resize and centre crop
    follow from the size (resize.eval_geometry), so nothing random is drawn."""
    return {"top": 0, "left": 0, "height": height, "width": width}, False
