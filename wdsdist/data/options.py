"""The loader's typed config, and every rule on it, in one place.

``SampleOptions`` and ``StreamOptions`` are also the trainer's ``data`` and ``loader`` sections:
its Hydra schema (train/config.py) extends them, so each field, its type and its default are
written once, here. ``problems`` checks the rules alike on a LoaderConfig, on the Hydra
sections before anything starts, and (``parse_nbatches``) in the planner and simdist's arguments.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from wdsdist.data.autos import auto_decode
from wdsdist.data.cores import AUTO, auto_workers
from wdsdist.data.sources import httpopen
from wdsdist.data.sources.access import Access
from wdsdist.errors import UserError


class LoaderMode(StrEnum):
    repeat = "repeat"  # epochless: each worker runs from epoch to epoch, the trainer counts steps
    epoch = "epoch"  # epochs of equal batch counts on every rank (cut to nbatches)
    resampled = "resampled"  # shards drawn with replacement per rank and worker


MODES = tuple(m.value for m in LoaderMode)


class Split(StrEnum):
    shards = "shards"  # whole shards per rank and worker (shards[rank::world][worker::nworkers])
    samples = "samples"  # the epoch's sample sequence cut into equal spans per rank and worker


class Remainder(StrEnum):
    pad = "pad"  # split=samples: the epoch's first samples again, up to a multiple of world x batch_size
    drop = "drop"  # split=samples: the epoch's last samples left out, down to such a multiple


class ShardOrder(StrEnum):
    # Hydra takes an enum by its members' names, and "global" is a keyword: the field is a str.
    global_ = "global"  # split=samples: all shards in one order, new every epoch (seed + epoch)
    node = "node"  # split=samples: each node keeps the same samples across epochs (order.node_parts)


SHARD_ORDERS = tuple(o.value for o in ShardOrder)
MIXES = ("sample", "stratified")
DECODES = ("cpu", "gpu", "auto")
GPU_DECODERS = ("auto", "nvimgcodec", "torchvision")


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


def default_split(mode: str, dsrepeat: int = 1) -> Split:
    """loader.split when not given: samples in epoch mode (every sample once, equal batches), except
    with dsrepeat, the shard split's own remedy; shards in repeat mode (see docs/equal-batches.md)
    and resampled mode (shards drawn at random)."""
    return Split.samples if mode == LoaderMode.epoch and dsrepeat == 1 else Split.shards


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
    """A bad or missing shard or sample is an error; by default it is skipped, warned and counted."""
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
    its GPU: the workers only read the bytes and draw the crops, so a GPU node needs few of them;
    decode/gpu.py). The same samples, draws and resume state either way. Evaluation decodes where
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
    """Keep a last, partial batch (split=shards)."""
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
        return _samples_split(self)

    @property
    def rebatch(self) -> bool:
        return self.cross_shuffle > 0

    @property
    def wanted_suffixes(self) -> frozenset[str]:
        """The members a sample is read for; others are skipped unread."""
        return frozenset(k.lower() for k in f"{self.image_key};{self.label_key}".split(";") if k)


# ---------------------------------------------------------------- the rules, each once


def parse_nbatches(value: int | str | None) -> int | str | None:
    """The cut as the planner takes it: None, "auto", or an int >= 1 (given as an int or its
    digits). Raises ValueError saying what is wrong."""
    if value is None or value == "auto":
        return value
    return _count(value, 1)


def parse_workers(value: Any) -> int | str:
    """``workers`` as the loader takes it: "auto" (cores.auto_workers) or an int >= 0 (given as
    an int or its digits). Raises ValueError saying what is wrong."""
    return AUTO if value == AUTO else _count(value, 0)


def _count(value: Any, least: int) -> int:
    """An int >= ``least``, given as an int or its digits, where "auto" is the other choice."""
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError
        number = int(value)
    except ValueError:
        raise ValueError(f"expected an integer or auto, got {value!r}") from None
    if number < least:
        raise ValueError(f"must be >= {least} or auto, got {value}")
    return number


_UNITS = {"": 1, "b": 1} | {
    f"{prefix}{suffix}": base**power
    for power, prefix in enumerate("kmgtp", start=1)
    for suffix, base in (("b", 1000), ("ib", 1024))
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*")


def parse_bytes(value: int | str | None) -> int | None:
    """A size in bytes as the cache takes it: None, or an int >= 1, given as an int, its digits, or
    a number with a unit (KB, MB, GB, TB, PB: powers of 1000; KiB, MiB, GiB, TiB, PiB: of 1024;
    any case). Raises ValueError saying what is wrong."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected bytes, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE.fullmatch(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"expected bytes such as 200GB or 500MiB, got {value!r}")
        number = int(float(match.group(1)) * _UNITS[match.group(2)])
    if number < 1:
        raise ValueError(f"must be >= 1 byte, got {value!r}")
    return number


