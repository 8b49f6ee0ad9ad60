"""hf:// shards: ``hf://datasets/ORG/NAME[@REV]/PATTERN`` on the Hugging Face Hub (``HF_ENDPOINT``).

``expand`` resolves the revision (a branch, a tag; ``main`` when none) to its commit once, lists
the data set's files at that commit (a brace pattern's shards must be there, a glob matches
them), and names every shard at that commit: ``hf://datasets/ORG/NAME@COMMIT/PATH``, so whoever
reads them, in any worker, on any node, later, reads the same bytes. Where the data set carries
per-shard counts (timm's ``_info.json`` / ``info.yaml``: ``splits.*.filenames`` and
``shard_lengths``), the shards get them, so the sample split needs no scan; they are checked
against what each shard delivers, as an index's counts are.

A shard's bytes: the Hub's resolver is asked once per shard opened (it has its own rate limit),
answering a signed CDN address that is then read with ranged requests by httpopen, as any
http(s) shard (timeouts, the minimum rate, retries and the node cache around it in opener.py).
A signed address expires: a 401 or 403 from it is answered by resolving the shard once more.
The token goes to the Hub's own origin only, never to the CDN.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import posixpath
import re
import threading
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import braceexpand

from wdsdist.data.sources import httpopen
from wdsdist.data.sources.access import Access
from wdsdist.data.sources.schemes import hubapi
from wdsdist.data.sources.schemes.file import matching
from wdsdist.data.sources.shard import MAX_SHARD_SAMPLES, Shard
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")

PREFIXES = ("hf://",)
RANGED = True
PLACE = "data set"  # what an index in a data set may not lead outside
INFO_NAMES = ("_info.json", "info.json", "_info.yaml", "info.yaml")  # where timm's reader looks
MAX_INFO_BYTES = 64 << 20  # as an index's cap
_URL = re.compile(r"hf://datasets/([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([^/]+))?/(.*)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_LOCATED_MAX = 4096  # resolved shards a process remembers


@dataclass(frozen=True)
class Ref:
    """A parsed hf:// URL: the data set, the revision (as given, unquoted) and the path in it."""

    repo: str
    rev: str
    path: str

    @property
    def pinned(self) -> bool:
        return bool(_COMMIT.fullmatch(self.rev))

    def url(self, path: str | None = None, rev: str | None = None) -> str:
        rev = self.rev if rev is None else rev
        return f"hf://datasets/{self.repo}@{urllib.parse.quote(rev, safe='')}/{self.path if path is None else path}"


def parse(url: str) -> Ref:
    match = _URL.fullmatch(url)
    if not match:
        raise UserError(f"{url}: an hf:// shard spec is hf://datasets/ORG/NAME[@REVISION]/PATH")
    repo, rev, path = match.group(1), urllib.parse.unquote(match.group(2) or "main"), match.group(3)
    if not path or any(part in ("", ".", "..") for part in path.split("/")):
        raise UserError(f"{url}: no file path in the data set after hf://datasets/{repo}/")
    return Ref(repo, rev, path)


def pin(url: str, access: Access) -> str:
    """The same files at the commit their revision names now."""
    ref = parse(url)
    if ref.pinned:
        return url
    hubapi.require(url)
    try:
        return ref.url(rev=_commit(ref, access))
    except hubapi.FAILED as exc:
        raise UserError(f"{url}: {exc}") from None


def _commit(ref: Ref, access: Access) -> str:
    return hubapi.commit_of(ref.repo, ref.rev, access.http_timeout, access.http_retry_s)


def expand(spec: str, access: Access, strict: bool) -> list[Shard]:
    ref = parse(spec)
    hubapi.require(spec)
    try:
        commit = _commit(ref, access)
        folder = _fixed_folder(ref.path)
        listing = hubapi.files(ref.repo, commit, folder, access.http_timeout, access.http_retry_s)
        paths = _matching(spec, ref, commit, listing, strict)
        # One shard resolved now: a gated data set without access stops here in one line, not
        # every shard in every worker later (its listing is public).
        _locate(ref.url(paths[0], commit), access, access.http_retry_s)
        counts, info = _info_counts(ref, commit, folder, listing, access)
    except hubapi.FAILED as exc:
        raise UserError(f"{spec}: {exc}") from None
    at = ref.rev if ref.pinned else f"{ref.rev} = commit {commit[:12]}"
    known = sum(p in counts for p in paths)
    said = f"sample counts of {known} from {info}" if info else "no sample counts in the data set's metadata"
    log.debug("hf://datasets/%s@%s: %d shards, %s", ref.repo, at, len(paths), said)
    return [Shard(ref.url(p, commit), counts.get(p)) for p in paths]


def _fixed_folder(path: str) -> str:
    """The folder above a pattern's first brace or wildcard: what has to be listed."""
    cut = min((i for i, c in enumerate(path) if c in "{*?["), default=len(path))
    return posixpath.dirname(path[:cut])


def _matching(spec: str, ref: Ref, commit: str, listing: dict[str, Any], strict: bool) -> list[str]:
    """The pattern's files, each there at ``commit`` (file.matching: missing ones an error or a warning)."""
    where = f" in hf://datasets/{ref.repo}@{ref.rev}" + ("" if ref.pinned else f" (commit {commit[:12]})")

    def glob_of(pattern: str) -> list[str]:
        return sorted(p for p in listing if fnmatch.fnmatchcase(p, pattern))

    return matching(spec, list(braceexpand.braceexpand(ref.path)), glob_of, listing.__contains__, strict, where)


