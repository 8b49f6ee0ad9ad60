"""The WebDataset pipeline and loader shared by train.py and simdist.py.

One rank's loader, in order:
  shards[rank::world] -> shards[worker::nworkers] (in each DataLoader worker)
  -> shard order shuffled per epoch (seed + epoch: new every epoch, the same on every rank),
     read ``dsrepeat`` times -> tar -> shuffle buffer of raw (compressed) samples
  -> decode -> augment -> batch inside the worker, into a shared buffer it reuses
  -> WebLoader(batch_size=None) -> the batch copied out (uint8 NCHW images, int64 labels)
  -> optional shuffle of samples across the rank's workers, then batched again
  -> epochless (each worker runs from epoch to epoch without stopping), or one epoch cut to
     ``nbatches``.

Every sample carries an id (epoch, worker, position in the worker's shuffled stream) so the
rank's loader knows exactly what was consumed; that is the loader state a checkpoint keeps,
and a resumed loader skips exactly those samples, before decoding them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import io
import itertools
import multiprocessing
import os
import random
import signal
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from webdataset.filters import _batched, _shuffle

from wdsdist.data import httpopen, jpegcrop, shardspec
from wdsdist.data.index import count_samples
from wdsdist.data.jpegcrop import CropDecoder, JpegError, crop_decoder
from wdsdist.data.shardspec import Shard
from wdsdist.data.sharedbatches import SharedBatches, plain_copy, plain_stack
from wdsdist.data.splits import Plan, plan, split_by_rank, split_by_worker
from wdsdist.data.tarread import Oversized, tar_samples
from wdsdist.errors import DataError, UserError

MODES = ("repeat", "epoch", "resampled")

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they remain the
# libjpeg-turbo/libpng decoders that work here, so keep the warning out of every worker's log.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities", category=DeprecationWarning)
# decode_image only reads its input, so it gets the sample's bytes without a copy; torch warns
# that the buffer is read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass
class LoaderConfig:
    """Everything that shapes one rank's loader. Plain values only: it travels to workers."""

    batch_size: int
    workers: int = 2
    mode: str = "repeat"  # repeat (epochless) | epoch | resampled
    train: bool = True  # train: RandomResizedCrop + flip; eval: resize + center crop
    image_size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    image_key: str = "jpg;jpeg;png"
    label_key: str = "cls"
    seed: int = 0
    shuffle_buffer: int = 1000  # raw samples, inside each worker; 0: off
    cross_shuffle: int = 0  # samples, across workers in the rank's loader; 0: no re-batching
    partial: bool = False
    nbatches: int | str | None = None  # epoch mode: cut every rank to N, or "auto"
    dsrepeat: int = 1
    prefetch: int = 2
    pin_memory: bool = False
    reuse_buffers: bool = True  # workers stack batches into shared buffers they reuse (sharedbatches)
    decode_region: bool = True  # train: decode only the crop's region of a JPEG (jpegcrop)
    decode_downscale: bool = True  # ... at 1/2, 1/4 or 1/8 of its size where the crop is that much larger
    with_keys: bool = False  # carry sample keys in batches (simdist's coverage check)
    trace: bool = False  # print every shard open and close (simdist --showopen)
    strict: bool = False  # a bad shard or sample is an error (default: skipped, warned and counted)
    allow_pipe: bool = False  # accept pipe: URLs (they run a shell command)
    trust_index: bool = False  # an index may name shards outside its own place (shardspec.Access)
    max_pixels: int = 89_478_485  # larger images (width x height x frames) are corrupt (decompression bombs)
    max_member_bytes: int = 64 << 20  # larger tar members are corrupt samples, skipped unread
    num_classes: int | None = None  # labels outside [0, num_classes) are corrupt samples; None: unchecked
    http_timeout: float = 60.0  # seconds without data before an http(s) shard counts as failed
    http_min_rate: int = httpopen.DEFAULT_MIN_RATE  # bytes/s per http_timeout of waiting (httpopen); 0: off

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"loader.mode={self.mode!r}: must be one of {', '.join(MODES)}")
        for name in ("batch_size", "dsrepeat", "image_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("workers", "shuffle_buffer", "cross_shuffle"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.nbatches is not None and self.nbatches != "auto":
            try:
                self.nbatches = int(self.nbatches)
            except ValueError:
                raise UserError(f"nbatches={self.nbatches!r}: must be an integer or auto") from None
            if self.nbatches < 1:
                raise UserError(f"nbatches={self.nbatches}: must be >= 1 or auto")

    @property
    def access(self) -> shardspec.Access:
        return shardspec.Access(self.allow_pipe, self.trust_index, self.http_timeout, self.http_min_rate)

    @property
    def rebatch(self) -> bool:
        return self.cross_shuffle > 0

    @property
    def wanted_suffixes(self) -> frozenset[str]:
        """The members a sample is read for; others are skipped unread."""
        return frozenset(k.lower() for k in f"{self.image_key};{self.label_key}".split(";") if k)


# ---------------------------------------------------------------- opening shards (in workers)


def open_shard(url: str, cfg: LoaderConfig) -> io.BufferedIOBase:
    """Open a shard for sequential reading.

    http(s) goes through urllib (httpopen), never a shell, so a URL cannot inject a command;
    a server that does not answer fails in ``http_timeout`` seconds, one that drips data fails
    below ``http_min_rate``, and a redirect off http(s) is refused. ``pipe:`` runs its command
    in a shell (WebDataset's gopen) and is refused unless ``allow_pipe``. Local files honour
    WebDataset's GOPEN_BUFFER (bytes of read buffer) for slow disks.
    """
    if url.startswith(("http://", "https://")):
        return httpopen.open_url(url, cfg.http_timeout, cfg.http_min_rate)
    if url.startswith("pipe:"):
        if not cfg.allow_pipe:
            raise DataError(f"{url}: pipe: URLs are refused (allow_pipe is false)")
        return wds.gopen(url, "rb")
    if shardspec.is_remote(url) or url.startswith("file:"):
        return wds.gopen(url, "rb")
    return open(url, "rb", buffering=int(os.environ.get("GOPEN_BUFFER", -1)))


_warned = [0]
_malloc_pinned = [False]


def pin_malloc_threshold(nbytes: int = 1 << 20) -> None:
    """Fix glibc's mmap threshold in this process (once).

    glibc raises the threshold each time a large block (a decoded image) is freed, after which
    such blocks come from the heap, which fragments: a persistent worker then grows by tens of
    MB every epoch (measured: 236 -> 437 MB over 4 epochs of ImageNet-sized JPEGs). A fixed
    1 MiB threshold keeps workers flat (~205 MB) at no cost in speed; 128 KiB would cost a
    third of the decode rate in mmap calls.
    """
    if _malloc_pinned[0] or not sys.platform.startswith("linux"):
        return
    _malloc_pinned[0] = True
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to pin


def warn_skip(error: Exception, limit: int = 20) -> None:
    """One line per skipped shard or sample, up to ``limit`` per worker; they are all counted."""
    _warned[0] += 1
    if _warned[0] <= limit:
        print(f"warning: skipped: {error}", file=sys.stderr, flush=True)
    elif _warned[0] == limit + 1:
        print("warning: more skipped samples; counts go on in the logs", file=sys.stderr, flush=True)


def _worker_init(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the trainer: a signal sent to the whole process group
    (Slurm signals every process of a job step) must not kill them under a trainer that is
    finishing its step and writing a checkpoint. They still end with it: the kernel kills them
    when it exits (PR_SET_PDEATHSIG; strictly, when the thread that started them ends, so a
    loader is iterated from the thread that lives as long as it), and at its normal exit
    ``_end_workers`` does."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # Linux only; elsewhere DataLoader's own watchdog notices
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


@atexit.register
def _end_workers() -> None:
    """At the trainer's exit, kill the DataLoader workers still running: they ignore the SIGTERM
    that multiprocessing would send them and then wait for in vain. (Registered after
    multiprocessing's own exit handler, so it runs before it.)"""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # DataLoader's handler would call this a crash
    for child in children:
        child.kill()


# ---------------------------------------------------------------- per-sample work (in workers)


def _find(sample: dict, keys: str) -> Any:
    for k in keys.split(";"):
        if k in sample:
            return sample[k]
    return None


def _transform(cfg: LoaderConfig) -> v2.Transform:
    size = cfg.image_size
    if cfg.train:
        return v2.Compose(
            [v2.RandomResizedCrop(size, scale=tuple(cfg.crop_scale), antialias=True), v2.RandomHorizontalFlip()]
        )
    return v2.Compose([v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])


# Not JPEG: decoded by PIL, whose decoders raise on damaged data where torchvision's libpng path
# crashes the process (a PNG with one flipped byte in its image data: "libpng error: IDAT:
# incorrect data check", then a segmentation fault). Only the formats torchvision read: PIL
# also opens formats whose loading runs a program (EPS runs Ghostscript).
_PIL_FORMATS = ("PNG", "GIF", "WEBP")
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I")


def _decode_other(data: bytes, where: str, max_pixels: int) -> torch.Tensor:
    """A PNG, GIF or WebP as a uint8 RGB CHW tensor, by PIL; an animation gives its first frame.

    The pixel budget counts every frame, as declared by the file (the frame count of a GIF is
    found by walking its blocks, none decoded): torchvision decoded all of them, and a 940-byte
    GIF with a 2000x2000 canvas and 40 one-pixel frames then cost 470 MB.
    """
    try:
        with Image.open(io.BytesIO(data), formats=_PIL_FORMATS) as img:
            frames = getattr(img, "n_frames", 1)
            width, height = img.size
            if width * height * frames > max_pixels:
                what = f"{width}x{height} pixels" + (f" x {frames} frames" if frames > 1 else "")
                raise DataError(f"{where}: image of {what} exceeds max_pixels={max_pixels}")
            img.seek(0)
            if img.mode in _SIXTEEN_BIT:  # 16-bit grey: keep the high byte (convert() would clip)
                img = img.convert("I").point(lambda v: v * (1 / 256))
            rgb = img.convert("RGB")
            pixels = torch.frombuffer(rgb.tobytes(), dtype=torch.uint8)
    except DataError:
        raise
    except Image.UnidentifiedImageError:
        raise DataError(f"{where}: cannot decode image: not a JPEG, PNG, GIF or WebP image") from None
    except Exception as exc:  # untrusted bytes: whatever PIL raises, the sample is bad, not the run
        raise DataError(f"{where}: cannot decode image: {exc.__class__.__name__}: {exc}") from None
    return pixels.view(rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()


def decode_sample(
    sample: dict, cfg: LoaderConfig, transform: v2.Transform, crop: CropDecoder | None = None
) -> tuple[torch.Tensor, int]:
    """Raw sample -> (uint8 CHW image, label); raises DataError naming the shard and key.
    With ``crop``, a JPEG is decoded only where ``transform``'s crop falls (jpegcrop)."""
    where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
    data, label = _find(sample, cfg.image_key), _find(sample, cfg.label_key)
    if data is None or label is None:
        missing = cfg.image_key if data is None else cfg.label_key
        present = sorted(k for k in sample if not k.startswith("__"))
        raise DataError(f"{where}: no {missing!r} in it (has {', '.join(present)})")
    for what, value in (("image", data), ("label", label)):
        if isinstance(value, Oversized):
            raise DataError(f"{where}: {what} of {value.size} bytes exceeds max_member_bytes={cfg.max_member_bytes}")
    # The label first: a bad one costs no decode.
    try:
        value = int(label.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{where}: label {label[:20]!r} is not an integer") from None
    if cfg.num_classes is not None and not 0 <= value < cfg.num_classes:
        raise DataError(f"{where}: label {value} is outside 0..{cfg.num_classes - 1} (num_classes={cfg.num_classes})")
    data = bytes(data)
    if not data.startswith(jpegcrop.JPEG_MAGIC):
        return transform(_decode_other(data, where, cfg.max_pixels)), value

    def whole() -> torch.Tensor:
        try:
            return decode_image(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
        except (RuntimeError, ValueError) as exc:
            raise DataError(f"{where}: cannot decode image: {exc}") from None

    region = crop is not None and crop.takes(data)
    size = None
    if region:
        with contextlib.suppress(JpegError):  # torchvision then decodes it, or says what is wrong
            size = crop.size(data)
    try:
        # The header alone gives the size: refuse a decompression bomb before allocating it.
        if size is None:
            with Image.open(io.BytesIO(data), formats=("JPEG",)) as header:
                size = header.size
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: cannot decode image: {exc}") from None
    width, height = size
    if width * height > cfg.max_pixels:
        raise DataError(f"{where}: image of {width}x{height} pixels exceeds max_pixels={cfg.max_pixels}")
    if region:
        image = crop(data, width, height, whole)
    else:
        image = transform(whole())
    return image, value


def collate(rows: list[tuple], shared: SharedBatches | None = None, worker: int = 0) -> dict[str, Any]:
    """A batch as it leaves the worker. Labels and ids stay lists (pickled inline: a small tensor
    would cost a shared-memory file of its own); ``finish_batches`` makes tensors of them."""
    images, labels, ids, bad, keys = zip(*rows, strict=True)
    batch: dict[str, Any] = {"label": labels, "id": ids, "bad": bad}
    ref = shared.fill(worker, list(images)) if shared is not None else None
    if ref is not None:
        batch["shared"] = ref
    else:
        # default_collate stacks straight into shared memory inside a worker: the batch then
        # reaches the main process without the extra 10 MB copy the DataLoader makes otherwise.
        batch["image"] = default_collate(list(images))
    if keys[0] is not None:
        batch["key"] = list(keys)
    return batch


def bad_counts(bad: Sequence[Sequence]) -> tuple[torch.Tensor, list[str]]:
    """Rows' skip records (samples, shard reads, then the URL of each shard read that failed)
    -> a [b, 2] count tensor and the failed URLs: a shard that fails on every pass is one bad
    shard, read many times."""
    return torch.tensor([b[:2] for b in bad], dtype=torch.int64), [url for b in bad for url in b[2:]]


def finish_batches(batches: Iterable[dict], shared: SharedBatches | None, pin_memory: bool) -> Iterator[dict]:
    """In the main process: each batch's images as its own tensor, labels and ids as tensors."""
    for batch in batches:
        if "shared" in batch:
            batch["image"] = shared.claim(batch.pop("shared"), pin_memory)  # type: ignore[union-attr]
        elif pin_memory and shared is not None:
            # A worker that found no free buffer sent a batch of its own, which the DataLoader
            # does not pin (its pin_memory is off when buffers are shared): pin it here, or its
            # non_blocking copy to the GPU waits.
            batch["image"] = pin(batch["image"])
        batch["label"] = torch.tensor(batch["label"], dtype=torch.int64)
        batch["id"] = torch.tensor(batch["id"], dtype=torch.int64)
        # bad: [b, 2], the samples and shard reads skipped before each row; bad_shards: their URLs
        batch["bad"], batch["bad_shards"] = bad_counts(batch["bad"])
        yield batch


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in pinned memory (needs CUDA), in the same layout."""
    return plain_copy(tensor, pin_memory=True)


def unbatch_samples(batches: Iterable[dict], shared: SharedBatches | None) -> Iterator[dict]:
    """In the main process, for the cross-worker shuffle: the samples of each batch, each image
    its own tensor. A view into its batch would keep the whole batch alive in the shuffle buffer
    until the last of its samples left (measured: 3.2 GB peak RSS with a buffer of 1000)."""
    for batch in batches:
        if "shared" in batch:
            images = shared.claim_rows(batch.pop("shared"))  # type: ignore[union-attr]
        else:
            images = [plain_copy(image) for image in batch.pop("image")]
        keys = batch.get("key") or [None] * len(images)
        for image, label, id_, bad, key in zip(images, batch["label"], batch["id"], batch["bad"], keys, strict=True):
            yield {"image": image, "label": label, "id": id_, "bad": bad, "key": key}


def collate_samples(rows: list[dict], pin_memory: bool = False) -> dict[str, Any]:
    """Re-batch samples after the cross-worker shuffle."""
    batch: dict[str, Any] = {
        "image": plain_stack([r["image"] for r in rows], pin_memory),
        "label": torch.tensor([r["label"] for r in rows], dtype=torch.int64),
        "id": torch.tensor([r["id"] for r in rows], dtype=torch.int64),
    }
    batch["bad"], batch["bad_shards"] = bad_counts([r["bad"] for r in rows])
    if rows[0]["key"] is not None:
        batch["key"] = [r["key"] for r in rows]
    return batch


# ---------------------------------------------------------------- the dataset (one per rank)


def shard_order(shards: Sequence[Shard], seed: int, epoch: int, dsrepeat: int) -> list[Shard]:
    """A worker's shards for one epoch: ``dsrepeat`` passes, each shuffled; the same on every rank."""
    rng = random.Random(f"{seed}:{epoch}")
    order: list[Shard] = []
    for _ in range(dsrepeat):
        one = list(shards)
        rng.shuffle(one)
        order.extend(one)
    return order


@dataclass
class ResumePoint:
    """Where each worker of a rank stands: for each epoch it has begun and not left behind,
    every sample before ``start`` and every one listed in ``skip`` was consumed.

    In epoch mode every worker is in ``epoch``. In repeat mode a worker runs from one epoch
    into the next without stopping (a batch may hold the end of one and the start of the next),
    so each worker has its own epochs; ``epoch`` is where a worker with no entry starts.
    """

    epoch: int
    workers: dict[int, dict[int, tuple[int, frozenset[int]]]] = field(default_factory=dict)

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "workers": {
                str(w): {str(e): [s, sorted(k)] for e, (s, k) in epochs.items()} for w, epochs in self.workers.items()
            },
        }

    @classmethod
    def from_state(cls, state: dict) -> ResumePoint:
        epoch, workers = int(state["epoch"]), {}
        for w, entry in state["workers"].items():
            if isinstance(entry, list):  # written before workers had epochs of their own: [start, skip]
                entry = {str(epoch): entry}
            workers[int(w)] = {int(e): (int(s), frozenset(int(i) for i in k)) for e, (s, k) in entry.items()}
        return cls(epoch, workers)

    def first_epoch(self, worker: int) -> int:
        return min(self.workers.get(worker) or [self.epoch])


class ShardStream(IterableDataset):
    """One rank's stream: splits, shuffles, reads, decodes and batches inside each worker."""

    def __init__(
        self,
        shards: Sequence[Shard],
        rank: int,
        world: int,
        cfg: LoaderConfig,
        resume: ResumePoint | None = None,
        shared: SharedBatches | None = None,
    ):
        super().__init__()
        self.all_shards = list(shards)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.rank_shards = split_by_rank(self.all_shards, rank, world)
        self.resume = resume
        self.shared = shared  # used in DataLoader workers only
        self.epoch = -1  # the last epoch begun, in each worker

    def _passes(self, worker: int, nworkers: int, epoch: int) -> list[Iterable[str]]:
        """The worker's shard URLs for this epoch, one list per pass (``dsrepeat`` passes)."""
        cfg = self.cfg
        if cfg.mode == "resampled":
            rng = random.Random(f"{cfg.seed}:{epoch}:{self.rank}:{worker}")
            return [(rng.choice(self.all_shards).url for _ in itertools.count())]
        mine = split_by_worker(self.rank_shards, worker, nworkers)
        if not mine:
            raise DataError(f"rank {self.rank} worker {worker} of {nworkers} has no shard")
        order = [s.url for s in shard_order(mine, cfg.seed, epoch, cfg.dsrepeat)]
        return [order[k * len(mine) : (k + 1) * len(mine)] for k in range(cfg.dsrepeat)]

    def _samples(self, worker: int, nworkers: int, epoch: int, bad: list[int]) -> Iterator[dict]:
        """Raw samples, shuffled within each pass: with dsrepeat, a worker shows every sample
        once before it shows any a second time."""
        cfg = self.cfg
        for k, urls in enumerate(self._passes(worker, nworkers, epoch)):
            samples = self._raw_samples(urls, worker, bad)
            if cfg.shuffle_buffer > 0:
                rng = random.Random(f"{cfg.seed}:{epoch}:{self.rank}:{worker}:{k}:samples")
                samples = _shuffle(samples, cfg.shuffle_buffer, min(cfg.shuffle_buffer, 100), rng=rng)
            yield from samples

    def _raw_samples(self, urls: Iterable[str], worker: int, bad: list[int]) -> Iterator[dict]:
        """Raw samples of these shards; a shard that fails is skipped, counted in ``bad[1]`` and
        its URL appended to ``bad`` (or raises DataError in strict mode)."""
        for url in urls:
            if self.cfg.trace:
                print(f"rank {self.rank} worker {worker} open  {url}", file=sys.stderr, flush=True)
            try:
                stream = open_shard(url, self.cfg)
                try:
                    yield from tar_samples(stream, url, self.cfg.wanted_suffixes, self.cfg.max_member_bytes)
                finally:
                    stream.close()
            except Exception as exc:
                # webdataset appends streams to args; an OSError says more in strerror
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc.args[0] if exc.args else exc
                error = DataError(f"{url}: cannot read shard: {exc.__class__.__name__}: {reason}")
                if self.cfg.strict:
                    raise error from None
                warn_skip(error)
                bad[1] += 1
                bad.append(url)
            if self.cfg.trace:
                print(f"rank {self.rank} worker {worker} close {url}", file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator[dict]:
        """In epoch mode (and with the cross-worker shuffle), one epoch; in repeat and resampled
        mode, epoch after epoch without end. A worker that stopped at each epoch's end would
        decode the samples of its last, partial batch only to drop them and then sit idle while
        the DataLoader restarts it (measured: 6 % of the loader's time on ImageNet-sized shards
        of 250 samples)."""
        pin_malloc_threshold()
        info = get_worker_info()
        worker, nworkers = (info.id, info.num_workers) if info else (0, 1)
        cfg = self.cfg
        partial, skips = cfg.partial, {}
        if self.resume is not None:
            self.epoch = self.resume.first_epoch(worker) - 1
            skips = self.resume.workers.get(worker, {})
            # Re-batched ranks keep every remaining sample so the epoch's count still holds.
            partial = partial or cfg.rebatch
            self.resume = None
        bad: list = [0, 0]  # samples and shard reads skipped since the last row, then the failed URLs
        transform = _transform(cfg)
        crop = crop_decoder(transform, cfg.decode_downscale) if cfg.train and cfg.decode_region else None
        shared = self.shared if info else None
        if shared is not None:
            shared.restart(worker)

        def rows() -> Iterator[tuple]:
            while True:
                self.epoch += 1
                epoch = self.epoch
                start, skip = skips.get(epoch, (0, frozenset()))
                produced = 0
                for seq, sample in enumerate(self._samples(worker, nworkers, epoch, bad)):
                    if seq < start or seq in skip:
                        continue
                    try:
                        image, label = decode_sample(sample, cfg, transform, crop)
                    except DataError as error:
                        if cfg.strict:
                            raise
                        warn_skip(error)
                        bad[0] += 1
                        continue
                    key = sample["__key__"] if cfg.with_keys else None
                    yield image, label, (epoch, worker, seq), tuple(bad), key
                    bad[:] = [0, 0]
                    produced += 1
                if not produced and start == 0 and not skip:
                    # Never a silent empty rank: every shard of this worker failed.
                    raise DataError(
                        f"rank {self.rank} worker {worker} read no sample from its shards "
                        f"(epoch {epoch}); see the warnings above"
                    )
                if cfg.mode == "epoch" or cfg.rebatch:
                    # With the cross-worker shuffle each epoch stays one DataLoader iteration, so
                    # the shuffle buffer empties before the next begins and a resume is exact.
                    return

        collation = functools.partial(collate, shared=shared, worker=worker)
        return _batched(rows(), cfg.batch_size, collation_fn=collation, partial=partial)


# ---------------------------------------------------------------- the rank's loader


class EpochShuffle:
    """WebDataset's shuffle stage with a seeded generator that changes every epoch."""

    def __init__(self, bufsize: int, seed: str):
        self.bufsize, self.seed, self.epoch = bufsize, seed, -1

    def __call__(self, source: Iterator) -> Iterator:
        self.epoch += 1
        rng = random.Random(f"{self.seed}:{self.epoch}")
        return _shuffle(source, self.bufsize, min(self.bufsize, 100), rng=rng)


class ConsumedTracker:
    """Follows the ids of consumed samples to give the loader's exact position.

    A worker's samples of one epoch all arrive before any of its next (a worker's batches come
    in order, and the cross-worker shuffle empties at each epoch's end), so once its next epoch
    shows, the one before is done and forgotten: a resumed worker would otherwise read through
    it again.
    """

    def __init__(self, epoch: int):
        self.base = epoch  # where a worker that delivered nothing yet starts
        self.epoch = epoch  # the newest epoch consumed from (epoch mode: the epoch)
        self.batches = 0  # batches consumed since self.epoch began (counts in epoch mode)
        self.open: dict[int, list] = {}  # worker -> [its epoch, start, seen beyond start]

    def load(self, point: ResumePoint, batches: int) -> None:
        self.base = self.epoch = point.epoch
        self.batches = batches
        self.open = {w: [e, s, set(k)] for w, eps in point.workers.items() for e, (s, k) in eps.items()}

    def update(self, ids: torch.Tensor) -> None:
        rows = ids.tolist()
        newest = max(e for e, _, _ in rows)
        if newest > self.epoch:
            self.epoch, self.batches = newest, 0
        self.batches += 1
        for epoch, worker, seq in rows:
            entry = self.open.get(worker)
            if entry is None or epoch > entry[0]:
                entry = self.open[worker] = [epoch, 0, set()]
            elif epoch < entry[0]:
                continue  # an epoch this worker has left behind
            seen = entry[2]
            seen.add(seq)
            while entry[1] in seen:
                seen.discard(entry[1])
                entry[1] += 1

    def point(self) -> ResumePoint:
        workers = {w: {e: (s, frozenset(k))} for w, (e, s, k) in self.open.items()}
        return ResumePoint(self.base, workers)


class RankLoader:
    """One rank's loader: iterate it for batches; ``state_dict`` is its exact position.

    In epoch mode each ``iter()`` is one epoch of ``plan.nbatches`` batches (every rank the
    same); in repeat and resampled mode ``iter()`` never ends and the trainer counts steps.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        rank: int,
        world: int,
        cfg: LoaderConfig,
        state: dict | None = None,
        plan_: Plan | None = None,
    ):
        if cfg.train and cfg.decode_region:
            lib = jpegcrop.load()  # built here, once, before the workers start
            if isinstance(lib, str):
                if rank == 0:
                    print(f"note: {lib}; decoding whole JPEGs (slower)", file=sys.stderr, flush=True)
                cfg = replace(cfg, decode_region=False)
        self.cfg, self.rank, self.world, self.plan = cfg, rank, world, plan_
        point = ResumePoint.from_state(state["point"]) if state else None
        if state and state.get("workers", cfg.workers) != cfg.workers:
            raise UserError(
                f"loader state was saved with {state['workers']} workers, now {cfg.workers}: "
                f"resume with the same trainer.workers"
            )
        self.tracker = ConsumedTracker(point.epoch if point else 0)
        if point is not None:
            self.tracker.load(point, int(state.get("batches", 0)))
        nw = cfg.workers
        shared = None
        if nw > 0 and cfg.reuse_buffers:
            shape = (cfg.batch_size, 3, cfg.image_size, cfg.image_size)
            # Region-decoded images come out H x W x C in memory: batches keep that layout.
            shared = SharedBatches(nw, cfg.prefetch + 1, shape, channels_last=cfg.train and cfg.decode_region)
        self.dataset = ShardStream(shards, rank, world, cfg, point, shared)
        loader = wds.WebLoader(
            self.dataset,
            batch_size=None,
            num_workers=nw,
            persistent_workers=nw > 0,
            prefetch_factor=cfg.prefetch if nw > 0 else None,
            # With shared buffers, the batches are copied into pinned memory as they are claimed.
            pin_memory=cfg.pin_memory and shared is None and not cfg.rebatch,
            worker_init_fn=_worker_init if nw > 0 else None,
        )
        if cfg.rebatch:
            loader = loader.compose(functools.partial(unbatch_samples, shared=shared))
            loader = loader.compose(EpochShuffle(cfg.cross_shuffle, f"{cfg.seed}:{rank}:cross"))
            collation = functools.partial(collate_samples, pin_memory=cfg.pin_memory)
            loader = loader.batched(cfg.batch_size, collation_fn=collation, partial=cfg.partial)
        else:
            loader = loader.compose(functools.partial(finish_batches, shared=shared, pin_memory=cfg.pin_memory))
        self.epoch_batches: int | None = None
        if cfg.mode == "epoch":
            self.epoch_batches = plan_.ranks[rank].batches if plan_ is not None else None
        else:
            loader = loader.repeat()
        self.loader = loader

    def __iter__(self) -> Iterator[dict]:
        if self.epoch_batches is None:
            for batch in self.loader:
                self.tracker.update(batch["id"])
                yield batch
            return
        if self.tracker.batches >= self.epoch_batches:
            self.tracker = ConsumedTracker(self.tracker.epoch + 1)
        remaining = self.epoch_batches - self.tracker.batches
        for i, batch in enumerate(self.loader):
            self.tracker.update(batch["id"])
            yield batch
            if i + 1 >= remaining:
                break

    def end_epoch(self) -> None:
        """Epoch mode: end this epoch here, before its planned length (another rank ran out after
        skipping bad data, and ranks must stay in step); the next ``iter()`` starts the next one."""
        if self.epoch_batches is not None:
            self.tracker = ConsumedTracker(self.tracker.epoch + 1)

    def state_dict(self) -> dict:
        """The loader's exact position, small and JSON-friendly, for checkpoints."""
        point = self.tracker.point()
        batches = self.tracker.batches
        if self.epoch_batches is not None and batches >= self.epoch_batches:
            point, batches = ResumePoint(point.epoch + 1), 0
        return {
            "point": point.state(),
            "batches": batches,
            "workers": self.cfg.workers,
            "rank": self.rank,
            "world": self.world,
        }


# ---------------------------------------------------------------- startup: plan and check


def known_counts(shards: Sequence[Shard], *, count_local: bool) -> list[int] | None:
    """Per-shard sample counts from the index, or counted from local tar headers if asked."""
    counts = shardspec.sample_counts(shards)
    if counts is None and count_local and not any(shardspec.is_remote(s.url) for s in shards):
        counts = [s.nsamples if s.nsamples is not None else count_samples(s.url) for s in shards]
    return counts


def check_layout(shards: Sequence[Shard], world: int, cfg: LoaderConfig, *, equal: bool = True) -> Plan | None:
    """Plan the layout and refuse, with numbers and a fix, one that would hang or starve a rank.

    Returns the plan when sample counts are known (always in epoch mode), else None.
    """
    nw = max(cfg.workers, 1)
    if cfg.mode == "resampled":
        return None
    epoch_mode = cfg.mode == "epoch"
    counts = known_counts(shards, count_local=epoch_mode)
    if counts is None:
        if epoch_mode:
            raise UserError(
                "epoch mode needs sample counts per shard: give an index JSON (makeshards.py --index) "
                "or use loader.mode=repeat"
            )
        structural = plan([1] * len(shards), world, nw, 1)
        problems = structural.problems(epoch_mode=False)
        if problems:
            raise UserError(problems[0])
        return None
    if cfg.nbatches is not None and not epoch_mode:
        raise UserError(f"nbatches={cfg.nbatches} only applies to loader.mode=epoch (mode is {cfg.mode})")
    p = plan(
        counts,
        world,
        nw,
        cfg.batch_size,
        partial=cfg.partial,
        dsrepeat=cfg.dsrepeat,
        rebatch=cfg.rebatch,
        nbatches=cfg.nbatches,
    )
    problems = p.problems(epoch_mode=epoch_mode and equal)
    if problems:
        raise UserError(problems[0])
    if epoch_mode and equal and p.batches[0] == 0:
        raise UserError(f"every rank delivers 0 batches of {cfg.batch_size}: use a smaller batch size")
    return p


def resolve_shards(spec: str | Sequence[str] | Sequence[Shard], cfg: LoaderConfig) -> list[Shard]:
    """The spec's shards, with missing local files an error (strict) or a warning, and pipe:
    URLs refused unless allowed."""
    if spec and isinstance(spec, (list, tuple)) and isinstance(spec[0], Shard):
        shards = list(spec)
    else:
        shards = shardspec.expand(spec, strict=cfg.strict, access=cfg.access)  # type: ignore[arg-type]
    shardspec.refuse_pipes(shards, cfg.access)
    return shards


def make_loader(
    spec: str | Sequence[str] | Sequence[Shard], rank: int, world: int, cfg: LoaderConfig, state: dict | None = None
) -> RankLoader:
    """Expand the spec, check the layout, and build rank ``rank``'s loader."""
    shards = resolve_shards(spec, cfg)
    p = check_layout(shards, world, cfg)
    return RankLoader(shards, rank, world, cfg, state, p)


def make_eval_loader(
    spec: str | Sequence[str] | Sequence[Shard], rank: int, world: int, cfg: LoaderConfig
) -> RankLoader | list:
    """One pass over this rank's share of the evaluation shards, every sample exactly once.

    Ranks may hold different numbers of samples (the caller all-reduces sums, not batches);
    a rank with fewer shards than workers uses fewer workers, one with none yields nothing.
    """
    shards = resolve_shards(spec, cfg)
    mine = len(split_by_rank(shards, rank, world))
    if mine == 0:
        return []
    ecfg = replace(
        cfg,
        mode="epoch",
        train=False,
        partial=True,
        nbatches=None,
        dsrepeat=1,
        cross_shuffle=0,
        shuffle_buffer=0,
        workers=min(cfg.workers, mine),
        reuse_buffers=False,  # passes are short and far apart: no shared memory held between them
    )
    # Epoch mode without a plan: each iter() is one whole pass, so no sample counts are needed
    # (and no shard is opened at startup to count them).
    return RankLoader(shards, rank, world, ecfg)
