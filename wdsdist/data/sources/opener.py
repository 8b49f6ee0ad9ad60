"""Where a shard's or an index's bytes come from, written once: a local file, http(s) (httpopen),
s3:// and gs:// (s3open), or a ``pipe:`` command (WebDataset's gopen, refused unless allowed).
Whatever reads a shard or an index opens it here, with the limits an ``Access`` carries; what it
then parses (tar headers, JSON) knows nothing of URLs."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import webdataset as wds

from wdsdist.data.sources import cache, httpopen, retry, s3open
from wdsdist.data.tar.tarread import skip_bytes
from wdsdist.errors import DataError

REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://", "ais://", "hf://")


@dataclass(frozen=True)
class Access:
    """What reading a spec may do beyond local files the user named.

    ``allow_pipe``: ``pipe:`` URLs (a shell command) may run. ``trust_index``: an index may name
    shards outside its own place (absolute paths, ``..``, another server or bucket, other URL
    schemes, and with ``allow_pipe`` also ``pipe:``); without it a local index names files inside
    its folder or URLs, an http(s) index names http(s) URLs on its own server (scheme, host and
    port), and an s3:// or gs:// index names objects in its own bucket.

    ``http_timeout``, ``http_min_rate`` and ``http_retry_s`` (seconds of failure a shard read
    rides out, retry.py; 0: none) hold for object stores too; ``s3_endpoint_url`` and
    ``gs_endpoint_url`` (None: boto3's own, and Cloud Storage) say where s3:// and gs:// go.
    ``cache_dir``: the node's folder that http(s), s3:// and gs:// shards are fetched into once and
    read from (cache.py; None: none), holding at most ``cache_limit`` bytes (None: half of what
    it holds plus the free space when it starts)."""

    allow_pipe: bool = False
    trust_index: bool = False
    http_timeout: float = 60.0
    http_min_rate: int = httpopen.DEFAULT_MIN_RATE
    http_retry_s: float = 60.0
    s3_endpoint_url: str | None = None
    gs_endpoint_url: str | None = None
    cache_dir: str | None = None
    cache_limit: int | None = None

    def endpoint_url(self, url: str) -> str | None:
        """The configured endpoint of an s3:// or gs:// URL's store."""
        return self.gs_endpoint_url if url.startswith("gs://") else self.s3_endpoint_url


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE_PREFIXES)


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def open_shard(
    url: str, access: Access, start: int = 0, end: int | None = None, span: cache.Span | None = None
) -> io.IOBase:
    """Open a shard for sequential reading from byte ``start``; ``end`` (exclusive) is where the
    caller will stop at the latest, for sources that can ask for less (an http Range request).
    Local files seek to ``start``; sources that cannot seek read and drop the bytes before it.

    http(s) goes through urllib (httpopen), never a shell, so a URL cannot inject a command;
    a server that does not answer fails in ``http_timeout`` seconds, one that drips data fails
    below ``http_min_rate``, and a redirect off http(s) is refused. s3:// and gs:// go through
    boto3 (s3open) with the same limits. Both ride out transient failures for ``http_retry_s``
    seconds, resuming where they stopped (retry.py). ``pipe:`` runs its command
    in a shell (WebDataset's gopen) and is refused unless ``allow_pipe``. Local files honour
    WebDataset's GOPEN_BUFFER (bytes of read buffer) for slow disks.

    With ``cache_dir``, an http(s), s3:// or gs:// shard is fetched whole into the node's cache
    once (cache.py) and read from there, seeking to ``start``; where the cache cannot take it,
    it is read from the store as without one. ``span`` (bytes [lo, hi) holding ``start`` ..
    ``end``; hi None: to the end) makes the cache fetch and keep only those bytes, with one
    ranged request: the part of a shard this node reads, where another node reads the rest.
    """
    if access.cache_dir is not None and cache.cacheable(url):
        lo, hi = span if span is not None else (0, None)
        return cache.open_cached(
            url,
            access.cache_dir,
            access.cache_limit,
            start,
            fetch=lambda: _open_uncached(url, access, lo, hi),
            direct=lambda: _open_uncached(url, access, start, end),
            span=span,
        )
    return _open_uncached(url, access, start, end)


def fetch_ahead(url: str, access: Access, stop: threading.Event, span: cache.Span | None = None) -> cache.Pin | None:
    """Fetch a remote shard (or its ``span``, as open_shard's) into ``access.cache_dir`` before its
    worker opens it (cache.fetch_ahead). One try, without ``http_retry_s``: a failure costs the
    worker nothing, whose own open then retries, skips or stops the run as it would have, and
    says so once."""
    once = dataclasses.replace(access, http_retry_s=0)
    if access.cache_dir is None:
        raise cache.CacheFull(url)
    lo, hi = span if span is not None else (0, None)
    return cache.fetch_ahead(
        url, access.cache_dir, access.cache_limit, lambda: _open_uncached(url, once, lo, hi), stop, span
    )


def _open_uncached(url: str, access: Access, start: int, end: int | None) -> io.IOBase:
    if is_http(url):

        def open_http(at: int):
            return httpopen.open_url(url, access.http_timeout, access.http_min_rate, start=at, end=end)

        return _resuming(url, access, open_http, start, end, lambda: retry.server_of(url))
    if s3open.is_object_url(url):
        endpoint = access.endpoint_url(url)

        def open_object(at: int):
            return s3open.open_url(
                url, access.http_timeout, access.http_min_rate, start=at, end=end, endpoint_url=endpoint
            )

        def server() -> str:
            return retry.server_of(s3open.endpoint(url, access.http_timeout, endpoint))

        return _resuming(url, access, open_object, start, end, server)
    if url.startswith("pipe:"):
        if not access.allow_pipe:
            raise DataError(f"{url}: pipe: URLs are refused (allow_pipe is false)")
        stream = wds.gopen(url, "rb")
    elif is_remote(url) or url.startswith("file:"):
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


def _resuming(
    url: str, access: Access, open_at: Callable[[int], Any], start: int, end: int | None, server: Callable[[], str]
) -> Any:
    """The remote stream ``open_at(start)``, resumed after transient failures where
    ``http_retry_s`` allows (0: opened once, failing as it fails)."""
    if access.http_retry_s <= 0:
        return open_at(start)
    return retry.Resuming(url, open_at, start, end, access.http_retry_s, server)


def read_capped(url: str, access: Access, limit: int) -> bytes:
    """The whole of a small file (an index) from a local path, http(s), s3:// or gs://, refused
    (ValueError) when it is larger than ``limit`` bytes; never holds more than ``limit`` + 1."""
    if is_http(url):
        return httpopen.read_capped(url, limit, access.http_timeout, access.http_min_rate)
    if s3open.is_object_url(url):
        return s3open.read_capped(
            url, limit, access.http_timeout, access.http_min_rate, endpoint_url=access.endpoint_url(url)
        )
    with open(url, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is more than the limit of {limit} bytes")
    return data
