"""decode=gpu's crop, resize and flip of a whole batch, in two launches (resize_kernels.py).

A decoder puts the batch's decoded regions into one uint8 buffer (``Places``: where each starts,
its row stride, height and width). ``BatchResize`` makes the N x 3 x S x S channels_last batch of
them: the training crop resized to S x S and flipped where drawn, or evaluation's resize of the
shorter side to round(S / 0.875) and centre crop, as the CPU path's transforms do
(sample.make_transform). It runs the Triton kernels on a GPU, and under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors; where neither is there, ``reference`` does the same
per image with torch's interpolate.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Triton compiles a kernel at its first launch; decode threads (loader.gpu_decode_threads) make
# their first batches at once, so first launches take turns.
_FIRST_LAUNCH = threading.Lock()
EVAL_RATIO = 0.875  # evaluation resizes the shorter side to round(size / EVAL_RATIO), as make_transform


@dataclass(frozen=True)
class Place:
    """A decoded region in a batch's buffer: its first byte, the bytes between rows, its size."""

    start: int
    stride: int
    height: int
    width: int


@dataclass(frozen=True)
class Geometry:
    """What the output window is of a region: the region resized to tgt_h x tgt_w, cut at
    (off_y, off_x) to size x size, and flipped or not."""

    tgt_h: int
    tgt_w: int
    off_y: int
    off_x: int
    flip: int


def train_geometry(size: int, flip: int) -> Geometry:
    return Geometry(size, size, 0, 0, int(flip))


def eval_geometry(height: int, width: int, size: int, short_side: int | None = None) -> Geometry:
    """v2.Resize(short_side) then v2.CenterCrop(size), as torchvision computes them; short_side by
    default round(size / 0.875) (the loader's data.eval_resize otherwise)."""
    short_side = short_side or round(size / EVAL_RATIO)
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(short_side * long / short)
    tgt_w, tgt_h = (short_side, new_long) if width <= height else (new_long, short_side)
    off_y = int(round((tgt_h - size) / 2.0))
    off_x = int(round((tgt_w - size) / 2.0))
    return Geometry(tgt_h, tgt_w, off_y, off_x, 0)


def _taps(region: int, target: int) -> int:
    """The most input pixels one output pixel reads (the triangle's width, in pixels, plus one)."""
    support = max(region / target, 1.0)
    return int(2 * support) + 2


def params_of(places: Sequence[Place], geometry: Sequence[Geometry]) -> tuple[torch.Tensor, int, int]:
    """The kernels' rows (resize_kernels.PARAMS), the rows of ``tmp`` they need and the tallest region."""
    rows, tmp_row, tallest = [], 0, 0
    for p, g in zip(places, geometry, strict=True):
        taps_x, taps_y = _taps(p.width, g.tgt_w), _taps(p.height, g.tgt_h)
        rows.append(
            (p.start, p.stride, p.height, p.width, g.tgt_h, g.tgt_w, g.off_y, g.off_x, g.flip, tmp_row, taps_x, taps_y)
        )
        tmp_row += p.height
        tallest = max(tallest, p.height)
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 12), tmp_row, tallest


def region_of(src: torch.Tensor, p: Place) -> torch.Tensor:
    """A place in the buffer as a 3 x H x W view."""
    rows = src[p.start : p.start + (p.height - 1) * p.stride + p.width * 3]
    return rows.as_strided((3, p.height, p.width), (1, p.stride, 3))


def reference(src: torch.Tensor, places: Sequence[Place], geometry: Sequence[Geometry], size: int) -> torch.Tensor:
    """What the kernels make, image by image with torch: N x 3 x size x size uint8, channels_last."""
    out = torch.empty((len(places), 3, size, size), dtype=torch.uint8, device=src.device)
    out = out.contiguous(memory_format=torch.channels_last)
    for i, (p, g) in enumerate(zip(places, geometry, strict=True)):
        region = region_of(src, p).unsqueeze(0).float()
        full = torch.nn.functional.interpolate(region, size=(g.tgt_h, g.tgt_w), mode="bilinear", antialias=True)
        window = full[0, :, g.off_y : g.off_y + size, g.off_x : g.off_x + size]
        out[i] = (window.flip(-1) if g.flip else window).round_()
    return out


def kernels_here(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device``: on CUDA with Triton, on the CPU
    under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


class BatchResize:
    """The batch's regions to its images on ``device``; ``how`` says which implementation."""

    def __init__(self, size: int, device: torch.device):
        self.size, self.device = size, device
        self.kernels = kernels_here(device)
        self.how = "Triton, 2 launches a batch" if self.kernels else "torch, per image"
        self.tmp = torch.empty(0, dtype=torch.float32, device=device)  # reused, grown as needed
        self.launched: set[int] = set()  # the sizes launched once (Triton compiles a kernel per size)

    def __call__(
        self, src: torch.Tensor, places: Sequence[Place], geometry: Sequence[Geometry], size: int | None = None
    ) -> torch.Tensor:
        """The batch at ``size`` (a size schedule's; default the one it was made for)."""
        size = size or self.size
        if not places:
            return torch.empty((0, 3, size, size), dtype=torch.uint8, device=self.device)
        if not self.kernels:
            return reference(src, places, geometry, size)
        from wdsdist.data.decode import resize_kernels

        params, tmp_rows, tallest = params_of(places, geometry)
        params = params.to(self.device, non_blocking=True)
        need = tmp_rows * size * 3
        if self.tmp.numel() < need:
            self.tmp = torch.empty(int(need * 1.25), dtype=torch.float32, device=self.device)
        out = torch.empty((len(places), size, size, 3), dtype=torch.uint8, device=self.device)
        if size in self.launched:
            resize_kernels.launch(src, self.tmp, out, params, size, tallest)
        else:
            with _FIRST_LAUNCH:
                if not self._first_launch(src, out, params, tallest, size):
                    return reference(src, places, geometry, size)
        return out.permute(0, 3, 1, 2)  # N x 3 x S x S, channels_last in memory

    def _first_launch(self, src, out, params, tallest: int, size: int) -> bool:
        """The kernels' first launch, where Triton compiles them. A GPU machine on which Triton
        cannot compile (no compiler, say) goes on with the per-image reference, and says so in one
        line; under the interpreter, which compiles nothing, the error is the kernels' own: raised."""
        from wdsdist.data.decode import resize_kernels

        try:
            resize_kernels.launch(src, self.tmp, out, params, size, tallest)
        except Exception as exc:
            if os.environ.get("TRITON_INTERPRET") == "1":
                raise
            self.kernels, self.how = False, f"torch, per image (Triton failed here: {type(exc).__name__})"
            log.warning(
                "decode=gpu: the Triton resize failed at its first launch, so torch resizes image by image: %s",
                str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__,
            )
            return False
        self.launched.add(size)
        return True
