"""The policies' ops (TrivialAugmentWide's, RandAugment's, AutoAugment's) on a uint8 crop, each
where it costs least, with the pixels of torchvision's functional op on a PIL image: what
torchvision's classification reference and timm apply the policies to.

Per op (``HOW``; each op's cost three ways: bench/recipe/recipe.py --ops, the report of 2026-12-05):

- ``ours``: small C loops beside jpegcrop's (jpegcrop.c's ``augment_*``) in Pillow's own
  arithmetic: the bilinear affine of shear, translate and rotate (PIL calls two functions per
  pixel), sharpness (its 3 x 3 smoothing and blend), the blends of brightness, contrast and colour,
  and the tables of solarize, autocontrast and equalize. What depends on Pillow's code rather than
  its arithmetic is Pillow's: torchvision's functional op runs on a stand-in image (``_Recorder``)
  that records the affine matrix or the table it is asked for instead of making pixels, as
  augment.py records the draws; a C loop then makes the pixels. Autocontrast's and equalize's
  tables, which depend on the crop's histogram, are ImageOps' arithmetic in numpy (its Python
  loops cost more than the table's use). Where the library is missing, or an op asks for
  something else (a right angle's transpose), PIL makes them: the same pixels.
- ``tensor``: torchvision's tensor op, where it is cheaper still and its pixels equal PIL's
  (posterize, invert).

A crop moves between a tensor and a PIL image only when the next op wants the other form; both
hold the same bytes (HWC, RGB). tests/data/decode/test_augment_ops.py holds each op's pixels equal to
torchvision's on a PIL image, over every magnitude each policy draws.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageStat
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

from wdsdist.data.decode import jpegcrop

GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
TABLES = ("Solarize", "AutoContrast", "Equalize")  # PIL's ImageOps makes a table, ours applies it
HOW = dict.fromkeys((*GEOMETRIC, *TABLES, "Sharpness", "Brightness", "Contrast", "Color"), "ours") | {
    "Identity": "none",
    "Posterize": "tensor",
    "Invert": "tensor",
}
_PIL_BILINEAR = 2  # Image.Resampling.BILINEAR, as torchvision hands it to Image.transform


class _Recorder(Image.Image):
    """A PIL image of a size and no pixels: what torchvision's functional ops ask of it (an
    affine ``transform``, a ``transpose``, a ``copy``, a table's ``point``) is recorded, not done;
    its ``histogram`` is the one it is given (the crop's)."""

    def __init__(self, width: int, height: int, counts: list[int] | None = None):
        super().__init__()
        self._mode, self._size = "RGB", (width, height)
        self.counts = counts
        self.asked: tuple = ()

    def histogram(self, mask=None, extrema=None) -> list[int]:
        if self.counts is None or mask is not None:
            raise NotImplementedError("no histogram given")
        return self.counts

    def point(self, lut, mode=None) -> _Recorder:  # type: ignore[override]
        self.asked = ("point", lut, mode)
        return self

    def transform(self, size, method, data=None, resample=0, fill=1, fillcolor=None) -> _Recorder:  # type: ignore[override]
        self.asked = ("transform", tuple(size), int(method), tuple(data or ()), int(resample), fillcolor)
        return self

    def transpose(self, method) -> _Recorder:  # type: ignore[override]
        self.asked = ("transpose",)
        return self

    def copy(self) -> _Recorder:  # type: ignore[override]
        self.asked = ("copy",)
        return self


@functools.lru_cache(maxsize=4096)
def affine_of(op: str, magnitude: float, width: int, height: int, interpolation: InterpolationMode) -> tuple | None:
    """(matrix, fill) of the bilinear affine that torchvision's op asks PIL for on an image of this
    size; () where it asks for a copy (no change); None where it asks otherwise (a transpose for
    a right angle, another interpolation): PIL does those."""
    policy = v2.TrivialAugmentWide(interpolation=interpolation)
    recorder = _Recorder(width, height)
    policy._apply_image_or_video_transform(recorder, op, magnitude, interpolation=interpolation, fill=policy._fill)
    asked = recorder.asked
    if asked == ("copy",):
        return ()
    if not asked or asked[0] != "transform":
        return None
    _, size, method, matrix, resample, fill = asked
    if size != (width, height) or method != Image.Transform.AFFINE or resample != _PIL_BILINEAR or len(matrix) < 6:
        return None
    fill = (0, 0, 0) if fill is None else tuple(fill) if isinstance(fill, tuple | list) else (fill,) * 3
    return tuple(float(m) for m in matrix[:6]), tuple(int(c) for c in fill)


@functools.cache
def library() -> ctypes.CDLL | None:
    """jpegcrop's C library with the augmentations' kernels, or None (PIL makes those ops); looked
    up once per process (jpegcrop.load asks the file system)."""
    lib = jpegcrop.load()
    return None if isinstance(lib, str) else lib


class Crop:
    """A crop's pixels as a uint8 CHW tensor or a PIL RGB image, whichever the last op made."""

    def __init__(self, image: torch.Tensor):
        self._tensor: torch.Tensor | None = image
        self._pil: Image.Image | None = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            pil = self._pil
            width, height = pil.size  # type: ignore[union-attr]
            data = bytearray(pil.tobytes())  # type: ignore[union-attr]  # writable, as any crop is
            self._tensor = torch.frombuffer(data, dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)
        return self._tensor

    def hwc(self) -> torch.Tensor:
        """The pixels as a contiguous height x width x 3 tensor (a view where they are laid out so)."""
        return self.tensor().permute(1, 2, 0).contiguous()

    def pil(self) -> Image.Image:
        if self._pil is None:
            hwc = self.hwc()
            self._pil = Image.frombytes("RGB", (hwc.shape[1], hwc.shape[0]), hwc.numpy())
        return self._pil

    def set(self, image: torch.Tensor | Image.Image) -> None:
        tensor = isinstance(image, torch.Tensor)
        self._tensor, self._pil = (image, None) if tensor else (None, image)  # type: ignore[assignment]


def _geometric(lib: ctypes.CDLL, hwc: torch.Tensor, op: str, magnitude: float, policy: Any) -> torch.Tensor | None:
    """The affine op by augment_affine; None where PIL must make it (a fill other than the
    policies' default black, which affine_of assumes; a transpose; another interpolation)."""
    if getattr(policy, "fill", None) is not None:
        return None
    height, width = hwc.shape[0], hwc.shape[1]
    affine = affine_of(op, float(magnitude), width, height, policy.interpolation)
    if affine is None:
        return None
    if not affine:
        return hwc.permute(2, 0, 1)
    matrix, fill = affine
    a, f = (ctypes.c_double * 6)(*matrix), (ctypes.c_ubyte * 3)(*fill)
    out = torch.empty_like(hwc)
    lib.augment_affine(hwc.data_ptr(), width, height, out.data_ptr(), a, f)
    return out.permute(2, 0, 1)


def _histogram(lib: ctypes.CDLL, hwc: torch.Tensor, luma: bool = False) -> torch.Tensor:
    """Image.histogram's 3 x 256 counts (int32); with ``luma``, convert("L").histogram()'s 256."""
    counts = torch.empty(256 if luma else 768, dtype=torch.int32)
    lib.augment_histogram(hwc.data_ptr(), hwc.shape[0] * hwc.shape[1], counts.data_ptr(), int(luma))
    return counts


def _table(policy: Any, hwc: torch.Tensor, op: str, magnitude: float, lib: ctypes.CDLL) -> bytes | None:
    """The 3 x 256 table that torchvision's op on a PIL image has ImageOps make and ``point``
    apply: a table of the magnitude alone made by PIL's own code on a _Recorder, once; or
    autocontrast's and equalize's from the crop's histogram in ImageOps' arithmetic, with numpy
    (ImageOps' loops over the 768 counts cost twice the table's use); None where it asks for
    something else."""
    if op not in ("AutoContrast", "Equalize"):
        return _fixed_table(policy, op, magnitude)
    counts = _histogram(lib, hwc).numpy().astype(np.int64).reshape(3, 256)
    tables = np.stack([(_stretched if op == "AutoContrast" else _equalized)(band) for band in counts])
    return tables.clip(0, 255).astype(np.uint8).tobytes()


def _stretched(counts: np.ndarray) -> np.ndarray:
    """ImageOps.autocontrast's table for one band's 256 counts (no cutoff, nothing ignored, as
    torchvision calls it): from its lowest value to its highest, int(i * scale + offset) in
    double precision, the operations Pillow does one by one; a band of one value as it is."""
    ix = np.arange(256)
    seen = np.flatnonzero(counts)
    lo, hi = (int(seen[0]), int(seen[-1])) if len(seen) else (255, 0)
    if hi <= lo:
        return ix
    scale = 255.0 / (hi - lo)
    offset = -lo * scale
    return np.trunc(ix * scale + offset).astype(np.int64)


def _equalized(counts: np.ndarray) -> np.ndarray:
    """ImageOps.equalize's table for one band's 256 counts, in its integer steps: ``step`` is the
    pixels but those of the highest value, over 255; value i maps to (step // 2 + the pixels
    below i) // step, above 255 where Pillow's ``point`` clips it; one value, or a step of 0, as
    it is."""
    seen = counts[counts > 0]
    step = (int(seen.sum()) - int(seen[-1])) // 255 if len(seen) > 1 else 0
    if not step:
        return np.arange(256)
    return (step // 2 + np.cumsum(counts) - counts) // step


def _fixed_table(policy: Any, op: str, magnitude: float) -> bytes | None:
    key = (op, float(magnitude), policy.interpolation)
    if key not in _TABLES:
        _TABLES[key] = _recorded_table(policy, _Recorder(1, 1), op, magnitude)
    return _TABLES[key]


_TABLES: dict[tuple, bytes | None] = {}


def _recorded_table(policy: Any, recorder: _Recorder, op: str, magnitude: float) -> bytes | None:
    policy._apply_image_or_video_transform(
        recorder, op, magnitude, interpolation=policy.interpolation, fill=policy._fill
    )
    if not recorder.asked or recorder.asked[0] != "point" or recorder.asked[2] is not None:
        return None
    lut = list(recorder.asked[1])
    lut = lut * 3 if len(lut) == 256 else lut
    if len(lut) != 768:
        return None
    try:
        return bytes(lut)  # integers in 0..255, as most of ImageOps' tables are
    except (TypeError, ValueError):  # Image.point's way: each entry made an integer, then clipped
        return np.array(lut).astype(np.int64).clip(0, 255).astype(np.uint8).tobytes()


def _colour(lib: ctypes.CDLL, hwc: torch.Tensor, op: str, magnitude: float) -> torch.Tensor:
    """ImageEnhance's Brightness, Contrast and Color by ``1 + magnitude`` (torchvision's factor):
    a blend with black, with the grey of the luma's mean, with each pixel's luma."""
    n, alpha = hwc.shape[0] * hwc.shape[1], ctypes.c_float(1.0 + magnitude)
    out = torch.empty_like(hwc)
    if op == "Color":
        lib.augment_color(hwc.data_ptr(), n, out.data_ptr(), alpha)
        return out.permute(2, 0, 1)
    base = 0
    if op == "Contrast":  # ImageEnhance.Contrast: the mean of convert("L"), rounded, as ImageStat gives it
        base = int(ImageStat.Stat(_histogram(lib, hwc, luma=True).tolist()).mean[0] + 0.5)
    lut = ctypes.create_string_buffer(768)
    lib.augment_blend_lut(base, alpha, lut)
    ctypes.memmove(ctypes.addressof(lut) + 256, lut, 256)
    ctypes.memmove(ctypes.addressof(lut) + 512, lut, 256)
    lib.augment_lut(hwc.data_ptr(), n, out.data_ptr(), lut)
    return out.permute(2, 0, 1)


def _ours(policy: Any, lib: ctypes.CDLL, crop: Crop, op: str, magnitude: float) -> bool:
    """The op by the C kernels into ``crop``; False where PIL must make it."""
    hwc = crop.hwc()
    if op in GEOMETRIC:
        out = _geometric(lib, hwc, op, magnitude, policy)
    elif op in TABLES:
        lut = _table(policy, hwc, op, magnitude, lib)
        out = None
        if lut is not None:
            new = torch.empty_like(hwc)
            lib.augment_lut(hwc.data_ptr(), hwc.shape[0] * hwc.shape[1], new.data_ptr(), lut)
            out = new.permute(2, 0, 1)
    elif op == "Sharpness":
        new = torch.empty_like(hwc)
        height, width = hwc.shape[0], hwc.shape[1]
        lib.augment_sharpness(hwc.data_ptr(), width, height, new.data_ptr(), ctypes.c_float(1.0 + magnitude))
        out = new.permute(2, 0, 1)
    else:
        out = _colour(lib, hwc, op, magnitude)
    if out is None:
        return False
    crop.set(out)
    return True


def apply_op(policy: Any, crop: Crop, op: str, magnitude: float, lib: ctypes.CDLL | None) -> None:
    """One op of ``policy`` (a v2 policy: its interpolation and fill) on ``crop``, where HOW says."""
    how = HOW.get(op, "pil")
    if how == "none":
        return
    if how == "ours" and lib is not None and _ours(policy, lib, crop, op, magnitude):
        return
    image = crop.tensor() if how == "tensor" else crop.pil()
    kw = {"interpolation": policy.interpolation, "fill": policy._fill}
    crop.set(policy._apply_image_or_video_transform(image, op, magnitude, **kw))
