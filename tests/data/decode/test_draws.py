"""A sample's random draws (wdsdist/data/decode/draws.py): CropDraw gives what the v2 transforms'
own make_params and flip give, number for number, and leaves torch's generator where they leave
it; where it cannot, it is make_params itself."""

from __future__ import annotations

import random

import pytest
import torch
from torchvision.transforms import v2

from wdsdist.data.decode.draws import CropDraw

SETTINGS = [
    dict(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)),
    dict(scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3)),
    dict(scale=(0.9, 0.9), ratio=(0.2, 5.0)),
    dict(scale=(0.5, 2.0), ratio=(1.0, 1.0)),
    dict(scale=(5.0, 6.0), ratio=(3 / 4, 4 / 3)),  # no try fits: make_params's central crop, always
]


def _transform_draws(crop: v2.RandomResizedCrop, flip: v2.RandomHorizontalFlip, width: int, height: int):
    """What the v2 transforms draw for an image of this size, as they draw it in a Compose."""
    params = crop.make_params([torch.empty(3, height, width)])
    return params, bool(torch.rand(1) < flip.p)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"scale{s['scale']}-ratio{s['ratio']}")
@pytest.mark.parametrize("p", [0.5, 0.3, 1.0, 0.0])
def test_draws_equal_the_transforms_own(setting, p):
    crop, flip = v2.RandomResizedCrop(224, antialias=True, **setting), v2.RandomHorizontalFlip(p)
    draw = CropDraw(crop, flip)
    assert draw.fast
    sizes = random.Random(7)
    for seed in range(400):
        width, height = sizes.randint(1, 3000), sizes.randint(1, 3000)
        torch.manual_seed(seed)
        ours = draw(width, height), draw(height, width), torch.rand(1).item()
        torch.manual_seed(seed)
        theirs = _transform_draws(crop, flip, width, height), _transform_draws(crop, flip, height, width)
        assert ours == (*theirs, torch.rand(1).item()), (seed, width, height)


def test_a_crop_that_draws_otherwise_is_asked_itself():
    class Centre(v2.RandomResizedCrop):
        def make_params(self, flat_inputs):
            return {"top": 1, "left": 2, "height": 3, "width": 4}

    draw = CropDraw(Centre(8), v2.RandomHorizontalFlip())
    assert not draw.fast
    torch.manual_seed(0)
    params, flipped = draw(100, 100)
    torch.manual_seed(0)
    assert (params, flipped) == ({"top": 1, "left": 2, "height": 3, "width": 4}, bool(torch.rand(1) < 0.5))


def test_making_one_leaves_the_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    CropDraw(v2.RandomResizedCrop(224), v2.RandomHorizontalFlip())
    assert torch.equal(torch.rand(4), expected)


def test_making_one_seeds_no_accelerator(monkeypatch):
    """Its check seeds the CPU generator only: torch.manual_seed would also (re)seed CUDA's,
    which the fork of the CPU generator does not restore (and on a machine without CUDA, queue
    the call with a stack trace each time)."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    torch.manual_seed(5)
    assert seeded == [5]  # what the check would have done
    CropDraw(v2.RandomResizedCrop(224), v2.RandomHorizontalFlip())
    assert seeded == [5]
