"""Shared-memory batch buffers that DataLoader workers fill and reuse, batch after batch.

A worker that returns a new tensor pays for a new shared-memory file per batch: create it, have
the kernel zero it (torch fallocates shared memory) and fault in every page, then the main
process maps it again and faults once more: a new tensor per batch cost a worker many times what
stacking into a reused one does (bench/results/2026-11-21-loader.md). So each worker owns a few
buffers, allocated once before the workers start; a batch leaves the worker as a buffer number
plus its labels, and the main process copies the images out (one memcpy, into pinned memory when
the batches go to a GPU, or else into memory it takes back when the caller drops the batch:
CopyPool) and hands the buffer back at once. The batch the caller gets is its own tensor.

Handing back goes through one pipe per worker (main process -> worker), written
synchronously. A worker restarting its iteration (each epoch, each DataLoader reset) takes every
buffer as free again: the DataLoader discards, unclaimed, any batch of the previous iteration
still in flight, and each release carries the iteration it belongs to, so a late one is ignored.
While every worker is active, a worker has at most ``prefetch`` batches assigned and not yet
taken, plus the one being copied, so ``prefetch + 1`` buffers cover it. When other workers have
ended their epoch the DataLoader gives their share to the ones left (up to ``prefetch + workers
- 1`` each); a worker that finds no free buffer then stacks that batch into new shared memory
of its own, and never waits.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import mmap
import multiprocessing
import struct
import sys
import weakref

import numpy as np
import torch

_RELEASE = struct.Struct("<qq")  # (iteration, buffer)


class SharedBatches:
    def __init__(self, workers: int, buffers: int, shape: tuple[int, ...], channels_last: bool = False):
        """``shape``: one batch, (N, C, H, W). With ``channels_last`` the buffers hold each image
        as H x W x C in memory (the batches are NCHW tensors in torch's channels_last format), as
        region-decoded images are: stacking them into an NCHW-contiguous buffer transposes every
        image, many times slower (bench/results/2026-11-21-loader.md)."""
        self.shape, self.nbuffers, self.channels_last = tuple(shape), buffers, channels_last
        n, c, h, w = shape
        layout = (buffers, n, h, w, c) if channels_last else (buffers, *shape)
        self._raw = [shared_uint8(layout) for _ in range(workers)]
        self.buffers = [b.permute(0, 1, 4, 2, 3) for b in self._raw] if channels_last else self._raw
        pipes = [multiprocessing.Pipe(duplex=False) for _ in range(workers)]
        self._released = [reader for reader, _ in pipes]
        self._release = [writer for _, writer in pipes]
        # A worker's own view (each worker has its copy of this object):
        self.iteration = 0
        self._free: set[int] = set()
        self.copies = CopyPool()  # the main process's: what claimed batches are copied into

    # ---------------------------------------------------------------- in a worker

    def restart(self, worker: int) -> None:
        """A new iteration: every buffer is free (what is in flight was discarded)."""
        reader = self._released[worker]
        while reader.poll():
            reader.recv_bytes()
        self.iteration += 1
        self._free = set(range(self.nbuffers))

    def view(self, worker: int, k: int, n: int, size: int) -> torch.Tensor:
        """Buffer ``k`` of ``worker`` as a batch of ``n`` images of ``size`` x ``size``: the front of
        its memory, in its layout (a smaller size of loader.size_schedule uses less of it)."""
        if size == self.shape[-1]:
            return self.buffers[worker][k, :n]
        c = self.shape[1]
        flat = self._raw[worker][k].view(-1)[: n * c * size * size]
        if self.channels_last:
            return flat.view(n, size, size, c).permute(0, 3, 1, 2)
        return flat.view(n, c, size, size)

    def fill(self, worker: int, images: list[torch.Tensor]) -> tuple[int, ...] | None:
        """Stack ``images`` into a free buffer and return the reference that travels in the batch;
        None (nothing written) when every buffer is in use."""
        reader = self._released[worker]
        while reader.poll():
            iteration, k = _RELEASE.unpack(reader.recv_bytes())
            if iteration == self.iteration:
                self._free.add(k)
        if not self._free:
            return None
        # The lowest free one: while the caller keeps up, a worker cycles through one or two
        # buffers, and the pages of the others are never touched (see shared_uint8).
        k = min(self._free)
        self._free.discard(k)
        size = images[0].shape[-1]
        torch.stack(images, out=self.view(worker, k, len(images), size))
        return worker, self.iteration, k, len(images), size

    def populate(self, worker: int) -> bool:
        """Have the kernel allocate and map the pages of the worker's first buffer now, in one
        call that holds no lock of Python's (the warm start's leader makes it on one of its
        threads while the others decode). Stacking the first batch into untouched pages faults
        them in one by one after the last decode, before the batch can leave; in one call they
        are mapped beside the decodes (bench/results/2026-11-24-peers.md; the kernel gives shared
        memory no huge pages). False where the kernel cannot (MADV_POPULATE_WRITE is Linux
        5.14's): the stack then faults them in."""
        first = self.buffers[worker][0]
        return _populate(first.data_ptr(), first.numel())

    # ---------------------------------------------------------------- in the main process

    def claim(self, ref: tuple[int, ...], pin_memory: bool = False) -> torch.Tensor:
        """The images of a batch as the caller's own tensor; the buffer goes back to its worker."""
        source = self._batch(ref)
        # Pinned: torch's host allocator keeps its own blocks for reuse.
        if pin_memory or not _dense(source) or not source.numel():
            images = plain_copy(source, pin_memory)
        else:
            images = self.copies.empty_like(source)
            ctypes.memmove(images.data_ptr(), source.data_ptr(), source.numel())
        self._hand_back(ref)
        return images

    def claim_rows(self, ref: tuple[int, ...]) -> list[torch.Tensor]:
        """The images of a batch, each its own tensor (for the cross-worker shuffle, where a
        view would keep its whole batch alive until the last of its images left the buffer)."""
        images = [plain_copy(image) for image in self._batch(ref)]
        self._hand_back(ref)
        return images

    def _batch(self, ref: tuple[int, ...]) -> torch.Tensor:
        worker, _, k, n, size = ref
        return self.view(worker, k, n, size)

    def _hand_back(self, ref: tuple[int, ...]) -> None:
        worker, iteration, k = ref[:3]
        self._release[worker].send_bytes(_RELEASE.pack(iteration, k))


_MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it


def _populate(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the pages that hold these bytes; through ctypes, which
    lets go of the GIL for the call (mmap.madvise holds it)."""
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address - address % mmap.PAGESIZE
    return libc.madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0


def shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor in memory shared with DataLoader workers started after it.

    When workers are forked (Linux's default start method before Python 3.14), an anonymous
    shared mapping: made at once, and each page is only allocated when first written. torch's
    shared memory (``share_memory_``) allocates and zeroes every page up front, paid before the
    first batch (bench/results/2026-11-23-batch-handover.md), and every buffer counted
    in the loader's memory even when the caller keeps up and a worker only ever uses one.
    Other start methods pickle the dataset to the workers, which only torch's shared memory
    survives."""
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if method != "fork":
        return torch.empty(shape, dtype=torch.uint8).share_memory_()
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape)), dtype=torch.uint8).view(shape)


