"""wds-makeshards (makeshards.py in a clone; python -m wdsdist.tools.makeshards): write WebDataset
shards plus an index of sample counts.

  wds-makeshards --source /data/imagenet/train --shards /data/shards --prefix imagenet-train
  wds-makeshards --source ILSVRC2012_img_train.tar --shards /data/shards --prefix imagenet-train
  wds-makeshards --source ILSVRC2012_img_val.tar --labels LOC_val_solution.csv \
      --classes-from /data/shards/imagenet-train.index.json --shards /data/shards --prefix imagenet-val
  wds-makeshards --synthetic 2000 --shards data/synth --prefix synth-train
  wds-makeshards --synthetic 500 --split val --shards data/synth --prefix synth-val
  wds-makeshards --index 'data/other-{000000..000009}.tar'
  wds-makeshards --index 's3://bucket/train/shard-{000000..000099}.tar' --output s3://bucket/train/train.index.json
  wds-makeshards --index 'hf://datasets/ORG/NAME/train-{0000..0099}.tar' --output data/name.index.json

--source is planned first (PREFIX.plan.json beside the shards: the order and each shard's images),
then written by --workers processes; the same command after a stop keeps the finished shards.
--index reads each shard once, with progress; into a local --output, the counts so far are kept in
OUTPUT.partial, so the same command run again after a stop goes on where it stopped.
"""
# A long module on purpose: the parser, the typed options and each mode's entry stay together,
# since every check names a flag the parser defines; the work itself is in convert.py and shards.py.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from wdsdist.data.cores import cores, ranks_on_node
from wdsdist.data.sources import s3open
from wdsdist.data.sources.index import (
    HTTP_TIMEOUT,
    OFFSET_EVERY,
    count_samples,
    index_bytes,
    index_desc,
    local_sample_offsets,
    write_index,
)
from wdsdist.data.sources.shard import MAX_SHARD_SAMPLES
from wdsdist.errors import CliParser, UserError, integer, run_cli
from wdsdist.tools.convert import Inputs, Progress, Run, convert
from wdsdist.tools.outfolder import check_local_output
from wdsdist.tools.planning import Options, parse_size

if TYPE_CHECKING:
    from wdsdist.data.sources import shardspec

# shardspec (the readers: webdataset, torch) and the synthetic set's writer are imported where they
# are used: --source needs neither, and each costs seconds of start-up.
PARTIAL = ".partial"  # beside a local --output: the counts made so far


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--source",
        help="an ImageFolder tree (SOURCE/CLASS/IMAGE), a tar of class tars or class folders, a flat folder or tar "
        "with --labels, or a Parquet file or folder of them",
    )
    src.add_argument("--synthetic", type=integer(1), metavar="N", help="N images of the built-in synthetic set")
    src.add_argument("--index", metavar="SHARDSPEC", help="write only the index for existing shards")
    p.add_argument(
        "--shards", default="data/shards", help="output folder, or s3:// / gs:// prefix (default: %(default)s)"
    )
    p.add_argument("--prefix", help="shard name prefix (default: the source folder's name, or synthetic-SPLIT)")
    p.add_argument("--maxcount", type=integer(1), default=1000, help="samples per shard (default: %(default)s)")
    p.add_argument("--maxsize", type=_size, help="bytes per shard, e.g. 1GB, 512MiB (default: 1GiB)")
    p.add_argument("--seed", type=int, default=0, help="sample order (ImageFolder) or drawing seed (synthetic)")
    p.add_argument("--split", choices=["train", "val"], default="train", help="synthetic split (default: train)")
    p.add_argument("--size", type=integer(1), default=64, help="synthetic image size in pixels (default: 64)")
    p.add_argument(
        "--quality",
        type=integer(1),
        help="JPEG quality: with --source, re-encode every image at it (off: images stored as they are); "
        "synthetic: default 90",
    )
    _source_options(p)
    p.add_argument(
        "--offset-every",
        type=integer(0),
        default=OFFSET_EVERY,
        metavar="K",
        help="index the byte offset of every K-th sample of plain tar shards, for reads from mid-shard "
        "(0: none; default: %(default)s)",
    )
    p.add_argument(
        "--output",
        help="with --index: the index file, or an s3:// or gs:// URL to upload it to (default: beside the first shard)",
    )
    p.add_argument("--allow-pipe", action="store_true", help="with --index: open pipe: shards (a shell command)")
    return p.parse_args(argv)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers", type=integer(1), help="processes writing shards (default: the cores this process may use)"
    )
    p.add_argument(
        "--labels",
        metavar="FILE",
        help="labels of a flat --source: CSV name,class, Kaggle's "
        "LOC_val_solution.csv, or the devkit's ILSVRC2012_validation_ground_truth.txt",
    )
    p.add_argument(
        "--devkit-classes",
        metavar="FILE",
        help="the devkit's class order: a text file of wnids in ILSVRC2012_ID order, or its meta.mat (needs scipy)",
    )
    p.add_argument("--classes-from", metavar="INDEX", help="the training set's index: its classes and their numbers")
    p.add_argument(
        "--verify",
        choices=["full", "header"],
        default="full",
        help="full (default): decode every image, "
        "skipping what does not decode; header: read headers only (fast; misses truncated files and "
        "damaged image data, which training then skips)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first file that is not a readable image")
    p.add_argument("--resize", type=integer(8), metavar="S", help="re-encode as JPEG with the shorter side at most S")
    p.add_argument("--max-member", type=_size, default=64 << 20, help="skip an image larger than this (default: 64MiB)")
    p.add_argument("--image-column", default="image", help="Parquet: the image bytes column (default: %(default)s)")
    p.add_argument("--label-column", default="label", help="Parquet: the label column (default: %(default)s)")


