"""Shards a command writes: ``pipe:`` (a shell command, refused unless ``allow_pipe``) and
``ais://`` (webdataset's gopen runs AIStore's CLI). Read as they stream, never ranged: a start is
reached by reading and dropping the bytes before it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

import braceexpand
import webdataset as wds

from wdsdist.data.sources.access import Access
from wdsdist.data.sources.schemes.file import from_byte
from wdsdist.data.sources.shard import Shard
from wdsdist.errors import DataError, UserError

PREFIXES = ("pipe:", "ais://")
RANGED = False


def expand(spec: str, access: Access, strict: bool) -> list[Shard]:
    return [Shard(u) for u in braceexpand.braceexpand(spec)]


def pin(url: str, access: Access) -> str:
    """What a run reads is what the URL names: nothing to pin."""
    return url


def check(shards: Sequence[Shard], access: Access) -> None:
    """``pipe:`` runs a shell command: refused unless the user allowed it (``data.allow_pipe``,
    ``--allow-pipe``)."""
    piped = [s.url for s in shards if s.url.startswith("pipe:")]
    if piped and not access.allow_pipe:
        raise UserError(f"{piped[0]}: pipe: URLs are refused (allow_pipe is false)")


def open_range(url: str, access: Access, start: int, end: int | None) -> IO[bytes]:
    if url.startswith("pipe:") and not access.allow_pipe:
        raise DataError(f"{url}: pipe: URLs are refused (allow_pipe is false)")
    return from_byte(wds.gopen(url, "rb"), start)


def read_capped(url: str, access: Access, limit: int) -> bytes:
    raise OSError(f"{url}: an index or metadata file is not read through a command")


def server(url: str, access: Access) -> str:
    return url.split(" ", 1)[0]
