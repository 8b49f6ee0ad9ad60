"""The batched crop-resize-flip as two Triton kernels: every image of a batch in one launch each.

Each image is a region of ``src`` (uint8, H x W x 3 rows at a stride of their own) that is resized
to a target size and cut to the output's S x S window (training: the region is the drawn crop and
the target is S x S; evaluation: the region is the whole image, the target is its resize with the
shorter side at round(S / 0.875), and the window is the centre crop). The filter is torch's
antialiased bilinear one (``interpolate(..., mode="bilinear", antialias=True)``): a triangle
stretched over the scale factor when shrinking, its weights normalised per output pixel. It is
separable: the first kernel filters each region's rows into ``tmp`` (float32, the region's height
x S x 3), the second its columns into the uint8 batch, rounded, N x S x S x 3 (channels_last).

Per image, the table holds one row of int64 (PARAMS names the columns). The kernels' arguments
end in ``_ptr``: Triton's launcher (3.6) names a local of its own ``params``, which an argument of
that name met as a dict. Triton's interpreter
(``TRITON_INTERPRET=1``, set before this module is imported) runs both on CPU tensors, which is
how the suite checks them against the CPU path (tests/data/decode/test_gpu_resize.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The columns of a row of ``params``.
PARAMS = ("src", "stride", "h", "w", "tgt_h", "tgt_w", "off_y", "off_x", "flip", "tmp_row", "taps_x", "taps_y")
BLOCK_ROWS = 8
BLOCK_COLS = 64


@triton.jit
def _span(i, off, in_size, out_size):
    """Where output index ``i`` (of a window starting at ``off`` in a target of ``out_size``) reads
    in an axis of ``in_size``: the first index, the number of taps, and the filter's centre and
    its inverse width (PyTorch's _upsample_bilinear2d_aa)."""
    scale = in_size.to(tl.float32) / out_size.to(tl.float32)
    support = tl.maximum(scale, 1.0)
    invscale = 1.0 / support
    center = scale * ((i + off).to(tl.float32) + 0.5)
    first = tl.maximum((center - support + 0.5).to(tl.int32), 0)
    last = tl.minimum((center + support + 0.5).to(tl.int32), in_size)
    return first, last - first, center, invscale


@triton.jit
def _weight(k, first, center, invscale, n):
    x = tl.abs(((k + first).to(tl.float32) - center + 0.5) * invscale)
    w = tl.maximum(1.0 - x, 0.0)
    return tl.where(k < n, w, 0.0)


@triton.jit
def rows_kernel(src_ptr, tmp_ptr, table_ptr, S: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Pass 1: tmp[tmp_row + r, x, c] = the row filter of region row r at output column x."""
    n = tl.program_id(0)
    p = table_ptr + n * NP
    h = tl.load(p + 2).to(tl.int32)
    r0 = tl.program_id(1) * BR
    if r0 < h:
        base = tl.load(p + 0)
        stride = tl.load(p + 1)
        w = tl.load(p + 3).to(tl.int32)
        tgt_w = tl.load(p + 5).to(tl.int32)
        off_x = tl.load(p + 7).to(tl.int32)
        flip = tl.load(p + 8).to(tl.int32)
        tmp_row = tl.load(p + 9)
        taps = tl.load(p + 10).to(tl.int32)
        rows = r0 + tl.arange(0, BR)
        q = tl.program_id(2) * BC + tl.arange(0, BC)  # output column * 3 + channel
        x = q // 3
        c = q % 3
        col = tl.where(flip != 0, S - 1 - x, x)  # the flip: output column x is the window's S-1-x
        first, count, center, invscale = _span(col, off_x, w, tgt_w)
        row_ok = rows < h
        q_ok = q < S * 3
        acc = tl.zeros((BR, BC), dtype=tl.float32)
        total = tl.zeros((BC,), dtype=tl.float32)
        for k in range(0, taps):
            wk = _weight(k, first, center, invscale, count)
            total += wk
            at = base + rows[:, None].to(tl.int64) * stride + ((first + k) * 3 + c)[None, :]
            ok = row_ok[:, None] & (q_ok & (k < count))[None, :]
            v = tl.load(src_ptr + at, mask=ok, other=0).to(tl.float32)
            acc += v * wk[None, :]
        acc = acc / tl.maximum(total, 1e-20)[None, :]
        out = (tmp_row + rows[:, None].to(tl.int64)) * (S * 3) + q[None, :]
        tl.store(tmp_ptr + out, acc, mask=row_ok[:, None] & q_ok[None, :])


@triton.jit
def columns_kernel(tmp_ptr, out_ptr, table_ptr, S: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Pass 2: out[n, y, x, c] = the column filter of tmp at output row y, rounded to uint8."""
    n = tl.program_id(0)
    p = table_ptr + n * NP
    h = tl.load(p + 2).to(tl.int32)
    tgt_h = tl.load(p + 4).to(tl.int32)
    off_y = tl.load(p + 6).to(tl.int32)
    tmp_row = tl.load(p + 9)
    taps = tl.load(p + 11).to(tl.int32)
    y = tl.program_id(1) * BR + tl.arange(0, BR)
    q = tl.program_id(2) * BC + tl.arange(0, BC)
    first, count, center, invscale = _span(y, off_y, h, tgt_h)
    y_ok = y < S
    q_ok = q < S * 3
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    total = tl.zeros((BR,), dtype=tl.float32)
    for k in range(0, taps):
        wk = _weight(k, first, center, invscale, count)
        total += wk
        at = (tmp_row + (first + k)[:, None].to(tl.int64)) * (S * 3) + q[None, :]
        ok = (y_ok & (k < count))[:, None] & q_ok[None, :]
        v = tl.load(tmp_ptr + at, mask=ok, other=0.0)
        acc += v * wk[:, None]
    acc = acc / tl.maximum(total, 1e-20)[:, None]
    pixel = tl.minimum(tl.maximum(acc + 0.5, 0.0), 255.0).to(tl.uint8)  # round half up: >= 0 here
    at = (n * S + y[:, None].to(tl.int64)) * (S * 3) + q[None, :]
    tl.store(out_ptr + at, pixel, mask=y_ok[:, None] & q_ok[None, :])


def launch(src, tmp, out, params, size: int, max_rows: int) -> None:
    """Both passes over the batch: ``params`` (N x len(PARAMS) int64) on the device of ``src``;
    ``max_rows`` the tallest region's height."""
    n = params.shape[0]
    # The interpreter runs one program at a time in Python: fewer, larger blocks there.
    br, bc = (BLOCK_ROWS, BLOCK_COLS) if src.is_cuda else (32, 256)
    cols = triton.cdiv(size * 3, bc)
    rows_kernel[(n, triton.cdiv(max_rows, br), cols)](src, tmp, params, S=size, NP=len(PARAMS), BR=br, BC=bc)
    columns_kernel[(n, triton.cdiv(size, br), cols)](tmp, out, params, S=size, NP=len(PARAMS), BR=br, BC=bc)
