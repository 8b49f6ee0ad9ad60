"""Where a shard's or an index's bytes come from, written once: whichever scheme reads the URL
(schemes/: a local file, http(s), s3:// and gs://, hf://, or a ``pipe:`` command, refused unless
allowed), with the node cache and the retries wrapped around every ranged scheme here, the one
place. Whatever reads a shard or an index opens it here, with the limits an ``Access`` carries;
what it then parses (tar headers, JSON) knows nothing of URLs."""

from __future__ import annotations

import dataclasses
import io
import threading

from wdsdist.data.sources import cache, retry, schemes
from wdsdist.data.sources.access import REMOTE_PREFIXES, Access, is_http, is_remote

__all__ = ["REMOTE_PREFIXES", "Access", "fetch_ahead", "is_http", "is_remote", "open_shard", "read_capped"]


def open_shard(
    url: str, access: Access, start: int = 0, end: int | None = None, span: cache.Span | None = None
) -> io.IOBase:
    """Open a shard for sequential reading from byte ``start``; ``end`` (exclusive) is where the
    caller will stop at the latest, for sources that can ask for less (an http Range request).
    Local files seek to ``start``; sources that cannot seek read and drop the bytes before it.

    http(s) goes through urllib (httpopen), never a shell, so a URL cannot inject a command;
    a server that does not answer fails in ``http_timeout`` seconds, one that drips data fails
    below ``http_min_rate``, and a redirect off http(s) is refused. s3:// and gs:// go through
    boto3 (s3open), hf:// through the Hub's resolver and then urllib, with the same limits. All
    ride out transient failures for ``http_retry_s`` seconds, resuming where they stopped
    (retry.py). ``pipe:`` runs its command in a shell (WebDataset's gopen) and is refused unless
    ``allow_pipe``. Local files honour WebDataset's GOPEN_BUFFER (bytes of read buffer).

    With ``cache_dir``, a remote (ranged) shard is fetched whole into the node's cache
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
    """One scheme's bytes ``start`` .. ``end``, resumed after transient failures where it reads
    ranges and ``http_retry_s`` allows (0: opened once, failing as it fails)."""
    scheme = schemes.of(url)

    def open_at(at: int):
        return scheme.open_range(url, access, at, end)

    if not scheme.RANGED or access.http_retry_s <= 0:
        return open_at(start)
    return retry.Resuming(url, open_at, start, end, access.http_retry_s, lambda: scheme.server(url, access))


def read_capped(url: str, access: Access, limit: int) -> bytes:
    """The whole of a small file (an index, a data set's metadata) from wherever it is, refused
    (ValueError) when it is larger than ``limit`` bytes; never holds more than ``limit`` + 1."""
    return schemes.of(url).read_capped(url, access, limit)
