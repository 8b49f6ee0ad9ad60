"""The loader's typed config.

``SampleOptions`` and ``StreamOptions`` are also the trainer's ``data`` and ``loader`` sections:
its Hydra schema (train/config.py) extends them, so each field, its type and its default are
written once, here. The values each may take and every rule on them are rules.py's; a
LoaderConfig checks them when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from wdsdist.data.autos import auto_decode
from wdsdist.data.cores import AUTO, auto_workers
from wdsdist.data.rules import (
    EVAL_RATIO,
    LOADER_RULES,
    MODES,
    LoaderMode,
    Remainder,
    Split,
    parse_bytes,
    parse_nbatches,
    parse_workers,
    problems,
    samples_split,
)
from wdsdist.data.sources import httpopen
from wdsdist.data.sources.access import Access
from wdsdist.errors import UserError


@dataclass(frozen=True)
class Source:
    """One data set of several (``Loader([Source(...), ...], config)``, data.sources): a name, its
    shards (a spec, as for one data set) and how much of it an epoch reads, one of: ``repeat``
    (passes per epoch: 0.5 reads half of it, the other half next epoch; 3 reads it three times),
    ``samples`` (a count per epoch) or ``weight`` (a share of config.epoch_samples, beside the
    others' weights). None of them: repeat=1. docs/several-datasets.md has the semantics."""

    name: str
    shards: Any
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None


@dataclass(kw_only=True)
class SampleOptions:
    """What a sample is, and what makes one bad (the trainer's ``data`` section)."""

    image_key: str = "jpg;jpeg;png"
    """The member suffixes a sample's image may have, tried in order (``;`` between them)."""
    label_key: str = "cls"
    """The member suffix of a sample's label: an integer as text."""
    image_size: int = 224
    """The side of the square images a batch holds, in pixels (>= 8)."""
    crop_scale: tuple[float, float] = (0.08, 1.0)
    """Training crops: RandomResizedCrop's range of the image's area, [lo, hi] in (0, 1]."""
    num_classes: int | None = None
    """Labels outside [0, num_classes) are corrupt samples, skipped; None: not checked."""
    strict: bool = False
    """A bad or missing shard or sample is an error (in training: the rank stops at the first, as
    past ``max_bad``); by default its place is filled, and it is warned and counted."""
    max_bad: float = 0.01
    """Training: the share of a rank's samples in an epoch that may be lost (damaged, or in a shard
    that cannot be read) and filled by stand-ins; past it the rank stops with DataError naming
    them. A few damaged files are normal; a share past 1 % is a missing bucket or mount, and
    training on what is left would skew the data set without a word."""
    allow_pipe: bool = False
    """Accept ``pipe:`` shard URLs (they run a shell command)."""
    trust_index: bool = False
    """An index may name absolute paths, ``..``, other servers (and ``pipe:`` with allow_pipe)."""
    max_pixels: int = 89_478_485
    """An image declaring more pixels (times frames) is a corrupt sample: a decompression bomb."""
    max_member_bytes: int = 64 << 20
    """A larger file in a shard is a corrupt sample, skipped unread."""
    http_timeout: float = 60.0
    """Seconds without data before an http(s), s3:// or gs:// read counts as failed."""
    http_min_rate: int = httpopen.DEFAULT_MIN_RATE
    """Bytes a second a server must send, per http_timeout waited; 0: not checked."""
    http_retry_s: float = 60.0
    """Seconds a remote read keeps retrying transient failures without a new byte, resuming where
    it stopped; a server that never answers then ends the run (retry.py). 0: no retry."""
    s3_endpoint_url: str | None = None
    """An S3-compatible store for s3:// (MinIO, Ceph, R2); None: AWS_ENDPOINT_URL, or AWS."""
    gs_endpoint_url: str | None = None
    """The store for gs://; None: https://storage.googleapis.com (Cloud Storage's S3 API)."""
    epoch_samples: int | None = None
    """Several data sets with weights (``Source``): the mixed epoch's samples (plan/mix.py)."""
    augment: str = "none"
    """A training image's augmentation after its crop and flip, on the uint8 crop in the worker
    (under decode=gpu on the batch on the device, after its resize: decode/gpu_augment.py):
    ``none``, ``trivialaugment`` (TrivialAugment Wide), ``randaugment`` (``augment_n`` ops of
    magnitude ``augment_m``) or ``autoaugment`` (ImageNet's policy); torchvision's own ops, drawn
    from the sample's own generator (decode/augment.py)."""
    augment_n: int = 2
    """augment=randaugment: ops per image."""
    augment_m: int = 9
    """augment=randaugment: their magnitude, of 31 steps (0-30)."""
    random_erase: float = 0.0
    """The chance that a training image has a random rectangle erased to the mean colour
    (torchvision's RandomErasing after normalisation, as its reference and timm use it)."""
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    """The data's mean colour on the 0-1 scale (what random_erase fills with; the trainer also
    normalises with it)."""
    eval_size: int | None = None
    """Evaluation's centre crop, in pixels; None: image_size (the largest of a schedule)."""
    eval_resize: int | None = None
    """Evaluation resizes the shorter side to this before the centre crop; None: eval_size / 0.875
    (FixRes: train at 176, evaluate at 224 resized to 232)."""


@dataclass(kw_only=True)
class StreamOptions:
    """How a rank's shards become batches (the trainer's ``loader`` section)."""

    mode: LoaderMode = LoaderMode.repeat
    """``repeat``: batches without end (count steps); ``epoch``: epochs of the same number of
    batches on every rank; ``resampled``: shards drawn with replacement."""
    split: Split | None = None
    """``shards`` (whole shards per rank and worker) or ``samples`` (equal spans of the epoch's
    samples); None: samples in epoch mode (unless dsrepeat), else shards."""
    remainder: Remainder = Remainder.pad
    """split=samples: ``pad`` (the epoch's first samples again) or ``drop`` (its last ones), to
    equal batches on every rank."""
    shard_order: str = "global"
    """split=samples: ``global`` (one shard order, new every epoch) or ``node`` (each node reads the
    same samples every epoch, in a new order, and pads from them: with cache_dir a run fetches the
    data set once)."""
    nbatches: int | str | None = None
    """Epoch mode: cut every rank to N batches, or ``auto`` (the most every rank delivers)."""
    dsrepeat: int = 1
    """Epoch mode, split=shards: read each rank's shards this many times per epoch."""
    shuffle_buffer: int = 1000
    """Raw samples each worker shuffles among; 0: no shuffle."""
    cross_shuffle: int = 0
    """Samples shuffled across a rank's workers; 0: none (a resume is then batch for batch)."""
    prefetch: int = 2
    """Batches each worker makes ahead."""
    decode_region: bool = True
    """Decode only the training crop's region of a JPEG (decode/jpegcrop.py): the same pixels,
    faster."""
    decode_downscale: bool = False
    """Decode at 1/2, 1/4 or 1/8 of a JPEG's size where the crop stays >= image_size: faster for
    large images, not the same pixels (bench/results/2026-11-25-decode-downscale-accuracy.md)."""
    decode: str = "cpu"
    """Where JPEGs are decoded: ``cpu`` (in the workers) or ``gpu`` (in the training process, on
    its GPU: the workers only read the bytes and draw the crops and augmentations, so a GPU node
    needs few of them; decode/gpu.py). The same samples, draws and resume state either way. Evaluation decodes where
    training does, so a model is evaluated on the pixels it trained on. ``auto``: gpu where the
    batches go to a CUDA GPU (pin_memory) and the [gpu] extra is installed, cpu elsewhere
    (``decode_why`` says which and why)."""
    gpu_decoder: str = "auto"
    """decode=gpu's JPEG decoder: ``nvimgcodec`` (the ``[gpu]`` extra: crops decoded as regions,
    chroma upsampled as libjpeg-turbo does), ``torchvision`` (its nvJPEG decode: no extra, other
    chroma) or ``auto``, nvimgcodec where it is installed (decode/codecs.py)."""
    gpu_decode_threads: int = 1
    """decode=gpu: threads in the training process that decode the workers' batches, each with
    its own decoder, stream and buffer. A decode call waits for the GPU's JPEG engines; with two
    or more, one batch's call overlaps the next one's. The batches come in the workers' order
    either way (delivery/gpubatches.py)."""
    gpu_decode_share: float = 1.0
    """decode=gpu: the share of the JPEGs the GPU decodes; the workers decode the others as on
    the CPU path, and the batch joins both on the GPU. Below 1 where the GPU's decoder bounds a
    fast model and the workers have time to spare. Which JPEGs: by a hash of the shard and key,
    so a resumed run picks the same ones; the draws, samples and labels are the same either way."""
    warm_start: bool = True
    """The first batch: worker 0 decodes its crops on a thread per worker while the others wait
    (delivery/warmstart.py), so the first batch comes sooner."""
    read_late: bool = True
    """Local shards: the shuffle buffer holds where each image lies in its file, read as it leaves
    (tar/lateread.py), not the image's bytes."""
    cache_dir: str | None = None
    """A local folder that http(s), s3:// and gs:// shards are fetched into once per node and read
    from by every rank, worker and later run naming it (sources/cache.py); None: no cache."""
    cache_limit: int | str | None = None
    """Bytes the cache may hold (an integer, or 200GB, 500MiB, ...); None: half of what the folder's
    cache holds plus its disk's free space, when the loader starts."""
    cache_ahead: int = 2
    """With cache_dir: the next N remote shards of each worker's plan are fetched while it reads
    one (sources/ahead.py); 0: each shard when it is opened."""
    mix: str = "sample"
    """Several data sets: ``sample`` (each batch a random mixture of the rank's stream, each
    source's share held per epoch) or ``stratified`` (every batch holds each share, rounded)."""


@dataclass(kw_only=True)
class LoaderConfig(SampleOptions, StreamOptions):
    """Everything that shapes one rank's loader, keywords only; every field is checked when made
    (one line naming the bad value). Plain values only: it travels to the workers."""

    batch_size: int
    """Samples per batch, per rank."""
    workers: int | str = 2
    """DataLoader worker processes per rank; 0: load in the main process; ``auto``: sized to the
    cores this process may use and the ranks on its node (cores.py; ``workers_why`` says how)."""
    seed: int = 0
    """Every order the loader draws (shards, shuffles) comes from it: the same on every rank."""
    train: bool = True
    """Training images: RandomResizedCrop and a flip; False: resize and centre crop."""
    partial: bool = False
    """Keep a last, partial batch; ranks may then differ in batches, so a lost sample is skipped,
    not filled, and under split=samples the padding is not read (every sample once, as
    prediction reads a data set)."""
    pin_memory: bool = False
    """Batches in pinned memory, for a faster non-blocking copy to the GPU."""
    reuse_buffers: bool = True
    """Workers stack batches into shared-memory buffers they reuse (delivery/sharedbatches.py)."""
    with_keys: bool = False
    """Batches carry their samples' keys (``batch["key"]``)."""
    trace: bool = False
    """Log every shard open and close, at debug level (simdist --showopen)."""
    node_ranks: int = 1
    """Ranks that share a node, and so its cache (torchrun's LOCAL_WORLD_SIZE, given by the
    caller): shard_order=node keeps shards per node of these."""
    size_schedule: tuple[tuple[int, int], ...] = ()
    """Progressive resizing: ``((from, size), ...)``, the training images' size from each ``from``
    on, the first from 0; ``image_size`` is the largest (the buffers' size). ``from`` counts
    epochs in epoch mode (a size holds for whole epochs) and, in repeat and resampled mode, the
    rank's batches since the run began (``Loader.steps``, carried across a resume), so every rank
    switches at the same batch. Empty: ``image_size`` throughout."""

    workers_why: str | None = field(default=None, init=False)
    """How ``workers="auto"`` was resolved, in words (None: the number was given)."""
    decode_why: str | None = field(default=None, init=False)
    """How ``decode="auto"`` was resolved, in words (None: it was given)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"loader.mode={self.mode!r}: must be one of {', '.join(MODES)}")
        self.mode = LoaderMode(self.mode)
        self.split = Split(self.split) if self.split is not None else None
        self.remainder = Remainder(self.remainder)
        self.crop_scale = tuple(self.crop_scale)  # type: ignore[assignment]
        self.mean = tuple(self.mean)  # type: ignore[assignment]
        self.size_schedule = tuple((int(a), int(b)) for a, b in self.size_schedule)
        if self.decode == AUTO:
            self.decode, self.decode_why = auto_decode(self)
        problem = next(problems(self, LOADER_RULES), None)
        if problem is not None:
            raise UserError(problem)
        self.nbatches = parse_nbatches(self.nbatches)
        self.cache_limit = parse_bytes(self.cache_limit)
        self.workers = parse_workers(self.workers)
        if self.workers == AUTO:
            gpu_decode = self.decode == "gpu"
            self.workers, self.workers_why = auto_workers(
                gpu=self.pin_memory or gpu_decode,
                gpu_decode=gpu_decode,
                node_ranks=self.node_ranks,
                cpu_share=1 - self.gpu_decode_share if gpu_decode else 0.0,
            )

    @classmethod
    def from_sections(cls, *sections: Any, **given: Any) -> LoaderConfig:
        """A LoaderConfig from sections that extend SampleOptions or StreamOptions (the Hydra
        schema's ``data`` and ``loader``): every field a section's class shares with ours, by
        name; ``given`` holds the rest."""
        ours = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for section in sections:
            values |= {name: section[name] for name in section if name in ours}
        return cls(**(values | given))

    @property
    def access(self) -> Access:
        return Access(
            allow_pipe=self.allow_pipe,
            trust_index=self.trust_index,
            http_timeout=self.http_timeout,
            http_min_rate=self.http_min_rate,
            http_retry_s=self.http_retry_s,
            s3_endpoint_url=self.s3_endpoint_url,
            gs_endpoint_url=self.gs_endpoint_url,
            cache_dir=self.cache_dir,
            cache_limit=parse_bytes(self.cache_limit),
        )

    @property
    def by_samples(self) -> bool:
        """split=samples in effect: given, or the default for this mode (``default_split``)."""
        return samples_split(self)

    @property
    def eval_crop(self) -> tuple[int, int]:
        """Evaluation's (resize of the shorter side, centre crop), in pixels."""
        size = self.eval_size or self.image_size
        return self.eval_resize or round(size / EVAL_RATIO), size

    @property
    def rebatch(self) -> bool:
        return self.cross_shuffle > 0

    @property
    def wanted_suffixes(self) -> frozenset[str]:
        """The members a sample is read for; others are skipped unread."""
        return frozenset(k.lower() for k in f"{self.image_key};{self.label_key}".split(";") if k)
