"""Write WebDataset shards (plus their index) from an ImageFolder tree or the synthetic set."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import webdataset as wds
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from tqdm import tqdm

from wdsdist import synthetic
from wdsdist.errors import UserError
from wdsdist.index import index_path, write_index


@dataclass(frozen=True)
class Sample:
    key: str
    ext: str  # image extension: jpg, jpeg, png, ...
    image: bytes
    label: int
    meta: dict


class ShardSink:
    """Rolls over to a new shard at maxcount samples or maxsize bytes; each shard is written
    to a temporary name and renamed when complete, so no reader ever sees half a shard."""

    def __init__(self, outdir: str, prefix: str, maxcount: int, maxsize: int):
        if maxcount < 1 or maxsize < 1:
            raise UserError(f"--maxcount and --maxsize must be >= 1, got {maxcount} and {maxsize}")
        os.makedirs(outdir, exist_ok=True)
        self.outdir, self.prefix = outdir, prefix
        self.maxcount, self.maxsize = maxcount, maxsize
        self.shards: list[tuple[str, int]] = []
        self._writer: wds.TarWriter | None = None
        self._count = self._size = 0

    def _path(self) -> str:
        return os.path.join(self.outdir, f"{self.prefix}-{len(self.shards):06d}.tar")

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            path = self._path()
            os.replace(path + ".tmp", path)
            self.shards.append((path, self._count))
            self._writer = None

    def write(self, s: Sample) -> None:
        nbytes = len(s.image) + 1024
        if self._writer is not None and (self._count >= self.maxcount or self._size + nbytes > self.maxsize):
            self._close()
        if self._writer is None:
            # A whole-second mtime: a float one makes tarfile add a PAX header to every member,
            # which every reader then parses.
            self._writer = wds.TarWriter(self._path() + ".tmp", mtime=int(time.time()))
            self._count = self._size = 0
        self._writer.write({"__key__": s.key, s.ext: s.image, "cls": str(s.label), "json": json.dumps(s.meta).encode()})
        self._count += 1
        self._size += nbytes

    def end_shard(self) -> None:
        """Complete the shard being written now, before maxcount (layouts of uneven shards)."""
        self._close()

    def abort(self) -> None:
        """Drop the shard being written; the complete ones stay, the index is not written."""
        if self._writer is not None:
            self._writer.close()
            os.remove(self._path() + ".tmp")
            self._writer = None

    def finish(self) -> list[tuple[str, int]]:
        self._close()
        return self.shards


def write_shards(
    samples: Iterable[Sample], total: int, outdir: str, prefix: str, *, maxcount: int, maxsize: int, **index_extra
) -> dict:
    """Write samples into shards and the index beside them; return the index."""
    sink = ShardSink(outdir, prefix, maxcount, maxsize)
    try:
        for s in tqdm(samples, total=total, desc=f"writing {prefix}", unit="img", mininterval=1.0):
            sink.write(s)
    except BaseException:
        sink.abort()
        raise
    shards = sink.finish()
    if not shards:
        raise UserError(f"no samples to write for {prefix}")
    return write_index(index_path(outdir, prefix), shards, name=prefix, **index_extra)


def image_folder_samples(source: str, seed: int) -> tuple[list[Sample], list[str]]:
    """List an ImageFolder tree; return lazily-read samples in seeded shuffled order and the classes."""
    if not os.path.isdir(source):
        raise UserError(f"--source {source}: no such folder")
    try:
        classes, class_to_idx = find_classes(source)
    except FileNotFoundError:
        raise UserError(f"--source {source}: no class folders in it (expected SOURCE/CLASS/IMAGE)") from None
    files = make_dataset(source, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not files:
        raise UserError(f"--source {source}: no images ({', '.join(IMG_EXTENSIONS)}) in its class folders")
    random.Random(seed).shuffle(files)
    return files, classes


def _read_image_file(source: str, path: str, label: int, classes: list[str]) -> Sample:
    rel = os.path.relpath(path, source)
    stem, ext = os.path.splitext(rel)
    try:
        with Image.open(path) as im:
            fmt = im.format
        with open(path, "rb") as f:
            data = f.read()
    except (UnidentifiedImageError, OSError) as exc:
        raise UserError(f"unreadable image {path}: {exc.__class__.__name__}: {exc}") from None
    ext = ext.lstrip(".").lower() or (fmt or "img").lower()
    # WebDataset splits keys at the first dot of the file name: keep dots out of keys.
    key = stem.replace(os.sep, "/").replace(".", "_")
    return Sample(key, ext, data, label, {"path": rel, "class": classes[label]})


def from_image_folder(source: str, outdir: str, prefix: str, *, maxcount: int, maxsize: int, seed: int) -> dict:
    files, classes = image_folder_samples(source, seed)

    def samples() -> Iterator[Sample]:
        for path, label in files:
            yield _read_image_file(source, path, label, classes)

    return write_shards(
        samples(),
        len(files),
        outdir,
        prefix,
        maxcount=maxcount,
        maxsize=maxsize,
        classes=classes,
        source=os.path.abspath(source),
    )


def from_synthetic(
    n: int,
    outdir: str,
    prefix: str,
    *,
    maxcount: int,
    maxsize: int,
    seed: int,
    split: str = "train",
    size: int = 64,
    quality: int = 90,
) -> dict:
    if n < 1:
        raise UserError(f"--synthetic must be >= 1, got {n}")
    if size < 8:
        raise UserError(f"--size must be >= 8, got {size}")

    def samples() -> Iterator[Sample]:
        for i in range(n):
            img, label = synthetic.draw(i, size=size, seed=seed, split=split)
            key = f"{split}-{i:08d}"
            yield Sample(
                key,
                "jpg",
                synthetic.jpeg_bytes(img, quality),
                label,
                {"index": i, "class": synthetic.CLASSES[label], "split": split},
            )

    return write_shards(
        samples(),
        n,
        outdir,
        prefix,
        maxcount=maxcount,
        maxsize=maxsize,
        classes=list(synthetic.CLASSES),
        synthetic={"seed": seed, "split": split, "size": size},
    )
