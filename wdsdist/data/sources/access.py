"""What reading a spec may do (``Access``), and which URLs are remote: a leaf every scheme and
the opener read."""

from __future__ import annotations

from dataclasses import dataclass

from wdsdist.data.sources.httpopen import DEFAULT_MIN_RATE

REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://", "ais://", "hf://")


@dataclass(frozen=True)
class Access:
    """What reading a spec may do beyond local files the user named.

    ``allow_pipe``: ``pipe:`` URLs (a shell command) may run. ``trust_index``: an index may name
    shards outside its own place (absolute paths, ``..``, another server, bucket or repository,
    other URL schemes, and with ``allow_pipe`` also ``pipe:``); without it a local index names
    files inside its folder or URLs, an http(s) index names http(s) URLs on its own server
    (scheme, host and port), an s3:// or gs:// index names objects in its own bucket, and an
    hf:// index files of its own data set at its own revision.

    ``http_timeout``, ``http_min_rate`` and ``http_retry_s`` (seconds of failure a shard read
    rides out, retry.py; 0: none) hold for object stores and the Hub too; ``s3_endpoint_url`` and
    ``gs_endpoint_url`` (None: boto3's own, and Cloud Storage) say where s3:// and gs:// go (the
    Hub's is ``HF_ENDPOINT``). ``cache_dir``: the node's folder that remote shards are fetched
    into once and read from (cache.py; None: none), holding at most ``cache_limit`` bytes (None:
    half of what it holds plus the free space when it starts)."""

    allow_pipe: bool = False
    trust_index: bool = False
    http_timeout: float = 60.0
    http_min_rate: int = DEFAULT_MIN_RATE
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