@dataclass(frozen=True, kw_only=True)
class MakeshardsOptions:
    """makeshards' command line, typed and checked once (``parse``): what main and everything below
    it read. A combination that cannot run is refused here in one line naming its option; the
    values alone argparse checks as it reads them."""

    source: str | None  # exactly one of source, synthetic and index (argparse's group)
    synthetic: int | None
    index: str | None
    shards: str
    prefix: str | None
    maxcount: int
    maxsize: int | None  # None: 1GiB, or none with --resize/--quality
    seed: int
    split: str
    size: int
    quality: int | None
    workers: int | None  # None: the cores this process may use
    labels: str | None
    devkit_classes: str | None
    classes_from: str | None
    verify: str
    strict: bool
    resize: int | None
    max_member: int
    image_column: str
    label_column: str
    offset_every: int
    output: str | None
    allow_pipe: bool

    def __post_init__(self) -> None:
        # Before anything is read or opened: outputs are local files (or, for --source, a bucket),
        # never pipe: commands or URLs.
        if self.index is None and not (self.source and s3open.is_object_url(self.shards)):
            check_local_output(self.shards, f"--shards {self.shards}")
        elif self.output is not None and not s3open.is_object_url(self.output):
            check_local_output(self.output, f"--output {self.output}")
        if self.source and (self.resize or self.quality) and self.maxsize is not None:
            raise UserError(
                "--maxsize with --resize/--quality: a re-encoded image's size is not known before it is encoded, "
                "so those shards are cut by --maxcount alone"
            )


def parse(argv: list[str] | None = None) -> MakeshardsOptions:
    """The command line as the typed, checked options: the one place its Namespace is read."""
    return MakeshardsOptions(**vars(parse_args(argv)))


