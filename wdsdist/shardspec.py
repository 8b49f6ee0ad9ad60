"""Shard specs -> a list of shards with their sample counts (when an index gives them).

A spec is one of:
  - a brace pattern or glob of local files: ``data/train-{000000..000099}.tar``, ``data/*.tar``
  - several specs joined by ``::`` (WebDataset's separator), or a Python list of specs
  - ``http(s)://`` and ``pipe:`` URLs (brace patterns allowed, not checked for existence)
  - the path or URL of an index JSON (``*.json``), which also gives ``nsamples`` per shard;
    relative shard URLs in it are resolved against the index's location.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import braceexpand

from wdsdist.errors import UserError

REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://", "ais://", "hf://")


@dataclass(frozen=True)
class Shard:
    url: str
    nsamples: int | None = None


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE_PREFIXES)


def is_index(spec: str) -> bool:
    return spec.split("?", 1)[0].endswith(".json")


def _read_text(url: str) -> str:
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                return response.read().decode("utf-8")
        except OSError as exc:
            raise UserError(f"cannot read shard index {url}: {exc}") from None
    try:
        with open(url, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UserError(f"cannot read shard index {url}: {exc.strerror}") from None


def _resolve(base: str, url: str) -> str:
    """Resolve a shard URL from an index relative to the index's own location."""
    if is_remote(url) or os.path.isabs(url):
        return url
    if base.startswith(("http://", "https://")):
        return base.rsplit("/", 1)[0] + "/" + url
    return os.path.join(os.path.dirname(base), url)


def read_index_shards(index_url: str) -> list[Shard]:
    text = _read_text(index_url)
    try:
        desc = json.loads(text)
        entries = desc["shardlist"]
        shards = [Shard(_resolve(index_url, e["url"]), int(e["nsamples"])) for e in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index_url}: not a shard index (need 'shardlist' of url/nsamples): {exc}") from None
    if not shards:
        raise UserError(f"{index_url}: the shard index lists no shards")
    return shards


def _expand_one(spec: str, strict: bool) -> list[Shard]:
    spec = spec.strip()
    if not spec:
        return []
    if is_index(spec):
        return read_index_shards(spec)
    urls = list(braceexpand.braceexpand(spec))
    if is_remote(spec):
        return [Shard(u) for u in urls]
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
        print(f"warning: {message}; going on without them", file=sys.stderr)
    return shards


def expand(spec: str | Sequence[str], strict: bool = True) -> list[Shard]:
    """Expand a shard spec (see module docstring); raise UserError if it names nothing.

    Some missing local shards are an error when ``strict``, else a warning; none at all is
    always an error."""
    parts = spec.split("::") if isinstance(spec, str) else [str(s) for s in spec]
    shards: list[Shard] = []
    for part in parts:
        shards.extend(_expand_one(part, strict))
    if not shards:
        raise UserError(f"shard spec {spec!r} is empty")
    return shards


def sample_counts(shards: Sequence[Shard]) -> list[int] | None:
    """Sample counts of all shards, or None when any is unknown."""
    counts = [s.nsamples for s in shards]
    return None if any(c is None for c in counts) else counts  # type: ignore[return-value]
