"""The policies' op spaces and a test crop, for the tests of each op (on the CPU and on the device)."""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from wdsdist.data.decode.augment import INTERPOLATION, MAGNITUDE_BINS

POLICIES = {
    "trivialaugment": lambda: v2.TrivialAugmentWide(num_magnitude_bins=MAGNITUDE_BINS, interpolation=INTERPOLATION),
    "randaugment": lambda: v2.RandAugment(num_ops=2, magnitude=9, interpolation=INTERPOLATION),
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=INTERPOLATION),
}


def crop(width: int, height: int, seed: int = 0, hwc: bool = True) -> torch.Tensor:
    """A uint8 CHW crop with gradients, an edge and grain in it; laid out HWC in memory as a
    region decode's crop is (``hwc``), or CHW as a whole decode's."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.linspace(0, 1, width), torch.linspace(0, 1, height)
    img = torch.stack([x[None, :].expand(height, width), y[:, None].expand(height, width), x[None, :] * y[:, None]])
    img = (img * 200).to(torch.int32) + torch.randint(0, 56, (3, height, width), generator=g)
    img[:, height // 4 : height // 2, width // 3 : width // 2] = 240
    img = img.clamp(0, 255).to(torch.uint8)
    return img.permute(1, 2, 0).contiguous().permute(2, 0, 1) if hwc else img.contiguous()


def magnitudes(policy: v2.Transform, op: str, width: int, height: int) -> list[float]:
    """Every magnitude the policy's space holds for ``op``, signed both ways where it draws a sign."""
    bins = 10 if isinstance(policy, v2.AutoAugment) else MAGNITUDE_BINS
    values, signed = policy._AUGMENTATION_SPACE[op]
    mags = values(bins, height, width)
    if mags is None:
        return [0.0]
    out = [float(m) for m in mags]
    return out + [-m for m in out if m] if signed else out
