"""Each op of the policies where it costs least (wdsdist/data/decode/augment_ops.py): its pixels
against torchvision's functional op on a PIL image, for every op of TrivialAugmentWide,
RandAugment and AutoAugment at every magnitude each can draw, both signs, square and oblong
crops, in both memory layouts a crop comes in. The tolerance is stated per op in TOLERANCE: none
(every op equals PIL's), whether the C kernels make it or PIL does where they are missing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from tests.helpers.augment import POLICIES, crop, magnitudes
from wdsdist.data.decode import augment_ops
from wdsdist.data.decode.augment import INTERPOLATION

# The largest difference from PIL's pixels allowed per op (in uint8 steps): every op is exact.
TOLERANCE = dict.fromkeys(augment_ops.HOW, 0)


def pil_of(image: torch.Tensor) -> Image.Image:
    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def tensor_of(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def theirs(policy, image: torch.Tensor, op: str, magnitude: float) -> torch.Tensor:
    pil = policy._apply_image_or_video_transform(
        pil_of(image), op, magnitude, interpolation=policy.interpolation, fill=policy._fill
    )
    return tensor_of(pil)


def ours(policy, image: torch.Tensor, op: str, magnitude: float, lib) -> torch.Tensor:
    c = augment_ops.Crop(image)
    augment_ops.apply_op(policy, c, op, magnitude, lib)
    return c.tensor()


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("width, height, hwc", [(40, 40, True), (37, 29, False)])
def test_every_op_at_every_magnitude_equals_torchvisions_on_a_pil_image(name, width, height, hwc):
    policy, lib = POLICIES[name](), augment_ops.library()
    assert lib is not None, "jpegcrop's library (with the augmentations' kernels) did not build"
    image = crop(width, height, hwc=hwc)
    reached = set()
    for op in policy._AUGMENTATION_SPACE:
        for magnitude in magnitudes(policy, op, width, height):
            got, want = ours(policy, image, op, magnitude, lib), theirs(policy, image, op, magnitude)
            assert got.shape == want.shape == image.shape
            worst = (got.int() - want.int()).abs().max().item()
            assert worst <= TOLERANCE[op], (op, magnitude, worst)
            reached.add(op)
        assert torch.equal(image, crop(width, height, hwc=hwc)), op  # the input is never written
    assert reached == set(policy._AUGMENTATION_SPACE)


def test_without_the_c_kernels_pil_makes_the_same_pixels():
    policy, image = POLICIES["trivialaugment"](), crop(40, 40, seed=1)
    for op in augment_ops.HOW:
        for magnitude in magnitudes(policy, op, 40, 40)[::5] if op in policy._AUGMENTATION_SPACE else [0.0]:
            assert torch.equal(ours(policy, image, op, magnitude, None), theirs(policy, image, op, magnitude))
    # a fill other than black: the geometric ops go to PIL, which fills with it
    filled, lib = v2.TrivialAugmentWide(interpolation=INTERPOLATION, fill=[10, 20, 30]), augment_ops.library()
    for op, magnitude in (("Rotate", 20.0), ("TranslateX", 8.0), ("ShearY", 0.3)):
        got, want = ours(filled, image, op, magnitude, lib), theirs(filled, image, op, magnitude)
        assert torch.equal(got, want) and (got == torch.tensor([10, 20, 30])[:, None, None]).all(0).any()


def test_a_chain_of_ops_moves_between_forms_and_equals_pils_chain():
    """RandAugment's two ops in turn, each in its own form (C, tensor, PIL): the same as PIL's chain."""
    policy, image, lib = POLICIES["randaugment"](), crop(40, 40, seed=2), augment_ops.library()
    chains = [("Rotate", 12.0, "Color", 0.3), ("Posterize", 5.0, "ShearY", -0.2), ("Sharpness", 0.5, "Invert", 0.0)]
    for first, m1, second, m2 in chains:
        c = augment_ops.Crop(image)
        augment_ops.apply_op(policy, c, first, m1, lib)
        augment_ops.apply_op(policy, c, second, m2, lib)
        want = theirs(policy, theirs(policy, image, first, m1), second, m2)
        assert torch.equal(c.tensor(), want), (first, second)


def band_image(values_per_band: list[list[int]], size: int = 24) -> torch.Tensor:
    """A crop whose bands take these values (repeated in order), so their histograms are known."""
    bands = [torch.tensor(values * (size * size // len(values) + 1))[: size * size] for values in values_per_band]
    return torch.stack(bands).view(3, size, size).to(torch.uint8)


@pytest.mark.parametrize(
    "bands",
    [
        [[7], [0, 255], [3] + [200] * 10],  # one value; the two ends; a step of 0 (the top value holds most)
        [[0] * 500 + [1], [250, 251, 252, 253, 254, 255], list(range(256))],  # a table past 255; every value
        [[128, 129], [5, 9, 9, 9, 17, 17, 250], [60] * 7 + [61]],
    ],
)
def test_autocontrast_and_equalize_tables_equal_imageops_on_every_kind_of_histogram(bands):
    """Their tables come from the crop's histogram in ImageOps' arithmetic, made here with numpy:
    the edge cases of its code (one value, a step of 0, values past 255 that ``point`` clips)."""
    policy, lib, image = POLICIES["trivialaugment"](), augment_ops.library(), band_image(bands)
    for op in ("AutoContrast", "Equalize"):
        assert torch.equal(ours(policy, image, op, 0.0, lib), theirs(policy, image, op, 0.0)), op
