"""simdist's data: per-shard sample counts, described (N or N+-D per shard) or read from a shard spec,
and the synthetic shards real mode writes once for a described layout."""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from wdsdist.data.sources import shardspec
from wdsdist.data.sources.shardspec import Access, Shard
from wdsdist.errors import UserError

DEFAULT_NSHARDS = 10
DEFAULT_SAMPLES = "100"
IMAGE_SIZE = 16  # pixels, written and loaded: the counts do not depend on it, the run time does
REAL_MODE_MAX_SAMPLES = 200_000  # real mode writes (for a described layout) and reads every sample


@dataclass(frozen=True)
class Layout:
    """Per-shard sample counts, and the shards themselves when there are files to read."""

    counts: tuple[int, ...]
    source: str  # how the layout was given, for the report
    shards: tuple[Shard, ...] | None = None

    @property
    def total(self) -> int:
        return sum(self.counts)


_SPREAD = re.compile(r"^\s*(\d+)\s*(?:(?:\+-|\+/-|±)\s*(\d+))?\s*$")


def parse_spread(text: str) -> tuple[int, int]:
    """'1000' -> (1000, 0); '1000+-50' -> (1000, 50): samples per shard and the spread around it."""
    match = _SPREAD.match(str(text))
    if not match:
        raise UserError(f"--samples-per-shard {text!r}: expected N or N+-D, such as 1000 or 1000+-50")
    base, spread = int(match.group(1)), int(match.group(2) or 0)
    if base < 1:
        raise UserError(f"--samples-per-shard must be >= 1, got {base}")
    if spread >= base:
        raise UserError(f"--samples-per-shard {text!r}: the spread {spread} must be less than {base}")
    return base, spread


def described_counts(nshards: int, samples: str, seed: int) -> list[int]:
    """Counts of a described layout: uniform integers in [N-D, N+D], seeded."""
    if nshards < 1:
        raise UserError(f"--nshards must be >= 1, got {nshards}")
    base, spread = parse_spread(samples)
    if not spread:
        return [base] * nshards
    rng = random.Random(seed)
    return [rng.randint(base - spread, base + spread) for _ in range(nshards)]


def described_layout(nshards: int, samples: str, seed: int) -> Layout:
    counts = described_counts(nshards, samples, seed)
    base, spread = parse_spread(samples)
    source = f"--nshards {nshards} --samples-per-shard {base}" + (f"+-{spread} (seed {seed})" if spread else "")
    return Layout(tuple(counts), source)


def spec_layout(
    spec: str, *, count_local: bool, count_remote: bool, need_files: bool = False, access: Access | None = None
) -> Layout:
    """A layout from a shard spec: counts from its index, else counted from tar headers if allowed.

    ``need_files``: real mode reads the shards, so local ones an index lists must exist.
    ``access``: what the spec's index may name, and whether pipe: shards may be opened.
    """
    access = access or Access()
    shards = shardspec.expand(spec, access=access)
    if need_files:
        absent = [s.url for s in shards if not shardspec.is_remote(s.url) and not os.path.exists(s.url)]
        if absent:
            raise UserError(
                f"{len(absent)} of {len(shards)} shards of {spec} do not exist, first {absent[0]}; "
                f"--plan plans from the index alone"
            )
    counts = shardspec.sample_counts(shards)
    if counts is None:
        unknown = [s for s in shards if s.nsamples is None]
        remote = [s for s in unknown if shardspec.is_remote(s.url)]
        if (remote and not count_remote) or (unknown and not count_local):
            first = (remote or unknown)[0].url
            raise UserError(
                f"--plan needs sample counts and {first} has none: give an index JSON "
                f"(makeshards.py --index), or describe the layout with --nshards and --samples-per-shard"
            )
        shardspec.check_access(unknown, access)
        from wdsdist.data.sources.index import count_samples  # imports torch: only when counting

        try:
            counts = [s.nsamples if s.nsamples is not None else count_samples(s.url) for s in shards]
        except UserError as exc:
            raise UserError(" ".join(str(exc).split())) from None  # tarfile's reasons span lines
    if need_files:
        shardspec.check_access(shards, access)
    return Layout(tuple(counts), spec, tuple(shards))


def synthetic_layout(layout: Layout, cache: str, name: str, seed: int = 0) -> Layout:
    """Write (once) synthetic shards with exactly the layout's counts; reuse them afterwards."""
    if layout.total > REAL_MODE_MAX_SAMPLES:
        raise UserError(
            f"real mode would write and read {layout.total} samples (more than {REAL_MODE_MAX_SAMPLES}): "
            f"use --plan for a layout this big"
        )
    from wdsdist.data.sources.index import index_path

    outdir = os.path.join(cache, name)
    index = index_path(outdir, "simdist")
    if os.path.exists(index):
        try:
            shards = shardspec.read_index_shards(index)
        except UserError:
            shards = []
        if tuple(s.nsamples for s in shards) == layout.counts and all(os.path.exists(s.url) for s in shards):
            return Layout(layout.counts, f"{layout.source} -> {index}", tuple(shards))
    print(f"writing {len(layout.counts)} synthetic shards, {layout.total} samples, to {outdir} (once)", file=sys.stderr)
    write_synthetic_shards(list(layout.counts), outdir, "simdist", seed=seed)
    return Layout(layout.counts, f"{layout.source} -> {index}", tuple(shardspec.read_index_shards(index)))


def write_synthetic_shards(counts: Sequence[int], outdir: str, prefix: str, *, seed: int = 0) -> str:
    """Shards of exactly ``counts`` synthetic samples (tiny images, unique keys), and their index."""
    from wdsdist.data.sources.index import index_path
    from wdsdist.tools import synthetic
    from wdsdist.tools.shards import Sample, ShardSink

    with ShardSink(outdir, prefix, maxcount=max(counts), maxsize=1 << 40) as sink:
        i = 0
        for count in counts:
            for _ in range(count):
                image, label = synthetic.draw(i, size=IMAGE_SIZE, seed=seed)
                sink.write(Sample(f"sample-{i:08d}", "jpg", synthetic.jpeg_bytes(image, 90), label, {}))
                i += 1
            sink.end_shard()
        sink.commit(classes=list(synthetic.CLASSES), synthetic={"seed": seed})
    return index_path(outdir, prefix)
