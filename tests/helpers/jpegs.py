"""JPEGs for the region-decode tests, the library they test, and a loader's first batches."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

from wdsdist.data.decode import jpegcrop
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.tools import synthetic

LIB = jpegcrop.load()
needs_lib = pytest.mark.skipif(isinstance(LIB, str), reason=f"jpegcrop: {LIB}")


def encode(width: int, height: int, seed: int = 0, mode: str = "RGB", **save) -> bytes:
    """A JPEG with detail everywhere (noise on a drawn image), so every region is different."""
    img = synthetic.draw(seed, size=max(width, height))[0].resize((width, height))
    noise = np.random.default_rng(seed).integers(0, 40, (height, width, 3), dtype=np.uint8)
    img = Image.fromarray(np.asarray(img) // 2 + noise).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def whole(data: bytes) -> torch.Tensor:
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def first_batches(index, n, **kw):
    """A 2-worker training loader's first n batches of 8 (32 x 32), the workers seeded from 0."""
    cfg = LoaderConfig(batch_size=8, workers=2, image_size=32, crop_scale=(0.08, 1.0), **kw)
    loader = make_loader(str(index), 0, 1, cfg)
    torch.manual_seed(0)  # the workers' seeds come from it
    it = iter(loader)
    return [next(it) for _ in range(n)]
