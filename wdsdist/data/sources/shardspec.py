"""Shard specs -> a list of shards with their sample counts (when an index gives them).

A spec is one of:
  - a brace pattern or glob of local files: ``data/train-{000000..000099}.tar``, ``data/*.tar``
  - several specs joined by ``::`` (WebDataset's separator), or a Python list of specs
  - ``http(s)://``, ``s3://``, ``gs://`` and ``pipe:`` URLs (brace patterns allowed, not checked
    for existence)
  - the path or URL of an index JSON (``*.json``), which also gives ``nsamples`` per shard;
    relative shard URLs in it are resolved against the index's location. An index is data,
    not configuration: what it may name is checked here, the one place (see ``Access``).
  - a local folder (``DIR``, as makeshards.py writes one): its one index, else its ``*.tar``
    files in name order; a folder of several indexes (train and val, say) is refused in one line
    naming them.
"""

from __future__ import annotations

import array
import json
import logging
import os
import re
import stat
import sys
import urllib.parse
from collections.abc import Sequence

from wdsdist.data.sources import httpopen, s3open, schemes
from wdsdist.data.sources.access import Access, is_http, is_remote
from wdsdist.data.sources.opener import read_capped
from wdsdist.data.sources.schemes import hub
from wdsdist.data.sources.shard import MAX_SHARD_SAMPLES, SampleOffsets, Shard
from wdsdist.data.tar.tarread import is_tar_header
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "Access",
    "SampleOffsets",
    "Shard",
    "check_access",
    "expand",
    "is_index",
    "is_remote",
    "read_index_classes",
    "read_index_shards",
    "spec_classes",
]

MAX_INDEX_BYTES = 64 << 20  # an index of a million shards is ~60 MB; more is not an index but a memory attack
# Sample offsets an index may hold in all: one for every sample of ImageNet's 1.28 M (16 MB packed
# in each process); an index with more is read without them, with a warning.
MAX_INDEX_OFFSETS = 1 << 21
MAX_SHARD_BYTES = 1 << 50  # an offset beyond a PiB is no tar shard's
_BLOCK = 512  # tar's block: every header starts on one
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_index(spec: str) -> bool:
    return spec.split("?", 1)[0].endswith(".json")


def _read_text(url: str, access: Access) -> str:
    try:
        return read_capped(url, access, MAX_INDEX_BYTES).decode("utf-8")
    except OSError as exc:
        reason = exc.strerror or (exc.args[0] if exc.args else exc.__class__.__name__)
        raise UserError(f"cannot read shard index {url}: {reason}") from None
    except ValueError as exc:  # too large, or not UTF-8
        raise UserError(f"cannot read shard index {url}: {exc}") from None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # a port that is not a number: no origin matches it
        port = -1
    return scheme, (parts.hostname or ""), port


def _entry_url(index_url: str, i: int, url: str, access: Access) -> str:
    """An index entry resolved against the index's location; UserError where it reaches beyond
    what the index's own location allows (see ``Access``) and the user did not say to trust it."""
    trust = access.trust_index

    def refuse(why: str, lift: str = "data.trust_index=true") -> UserError:
        return UserError(f"{index_url}: shardlist[{i}]: refused {url!r}: {why} ({lift} allows it)")

    if url.startswith("pipe:"):
        if not trust:
            raise refuse("an index may not run a shell command", "data.trust_index=true with data.allow_pipe=true")
        if not access.allow_pipe:
            raise UserError(f"{index_url}: shardlist[{i}]: {url!r}: pipe: URLs are refused (allow_pipe is false)")
        return url
    remote_index = is_http(index_url)
    object_index = s3open.is_object_url(index_url)
    hub_index = index_url.startswith(hub.PREFIXES)
    match = _SCHEME.match(url)
    if match:
        scheme = match.group(1).lower()
        if trust:
            return url
        if scheme == "file":
            raise refuse("a file: URL, outside the index's folder")
        if remote_index and (scheme not in httpopen.SCHEMES or _origin(url) != _origin(index_url)):
            raise refuse(f"not on the index's own server {urllib.parse.urljoin(index_url, '/')}")
        if object_index and s3open.bucket_url(url) != s3open.bucket_url(index_url):
            raise refuse(f"not in the index's own bucket {s3open.bucket_url(index_url)}")
        if hub_index and not hub.within(url, index_url):
            raise refuse("not in the index's own data set at its revision")
        return url  # a local index may name any URL but file: (and pipe:)
    if os.path.isabs(url):
        if trust:
            return url  # a local file, also from a remote index
        raise refuse("an absolute path, outside the index's folder")
    if remote_index:
        resolved = urllib.parse.urljoin(index_url, url)
        if not trust and not resolved.startswith(urllib.parse.urljoin(index_url, ".")):
            raise refuse("it leads outside the index's folder")
        return resolved
    if object_index or hub_index:
        place = hub if hub_index else s3open
        joined = place.join(index_url, url)
        if joined is None:
            raise UserError(f"{index_url}: shardlist[{i}]: {url!r} leads outside the {place.PLACE}")
        if not trust and not joined.startswith(place.folder_url(index_url)):
            raise refuse("it leads outside the index's folder")
        return joined
    path = os.path.join(os.path.dirname(index_url), url)
    folder = os.path.abspath(os.path.dirname(index_url))
    if not trust and os.path.commonpath([folder, os.path.abspath(path)]) != folder:
        raise refuse("it leads outside the index's folder")
    return path


