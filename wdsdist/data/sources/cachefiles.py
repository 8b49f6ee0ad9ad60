"""The on-disk protocol of a node's cache of remote shards (``loader.cache_dir``, cache.py): its
files, its locks and the order they are taken in, the part files, eviction and read-ahead's pins.
This docstring is the one description of the format; every process sharing a folder follows it alike.

The processes sharing a folder know nothing of one another (ranks, workers, other jobs on the
node), so everything between them goes through the file system:

  - An entry is ``HASH-TAIL.data`` (the shard's bytes) and ``HASH-TAIL.meta`` (its URL, size, and
    ETag / Last-Modified where the store gave them). HASH is of the whole URL and TAIL its last
    part in ``[A-Za-z0-9._-]`` only, so a hostile name stays in the folder, and two buckets' or
    hosts' ``train-000000.tar`` are two entries. A file is used only when its size is the one its
    sidecar records; one that is not (cut short, damaged) is counted, removed and fetched again.
  - A span entry, ``HASH-TAIL.LO-HI.data`` (``.LO-end``: to the object's end) and its ``.meta``,
    holds bytes LO .. HI - 1 of the object, fetched with one ranged request; HASH is of the URL
    and the span, and the sidecar records the span as ``range``: [LO, HI] (HI null: the end). A
    node keeps its part of a shard that another node reads the rest of this way (the bytes of
    whole samples, from the index's offsets), never the whole shard. A reader of that part opens
    the span entry, never the object's; everything below holds for both kinds alike.
  - Readers hold a shared ``flock`` on ``.lock`` while their file is open. Eviction asks for it
    exclusively without waiting, and passes over an entry it cannot get: one in use is never
    removed.
  - A download holds ``.dl`` exclusively; a reader that finds the entry missing waits for that
    lock, so concurrent readers of one shard wait for one download instead of each fetching it.
    flock dies with its process: a downloader killed by SIGKILL leaves no lock behind.
  - A download is written to ``.part-PID``, made its full size first (a download in flight
    counts against the limit, and a full disk shows before the first byte), fsynced, checked
    against its size, then renamed: no reader sees part of a file. A part whose ``.dl`` nobody
    holds belongs to a dead process (whatever its PID says in this PID namespace) and is removed.
  - Read-ahead (``loader.cache_ahead``, ``fetch_ahead``) fetches a worker's next shards before it
    opens them, and holds a shared ``flock`` on ``.ahead`` from then until the worker has opened
    it. Read-ahead's own eviction passes over such entries as over those in use, so it never
    evicts what is about to be read to make room for what comes after; a worker's own open may
    evict them, newest last, as it would evict them without read-ahead. Read-ahead never warns:
    where the cache cannot take a shard it stops, and the worker's own open meets the cause.
  - ``cache.lock`` serialises the budget: the entries, the parts in flight and the new download
    must fit ``limit``, least recently used entries (by mtime, touched at each use) evicted first.

The cache trusts that an object does not change under its URL: a hit asks the store nothing. The
sidecar keeps the ETag and Last-Modified the store sent, to tell which version an entry holds.

"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from wdsdist.data.sources import schemes

BUDGET_LOCK = "cache.lock"  # in the folder: who may evict and reserve, one process at a time
TAIL = 40  # characters of the URL's last part kept in an entry's name, for people reading the folder
CHUNK = 1 << 20  # bytes copied from the store per read
ENTRY = re.compile(r"([0-9a-f]{32})-([A-Za-z0-9._-]*)\.(data|meta|lock|dl|ahead|part-\d+)")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
FULL = (errno.ENOSPC, errno.EDQUOT)  # errors of a full disk


def cacheable(url: str) -> bool:
    """A shard the cache takes: one a ranged scheme reads (http(s), s3://, gs://, hf://). Local
    files are read where they are, and a ``pipe:`` command's output is the command's to repeat."""
    return schemes.of(url).RANGED


Span = tuple[int, int | None]  # bytes [lo, hi) of an object (hi None: to its end)


def entry_name(url: str, span: Span | None = None) -> str:
    """The entry's name in the folder, without its kind: a hash of the whole URL (and the span of
    its bytes the entry holds, where it holds part of the object), then the URL's last part made
    safe (never a path: no ``/``, and never ``.`` or ``..``, as it begins with the hash), then
    the span as ``.LO-HI``."""
    key = url if span is None else f"{url}\n{span[0]}-{'' if span[1] is None else span[1]}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    last = url.rstrip("/").rsplit("/", 1)[-1].partition("?")[0]
    tail = "" if span is None else f".{span[0]}-{'end' if span[1] is None else span[1]}"
    return f"{digest}-{_UNSAFE.sub('_', last)[-TAIL:]}{tail}"


class Pin:
    """A shared flock on an entry's ``.ahead``: read-ahead's eviction passes over the entry until
    its worker has opened it (then its reader's lock holds it) and the pin is closed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.guard = threading.Lock()

    def close(self) -> None:
        with self.guard:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def write_part(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to a download's part file: the one place shard bytes are written (a
    full disk raises OSError(ENOSPC) here)."""
    while data:
        data = data[os.write(fd, data) :]


class CachedFile(io.BufferedReader):
    """A cache entry's file, open for reading, that holds its entry's read lock until closed: an
    entry is evicted only when nobody reads it."""

    def __init__(self, fd: int, lock: int, start: int) -> None:
        size = int(os.environ.get("GOPEN_BUFFER", -1))  # WebDataset's read buffer, as for local shards
        super().__init__(io.FileIO(fd, "rb"), size if size > 0 else io.DEFAULT_BUFFER_SIZE)
        self.lock = lock
        try:
            if start:
                self.seek(start)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            lock, self.lock = getattr(self, "lock", -1), -1
            if lock >= 0:
                os.close(lock)  # closing the descriptor drops its flock


class Entry:
    """The paths of one entry, and what reading and writing it takes: the object at ``url``, or
    the ``span`` of its bytes (a node's part of a shard another node reads the rest of)."""

    def __init__(self, folder: str, url: str, span: Span | None = None) -> None:
        self.folder, self.url, self.span = folder, url, span
        self.base = os.path.join(folder, entry_name(url, span))
        self.data, self.meta = f"{self.base}.data", f"{self.base}.meta"
        self.lock, self.dl = f"{self.base}.lock", f"{self.base}.dl"
        self.ahead = f"{self.base}.ahead"
        self.what = url if span is None else f"{url} (bytes {span[0]} to {'its end' if span[1] is None else span[1]})"

    def described(self, size: int) -> dict:
        """The sidecar's record of it: its URL, its span where it has one, and its size."""
        return {"url": self.url, "size": size} | ({} if self.span is None else {"range": list(self.span)})

    def part(self) -> str:
        return f"{self.base}.part-{os.getpid()}"

    def parts(self) -> list[str]:
        """Every process's part files of this entry."""
        name = os.path.basename(self.base)
        return [os.path.join(self.folder, f) for f in os.listdir(self.folder) if f.startswith(f"{name}.part-")]

    def verified(self) -> int | None:
        """The entry's file, open, where it is complete (the size its sidecar records); touched,
        so eviction takes the least recently used first."""
        meta = read_meta(self.meta)
        if meta is None or meta.get("url") != self.url or meta.get("range") != self.described(0).get("range"):
            return None
        try:
            fd = os.open(self.data, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if os.fstat(fd).st_size != meta.get("size"):
            os.close(fd)
            return None
        with contextlib.suppress(OSError):  # another user's entry: read, but not ours to touch
            os.utime(fd)
        return fd

    def finish(self, fd: int, part: str, meta: dict) -> None:
        """The sidecar, then the data under its name: a reader finds both complete or a missing
        entry. Raises OSError (the sidecar removed) where the disk refuses."""
        try:
            os.fsync(fd)
            with open(self.meta, "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(part, self.data)
            folder = os.open(self.folder, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(folder)  # the rename survives a crash of the node
            finally:
                os.close(folder)
        except OSError:
            unlink(self.meta)
            raise


def acquire(path: str, operation: int, *, create: bool = True) -> int | None:
    """A descriptor of ``path`` holding ``flock(operation)``, or None where ``LOCK_NB`` found it
    taken (or, without ``create``, the file is missing: nobody holds it). Lock files are removed
    with their entry, under the lock: one that was replaced while we waited is opened again."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    while True:
        try:
            fd = os.open(path, flags, 0o666)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            held = os.stat(path)
            mine = os.fstat(fd)
            if (held.st_ino, held.st_dev) == (mine.st_ino, mine.st_dev):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
        if not create:
            return None


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    fd = acquire(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)  # type: ignore[arg-type]


def unlink(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def content_length(headers: Any) -> int | None:
    value = str(headers.get("Content-Length") or "").strip() if headers is not None else ""
    return int(value) if value.isdigit() else None


def read_meta(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def scan(folder: str) -> tuple[int, list[tuple[float, int, str]]]:
    """(bytes held, entries as (mtime, size, base path)); parts of dead downloads are removed,
    parts in flight count at their full size. Called under the budget lock."""
    used, entries = 0, []
    for name in os.listdir(folder):
        match = ENTRY.fullmatch(name)
        kind = match.group(3) if match else ""
        if kind != "data" and not kind.startswith("part-"):
            continue
        path = os.path.join(folder, name)
        base = path[: -len(kind) - 1]
        if kind.startswith("part-"):
            dl = acquire(f"{base}.dl", fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
            if dl is not None or not os.path.exists(f"{base}.dl"):
                unlink(path)  # no download holds it: its process is gone
                if dl is not None:
                    os.close(dl)
                continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        used += st.st_size
        if kind == "data":
            entries.append((st.st_mtime, st.st_size, base))
    return used, entries


def room_for(folder: str, limit: int, size: int) -> bool:
    """Whether read-ahead could make room for ``size`` bytes now, evicting nothing: before it
    asks the store for a shard it would have to drop."""
    try:
        with locked(os.path.join(folder, BUDGET_LOCK)):
            used, entries = scan(folder)
            free = limit - used
            for _, n, base in sorted(entries):
                if free >= size:
                    break
                if _evictable(base):
                    free += n
    except OSError:
        return False
    return free >= size


def evict(folder: str, limit: int, room: int, spare_pinned: bool = False) -> tuple[bool, int]:
    """Evict least recently used entries nobody reads until ``room`` more bytes fit under
    ``limit``: (whether they fit now, the bytes evicted). ``spare_pinned``: pass over the entries
    read-ahead holds for their workers too. Called under the budget lock."""
    used, entries = scan(folder)
    evicted = 0
    for _, size, base in sorted(entries):
        if used + room <= limit:
            break
        lock = acquire(f"{base}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB)
        if lock is None:
            continue  # open by a reader
        if spare_pinned and _held(f"{base}.ahead"):
            os.close(lock)
            continue  # fetched ahead for a worker that has not opened it yet
        try:
            dl = acquire(f"{base}.dl", fcntl.LOCK_EX | fcntl.LOCK_NB)
            if dl is None:
                continue  # being fetched again
            try:
                unlink(f"{base}.data", f"{base}.meta", f"{base}.dl", f"{base}.ahead", f"{base}.lock")
            finally:
                os.close(dl)
        finally:
            os.close(lock)
        used -= size
        evicted += size
    return used + room <= limit, evicted


def _evictable(base: str) -> bool:
    """Nobody reads the entry, fetches it, or holds it for read-ahead, now."""
    lock = acquire(f"{base}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB)
    if lock is None:
        return False
    try:
        dl = acquire(f"{base}.dl", fcntl.LOCK_EX | fcntl.LOCK_NB)
        if dl is None:
            return False
        os.close(dl)
        return not _held(f"{base}.ahead")
    finally:
        os.close(lock)


def _held(path: str) -> bool:
    """Someone holds a lock on ``path``. Pins are taken only under the entry's ``.lock``, which the
    caller holds exclusively: none can begin after this answer."""
    fd = acquire(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
    if fd is not None:
        os.close(fd)
        return False
    return os.path.exists(path)


def allocate(fd: int, size: int) -> None:
    """Give the part file its size now: its blocks (where the file system can) or a sparse length."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in FULL:
            raise
        os.ftruncate(fd, size)  # a file system without fallocate