class CopyPool:
    """Memory for the batches the main process copies out of the shared buffers, used again
    once the caller has let go of a batch.

    A batch of 64 x 224 x 224 images is 9.6 MB. From malloc, such copies either fault in fresh
    pages every time or pile up in the heap, which then holds freed batches
    (bench/results/2026-11-23-batch-handover.md).
    Here each copy is a region of its own (an anonymous mapping); when the caller drops the last
    tensor that uses it (a view included: it keeps the storage), the region comes back and the
    next copy of that size goes into its pages, already mapped, several times faster. The ``keep``
    regions that came back last wait, whatever their sizes (an epoch's last, short batch has a
    size of its own); an older one is unmapped. A region in use is never handed out, so a batch
    the caller keeps is never overwritten. Regions come back on whichever thread drops a batch.

    As with any allocator, memory the caller's tensor no longer uses is reused: ``share_memory_()``
    (and a ``torch.multiprocessing`` queue) moves a tensor into new shared memory and frees the
    old, so a numpy array or DLPack capsule taken from the batch before that points at memory the
    next batch is copied into. Take such views after sharing, not before.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        # (size, region), newest last. Regions come back through a weakref callback, which can run
        # on any thread, or on this one in the middle of empty_like when an allocation there
        # starts a garbage collection that frees a batch: so no lock, only the deque's own
        # atomic append and pop (a lock taken twice on one thread would hang the loader).
        self._free: collections.deque[tuple[int, mmap.mmap | bytearray]] = collections.deque(maxlen=keep)

    def __getstate__(self) -> dict:  # a spawned worker gets an empty pool (it never copies out)
        return {"keep": self.keep}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["keep"])

    def empty_like(self, source: torch.Tensor) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``source``'s shape and strides (which fill their span)."""
        nbytes, region = source.numel(), None
        while region is None:
            try:
                size, region = self._free.pop()
            except IndexError:
                region = _new_region(nbytes)
                break
            if size != nbytes:
                region = None  # another size (a short batch): unmapped once nothing refers to it
        # The tensor's storage keeps this array alive, and the array keeps the region mapped;
        # when the storage goes, the array does, and the region comes back (the oldest waiting
        # one, beyond ``keep``, falls out of the deque).
        array = np.frombuffer(region, dtype=np.uint8)
        weakref.finalize(array, self._free.append, (nbytes, region)).atexit = False
        # Strided in numpy, so the batch is a tensor of its own rather than a view of a flat one.
        # (Its storage is numpy's, so it cannot be resized.)
        return torch.from_numpy(np.lib.stride_tricks.as_strided(array, source.shape, source.stride()))

    def reserve(self, nbytes: int) -> None:
        """A region for the next copy of ``nbytes``, its pages faulted in now. The main process
        calls it while its workers make their first batches, when it has nothing else to do: in
        the first copy, faulting in a fresh region (huge pages, compacted on demand) would add to
        the time to the first batch (bench/results/2026-11-23-batch-handover.md)."""
        if any(size == nbytes for size, _ in self._free):
            return
        region = _new_region(nbytes)
        np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # one write a page
        self._free.append((nbytes, region))

    def free_regions(self) -> int:
        return len(self._free)