def index_only(spec: str, output: str | None, allow_pipe: bool = False, offset_every: int = OFFSET_EVERY) -> dict:
    from wdsdist.data.sources import shardspec

    access = shardspec.Access(allow_pipe=allow_pipe)
    shards = shardspec.expand(spec, access=access)
    shardspec.check_access(shards, access)  # counting opens every shard
    first = shards[0].url
    name = re.sub(r"[-_.]?\d+$", "", os.path.basename(first).split(".")[0]) or "shards"
    if output is None:
        if shardspec.is_remote(first):
            raise UserError("--index of remote shards needs --output FILE (or an s3:// or gs:// URL to upload it to)")
        output = os.path.join(os.path.dirname(first), f"{name}.index.json")
    upload = s3open.is_object_url(output)
    if upload:
        try:
            s3open.split(output)
        except ValueError as exc:
            raise UserError(f"--output {exc}") from None
        if not shardspec.is_index(output):
            raise UserError(f"--output {output}: an index's name ends in .json (readers know it by that)")
        local = next((s.url for s in shards if not s3open.is_object_url(s.url)), None)
        if local is not None:
            raise UserError(f"--output {output}: an index in a bucket names objects, and {local} is not one")
    elif not os.path.isdir(os.path.dirname(output) or "."):
        raise UserError(f"--output {output}: no folder {os.path.dirname(output)} to write it in")
    counts = count_all(shards, None if upload else output + PARTIAL)
    offsets = [_offsets(u, n) if offset_every and os.path.isfile(u) else None for u, n in counts]
    if upload:
        # One PUT after all counting: the object appears whole or not at all. Shards in its
        # folder are named relative to it, so the bucket's index works wherever it is copied.
        desc = index_desc(output, counts, offsets=offsets, offset_every=offset_every, name=name)
        try:
            s3open.put_bytes(output, index_bytes(desc), HTTP_TIMEOUT)
        except OSError as exc:
            raise UserError(f"--output {output}: cannot upload the index: {exc}") from None
        home = s3open.bucket_url(output)
        outside = [e["url"] for e in desc["shardlist"] if "://" in e["url"] and s3open.bucket_url(e["url"]) != home]
    else:
        desc = write_index(output, counts, offsets=offsets, offset_every=offset_every, name=name)
        with contextlib.suppress(FileNotFoundError):
            os.remove(output + PARTIAL)
        outside = [e["url"] for e in desc["shardlist"] if e["url"].split(os.sep, 1)[0] == ".."]
    if outside:
        print(
            f"note: {output} names shards outside its folder (first {outside[0]}); readers refuse that unless told "
            f"to trust the index (train.py data.trust_index=true, simdist.py --trust-index)",
            file=sys.stderr,
        )
    return desc | {"path": output}


