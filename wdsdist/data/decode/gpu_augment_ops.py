"""decode=gpu's augmentation ops on a batch of uint8 N x 3 x H x W rows, a magnitude per row
(gpu_augment.py groups the rows that drew each op). Each is Pillow's arithmetic as jpegcrop.c's C
loops make it on the CPU path (augment_ops.py), so that on the same crop the pixels are the CPU
path's: the affine ops' bilinear filter in double precision from the matrix PIL is asked for, the
blends of brightness, contrast, colour and sharpness in float32 truncated and clamped as Blend.c
does, and the tables of solarize, autocontrast and equalize from each row's own histogram, as
ImageOps makes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _luma(x: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB to L of int32 N x 3 x H x W: ITU-R 601-2 in 16-bit fixed point, rounded."""
    return (x[:, 0] * 19595 + x[:, 1] * 38470 + x[:, 2] * 7471 + 0x8000) >> 16


def _blend(base: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Blend.c's ``base + alpha * (v - base)`` in float32 (int32 operands), truncated, clamped."""
    t = base.float() + alpha * (v - base).float()
    return t.trunc_().clamp_(0, 255).to(torch.uint8)


def on_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few per-row values on ``device``: through pinned memory to a GPU, so the copy is queued
    on the stream rather than waiting for it (a copy from pageable memory does)."""
    values = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


def _per_row(values: Sequence[float], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return on_device(values, dtype, like.device).view(-1, 1, 1, 1)


def brightness(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    alpha = _per_row([1.0 + m for m in mags], x, torch.float32)
    return _blend(torch.zeros((), dtype=torch.int32, device=x.device), x.int(), alpha)


def contrast(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    """A blend with the grey of the luma's mean, rounded as ImageStat's mean and int(+ 0.5)."""
    v = x.int()
    luma = _luma(v).flatten(1)
    mean = luma.sum(1, dtype=torch.int64).double() / luma.shape[1]
    base = (mean + 0.5).trunc_().int().view(-1, 1, 1, 1)
    return _blend(base, v, _per_row([1.0 + m for m in mags], x, torch.float32))


def color(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    v = x.int()
    return _blend(_luma(v).unsqueeze(1), v, _per_row([1.0 + m for m in mags], x, torch.float32))


def sharpness(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    """A blend with ImageFilter.SMOOTH (1 1 1 / 1 5 1 / 1 1 1, over 13; the border kept)."""
    v = x.int()
    total = 4 * v[..., 1:-1, 1:-1]
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            total = total + v[..., dy : dy + v.shape[-2] - 2, dx : dx + v.shape[-1] - 2]
    smooth = torch.div(2 * total + 13, 26, rounding_mode="floor")
    out = x.clone()
    alpha = _per_row([1.0 + m for m in mags], x, torch.float32)
    out[..., 1:-1, 1:-1] = _blend(smooth, v[..., 1:-1, 1:-1], alpha)
    return out


def posterize(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    masks = [(0xFF << (8 - int(m))) & 0xFF for m in mags]
    return x & _per_row(masks, x, torch.uint8)


def solarize(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    threshold = _per_row([255.0 * m for m in mags], x, torch.float64)
    return torch.where(x.double() < threshold, x, 255 - x)


def invert(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    return 255 - x


def _histograms(x: torch.Tensor) -> torch.Tensor:
    """Each row's and band's 256 counts: (N * 3) x 256, int64."""
    flat = x.reshape(x.shape[0] * 3, -1).long()
    counts = torch.zeros((flat.shape[0], 256), dtype=torch.int64, device=x.device)
    return counts.scatter_add_(1, flat, torch.ones_like(flat))


def _looked_up(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Image.point with a table per row and band ((N * 3) x 256, values clipped to 0..255)."""
    flat = x.reshape(x.shape[0] * 3, -1).long()
    return lut.clamp(0, 255).gather(1, flat).to(torch.uint8).view(x.shape)


def autocontrast(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    """ImageOps.autocontrast: each band stretched from its lowest to its highest value."""
    seen = _histograms(x) > 0
    lo = seen.int().argmax(1, keepdim=True)
    hi = 255 - seen.flip(1).int().argmax(1, keepdim=True)
    scale = 255.0 / (hi - lo).clamp(min=1).double()
    offset = (-lo).double() * scale
    ix = torch.arange(256, device=x.device, dtype=torch.float64)
    lut = (ix * scale + offset).trunc_().clamp_(0, 255).long()
    return _looked_up(x, torch.where(hi <= lo, ix.long(), lut))


def equalize(x: torch.Tensor, mags: Sequence[float]) -> torch.Tensor:
    """ImageOps.equalize: each band's table from its histogram, in Pillow's integer steps."""
    counts = _histograms(x)
    seen = counts > 0
    last = 255 - seen.flip(1).int().argmax(1, keepdim=True)
    step = torch.div(counts.sum(1, keepdim=True) - counts.gather(1, last), 255, rounding_mode="floor")
    before = counts.cumsum(1) - counts
    lut = torch.div(torch.div(step, 2, rounding_mode="floor") + before, step.clamp(min=1), rounding_mode="floor")
    plain = (seen.sum(1, keepdim=True) <= 1) | (step == 0)
    return _looked_up(x, torch.where(plain, torch.arange(256, device=x.device), lut))


def affine(x: torch.Tensor, matrices: torch.Tensor, fills: torch.Tensor) -> torch.Tensor:
    """Image.transform(AFFINE, matrix, BILINEAR) per row (matrices N x 6, float64; fills N x 3):
    Pillow's affine_transform and bilinear_filter32RGB in double, as jpegcrop.c's augment_affine."""
    n, _, h, w = x.shape
    a = [matrices[:, k].view(n, 1, 1) for k in range(6)]
    xs = (torch.arange(w, device=x.device, dtype=torch.float64) + 0.5).view(1, 1, w)
    ys = (torch.arange(h, device=x.device, dtype=torch.float64) + 0.5).view(1, h, 1)
    xin = a[0] * xs + a[1] * ys + a[2]
    yin = a[3] * xs + a[4] * ys + a[5]
    inside = (xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)
    xin, yin = xin - 0.5, yin - 0.5
    xi, yi = xin.floor(), yin.floor()
    dx, dy = (xin - xi).unsqueeze(1), (yin - yi).unsqueeze(1)
    xi, yi = xi.long(), yi.long()
    x0, x1 = xi.clamp(0, w - 1), (xi + 1).clamp(0, w - 1)
    y0 = yi.clamp(0, h - 1)
    y1 = torch.where((yi + 1 >= 0) & (yi + 1 < h), yi + 1, y0)
    flat = x.reshape(n, 3, h * w)

    def at(yy: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
        index = (yy * w + xx).view(n, 1, h * w).expand(n, 3, h * w)
        return flat.gather(2, index).view(n, 3, h, w).double()

    p00, p01, p10, p11 = at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1)
    v1 = p00 + (p01 - p00) * dx
    v2 = p10 + (p11 - p10) * dx
    out = (v1 + (v2 - v1) * dy).trunc_().to(torch.uint8)
    return torch.where(inside.unsqueeze(1), out, fills.to(torch.uint8).view(n, 3, 1, 1))


COLOUR = {
    "Brightness": brightness,
    "Contrast": contrast,
    "Color": color,
    "Sharpness": sharpness,
    "Posterize": posterize,
    "Solarize": solarize,
    "Invert": invert,
    "AutoContrast": autocontrast,
    "Equalize": equalize,
}
