"""A training image's augmentations after its crop and flip: TrivialAugment, RandAugment or
AutoAugment (``augment``), then random erasing (``random_erase``), on the uint8 crop in the worker.

The policies are torchvision's v2 transforms. What is ours is the order of work: ``draw`` makes
the random choices (which ops, their magnitudes and signs, the erased box) by calling the v2
transform's own ``forward`` and ``make_params`` on an image of the crop's size that is never read,
and records them; ``apply`` then makes the pixels, each op where it costs least (augment_ops.py),
with the pixels torchvision's functional op makes on a PIL image, as the reference and timm apply
the policies; RandomErasing's box by ``F.erase``. So the draws are made in the stream's order,
from the sample's own generator (seeded by the sample: plan/seeds.sample_draws), like its crop's,
and the pixels may be made later, on any thread (the warm start's); a resumed or resized run draws
the same for each sample. For the same draws the output equals the v2 transform's on the image as
a PIL image (tests/data/decode/test_augment.py, each op in tests/data/decode/test_augment_ops.py).

Random erasing fills with the data's mean colour: torchvision's reference and timm erase to 0
after normalising, which is the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F

from wdsdist.data.decode import augment_ops

# Ops interpolate bilinearly, as torchvision's classification reference sets them (the v2
# classes' own default is nearest).
INTERPOLATION = InterpolationMode.BILINEAR
MAGNITUDE_BINS = 31  # RandAugment's and TrivialAugment's magnitude steps (torchvision's default)


class _Records:
    """A v2 policy that records each op it would apply, (name, magnitude), instead of applying it."""

    ops: list[tuple[str, float]]

    def _apply_image_or_video_transform(self, image: Any, transform_id: str, magnitude: float, **_: Any) -> Any:
        self.ops.append((transform_id, magnitude))
        return image


class _TrivialDraws(_Records, v2.TrivialAugmentWide):
    pass


class _RandDraws(_Records, v2.RandAugment):
    pass


class _AutoDraws(_Records, v2.AutoAugment):
    pass


class _EraseDraws(v2.RandomErasing):
    """RandomErasing that records the box it would erase (None: not this time) instead of erasing."""

    box: tuple[int, int, int, int] | None = None

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if params["v"] is not None:
            self.box = (params["i"], params["j"], params["h"], params["w"])
        return inpt


def _policies(name: str, n: int, m: int) -> tuple[v2.Transform, v2.Transform] | tuple[None, None]:
    """(the v2 policy that applies, its recording twin) for data.augment=NAME."""
    if name == "trivialaugment":
        kw: dict[str, Any] = {"num_magnitude_bins": MAGNITUDE_BINS, "interpolation": INTERPOLATION}
        return v2.TrivialAugmentWide(**kw), _TrivialDraws(**kw)
    if name == "randaugment":
        kw = {"num_ops": n, "magnitude": m, "num_magnitude_bins": MAGNITUDE_BINS, "interpolation": INTERPOLATION}
        return v2.RandAugment(**kw), _RandDraws(**kw)
    if name == "autoaugment":
        kw = {"policy": v2.AutoAugmentPolicy.IMAGENET, "interpolation": INTERPOLATION}
        return v2.AutoAugment(**kw), _AutoDraws(**kw)
    return None, None


@dataclass(frozen=True)
class Drawn:
    """One sample's augmentation draws: its ops, in order, and the box to erase (or None)."""

    ops: tuple[tuple[str, float], ...]
    erase: tuple[int, int, int, int] | None


class SampleAugment:
    """data.augment and data.random_erase for training images of ``size`` x ``size`` pixels."""

    def __init__(self, name: str, n: int, m: int, erase: float, mean: tuple[float, ...], size: int):
        self.name, self.size = name, size
        self.policy, self._draws = _policies(name, n, m)
        self._eraser = _EraseDraws(p=erase, value=0.0) if erase > 0 else None
        self.fill = torch.tensor([round(255 * c) for c in mean], dtype=torch.float32)[:, None, None]
        # What the transforms' forward reads of an image is its size: a zero-stride tensor of it
        self._shape = torch.empty((1, 1, 1), dtype=torch.uint8).expand(3, size, size)

    @staticmethod
    def wanted(name: str, erase: float) -> bool:
        return name != "none" or erase > 0

    def draw(self) -> Drawn:
        """The random choices for one image, from torch's generator, as the v2 transforms make
        them (the policy's, then the eraser's); no pixel is read or made."""
        ops: list[tuple[str, float]] = []
        if self._draws is not None:
            self._draws.ops = ops
            self._draws(self._shape)
        box = None
        if self._eraser is not None:
            self._eraser.box = None
            self._eraser(self._shape)
            box = self._eraser.box
        return Drawn(tuple(ops), box)

    def apply(self, image: torch.Tensor, drawn: Drawn) -> torch.Tensor:
        """The drawn ops on a uint8 3 x size x size image, each where it costs least with PIL's
        pixels (augment_ops.py); it draws nothing, so threads may run it at once."""
        if drawn.ops:
            crop, lib = augment_ops.Crop(image), augment_ops.library()
            for op, magnitude in drawn.ops:
                augment_ops.apply_op(self.policy, crop, op, magnitude, lib)
            image = crop.tensor()
        if drawn.erase is not None:
            i, j, h, w = drawn.erase
            image = F.erase(image, i, j, h, w, self.fill.to(image.dtype))
        return image