def count_all(shards: list[shardspec.Shard], partial: str | None) -> list[tuple[str, int]]:
    """Each shard's count (a shard the spec's metadata counted is taken as counted), read once
    with a progress bar. ``partial``: a file the counts are appended to as they come, so a run
    stopped midway (a remote data set takes hours) goes on where it stopped; lines it cannot use
    (another spec's shards, a torn last line) are passed over."""
    done = _counted(partial, {s.url for s in shards}) if partial else {}
    if done:
        print(f"note: {len(done)} of {len(shards)} shards counted before ({partial}); the rest now", file=sys.stderr)
    out = open(partial, "a", encoding="utf-8") if partial else None  # noqa: SIM115 (closed below)
    try:
        for s in tqdm(shards, desc="counting", unit="shard", mininterval=1.0):
            if s.url in done or s.nsamples is not None:
                continue
            done[s.url] = count_samples(s.url)
            if out is not None:
                out.write(json.dumps({"url": s.url, "nsamples": done[s.url]}) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return [(s.url, s.nsamples if s.nsamples is not None else done[s.url]) for s in shards]


def _counted(partial: str, urls: set[str]) -> dict[str, int]:
    try:
        with open(partial, encoding="utf-8") as f:
            lines = f.read(64 << 20).splitlines()
    except FileNotFoundError:
        return {}
    done: dict[str, int] = {}
    for line in lines:
        try:
            entry = json.loads(line)
            url, n = entry["url"], entry["nsamples"]
        except (ValueError, TypeError, KeyError):
            continue
        if url in urls and isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_SHARD_SAMPLES:
            done[url] = n
    return done


def _offsets(path: str, nsamples: int) -> list[int] | None:
    """A local shard's sample offsets; None (with a note) where they would not match its count."""
    offsets = local_sample_offsets(path)
    if offsets is not None and len(offsets) != nsamples:
        # tarfile's count and the loader's grouping disagree only on odd member names (a key
        # whose file name starts with "__"): no table rather than one the reader would misplace.
        print(
            f"note: {path}: {len(offsets)} samples by the loader's grouping, {nsamples} counted; no offsets",
            file=sys.stderr,
        )
        return None
    return offsets


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if options.index:
        desc = index_only(options.index, options.output, options.allow_pipe, options.offset_every)
        print(f"indexed {desc['nshards']} shards, {desc['nsamples']} samples -> {desc['path']}")
        return 0
    if options.source:
        return from_source(options)
    from wdsdist.tools.shards import from_synthetic

    prefix = options.prefix or f"synthetic-{options.split}"
    common = dict(maxcount=options.maxcount, maxsize=options.maxsize or 1 << 30, seed=options.seed)
    desc = from_synthetic(
        options.synthetic,
        options.shards,
        prefix,
        split=options.split,
        size=options.size,
        quality=options.quality or 90,
        offset_every=options.offset_every,
        **common,
    )
    where = os.path.join(options.shards, f"{prefix}.index.json")
    print(f"wrote {desc['nshards']} shards, {desc['nsamples']} samples, {len(desc['classes'])} classes -> {where}")
    return 0


def from_source(options: MakeshardsOptions) -> int:
    """--source: the planned, parallel, resumable conversion (tools/convert.py)."""
    name = os.path.basename(os.path.normpath(options.source))
    prefix = options.prefix or re.sub(r"\.(tar|parquet)$", "", name, flags=re.IGNORECASE)
    inputs = Inputs(
        options.source,
        options.seed,
        options.labels,
        options.devkit_classes,
        options.classes_from,
        options.image_column,
        options.label_column,
    )
    o = options
    plan = Options(prefix, o.maxcount, o.maxsize or 1 << 30, o.verify, o.resize, o.quality, o.max_member)
    rank, world = _torchrun_rank()
    workers = options.workers or max(1, cores() // ranks_on_node(1))
    how = "" if options.workers else " (the cores this process may use)"
    ranks = f", rank {rank} of {world}" if world > 1 else ""
    print(f"makeshards: {workers} worker{'s' if workers > 1 else ''}{how}{ranks}", file=sys.stderr)
    job = Run(options.shards, workers, rank, world, options.strict, options.offset_every)
    desc = convert(inputs, plan, job, _Bar(prefix))
    print(_summary(desc, options.shards, prefix))
    return 0


def _torchrun_rank() -> tuple[int, int]:
    """torchrun's RANK and WORLD_SIZE (0 and 1 outside it), read here, where the command line is."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError("RANK and WORLD_SIZE must be integers (as torchrun sets them)") from None
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is not within WORLD_SIZE={world}")
    return rank, world


def _summary(desc: dict, shards: str, prefix: str) -> str:
    secs = max(desc["seconds"], 1e-9)
    kept = f" ({desc['kept']} of them finished before, kept)" if desc["kept"] else ""
    if "rank" in desc:
        written = f"wrote {desc['written']} of its {desc['nshards']} shards{kept}"
        return f"rank {desc['rank']}: {written}; rank 0 writes the index"
    where = f"{shards.rstrip('/')}/{prefix}.index.json"
    skipped = f", {desc['nskipped']} files skipped (listed in the index)" if desc.get("nskipped") else ""
    rate = ""
    if desc.get("images"):
        rate = f" ({desc['images'] / secs:.0f} images/s, {desc['bytes'] / secs / 1e6:.1f} MB/s)"
    wrote = f"wrote {desc['nshards']} shards, {desc['nsamples']} samples, {len(desc['classes'])} classes"
    return f"{wrote}{skipped}{kept} in {secs:.1f} s{rate} -> {where}"


class _Bar(Progress):
    """One tqdm bar for the job: images/s, MB/s and the time left."""

    def __init__(self, prefix: str):
        self.prefix, self.bar, self.nbytes, self.began = prefix, None, 0, time.monotonic()

    def start(self, total: int, done: int) -> None:
        self.bar = tqdm(total=total, initial=done, desc=f"writing {self.prefix}", unit="img", mininterval=1.0)
        self.began = time.monotonic()

    def update(self, images: int, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.bar is not None and images:
            secs = max(time.monotonic() - self.began, 1e-6)
            self.bar.set_postfix_str(f"{self.nbytes / secs / 1e6:.1f} MB/s", refresh=False)
            self.bar.update(images)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run() -> None:
    """The console script: main() with one-line errors (wdsdist.errors.run_cli)."""
    run_cli(main)


if __name__ == "__main__":
    run()
