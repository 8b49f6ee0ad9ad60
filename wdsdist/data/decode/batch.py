"""The batch kernel: a worker's next region-decoded JPEGs made in one call that releases the GIL.

``prepare_sample`` checks each sample and makes its random draws in the stream's order; for a
JPEG that jpegcrop takes it returns a ``RegionJob`` (its bytes, its size, its drawn crop and flip).
``rendered`` gathers the next ``chunk`` prepared samples of the stream and hands every job among
them to ``jpegcrop_batch`` (jpegcrop.c) at once: on ``threads`` threads of its own, each image is
decoded in its crop's region only, resized with torch's antialiased bilinear weights (the same
pixels as torchvision's ``RandomResizedCrop(antialias=True)``: tests/test_batch_kernel.py) and
flipped, into one H x W x C buffer, with no Python between two images. A job the kernel refuses
(libjpeg's error or warning: CMYK, corrupt data) stays a job, and calling it takes the existing
path: torchvision's whole decode, which decides (a DataError, a skipped sample). Other images
pass through as ``prepare_sample`` made them.

Each image is a tensor of its own (C x H x W, stored H x W x C as the batch buffers are:
sharedbatches.py), kept until its batch has been stacked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wdsdist.data.decode.jpegcrop import MSG_LEN, CropDecoder


@dataclass(frozen=True)
class RegionJob:
    """A JPEG whose crop and flip are drawn; calling it makes the pixels on the Python path
    (CropDecoder.render: jpegcrop's region decode, else torchvision's whole decode)."""

    crop: CropDecoder
    data: bytes
    width: int
    height: int
    drawn: tuple[dict, bool]
    whole: Callable[[], torch.Tensor]
    label: int

    def __call__(self) -> tuple[torch.Tensor, int]:
        return self.crop.render(self.data, self.width, self.height, self.drawn, self.whole), self.label

    def params(self) -> tuple[int, ...]:
        """What jpegcrop_batch reads for it: denom, x, y, w, h, flip."""
        p, flip = self.drawn
        return (*self.crop.region_of(self.width, self.height, p), int(flip))


def render_jobs(jobs: list[RegionJob], threads: int = 1) -> tuple[list[torch.Tensor], list[str | None]]:
    """The jobs' images, each a uint8 H x W x C tensor of its own, made by one jpegcrop_batch call,
    and per job None or libjpeg's reason (that image's pixels are then undefined)."""
    n = len(jobs)
    crop = jobs[0].crop
    out_h, out_w = crop.crop.size
    # One tensor per image, not one buffer for all: an image is kept until its batch is stacked,
    # and images of that size come from the heap that the ones before them freed (workers.py).
    images = [torch.empty(out_h, out_w, 3, dtype=torch.uint8) for _ in jobs]
    # The bytes' own buffers, no copy: a bytes object's is fixed while it lives (the jobs hold them).
    views = [np.frombuffer(job.data, dtype=np.uint8) for job in jobs]
    bufs = np.array([v.ctypes.data for v in views], dtype=np.uintp)
    lens = np.array([len(v) for v in views], dtype=np.uint64)
    outs = np.array([image.data_ptr() for image in images], dtype=np.uintp)
    params = np.array([job.params() for job in jobs], dtype=np.intc)
    status = np.zeros(n, dtype=np.intc)
    msgs = ctypes.create_string_buffer(MSG_LEN * n)
    args = (bufs.ctypes.data, lens.ctypes.data, params.ctypes.data, out_h, out_w, outs.ctypes.data)
    failed = crop.lib.jpegcrop_batch(n, *args, max(1, threads), status.ctypes.data, msgs)
    reasons: list[str | None] = [None] * n
    if failed:
        raw = msgs.raw
        for i in np.flatnonzero(status):
            reasons[i] = raw[i * MSG_LEN : (i + 1) * MSG_LEN].split(b"\0", 1)[0].decode(errors="replace")
    return images, reasons


def rendered(
    items: Iterable[tuple], chunk: int, threads: Callable[[], int], before: Callable[[], Any] | None = None
) -> Iterator[tuple]:
    """``(seq, sample, prepared)`` items (stream._prepared's) in the same order, each RegionJob
    among the next ``chunk`` replaced by its ``(image, label)`` where the kernel made it.
    ``threads()``: the threads for the next kernel call; 0 passes items on one by one, untouched
    (the warm start's leader makes its first batch on its own threads as the samples come,
    warmstart.py); ``before()``: called before each kernel call (a warm start's follower waits
    there, once, for the leader's first batch). An error that ends the stream is raised after
    the items read before it have been given."""
    items = iter(items)
    while True:
        nthreads = threads()
        if nthreads == 0:
            item = next(items, None)
            if item is None:
                return
            yield item
            continue
        window, error = [], None
        try:
            for item in items:
                window.append(item)
                if len(window) >= chunk:
                    break
        except Exception as exc:  # noqa: BLE001 (raised again below, once the window is out)
            error = exc
        at = [i for i, (_, _, prepared) in enumerate(window) if isinstance(prepared, RegionJob)]
        if at:
            if before is not None:
                before()
            images, reasons = render_jobs([window[i][2] for i in at], nthreads)
            for k, i in enumerate(at):
                if reasons[k] is None:
                    seq, sample, job = window[i]
                    window[i] = (seq, sample, (images[k].permute(2, 0, 1), job.label))
        yield from window
        if error is not None:
            raise error
        if len(window) < chunk:
            return
