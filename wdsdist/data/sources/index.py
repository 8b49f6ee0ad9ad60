"""Shard index files (wids ``wids-shard-index-v1`` compatible) and counting samples in tars."""

from __future__ import annotations

import json
import os
import secrets
import tarfile
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

from wdsdist.data.sources import s3open
from wdsdist.data.sources.access import Access
from wdsdist.errors import UserError

INDEX_KIND = "wids-shard-index-v1"
# Every 16th sample's byte offset: ImageNet's index grows from 60 KB to about 1 MB, and a read
# from mid-shard passes over at most 15 samples' headers (locally) or bytes (http) to its start.
OFFSET_EVERY = 16
HTTP_TIMEOUT = 60.0  # seconds, as data.http_timeout's default
# Counting a shard the user named (makeshards.py --index): pipe: runs, http and stores as by default.
COUNT_ACCESS = Access(allow_pipe=True, http_timeout=HTTP_TIMEOUT)
# The readers (opener, tarread, webdataset's key split) are imported where they are used: writing
# an index (wds-makeshards --source) then needs neither torch nor webdataset, a few seconds of
# start-up on every run.


def index_path(outdir: str, prefix: str) -> str:
    return os.path.join(outdir, f"{prefix}.index.json")


def create_new(path: str) -> BinaryIO:
    """Open a file that does not exist yet for writing. O_EXCL and O_NOFOLLOW: a file or a
    symlink planted at that name makes this fail instead of being written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, "wb")


def write_beside(path: str, data: bytes) -> str:
    """Write data to a new, uniquely named temporary file in path's folder (synced to disk) and
    return its name; the caller os.replace()s it onto path, which swaps the directory entry and
    so never writes through a link at path. Two writers never share a temporary."""
    folder, base = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(folder, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            f = create_new(tmp)
        except FileExistsError:
            continue
        try:
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.remove(tmp)
            raise
        return tmp
    raise UserError(f"cannot create a temporary file beside {path}")


def offsets_entry(offsets: Sequence[int], every: int) -> dict:
    """An index entry's "offsets": where every ``every``-th sample's headers begin, in bytes."""
    return {"every": every, "at": [int(o) for o in offsets[::every]]}


def index_desc(
    path: str,
    shards: Sequence[tuple[str, int]],
    *,
    offsets: Sequence[Sequence[int] | None] | None = None,
    offset_every: int = OFFSET_EVERY,
    **extra: Any,
) -> dict:
    """The index for shards, with shard URLs relative to the index's folder: local shards of a
    local index, and objects in the folder of an index at an s3:// or gs:// URL. ``offsets``:
    per shard, the byte offset of each of its samples (None: unknown), of which the index keeps
    every ``offset_every``-th (0: none)."""
    in_store = s3open.is_object_url(path)
    base = s3open.folder_url(path) if in_store else os.path.dirname(os.path.abspath(path))
    shardlist = []
    for i, (url, n) in enumerate(shards):
        if in_store:
            url = url.removeprefix(base)
        elif not ("://" in url or url.startswith("pipe:")):
            url = os.path.relpath(os.path.abspath(url), base)
        entry = {"url": url, "nsamples": int(n)}
        known = offsets[i] if offsets is not None else None
        # A shard of no more than offset_every samples would get a table of one 0: no help.
        if known is not None and 0 < offset_every < n and len(known) == n:
            entry["offsets"] = offsets_entry(known, offset_every)
        shardlist.append(entry)
    return {
        "__kind__": INDEX_KIND,
        "wids_version": 1,
        "shardlist": shardlist,
        "nshards": len(shardlist),
        "nsamples": sum(s["nsamples"] for s in shardlist),
        **extra,
    }


def index_bytes(desc: dict) -> bytes:
    """The index as JSON, one shard to a line (an offset table on one line, not one per number)."""
    placeholder = "\0shardlist\0"
    text = json.dumps({**desc, "shardlist": placeholder}, indent=1)
    entries = ",\n  ".join(json.dumps(e) for e in desc["shardlist"])
    text = text.replace(json.dumps(placeholder), f"[\n  {entries}\n ]" if entries else "[]", 1)
    return (text + "\n").encode("utf-8")


def write_index(
    path: str,
    shards: Sequence[tuple[str, int]],
    *,
    offsets: Sequence[Sequence[int] | None] | None = None,
    offset_every: int = OFFSET_EVERY,
    **extra: Any,
) -> dict:
    """Write an index (atomically) whose shard URLs are relative to its folder when they are local."""
    desc = index_desc(path, shards, offsets=offsets, offset_every=offset_every, **extra)
    tmp = write_beside(path, index_bytes(desc))
    try:
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise
    return desc


def read_index(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read shard index {path}: {exc}") from None
    if desc.get("__kind__") != INDEX_KIND or "shardlist" not in desc:
        raise UserError(f"{path}: not a {INDEX_KIND} shard index")
    return desc


def local_sample_offsets(path: str) -> list[int] | None:
    """The byte offset of each sample of a local plain tar shard (headers only are read, member
    data is passed by seeks); None for a compressed one, whose bytes no reader can seek to."""
    from wdsdist.data.tar import tarread

    try:
        with open(path, "rb") as f:
            return tarread.sample_offsets(f)
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"{path}: not a readable tar shard ({exc})") from None


def count_keys(names: Iterable[str]) -> int:
    """Count samples the way WebDataset groups tar members: consecutive runs of one key."""
    from webdataset.tariterators import base_plus_ext

    count, last = 0, None
    for name in names:
        key, _ = base_plus_ext(name)
        if key is None or os.path.basename(name).startswith("__"):
            continue
        if key != last:
            count += 1
            last = key
    return count


def count_samples(url: str) -> int:
    """Count samples in a shard from its tar headers (plain or gzipped; local or any gopen URL)."""
    from wdsdist.data.sources import opener

    try:
        if os.path.exists(url):
            # Random access: headers only, member data is skipped with seeks.
            with tarfile.open(url, mode="r:*") as tar:
                return count_keys(m.name for m in tar if m.isreg())
        # http(s) and object stores the way the loader reads them (their limits), not through a CLI.
        try:
            stream = opener.open_shard(url, COUNT_ACCESS)
        except OSError as exc:  # no object, no access: not a question of the tar format
            if not s3open.is_object_url(url):
                raise
            raise UserError(f"{url}: cannot read shard: {exc}") from None
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                return count_keys(m.name for m in tar if m.isreg())
        finally:
            stream.close()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UserError(f"{url}: not a readable tar shard ({exc})") from None