def _bytes_ok(value: Any) -> bool:
    try:
        parse_bytes(value)
    except ValueError:
        return False
    return True


def _nbatches_ok(value: Any) -> bool:
    try:
        parse_nbatches(value)
    except ValueError:
        return False
    return True


def _workers_ok(value: Any) -> bool:
    try:
        parse_workers(value)
    except ValueError:
        return False
    return True


def _samples_split(o: Any) -> bool:
    """split=samples in effect on a section, a LoaderConfig or a Hydra node: given, or the default
    for its mode (``default_split``); never in resampled mode."""
    return o.mode != LoaderMode.resampled and (o.split or default_split(o.mode, o.dsrepeat)) == Split.samples


def _crop_scale_ok(scale: Any) -> bool:
    return len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1


# (field, test, what it must be), in the order they are checked; a test sees the whole section.
Rule = tuple[str, Callable[[Any], bool], str]
BATCH_RULES: tuple[Rule, ...] = (
    ("batch_size", lambda o: o.batch_size >= 1, "must be >= 1"),
    ("workers", lambda o: _workers_ok(o.workers), "an integer >= 0 or auto"),
)
SAMPLE_RULES: tuple[Rule, ...] = (
    ("image_size", lambda o: o.image_size >= 8, "must be >= 8"),
    ("crop_scale", lambda o: _crop_scale_ok(o.crop_scale), "[lo, hi] in (0, 1]"),
    ("num_classes", lambda o: o.num_classes is None or o.num_classes >= 2, "must be >= 2"),
    ("max_pixels", lambda o: o.max_pixels >= 1, "must be >= 1"),
    ("max_member_bytes", lambda o: o.max_member_bytes >= 1, "must be >= 1"),
    ("http_timeout", lambda o: o.http_timeout > 0, "must be > 0 (seconds)"),
    ("http_min_rate", lambda o: o.http_min_rate >= 0, "must be >= 0 (bytes/s; 0: no rate check)"),
    ("http_retry_s", lambda o: 0 <= o.http_retry_s < math.inf, "must be >= 0 and finite (seconds; 0: no retry)"),
)
STREAM_RULES: tuple[Rule, ...] = (
    ("dsrepeat", lambda o: o.dsrepeat >= 1, "must be >= 1"),
    ("shuffle_buffer", lambda o: o.shuffle_buffer >= 0, "must be >= 0"),
    ("cross_shuffle", lambda o: o.cross_shuffle >= 0, "must be >= 0"),
    ("prefetch", lambda o: o.prefetch >= 1, "must be >= 1"),
    ("nbatches", lambda o: _nbatches_ok(o.nbatches), "an integer >= 1 or auto"),
    ("nbatches", lambda o: o.nbatches is None or o.mode == LoaderMode.epoch, "only applies to loader.mode=epoch"),
    ("dsrepeat", lambda o: o.dsrepeat == 1 or o.mode == LoaderMode.epoch, "only applies to loader.mode=epoch"),
    ("split", lambda o: o.split in (None, *Split), "shards or samples"),
    ("remainder", lambda o: o.remainder in tuple(Remainder), "pad or drop"),
    (
        "split",
        lambda o: o.split != Split.samples or o.mode != LoaderMode.resampled,
        "does not apply to loader.mode=resampled",
    ),
    ("dsrepeat", lambda o: o.dsrepeat == 1 or o.split != Split.samples, "only applies to loader.split=shards"),
    ("cache_dir", lambda o: o.cache_dir is None or o.cache_dir.strip() != "", "a folder, or null for no cache"),
    ("cache_limit", lambda o: _bytes_ok(o.cache_limit), "bytes >= 1: an integer, or a size such as 200GB or 500MiB"),
    ("cache_limit", lambda o: o.cache_limit is None or o.cache_dir is not None, "needs loader.cache_dir"),
    ("cache_ahead", lambda o: o.cache_ahead >= 0, "must be >= 0 (shards; 0: no read-ahead)"),
    ("shard_order", lambda o: o.shard_order in SHARD_ORDERS, "global or node"),
    (
        "shard_order",
        lambda o: o.shard_order != ShardOrder.node or _samples_split(o),
        "only applies with loader.split=samples (the epoch default; give it in repeat mode)",
    ),
)
MIX_RULES: tuple[Rule, ...] = (("mix", lambda o: o.mix in MIXES, "sample or stratified"),)
DECODE_RULES: tuple[Rule, ...] = (
    ("decode", lambda o: o.decode in DECODES, "cpu, gpu or auto"),
    ("gpu_decoder", lambda o: o.gpu_decoder in GPU_DECODERS, "auto, nvimgcodec or torchvision"),
    ("gpu_decode_threads", lambda o: isinstance(o.gpu_decode_threads, int) and o.gpu_decode_threads >= 1, "1 or more"),
    ("gpu_decode_share", lambda o: 0.0 <= o.gpu_decode_share <= 1.0, "a share between 0 and 1"),
    (
        "decode",
        lambda o: o.decode != "gpu" or o.cross_shuffle == 0,
        "gpu does not apply with loader.cross_shuffle (the workers' batches hold bytes, not images)",
    ),
    (
        "decode",
        lambda o: o.decode != "gpu" or not o.decode_downscale,
        "gpu does not apply with loader.decode_downscale (a CPU decoder's option)",
    ),
)
STREAM_RULES += MIX_RULES + DECODE_RULES
LAYOUT_RULES: tuple[Rule, ...] = (("node_ranks", lambda o: o.node_ranks >= 1, "must be >= 1"),)
LOADER_RULES = BATCH_RULES + SAMPLE_RULES + STREAM_RULES + LAYOUT_RULES


def problems(section: Any, rules: tuple[Rule, ...], prefix: str = "") -> Iterator[str]:
    """``key=value: rule`` for each of ``rules`` that ``section`` breaks (a dataclass or its
    Hydra node; ``prefix`` names the section in config terms, e.g. ``loader.``)."""
    for name, ok, rule in rules:
        if not ok(section):
            yield f"{prefix}{name}={getattr(section, name)}: {rule}"


def option_problems(*, batch: Any = None, sample: Any = None, stream: Any = None) -> Iterator[str]:
    """Every rule of the loader's that these sections break, as ``key=value: rule`` lines named in
    a trainer's config terms: ``batch`` holds batch_size and workers (``trainer.``), ``sample``
    extends SampleOptions (``data.``), ``stream`` extends StreamOptions (``loader.``). A
    LoaderConfig checks the same rules itself when it is made."""
    for section, rules, prefix in (
        (batch, BATCH_RULES, "trainer."),
        (sample, SAMPLE_RULES, "data."),
        (stream, STREAM_RULES, "loader."),
    ):
        if section is not None:
            yield from problems(section, rules, prefix)
