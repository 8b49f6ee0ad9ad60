"""Write WebDataset shards (plus their index) of the synthetic set as one whole new set (a source's
conversion, planned and resumable, is tools/convert.py).

The atomic set writer (ShardSink: temporaries, commit by renames under a lock, rollback) is
half of one guarantee, "a re-run loses nothing and reads and writes only where told"; the
other half, the source walk that stays inside --source, is tools/sourcetree.py."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import webdataset as wds
from tqdm import tqdm

from wdsdist.data.sources.index import (
    OFFSET_EVERY,
    create_new,
    index_bytes,
    index_desc,
    index_path,
    local_sample_offsets,
    read_index,
    write_beside,
)
from wdsdist.errors import UserError
from wdsdist.tools import synthetic
from wdsdist.tools.outfolder import check_local_output, make_output_folder


@dataclass(frozen=True)
class Sample:
    key: str
    ext: str  # image extension: jpg, jpeg, png, ...
    image: bytes
    label: int
    meta: dict


def shard_name(prefix: str, i: int) -> str:
    return f"{prefix}-{i:06d}.tar"


@contextlib.contextmanager
def _folder_lock(folder: str) -> Iterator[None]:
    """Serialise the short steps that look at or change the output folder's finished files,
    between writers in this and other processes (flock on the folder itself: no lock file)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # A file system without flock (some NFS setups): unique temporaries still keep writers apart.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_dead_temporaries(outdir: str, prefix: str) -> None:
    """Remove temporary folders of this prefix left by writers that were killed (each live
    writer holds a lock on its own)."""
    with os.scandir(outdir) as it:
        stale = [e.path for e in it if e.name.startswith(f".{prefix}.tmp-") and e.is_dir(follow_symlinks=False)]
    for path in stale:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a writer is alive, or no flock here: leave it
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


