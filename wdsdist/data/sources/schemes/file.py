"""Local shards: paths (brace patterns and globs, each checked to exist) and file: URLs."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Sequence
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
    """The files a brace pattern or glob names. Some missing are an error when ``strict``, else a
    warning; none at all is always an error."""
    urls = list(braceexpand.braceexpand(spec))
    shards: list[Shard] = []
    missing: list[str] = []
    for u in urls:
        if glob.has_magic(u):
            matches = sorted(glob.glob(u))
            if not matches:
                missing.append(u)
            shards.extend(Shard(m) for m in matches)
        elif os.path.exists(u):
            shards.append(Shard(u))
        else:
            missing.append(u)
    if missing and not shards:
        raise UserError(f"shard spec {spec!r} matches no file")
    if missing:
        message = f"shard spec {spec!r}: {len(missing)} of {len(urls)} shards do not exist, first {missing[0]}"
        if strict:
            raise UserError(message)
        log.warning("%s; going on without them", message)
    return shards


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
