"""loader.decode=gpu: a batch's JPEGs decoded in the training process, on its GPU, by the draws
its workers made.

A worker does for a JPEG what it does on the CPU path up to the decode: it checks the sample,
reads the image's size from its header and draws its crop and flip (the v2 transforms' own
``make_params`` and ``torch.rand``, in the stream's order), so the random stream, the batch's
samples, labels, skips and the resume state are those of decode=cpu. Instead of pixels it hands
on a ``Drawn``: the bytes and the draws (for evaluation, the whole image: resize.eval_geometry
gives its resize and centre crop). ``pack`` puts a batch's ``Drawn`` bytes into one tensor (one
shared-memory transfer to the main process). ``BatchDecoder`` then decodes the batch in one call
(codecs.py: nvImageCodec, each crop as a region, or torchvision's nvJPEG) into one reused buffer,
and crops, resizes (bilinear, antialiased, in floating point) and flips the whole batch into one
uint8 N x 3 x S x S channels_last tensor in two launches (resize.py). The CPU path resizes uint8
with integer weights: the pixels agree within a grey level. The same functions run on CPU tensors
(nvImageCodec's CPU backend, Triton's interpreter), which is how the suite tests the path
without a GPU.

What the GPU decoder is not given, the worker decodes as on the CPU path, one by one, counted:
PNG, GIF, WebP, a JPEG cut short (no end-of-image marker), one of other than 1 or 3 components
(CMYK, YCCK), arithmetic-coded, lossless or 12-bit. A JPEG the GPU's decoder refuses in the training process
is decoded there on the CPU (torchvision's libjpeg-turbo, as the CPU path's whole decode); one
that neither decodes is left out of its batch, counted as a skipped sample and named in a
warning (the CPU path skips such a sample in the worker and fills its place with the next one;
here the batch is made already, so it is one row shorter).

Streams: torchvision's nvJPEG decode writes on a stream of its own, which is not ordered against
the caller's (pytorch/vision#9606): memory the caller's stream has freed but still reads can be
handed to the decoder's outputs and overwritten. nvImageCodec orders its work after the stream
it is given. Either way, the batch is decoded and resized on a side stream that holds nothing
but this decoder's work and is drained before each decode; the training stream waits for the
side stream's work through an event, and the batch's tensor is recorded on it. The training
stream's own blocks never reach the side stream's allocations.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.io import ImageReadMode, decode_image

from wdsdist.data.decode import codecs
from wdsdist.data.decode.resize import BatchResize, Geometry, Place, eval_geometry, reference, train_geometry
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

# Frame headers nvJPEG decodes: baseline, extended and progressive Huffman (SOF0, SOF1, SOF2).
_GPU_FRAMES = {0xC0, 0xC1, 0xC2}
_FRAMES = _GPU_FRAMES | {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD9)}  # markers without a length (TEM, RSTn, SOI)


@dataclass(frozen=True)
class Drawn:
    """A JPEG and its drawn crop and flip, as a worker hands it on under decode=gpu."""

    data: bytes
    box: tuple[int, int, int, int, int]  # top, left, height, width, flip
    where: str  # the shard and key, for a warning
    size: int | None = None  # its batch's size (loader.size_schedule); None: the decoder's
    augment: Any = None  # its augmentations' draws (augment.Drawn), made on the device (gpu_augment.py)


def gpu_takes(data: bytes) -> bool:
    """A JPEG whose frame header nvJPEG decodes: 8-bit Huffman (baseline, extended or
    progressive) with 1 or 3 components. The markers before the frame header are walked by
    their lengths, never past the data."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in _FRAMES:
            return marker in _GPU_FRAMES and i + 10 <= n and data[i + 4] == 8 and data[i + 9] in (1, 3)
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA or length < 2:  # scan data before any frame header, or a broken length
            return False
        i += 2 + length
    return False


def pack(images: Sequence) -> dict:
    """A batch's rows as a worker hands them over: the ``Drawn`` rows' bytes in one uint8 tensor
    with their lengths and draws, and the rows the worker decoded itself (``ready``) stacked."""
    rows = [i for i, image in enumerate(images) if isinstance(image, Drawn)]
    ready_rows = [i for i, image in enumerate(images) if not isinstance(image, Drawn)]
    drawn = [images[i] for i in rows]
    joined = bytearray().join(d.data for d in drawn)
    return {
        "data": torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8),
        "lengths": [len(d.data) for d in drawn],
        "boxes": [d.box for d in drawn],
        "where": [d.where for d in drawn],
        "augment": [d.augment for d in drawn],
        "size": drawn[0].size if drawn else None,
        "rows": rows,
        "ready_rows": ready_rows,
        "ready": torch.stack([images[i] for i in ready_rows]) if ready_rows else None,
    }


def device() -> torch.device:
    """The GPU this process decodes on (torch's current CUDA device); UserError where there is none."""
    if not torch.cuda.is_available():
        extra = codecs.nvimgcodec_version()
        which = f"; {codecs.NVIMGCODEC} {extra} is installed, and it decodes on a GPU" if extra else ""
        raise UserError(
            f"loader.decode=gpu: torch sees no CUDA GPU here (torch {torch.__version__}{which}); "
            "use loader.decode=cpu, the default"
        )
    return torch.device("cuda", torch.cuda.current_device())