class ShardSink:
    """Writes one set of shards; rolls over to a new shard at maxcount samples or maxsize bytes.

    The shards go into a private temporary folder inside outdir (made by mkdtemp: unique, so
    two writers of one prefix never share a file, and nothing planted in outdir is written
    through). commit() moves the whole set into place, removes stale higher-numbered shards of
    the prefix and writes the index; leaving without commit() (an unreadable image, Ctrl-C)
    removes the temporaries, so the shards and index in outdir stay as they were. Use it as a
    context manager."""

    def __init__(self, outdir: str, prefix: str, maxcount: int, maxsize: int, offset_every: int = OFFSET_EVERY):
        if maxcount < 1 or maxsize < 1:
            raise UserError(f"--maxcount and --maxsize must be >= 1, got {maxcount} and {maxsize}")
        if offset_every < 0:
            raise UserError(f"--offset-every must be >= 0, got {offset_every}")
        check_local_output(outdir, f"output folder {outdir}")
        if not prefix or "/" in prefix or os.sep in prefix or prefix in (".", ".."):
            raise UserError(f"shard prefix {prefix!r} must be a plain file name (no '/')")
        make_output_folder(outdir, "shard output folder")
        self.outdir, self.prefix = outdir, prefix
        self.maxcount, self.maxsize = maxcount, maxsize
        self.counts: list[int] = []
        self.offset_every = offset_every
        self.offsets: list[list[int] | None] = []  # per finished shard: each sample's byte offset
        self._alive: int | None = None
        self._file: BinaryIO | None = None
        self._writer: wds.TarWriter | None = None
        self._count = self._size = 0
        with _folder_lock(outdir):  # so a starting writer never removes this folder before it is locked
            _remove_dead_temporaries(outdir, prefix)
            self.tmpdir = tempfile.mkdtemp(prefix=f".{prefix}.tmp-", dir=outdir)
            try:
                self._alive = os.open(self.tmpdir, os.O_RDONLY | os.O_DIRECTORY)
                with contextlib.suppress(OSError):
                    fcntl.flock(self._alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BaseException:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                raise

    def __enter__(self) -> ShardSink:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self.offset_every:
                # Read back from the page cache, headers only: TarWriter's stream mode hides positions.
                path = os.path.join(self.tmpdir, shard_name(self.prefix, len(self.counts)))
                self.offsets.append(local_sample_offsets(path))
            self.counts.append(self._count)
            self._writer = self._file = None

    def write(self, s: Sample) -> None:
        nbytes = len(s.image) + 1024
        if self._writer is not None and (self._count >= self.maxcount or self._size + nbytes > self.maxsize):
            self._close()
        if self._writer is None:
            self._file = create_new(os.path.join(self.tmpdir, shard_name(self.prefix, len(self.counts))))
            # A whole-second mtime: a float one makes tarfile add a PAX header to every member,
            # which every reader then parses.
            self._writer = wds.TarWriter(self._file, mtime=int(time.time()))
            self._count = self._size = 0
        self._writer.write({"__key__": s.key, s.ext: s.image, "cls": str(s.label), "json": json.dumps(s.meta).encode()})
        self._count += 1
        self._size += nbytes

    def end_shard(self) -> None:
        """Complete the shard being written now, before maxcount (layouts of uneven shards)."""
        self._close()

    def abort(self) -> None:
        """Drop everything not committed; what is in outdir stays as it was."""
        if self._writer is not None:
            with contextlib.suppress(Exception):  # ends the tar stream, so nothing flushes into a closed file later
                self._writer.close()
        if self._file is not None:
            self._file.close()
        self._writer = self._file = None
        if self._alive is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            os.close(self._alive)
            self._alive = None

    def commit(self, **index_extra) -> dict:
        """Put the new set of shards and its index in place of the old; return the index."""
        self._close()
        if not self.counts:
            raise UserError(f"no samples to write for {self.prefix}")
        if self._alive is None:
            raise RuntimeError("commit() after abort()")
        index = index_path(self.outdir, self.prefix)
        final = [(os.path.join(self.outdir, shard_name(self.prefix, i)), n) for i, n in enumerate(self.counts)]
        offsets = self.offsets if self.offset_every else None
        desc = index_desc(
            index, final, offsets=offsets, offset_every=self.offset_every, **({"name": self.prefix} | index_extra)
        )
        for path, _ in final:
            if os.path.isdir(path) and not os.path.islink(path):
                raise UserError(f"{path} is a folder where a shard goes: move it or choose another prefix")
        # Everything that can fail for want of space is written before the first old file goes.
        new_index = write_beside(index, index_bytes(desc))
        old = os.path.join(self.tmpdir, "old")
        os.mkdir(old)
        moved: list[tuple[str, str]] = []

        def move(src: str, dst: str) -> None:
            os.rename(src, dst)
            moved.append((src, dst))

        try:
            with _folder_lock(self.outdir):
                # The window: renames only, none onto an existing name (replacing a file costs
                # its deletion, milliseconds each on some file systems); the old files are
                # deleted with the temporary folder afterwards. The old index goes first, so a
                # crash inside the window leaves no index (readers refuse it, ensure_synthetic
                # rewrites the set) rather than an index listing other shards than those on disk.
                # An exception inside it (Ctrl-C) moves everything back.
                try:
                    if os.path.lexists(index):
                        move(index, os.path.join(old, "index"))
                    for i, (path, _) in enumerate(final):
                        if os.path.lexists(path):
                            move(path, os.path.join(old, os.path.basename(path)))
                        move(os.path.join(self.tmpdir, shard_name(self.prefix, i)), path)
                    for path in self._stale(len(final)):
                        move(path, os.path.join(old, os.path.basename(path)))
                    move(new_index, index)
                except BaseException:
                    for src, dst in reversed(moved):
                        os.rename(dst, src)
                    raise
                _fsync_dir(self.outdir)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(new_index)
            raise
        finally:
            self.abort()
        return desc

    def _stale(self, nshards: int) -> list[str]:
        """Shards of this prefix numbered beyond the new set: left, a *.tar glob would add them."""
        pattern = re.compile(re.escape(self.prefix) + r"-(\d{6,})\.tar")
        with os.scandir(self.outdir) as it:
            return [
                e.path
                for e in it
                if (m := pattern.fullmatch(e.name))
                and int(m.group(1)) >= nshards
                and not e.is_dir(follow_symlinks=False)
            ]


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shards(
    samples: Iterable[Sample],
    total: int,
    outdir: str,
    prefix: str,
    *,
    maxcount: int,
    maxsize: int,
    offset_every: int = OFFSET_EVERY,
    **index_extra,
) -> dict:
    """Write samples into shards and the index beside them, replacing the prefix's old set
    only when every sample is written; return the index."""
    with ShardSink(outdir, prefix, maxcount, maxsize, offset_every) as sink:
        for s in tqdm(samples, total=total, desc=f"writing {prefix}", unit="img", mininterval=1.0):
            sink.write(s)
        return sink.commit(**index_extra)


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
    offset_every: int = OFFSET_EVERY,
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
        offset_every=offset_every,
        classes=list(synthetic.CLASSES),
        synthetic={"seed": seed, "split": split, "size": size},
    )


def synthetic_is_current(index: str, key: str, want: dict, nsamples: int) -> bool:
    """Whether the synthetic data set at ``index`` was written with ``want`` (seed, split, size)
    and holds ``nsamples``; refused (one line naming ``key``) when ``index`` is not synthetic data."""
    if not os.path.exists(index):
        return False
    desc = read_index(index)
    if desc.get("synthetic") is None:
        raise UserError(
            f"{key}={index} is not synthetic data: for shards of your own use data=shards data.num_classes=N"
        )
    return desc["synthetic"] == want and desc["nsamples"] == nsamples