def _new_region(nbytes: int) -> mmap.mmap | bytearray:
    if not hasattr(mmap, "MAP_PRIVATE"):  # not POSIX
        return bytearray(nbytes)
    # Private: the caller's own memory, not shared with workers forked later. Huge pages where
    # the kernel gives them on request (private anonymous memory only): 5 faults, not 2,350.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    return region


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill their span of memory exactly (contiguous in some order of the
    dimensions, as NCHW and channels_last both are), so one memcpy of numel elements copies it."""
    expected = 1
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1]
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def plain_copy(source: torch.Tensor, pin_memory: bool = False) -> torch.Tensor:
    """A copy of a tensor, in the same memory layout, by one memcpy on this thread. Tensor.copy_
    would split it over OpenMP threads that then spin on the cores the workers decode on
    (bench/results/2026-11-21-loader.md: the main process's CPU several times higher)."""
    if not _dense(source):
        source = source.contiguous()
    copy = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, pin_memory=pin_memory)
    ctypes.memmove(copy.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
    return copy


def plain_stack(tensors: list[torch.Tensor], pin_memory: bool = False) -> torch.Tensor:
    """torch.stack of tensors of one shape, in the first one's memory layout, one memcpy each on
    this thread (torch.stack parallelises each of them, which took most of the main process's time
    in the cross-worker shuffle: bench/results/2026-11-21-loader.md). A tensor in another layout is
    copied element-wise."""
    first = tensors[0] if _dense(tensors[0]) else tensors[0].contiguous()
    n = first.numel()
    out = torch.empty_strided(
        (len(tensors), *first.shape), (n, *first.stride()), dtype=first.dtype, pin_memory=pin_memory
    )
    nbytes, base = n * first.element_size(), out.data_ptr()
    for i, tensor in enumerate(tensors):
        if tensor.stride() == first.stride():
            ctypes.memmove(base + i * nbytes, tensor.data_ptr(), nbytes)
        else:
            out[i].copy_(tensor)
    return out
