"""http:// and https:// shards, through urllib (httpopen.py): never a shell, so a URL cannot
inject a command; a brace pattern is expanded, not checked for existence (a missing shard fails
when it is opened)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

import braceexpand

from wdsdist.data.sources import httpopen, retry
from wdsdist.data.sources.access import Access
from wdsdist.data.sources.shard import Shard

PREFIXES = ("http://", "https://")
RANGED = True


def expand(spec: str, access: Access, strict: bool) -> list[Shard]:
    return [Shard(u) for u in braceexpand.braceexpand(spec)]


def pin(url: str, access: Access) -> str:
    """What a run reads is what the URL names: nothing to pin."""
    return url


def check(shards: Sequence[Shard], access: Access) -> None:
    """Nothing before opening: a server that does not answer is found by the first read."""


def open_range(url: str, access: Access, start: int, end: int | None) -> IO[bytes]:
    return httpopen.open_url(url, access.http_timeout, access.http_min_rate, start=start, end=end)  # type: ignore[return-value]


def read_capped(url: str, access: Access, limit: int) -> bytes:
    return httpopen.read_capped(url, limit, access.http_timeout, access.http_min_rate)


def server(url: str, access: Access) -> str:
    return retry.server_of(url)
