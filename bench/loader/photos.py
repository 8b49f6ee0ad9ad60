"""The bench's second data set: crops of real photographs that ship inside Python packages.

The noise images of bench.py compress unlike photographs (no flat regions, no edges). These are
crops and rescales of the colour photographs inside scikit-learn's and scikit-image's wheels,
at ImageNet-like sizes: shorter side 300-500 px, mixed aspect ratios, JPEG quality 75-95. The
packaged files are small, clean, already downscaled originals (300-741 px) that compress about
twice as well as camera JPEGs (42 KB mean at these sizes against ImageNet's ~110 KB), so each
crop gets what a camera adds before it encodes: sharpening (an unsharp mask) and sensor grain
(mostly luminance, of a strength drawn per image), which brings the mean to about 85 KB. They
are generated at bench time (nothing here is committed) and never fetched: only images that are
files inside the installed packages are used.

``python bench/loader/photos.py TREE N`` writes N images as an ImageFolder tree (run by bench.py in
.bench-venv, where the two packages are installed).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

ASPECTS = (4 / 3, 3 / 2, 1.0, 3 / 4, 2 / 3, 16 / 9, 5 / 4, 4 / 5)  # width / height
SHORT_SIDE = (300, 500)  # inclusive
QUALITY = (75, 95)  # inclusive
GRAIN = (4.0, 12.0)  # sensor noise, std of the luminance grain in 8-bit levels (chroma: a third)
SHARPEN = 150  # in-camera sharpening: unsharp-mask strength in percent (radius 1.5 px)
# skimage.data's colour photographs of everyday scenes that are files inside its wheel (others are
# downloaded on first use, which a benchmark must not do), read as files: no fetcher is called.
SKIMAGE_FILES = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png")


def photo_set(sources: list[np.ndarray], n: int, seed: int = 0) -> Iterator[tuple[bytes, dict]]:
    """n JPEGs cut from ``sources`` (H x W x 3 uint8 arrays): for each, an aspect ratio, a shorter
    side and a quality are drawn, then a random region of that aspect covering 25-100 % of the
    largest such region of a source is resized to that size (mostly down: the sources are
    400-640 px wide), flipped half the time, sharpened and given grain. Yields (jpeg bytes,
    what was drawn)."""
    if not sources:
        raise ValueError("no source photographs")
    for i in range(n):
        rng = np.random.default_rng((seed, i))
        src = sources[i % len(sources)]
        sh, sw = src.shape[:2]
        aspect = float(rng.choice(ASPECTS))
        short = int(rng.integers(SHORT_SIDE[0], SHORT_SIDE[1] + 1))
        w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
        # The largest region of that aspect inside the source, then a random share of it.
        rw, rh = (sw, sw / aspect) if sw / aspect <= sh else (sh * aspect, sh)
        scale = float(np.sqrt(rng.uniform(0.5, 1.0)))  # less upscaling: a blurred photo is no camera's
        rw, rh = max(16, int(rw * scale)), max(16, int(rh * scale))
        x, y = int(rng.integers(0, sw - rw + 1)), int(rng.integers(0, sh - rh + 1))
        img = Image.fromarray(src[y : y + rh, x : x + rw]).resize((w, h), Image.LANCZOS)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        quality = int(rng.integers(QUALITY[0], QUALITY[1] + 1))
        grain = float(rng.uniform(*GRAIN))
        img = camera(img, grain, rng)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        yield buf.getvalue(), {"size": (w, h), "quality": quality, "source": i % len(sources), "grain": grain}


def camera(img: Image.Image, grain: float, rng: np.random.Generator) -> Image.Image:
    """What a camera adds before its encoder: sharpening, then sensor grain (luminance, plus a
    third as much per channel)."""
    from PIL import ImageFilter

    arr = np.asarray(img.filter(ImageFilter.UnsharpMask(radius=1.5, percent=SHARPEN, threshold=0)), dtype=np.float32)
    h, w = arr.shape[:2]
    arr = arr + rng.normal(0, grain, (h, w, 1)) + rng.normal(0, grain / 3, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def shipped_photos() -> list[np.ndarray]:
    """The colour photographs inside scikit-learn's and scikit-image's installed packages."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    photos = [np.asarray(img) for img in load_sample_images().images]  # china.jpg, flower.jpg
    folder = Path(skimage.data.__file__).parent
    for file in SKIMAGE_FILES:
        with Image.open(folder / file) as img:
            photos.append(np.asarray(img.convert("RGB")))
    return photos


def write_tree(tree: Path, n: int, classes: int = 10) -> float:
    """n photos as tree/classNN/imgNNNNNN.jpg (class i % classes); returns the mean size in KB."""
    total = 0
    for i, (jpg, _) in enumerate(photo_set(shipped_photos(), n)):
        folder = tree / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:06d}.jpg").write_bytes(jpg)
        total += len(jpg)
    return total / n / 1024


def quadrant_tree(tree: Path, per_class: int, seed: int) -> float:
    """A labelled set for accuracy studies: the class is which quadrant of which shipped photograph
    a JPEG is cut from (7 photographs x 4 quadrants = 28 classes), per_class JPEGs each, written as
    tree/classNN/imgNNNNNN.jpg; returns the mean size in KB. Train and val: different seeds."""
    quads = []
    for src in shipped_photos():
        h, w = src.shape[:2]
        for qy, qx in ((0, 0), (0, 1), (1, 0), (1, 1)):
            quads.append(src[qy * h // 2 : (qy + 1) * h // 2, qx * w // 2 : (qx + 1) * w // 2].copy())
    total, n = 0, per_class * len(quads)
    for i, (jpg, what) in enumerate(photo_set(quads, n, seed=seed)):
        folder = tree / f"class{what['source']:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:06d}.jpg").write_bytes(jpg)
        total += len(jpg)
    return total / n / 1024


if __name__ == "__main__":
    # photos.py TREE N: the bench's set; photos.py --quadrants TREE PER_CLASS SEED: the labelled one
    if sys.argv[1] == "--quadrants":
        print(f"{quadrant_tree(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])):.1f}")
    else:
        print(f"{write_tree(Path(sys.argv[1]), int(sys.argv[2])):.1f}")
