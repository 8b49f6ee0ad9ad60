"""The built-in synthetic data set: procedurally drawn, learnable image classes.

Each class is a (shape, colour) pair drawn at a random place, size and angle over a noisy,
randomly tinted background, so a small CNN has to learn both shape and colour. Images are a
pure function of (seed, split, index): the held-out split never repeats a training image.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 230)}
CLASSES = tuple(f"{c}-{s}" for c in COLOURS for s in SHAPES)
SPLITS = {"train": 0, "val": 1}


def _polygon(cx: float, cy: float, r: float, angle: float, points: list[tuple[float, float]]):
    ca, sa = math.cos(angle), math.sin(angle)
    return [(cx + r * (x * ca - y * sa), cy + r * (x * sa + y * ca)) for x, y in points]


def draw(index: int, size: int = 64, seed: int = 0, split: str = "train") -> tuple[Image.Image, int]:
    """Draw sample ``index`` of a split: an RGB image and its class index."""
    rng = np.random.default_rng([seed, SPLITS[split], index])
    label = int(rng.integers(len(CLASSES)))
    colour_name, shape = CLASSES[label].split("-")
    tint = rng.integers(60, 200, size=3)
    noise = rng.normal(0, 28, size=(size, size, 3))
    background = np.clip(tint + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(background).filter(ImageFilter.GaussianBlur(radius=0.8))
    d = ImageDraw.Draw(img)
    base = np.array(COLOURS[colour_name])
    fill = tuple(int(v) for v in np.clip(base + rng.integers(-30, 31, size=3), 0, 255))
    r = size * rng.uniform(0.18, 0.32)
    margin = min(2.0, size * 0.04)
    cx, cy = rng.uniform(r + margin, size - r - margin, size=2)
    angle = rng.uniform(0, 2 * math.pi)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, int(r / 3)))
    elif shape == "square":
        d.polygon(_polygon(cx, cy, r, angle, [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]), fill=fill)
    elif shape == "triangle":
        pts = [(math.cos(a), math.sin(a)) for a in (0.0, 2 * math.pi / 3, 4 * math.pi / 3)]
        d.polygon(_polygon(cx, cy, r, angle, pts), fill=fill)
    else:  # cross
        w = 0.3
        arm = [
            (-1, -w),
            (-w, -w),
            (-w, -1),
            (w, -1),
            (w, -w),
            (1, -w),
            (1, w),
            (w, w),
            (w, 1),
            (-w, 1),
            (-w, w),
            (-1, w),
        ]
        d.polygon(_polygon(cx, cy, r, angle, arm), fill=fill)
    return img, label


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