class BatchDecoder:
    """Makes the images of the batches that workers packed (``batch["jpeg"]``) on ``device``:
    ``batch["image"]``, uint8 N x 3 x size x size, channels_last: the training crops (``train``)
    or evaluation's resize and centre crop. ``counts``: images decoded on the device, on the CPU
    (in a worker or here), and left out; ``host``: the seconds of host time by phase (the decode
    call, the resize's launch, the hand-over; ``decode_cpu``: the CPU time of the decode call on
    its own thread, the rest being nvImageCodec's threads, the JPEG engines or the GIL) and the
    batches they cover."""

    def __init__(
        self,
        size: int,
        device: torch.device,
        train: bool = True,
        engine: str = "auto",
        short_side: int | None = None,
        augment: Callable[[torch.Tensor, list], torch.Tensor] | None = None,
    ):
        self.size, self.device, self.train, self.short_side = size, device, train, short_side
        self.augment = augment  # the drawn augmentations on the batch (gpu_augment.BatchAugment)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.codec = codecs.choose(device, self.stream, engine)
        self.resize = BatchResize(size, device)
        self.counts: collections.Counter[str] = collections.Counter()
        self.host: collections.Counter[str] = collections.Counter()
        self.warm = False

    @property
    def described(self) -> str:
        return f"{self.codec.name}; crop, resize and flip: {self.resize.how}"

    def setup(self) -> None:
        """On the thread that decodes: the CUDA device is a thread's own."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def decode(self, batch: dict) -> dict:
        """The batch's images made on the device, on the side stream (delivery/gpubatches.py runs
        this on a thread of its own, a batch ahead): ``batch["image"]``, and ``batch["failed"]``,
        the rows no decoder could make. ``hand_over`` then gives it to the caller's stream."""
        packed = batch.pop("jpeg", None)
        if self.host["batches"] == 1 and not self.warm:  # the first compiled the kernels: not counted
            self.host.clear()
            self.warm = True
        self.host["batches"] += 1
        if packed is None:  # every row made in its worker (no JPEG the GPU takes)
            self.counts["cpu"] += len(batch["image"])
            with self._side():
                batch["image"] = batch["image"].to(self.device).contiguous(memory_format=torch.channels_last)
            return self._done(batch, [])
        with self._side():
            made, failed = self._make(packed)
            if self.augment is not None and any(d is not None for d in packed.get("augment", ())):
                began = time.perf_counter()
                made = self.augment(made, packed["augment"])
                self.host["augment"] += time.perf_counter() - began
            if packed["ready_rows"]:
                n, size = len(packed["rows"]) + len(packed["ready_rows"]), made.shape[-1]
                out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=self.device)
                out = out.contiguous(memory_format=torch.channels_last)
                out[packed["rows"]] = made
                out[packed["ready_rows"]] = packed["ready"].to(self.device)
                made = out
        batch["image"] = made
        self.counts["cpu"] += len(packed["ready_rows"])
        return self._done(batch, failed)

    def _done(self, batch: dict, failed: list[int]) -> dict:
        batch["failed"] = failed
        if self.stream is not None:
            batch["made"] = torch.cuda.Event()
            batch["made"].record(self.stream)
        return batch

    def hand_over(self, batch: dict, total_of: Callable[[int], int] | None = None) -> dict:
        """A decoded batch as the caller gets it, on the caller's thread: its stream waits for the
        images to be made and holds their memory until it is done with them; the rows no decoder
        could make are filled (fill_rows; ``total_of(epoch)``: the epoch's positions, split=samples)."""
        began = time.perf_counter()
        made = batch.pop("made", None)
        if made is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(made)
            batch["image"].record_stream(current)
        failed = batch.pop("failed", [])
        if failed:
            fill_rows(batch, failed, total_of(int(batch["id"][0, 0])) if total_of is not None else None)
        self.host["hand_over"] += time.perf_counter() - began
        return batch

    @contextmanager
    def _side(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.synchronize()  # nothing of ours in flight when the decoder writes (module docstring)
        with torch.cuda.stream(self.stream):
            yield

    def _make(self, packed: dict) -> tuple[torch.Tensor, list[int]]:
        """The packed JPEGs decoded (one call), cropped, resized and flipped (two launches), in
        the order of ``packed["rows"]``; the batch rows that no decoder could make."""
        began, began_cpu = time.perf_counter(), time.thread_time()
        datas = list(torch.split(packed["data"], packed["lengths"])) if packed["lengths"] else []
        boxes = packed["boxes"]
        regions = [tuple(box[:4]) if self.train else None for box in boxes]
        src, places = self.codec.decode(datas, regions)
        decoded = time.perf_counter()
        self.host["decode"] += decoded - began
        self.host["decode_cpu"] += time.thread_time() - began_cpu  # this thread's only (gpu-check's probe: all)
        size = packed.get("size") or self.size  # loader.size_schedule: the batch's own size
        geometry = [self._geometry(box, size) for box in boxes]
        on_device = [i for i, place in enumerate(places) if place is not None]
        made = self.resize(src, [places[i] for i in on_device], [geometry[i] for i in on_device], size)
        self.counts["gpu"] += len(on_device)
        self.host["resize"] += time.perf_counter() - decoded
        if len(on_device) == len(places):
            return made, []
        return self._on_cpu(packed, datas, places, geometry, made, on_device, size)

    def _on_cpu(self, packed, datas, places, geometry, made, on_device, size) -> tuple[torch.Tensor, list[int]]:
        """The JPEGs the device's decoder refused, decoded here by libjpeg-turbo (as the CPU path's
        whole decode) and resized one by one; those that neither decodes are left out."""
        out = torch.empty((len(places), 3, size, size), dtype=torch.uint8, device=self.device)
        out = out.contiguous(memory_format=torch.channels_last)
        if on_device:
            out[on_device] = made
        failed, kept = [], []
        for i, place in enumerate(places):
            if place is not None:
                kept.append(i)
                continue
            image = _cpu_decode(datas[i], packed["where"][i])
            if image is None:
                failed.append(packed["rows"][i])
                continue
            kept.append(i)
            top, left, height, width = packed["boxes"][i][:4]
            region = image[:, top : top + height, left : left + width].permute(1, 2, 0).contiguous().flatten()
            place = Place(0, width * 3, height, width)
            out[i] = reference(region.to(self.device), [place], [geometry[i]], size)[0]
            self.counts["cpu"] += 1
        self.counts["failed"] += len(failed)
        return out, failed

    def _geometry(self, box: Sequence[int], size: int) -> Geometry:
        if self.train:
            return train_geometry(size, box[4])
        return eval_geometry(box[2], box[3], size, self.short_side)


class Decoders:
    """decode=gpu's decoders, one per decode thread (loader.gpu_decode_threads; gpubatches.py
    runs each on a thread of its own): their counts and host time added up."""

    def __init__(
        self,
        threads: int,
        size: int,
        device: torch.device,
        train: bool = True,
        engine: str = "auto",
        short_side: int | None = None,
        augment: Callable[[], Callable] | None = None,
    ):
        # ``augment`` makes each decoder's own (its counts are the decoder's thread's)
        made = [augment() if augment else None for _ in range(threads)]
        self.all = [BatchDecoder(size, device, train, engine, short_side, aug) for aug in made]

    @property
    def pairs(self) -> list[tuple]:
        """Each decoder's ``(decode, setup)``, for gpubatches.decoded_ahead."""
        return [(d.decode, d.setup) for d in self.all]

    @property
    def counts(self) -> collections.Counter[str]:
        return sum((d.counts for d in self.all), collections.Counter())

    @property
    def host(self) -> collections.Counter[str]:
        return sum((d.host for d in self.all), collections.Counter())

    @property
    def described(self) -> str:
        threads = len(self.all)
        return self.all[0].described + (f"; {threads} decode threads" if threads > 1 else "")

    def hand_over(self, batch: dict, total_of: Callable[[int], int] | None = None) -> dict:
        """Any decoder's hand-over does it (the batch carries its event); its time is counted there."""
        return self.all[0].hand_over(batch, total_of)


def _cpu_decode(data: torch.Tensor, where: str) -> torch.Tensor | None:
    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError) as exc:
        log.warning("%s: cannot decode image: %s; left out of its batch (decode=gpu)", where, exc)
        return None