def _entry(index_url: str, i: int, entry: object, access: Access) -> Shard:
    where = f"{index_url}: shardlist[{i}]"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: must be an object with url and nsamples, got {_short(entry)}")
    for key in ("url", "nsamples"):
        if key not in entry:
            raise UserError(f'{where}: no "{key}" in {_short(entry)}')
    url, n = entry["url"], entry["nsamples"]
    if not isinstance(url, str) or not url:
        raise UserError(f'{where}: "url" must be a non-empty string, got {_short(url)}')
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise UserError(f'{where}: "nsamples" must be an integer >= 0, got {_short(n)}')
    if n > MAX_SHARD_SAMPLES:
        raise UserError(
            f"{where}: {url!r}: nsamples {n} is more than the {MAX_SHARD_SAMPLES} samples a shard may claim "
            f"(a corrupt or hostile index?)"
        )
    offsets = _offsets(where, entry["offsets"], n) if "offsets" in entry else None
    path = _entry_url(index_url, i, url, access)
    _check_fits(where, url, path, n)
    return Shard(path, n, offsets)


def _check_fits(where: str, url: str, path: str, n: int) -> None:
    """Warn of a local plain tar whose count cannot fit in its size: every sample takes at least
    one 512-byte header. The shard is then short (cut, or the index stale), which is one bad file:
    it is read as far as it goes and the rest skipped and counted, as when it is found short
    while read, and the cap above bounds what its missing positions cost. A missing file, or one
    that is no plain tar (garbage, compressed), is left to fail or be read when opened."""
    if _SCHEME.match(path) or path.startswith("pipe:"):
        return
    try:
        info = os.stat(path)
        size = info.st_size
        if n <= size // _BLOCK or not stat.S_ISREG(info.st_mode):
            return
        with open(path, "rb") as f:
            head = f.read(_BLOCK)
    except OSError:
        return
    if is_tar_header(head):
        log.warning(
            "%s: %r: nsamples %d cannot fit in its %d bytes (each sample takes at least one %d-byte tar header: "
            "at most %d): the shard is cut short or the index stale (rewrite it: makeshards.py --index SHARDS); "
            "what it lacks is skipped and counted",
            where, url, n, size, _BLOCK, size // _BLOCK,
        )  # fmt: skip


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _offsets(where: str, value: object, nsamples: int) -> SampleOffsets:
    """An entry's "offsets" ({"every": K, "at": [byte offset of sample 0, K, 2K, ...]}), checked:
    a table that cannot be a plain tar's (not on 512-byte blocks, not rising by a header per
    sample, the wrong length) says the index does not describe its shard, and is refused."""

    def bad(why: str) -> UserError:
        return UserError(f'{where}: "offsets": {why} (rewrite the index: makeshards.py --index SHARDS)')

    if not isinstance(value, dict) or not _is_int(value.get("every")) or not isinstance(value.get("at"), list):
        raise bad(f'must be {{"every": K, "at": [byte offsets]}}, got {_short(value)}')
    every, at = value["every"], value["at"]
    if not 1 <= every <= max(nsamples, 1):
        raise bad(f'"every" must be 1 .. nsamples={nsamples}, got {every}')
    if len(at) != -(-nsamples // every):
        raise bad(f"{len(at)} offsets for nsamples={nsamples} every {every}, need {-(-nsamples // every)}")
    previous = -_BLOCK * every
    for j, offset in enumerate(at):
        if not _is_int(offset) or not 0 <= offset < MAX_SHARD_BYTES or offset % _BLOCK:
            raise bad(f"at[{j}]={_short(offset)} is not a byte offset on a 512-byte tar block")
        if offset - previous < _BLOCK * every:
            raise bad(f"at[{j}]={offset} is less than {every} headers after at[{j - 1}]={previous}")
        previous = offset
    return SampleOffsets(every, array.array("q", at).tobytes() if sys.byteorder == "little" else _packed(at))


def _packed(at: list[int]) -> bytes:
    return b"".join(o.to_bytes(8, "little") for o in at)


def _short(value: object, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_index_shards(index_url: str, access: Access | None = None) -> list[Shard]:
    """The shards an index lists, checked (schema and where they may be; see ``Access``)."""
    access = access or Access()
    text = _read_text(index_url, access)
    try:
        desc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{index_url}: not a shard index (not JSON: {exc})") from None
    if not isinstance(desc, dict) or not isinstance(desc.get("shardlist"), list):
        raise UserError(f"{index_url}: not a shard index (need an object with a 'shardlist' of url/nsamples)")
    entries = desc["shardlist"]
    # Counted before any table is packed, so an index's offsets never cost more than the cap.
    held = sum(len(e["offsets"].get("at") or ()) for e in entries if isinstance(e, dict) and _table(e))
    if held > MAX_INDEX_OFFSETS:
        log.warning(
            "%s: %d sample offsets, more than the %d an index may hold; reading without them (shards are read "
            "from their start; a larger makeshards.py --offset-every makes a smaller table)",
            index_url, held, MAX_INDEX_OFFSETS,
        )  # fmt: skip
        entries = [{k: v for k, v in e.items() if k != "offsets"} if isinstance(e, dict) else e for e in entries]
    shards = [_entry(index_url, i, e, access) for i, e in enumerate(entries)]
    if not shards:
        raise UserError(f"{index_url}: the shard index lists no shards")
    return shards


MAX_CLASSES = 1_000_000  # an index's class names: more is no image classifier's
MAX_CLASS_NAME = 256


def read_index_classes(index_url: str, access: Access | None = None) -> list[str] | None:
    """The class names an index lists (makeshards.py writes them, label i named ``classes[i]``), or
    None where it lists none; UserError naming the index where the list is not names."""
    access = access or Access()
    try:
        desc = json.loads(_read_text(index_url, access))
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{index_url}: not a shard index (not JSON: {exc})") from None
    classes = desc.get("classes") if isinstance(desc, dict) else None
    if classes is None:
        return None
    ok = isinstance(classes, list) and 0 < len(classes) <= MAX_CLASSES
    if not ok or not all(isinstance(c, str) and 0 < len(c) <= MAX_CLASS_NAME for c in classes):
        raise UserError(f"{index_url}: 'classes' must be a list of names (strings of 1-{MAX_CLASS_NAME} characters)")
    return classes


def spec_classes(spec: str, access: Access | None = None) -> list[str] | None:
    """read_index_classes of a spec that is one index (pinned as its shards are read), else None."""
    access = access or Access()
    spec = spec.strip()
    return read_index_classes(schemes.of(spec).pin(spec, access), access) if is_index(spec) else None


def _table(entry: dict) -> bool:
    table = entry.get("offsets")
    return isinstance(table, dict) and isinstance(table.get("at"), list)


def folder_spec(folder: str) -> str:
    """A local folder's spec: its one index, else its tar files (see the module)."""
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(".index.json")]
    if len(indexes) > 1:
        raise UserError(f"{folder} holds {len(indexes)} indexes ({', '.join(indexes)}): name the one to read")
    if indexes:
        return os.path.join(folder, indexes[0])
    tars = [os.path.join(folder, n) for n in names if n.endswith(".tar")]
    if not tars:
        raise UserError(f"{folder} holds no index (*.index.json) and no .tar shard")
    return "::".join(tars)


def _expand_one(spec: str, strict: bool, access: Access) -> list[Shard]:
    spec = spec.strip()
    if not spec:
        return []
    if "://" not in spec and not spec.startswith("pipe:") and os.path.isdir(spec):
        return [s for part in folder_spec(spec).split("::") for s in _expand_one(part, strict, access)]
    scheme = schemes.of(spec)
    if is_index(spec):
        return read_index_shards(scheme.pin(spec, access), access)
    return scheme.expand(spec, access, strict)


def expand(spec: str | Sequence[str], strict: bool = True, access: Access | None = None) -> list[Shard]:
    """Expand a shard spec (see module docstring); raise UserError if it names nothing.

    Some missing local shards are an error when ``strict``, else a warning; none at all is
    always an error. ``access`` says what an index may name and how http(s) is read."""
    access = access or Access()
    parts = spec.split("::") if isinstance(spec, str) else [str(s) for s in spec]
    shards: list[Shard] = []
    for part in parts:
        shards.extend(_expand_one(part, strict, access))
    if not shards:
        raise UserError(f"shard spec {spec!r} is empty")
    return shards


def check_access(shards: Sequence[Shard], access: Access) -> None:
    """What each scheme checks before any of its shards is opened: a refused ``pipe:`` command,
    the credentials of the object stores the shards are in, the Hub's extra. Without it every
    shard would fail one by one after startup. Callers that open shards call it (a plan from an
    index's counts needs none)."""
    schemes.check(shards, access)


def sample_counts(shards: Sequence[Shard]) -> list[int] | None:
    """Sample counts of all shards, or None when any is unknown."""
    counts = [s.nsamples for s in shards]
    return None if any(c is None for c in counts) else counts  # type: ignore[return-value]
