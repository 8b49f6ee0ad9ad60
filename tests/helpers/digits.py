"""scikit-learn's handwritten digits (real scans, 8 x 8) as an ImageFolder tree: what
tests/model/test_own_images.py trains on, and the recipe study's data (bench/recipe/recipe.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digits_tree(root: Path, digits: list[int], train: int, val: int, first: int = 0, ink: bool = False) -> None:
    """root/train/NAME/*.png and root/val/NAME/*.png: the 8x8 digits upscaled to 40 pixels, from
    each digit's ``first`` image on; ``ink``: dark digits on white, not white on black."""
    from sklearn.datasets import load_digits

    data = load_digits()
    for d in digits:
        images = data.images[data.target == d][first:]
        images = 16 - images if ink else images
        for split, chunk in (("train", images[:train]), ("val", images[train : train + val])):
            folder = root / split / NAMES[d]
            folder.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(chunk):
                grey = Image.fromarray((image * 16).clip(0, 255).astype(np.uint8)).resize((40, 40), Image.BILINEAR)
                grey.convert("RGB").save(folder / f"{i:03d}.png")