def fill_rows(batch: dict, rows: list[int], total: int | None = None) -> None:
    """Fill ``rows`` of a finished batch, which no decoder could make, as a worker fills a lost
    sample (delivery/fill.py): each takes the next good row's image, label and key (its pixels
    too: the draws were made), is marked padding in ``pos`` (N + that row's position, with the
    epoch's ``total`` N) and counts its loss in ``bad``. A batch with no good row loses them."""
    n = len(batch["label"])
    gone = set(rows)
    good = [i for i in range(n) if i not in gone]
    if not good:
        keep = []
        batch["bad"] = batch["bad"][keep]
        for name in ("image", "label", "id", "pos", "source"):
            if name in batch:
                batch[name] = batch[name][keep]
        return
    bad = batch["bad"].clone()
    for row in rows:
        twin = next((i for i in good if i > row), good[0])
        bad[row, 0] += 1
        for name in ("image", "label", "source"):
            if name in batch:
                batch[name][row] = batch[name][twin]
        pos = int(batch["pos"][twin])
        batch["pos"][row] = pos + total if total is not None and 0 <= pos < total else pos
        if isinstance(batch.get("key"), list):
            name = str(batch["key"][row])
            batch.setdefault("bad_samples", []).append(name)
            batch.setdefault("bad_errors", []).append(f"sample {name!r}: no decoder could make it (decode=gpu)")
            batch["key"][row] = batch["key"][twin]
    batch["bad"] = bad