def _info_counts(
    ref: Ref, commit: str, folder: str, listing: dict[str, Any], access: Access
) -> tuple[dict[str, int], str | None]:
    """Per-shard counts from the data set's info file beside the shards (or at its root): {path: n}."""
    candidates = [posixpath.join(folder, n) for n in INFO_NAMES] + list(INFO_NAMES)
    name = next((c for c in candidates if c in listing), None)
    if name is None and folder:  # the root was not listed: ask for its info files directly
        name = next((n for n in INFO_NAMES if _exists(ref, commit, n, access)), None)
    if name is None:
        return {}, None
    url = ref.url(name, commit)
    try:
        counts = shard_lengths(read_capped(url, access, MAX_INFO_BYTES), name, posixpath.dirname(name))
    except (OSError, ValueError) as exc:
        log.warning("%s: not read (%s): no sample counts from it", url, exc)
        return {}, None
    return counts, name


def _exists(ref: Ref, commit: str, name: str, access: Access) -> bool:
    try:
        hubapi.locate(ref.repo, commit, name, access.http_timeout, access.http_retry_s)
    except hubapi.FAILED:
        return False
    return True


def shard_lengths(data: bytes, name: str, folder: str) -> dict[str, int]:
    """{path: samples} from an info file's ``splits``: each split's ``filenames`` (relative to the
    file's folder) and ``shard_lengths``, checked (ValueError naming what is wrong): data, not
    configuration."""
    if name.endswith(".json"):
        info = json.loads(data.decode("utf-8"))
    else:
        import yaml  # huggingface_hub's own dependency

        info = yaml.safe_load(data.decode("utf-8"))
    splits = info.get("splits") if isinstance(info, dict) else None
    if not isinstance(splits, dict):
        raise ValueError('no "splits" object')
    counts: dict[str, int] = {}
    for split, desc in splits.items():
        names = desc.get("filenames") if isinstance(desc, dict) else None
        lengths = desc.get("shard_lengths") if isinstance(desc, dict) else None
        if not isinstance(names, list) or not isinstance(lengths, list) or len(names) != len(lengths):
            raise ValueError(f"splits.{split}: filenames and shard_lengths must be lists of one length")
        for file, n in zip(names, lengths, strict=True):
            if not isinstance(file, str) or not isinstance(n, int) or isinstance(n, bool):
                raise ValueError(f"splits.{split}: {file!r}: {n!r} is not a file name and a count")
            if not 0 <= n <= MAX_SHARD_SAMPLES:
                raise ValueError(f"splits.{split}: {file!r}: {n} samples, not 0 .. {MAX_SHARD_SAMPLES}")
            counts[posixpath.normpath(posixpath.join(folder, file))] = n
    return counts


def check(shards: Sequence[Shard], access: Access) -> None:
    hubapi.require(shards[0].url)


# ---------------------------------------------------------------- bytes

_located: dict[tuple[str, str], hubapi.Located] = {}  # (endpoint, URL) -> where its bytes are
_lock = threading.Lock()


def _fresh_lock_after_fork() -> None:
    # A forked child (a DataLoader worker) keeps what its parent resolved, but not a lock another
    # parent thread may have held at the fork.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def _locate(url: str, access: Access, budget: float, fresh: bool = False) -> hubapi.Located:
    """Where ``url``'s bytes are, asked of the Hub once per process and shard (again if ``fresh``)."""
    key = (hubapi.endpoint(), url)
    with _lock:
        known = None if fresh else _located.get(key)
    if known is not None:
        return known
    ref = parse(url)
    located = hubapi.locate(ref.repo, ref.rev, ref.path, access.http_timeout, budget)
    with _lock:
        if len(_located) >= _LOCATED_MAX:
            _located.clear()
        _located[key] = located
    return located


def _expired(exc: urllib.error.HTTPError) -> bool:
    """A signed address that no longer opens: the Hub signs a new one."""
    if exc.code not in (401, 403):
        return False
    exc.close()
    return True


def _read(url: str, access: Access, budget: float, read: Callable[[hubapi.Located], T]) -> T:
    """``read`` of where the shard's bytes are, resolved once more where that address has expired."""
    try:
        return read(_locate(url, access, budget))
    except urllib.error.HTTPError as exc:
        if not _expired(exc):
            raise
    return read(_locate(url, access, budget, fresh=True))


def open_range(url: str, access: Access, start: int, end: int | None) -> IO[bytes]:
    """One try (opener.py retries): a ranged read of the shard's signed address."""

    def ranged(at: hubapi.Located) -> IO[bytes]:
        return httpopen.open_url(  # type: ignore[return-value]
            at.url, access.http_timeout, access.http_min_rate, start=start, end=end, headers=at.headers
        )

    return _read(url, access, 0, ranged)


def read_capped(url: str, access: Access, limit: int) -> bytes:
    """A small file of the data set (its info file, an index), waiting out a rate limit within
    ``http_retry_s``."""

    def whole(at: hubapi.Located) -> bytes:
        return httpopen.read_capped(at.url, limit, access.http_timeout, access.http_min_rate, headers=at.headers)

    return _read(url, access, access.http_retry_s, whole)


def server(url: str, access: Access) -> str:
    return hubapi.endpoint()


def join(index_url: str, relative: str) -> str | None:
    """A path an hf:// index names, in its data set at its revision (None: it leads outside the data set)."""
    ref = parse(index_url)
    path = posixpath.normpath(posixpath.join(posixpath.dirname(ref.path), relative))
    return None if path.startswith(("../", "/")) or path == ".." else ref.url(path)


def within(url: str, index_url: str) -> bool:
    """An hf:// URL of the index's own data set at the index's revision."""
    try:
        a, b = parse(url), parse(index_url)
    except UserError:
        return False
    return (a.repo, a.rev) == (b.repo, b.rev)


def folder_url(index_url: str) -> str:
    ref = parse(index_url)
    folder = posixpath.dirname(ref.path)
    return ref.url(folder + "/" if folder else "")
