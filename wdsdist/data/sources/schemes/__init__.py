"""One module per scheme, behind one small interface (``Scheme``): ``expand`` a spec into shards
(a brace pattern, a glob, a listing; with their sample counts where the scheme's metadata has
them), ``pin`` a URL to what it names now (the Hub's commit of a branch: a run reads one set of
bytes, also when resumed), ``check`` the shards before any is opened (credentials, a refused shell command),
``open_range`` one try at bytes ``start`` .. ``end`` of a shard, ``read_capped`` a small file (an
index, a data set's metadata) and name the ``server`` a failure is blamed on. What wraps every
ranged scheme alike, the node cache and the retries, lives once in opener.py; what an index may
name, in shardspec.py.

  file    local paths and file: URLs (file.py)
  web     http:// and https:// (web.py, over httpopen.py)
  bucket  s3:// and gs:// (bucket.py, over s3open.py)
  hub     hf://datasets/ORG/NAME[@REV]/PATTERN, the Hugging Face Hub (hub.py, hubapi.py)
  pipe    pipe: shell commands and ais:// (webdataset's gopen; pipe.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Protocol

from wdsdist.data.sources.access import Access
from wdsdist.data.sources.schemes import bucket, file, hub, pipe, web
from wdsdist.data.sources.shard import Shard


class Scheme(Protocol):
    PREFIXES: tuple[str, ...]  # what a URL of this scheme starts with
    RANGED: bool  # reads byte ranges of a remote object: retried, resumed and cached on the node

    def expand(self, spec: str, access: Access, strict: bool) -> list[Shard]: ...

    def pin(self, url: str, access: Access) -> str: ...

    def check(self, shards: Sequence[Shard], access: Access) -> None: ...

    def open_range(self, url: str, access: Access, start: int, end: int | None) -> IO[bytes]: ...

    def read_capped(self, url: str, access: Access, limit: int) -> bytes: ...

    def server(self, url: str, access: Access) -> str: ...


SCHEMES: tuple[Scheme, ...] = (web, bucket, hub, pipe)  # type: ignore[assignment]


def of(url: str) -> Scheme:
    """The scheme that reads ``url``: the first whose prefix it has, else a local file."""
    return next((s for s in SCHEMES if url.startswith(s.PREFIXES)), file)  # type: ignore[return-value]


def check(shards: Sequence[Shard], access: Access) -> None:
    """Each scheme's checks of its shards, before any is opened."""
    by_scheme: dict[int, list[Shard]] = {}
    for s in shards:
        by_scheme.setdefault(id(of(s.url)), []).append(s)
    for scheme in (*SCHEMES, file):
        mine = by_scheme.get(id(scheme))
        if mine:
            scheme.check(mine, access)  # type: ignore[attr-defined]
