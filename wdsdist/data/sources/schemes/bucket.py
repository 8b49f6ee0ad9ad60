"""s3:// and gs:// shards, through boto3 (s3open.py, imported with the [s3] extra); credentials are
checked once before any shard is opened, since without them every shard would fail one by one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

import braceexpand

from wdsdist.data.sources import retry, s3open
from wdsdist.data.sources.access import Access
from wdsdist.data.sources.shard import Shard
from wdsdist.errors import UserError

PREFIXES = ("s3://", "gs://")
RANGED = True


def expand(spec: str, access: Access, strict: bool) -> list[Shard]:
    urls = list(braceexpand.braceexpand(spec))
    bad = next((u for u in urls if not s3open.is_object_key(u)), None)
    if bad is not None:
        raise UserError(f"shard spec {spec!r}: {bad}: need s3://BUCKET/KEY or gs://BUCKET/KEY")
    return [Shard(u) for u in urls]


def pin(url: str, access: Access) -> str:
    """What a run reads is what the URL names: nothing to pin."""
    return url


def check(shards: Sequence[Shard], access: Access) -> None:
    first = shards[0].url
    s3open.require_boto3(first)
    try:
        s3open.check_credentials(first)
    except OSError as exc:
        raise UserError(f"{first}: {exc}") from None


def open_range(url: str, access: Access, start: int, end: int | None) -> IO[bytes]:
    return s3open.open_url(  # type: ignore[return-value]
        url, access.http_timeout, access.http_min_rate, start=start, end=end, endpoint_url=access.endpoint_url(url)
    )


def read_capped(url: str, access: Access, limit: int) -> bytes:
    return s3open.read_capped(
        url, limit, access.http_timeout, access.http_min_rate, endpoint_url=access.endpoint_url(url)
    )


def server(url: str, access: Access) -> str:
    return retry.server_of(s3open.endpoint(url, access.http_timeout, access.endpoint_url(url)))
