"""Local shards: paths (brace patterns and globs, each checked to exist) and file: URLs."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Sequence
from typing import IO

import braceexpand
import webdataset as wds

from wdsdist.data.sources.access import Access
from wdsdist.data.sources.shard import Shard
from wdsdist.data.tar.tarread import skip_bytes
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

PREFIXES: tuple[str, ...] = ()  # whatever no other scheme takes
RANGED = False


def expand(spec: str, access: Access, strict: bool) -> list[Shard]:
    """The files a brace pattern or glob names (see ``matching``)."""
    names = list(braceexpand.braceexpand(spec))
    return [Shard(p) for p in matching(spec, names, lambda g: sorted(glob.glob(g)), os.path.exists, strict)]


def matching(
    spec: str,
    names: list[str],
    glob_of: Callable[[str], list[str]],
    exists: Callable[[str], bool],
    strict: bool,
    where: str = "",
) -> list[str]:
    """What a spec's brace-expanded ``names`` find: a glob's matches, a plain name where it exists.
    Some missing are an error when ``strict``, else a warning; none at all is always an error.
    ``where`` (" in PLACE") says where they were looked for, when not on this machine."""
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        matches = glob_of(name) if glob.has_magic(name) else [name] if exists(name) else []
        found += matches
        missing += [] if matches else [name]
    if missing and not found:
        raise UserError(f"shard spec {spec!r} matches no file{where}")
    if missing:
        message = f"shard spec {spec!r}: {len(missing)} of {len(names)} shards do not exist{where}, first {missing[0]}"
        if strict:
            raise UserError(message)
        log.warning("%s; going on without them", message)
    return found


def pin(url: str, access: Access) -> str:
    """What a run reads is what the URL names: nothing to pin."""
    return url


def check(shards: Sequence[Shard], access: Access) -> None:
    """Nothing to check before opening: a missing file is found when it is opened."""


def open_range(url: str, access: Access, start: int, end: int | None) -> IO[bytes]:
    """The file from byte ``start`` (a seek). Honours WebDataset's GOPEN_BUFFER (bytes of read
    buffer) for slow disks."""
    if url.startswith("file:"):
        stream = wds.gopen(url, "rb")
    else:
        stream = open(url, "rb", buffering=int(os.environ.get("GOPEN_BUFFER", -1)))
    return from_byte(stream, start)


def from_byte(stream: IO[bytes], start: int) -> IO[bytes]:
    """``stream`` past its first ``start`` bytes (a seek where it can, else read and dropped);
    closed if that fails."""
    if start:
        try:
            skip_bytes(stream, start, seek_above=0)
        except BaseException:
            stream.close()
            raise
    return stream


def read_capped(url: str, access: Access, limit: int) -> bytes:
    with open(url, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is more than the limit of {limit} bytes")
    return data


def server(url: str, access: Access) -> str:
    return "this machine"
