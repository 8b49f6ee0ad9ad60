"""The values each loader option may take, and every rule on the options, in one place.

``problems`` checks the rules alike on a LoaderConfig (options.py) when it is made, on the trainer's
Hydra sections before anything starts (``option_problems``, in its config terms), and
(``parse_nbatches``) in the planner and simdist's arguments.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

from wdsdist.data.cores import AUTO


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
EVAL_RATIO = 0.875  # evaluation resizes the shorter side to round(eval_size / 0.875) unless told
MIXES = ("sample", "stratified")
AUGMENTS = ("none", "trivialaugment", "randaugment", "autoaugment")
DECODES = ("cpu", "gpu", "auto")
GPU_DECODERS = ("auto", "nvimgcodec", "torchvision")


def default_split(mode: str, dsrepeat: int = 1) -> Split:
    """loader.split when not given: samples in epoch mode (every sample once, equal batches), except
    with dsrepeat, the shard split's own remedy; shards in repeat mode (see docs/equal-batches.md)
    and resampled mode (shards drawn at random)."""
    return Split.samples if mode == LoaderMode.epoch and dsrepeat == 1 else Split.shards


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


def samples_split(o: Any) -> bool:
    """split=samples in effect on a section, a LoaderConfig or a Hydra node: given, or the default
    for its mode (``default_split``); never in resampled mode."""
    return o.mode != LoaderMode.resampled and (o.split or default_split(o.mode, o.dsrepeat)) == Split.samples


def _schedule_ok(o: Any) -> bool:
    froms = [a for a, _ in o.size_schedule]
    sizes = [b for _, b in o.size_schedule]
    return not froms or (froms[0] == 0 and froms == sorted(set(froms)) and min(sizes) >= 8)


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
    ("augment", lambda o: o.augment in AUGMENTS, ", ".join(AUGMENTS)),
    ("augment_n", lambda o: o.augment_n >= 0, "must be >= 0 (ops per image)"),
    ("augment_m", lambda o: 0 <= o.augment_m <= 30, "a magnitude in 0..30"),
    ("random_erase", lambda o: 0.0 <= o.random_erase <= 1.0, "a probability between 0 and 1"),
    ("max_bad", lambda o: 0.0 <= o.max_bad <= 1.0, "a share between 0 and 1"),
    ("mean", lambda o: len(o.mean) == 3 and all(0 <= m <= 1 for m in o.mean), "3 values on the 0-1 scale"),
    ("eval_size", lambda o: o.eval_size is None or o.eval_size >= 8, "must be >= 8, or null (image_size)"),
    (
        "eval_resize",
        lambda o: o.eval_resize is None or o.eval_resize >= (o.eval_size or o.image_size),
        "must be >= the evaluation's crop (data.eval_size), or null (eval_size / 0.875)",
    ),
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
        lambda o: o.shard_order != ShardOrder.node or samples_split(o),
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
SCHEDULE_RULES: tuple[Rule, ...] = (
    ("size_schedule", lambda o: _schedule_ok(o), "((from, size), ...): the first from 0, then rising; sizes >= 8"),
    (
        "size_schedule",
        lambda o: not o.size_schedule or o.image_size == max(size for _, size in o.size_schedule),
        "image_size must be its largest size (the buffers are made for it)",
    ),
    (
        "size_schedule",
        lambda o: not o.size_schedule or o.mode == LoaderMode.epoch or (o.cross_shuffle == 0 and o.mix == "sample"),
        "in repeat and resampled mode needs each batch from one worker (no cross_shuffle, mix=sample)",
    ),
)
LOADER_RULES = BATCH_RULES + SAMPLE_RULES + STREAM_RULES + LAYOUT_RULES + SCHEDULE_RULES


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
