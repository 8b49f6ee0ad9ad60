"""bench/photos.py's photo set: ImageNet-like sizes and aspect ratios, deterministic, without the
packages the real photographs come from (those are only in .bench-venv)."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
from conftest import ROOT
from PIL import Image

spec = importlib.util.spec_from_file_location("bench_photos", ROOT / "bench" / "photos.py")
photos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(photos)


def sources() -> list[np.ndarray]:
    """Two stand-ins of the packaged photographs' shapes (427x640 and 512x512)."""
    rng = np.random.default_rng(1)
    return [
        rng.integers(0, 256, size=(427, 640, 3), dtype=np.uint8),
        rng.integers(0, 256, size=(512, 512, 3), dtype=np.uint8),
    ]


def test_photo_set_sizes_aspects_and_qualities():
    made = list(photos.photo_set(sources(), 40, seed=3))
    assert len(made) == 40
    aspects, qualities = set(), set()
    for jpg, drawn in made:
        img = Image.open(io.BytesIO(jpg))
        assert img.format == "JPEG" and img.mode == "RGB"
        assert img.size == drawn["size"]
        w, h = img.size
        assert 300 <= min(w, h) <= 500
        # The drawn aspect, up to rounding the longer side to whole pixels.
        assert min(abs(w / h - a) for a in photos.ASPECTS) < 0.01
        aspects.add(min(photos.ASPECTS, key=lambda a: abs(w / h - a)))
        assert 75 <= drawn["quality"] <= 95
        qualities.add(drawn["quality"])
    # Mixed, as ImageNet's are: landscape, portrait and square among 40 images.
    assert any(a > 1 for a in aspects) and any(a < 1 for a in aspects) and 1.0 in aspects
    assert len(qualities) > 5
    assert {d["source"] for _, d in made} == {0, 1}


def test_photo_set_is_deterministic_per_seed():
    first = [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=7)]
    assert first == [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=7)]
    assert first != [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=8)]
