"""A node's cache of remote shards (``loader.cache_dir``): each http(s), s3:// or gs:// shard is
fetched from its store once per node, then read from a local file by every rank and DataLoader
worker of every run that names the same folder. Without it every epoch, and every run, reads the
whole data set from the store again.

The processes sharing a folder know nothing of one another (ranks, workers, other jobs on the
node), so everything between them goes through the file system:

  - An entry is ``HASH-TAIL.data`` (the shard's bytes) and ``HASH-TAIL.meta`` (its URL, size, and
    ETag / Last-Modified where the store gave them). HASH is of the whole URL and TAIL its last
    part in ``[A-Za-z0-9._-]`` only, so a hostile name stays in the folder, and two buckets' or
    hosts' ``train-000000.tar`` are two entries. A file is used only when its size is the one its
    sidecar records; one that is not (cut short, damaged) is counted, removed and fetched again.
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

Where the cache cannot take a shard (larger than the limit, the rest in use, the folder not
writable, the disk full), the shard is read from the store as without a cache, with one warning
line per cause in the process, and the run goes on.

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
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, fields, replace
from typing import IO, Any

from wdsdist.data.sources.retry import describe

log = logging.getLogger(__name__)

# One module, though long: its parts (entry names, the lock files and the order they are taken
# in, the part files, eviction, read-ahead's pins, the counts) are one on-disk protocol that
# every process sharing a folder must follow alike; split, a change to one part could silently
# break another's assumptions about it. (read-ahead's scheduling lives apart, in ahead.py.)
CACHED_PREFIXES = ("http://", "https://", "s3://", "gs://")
BUDGET_LOCK = "cache.lock"  # in the folder: who may evict and reserve, one process at a time
TAIL = 40  # characters of the URL's last part kept in an entry's name, for people reading the folder
CHUNK = 1 << 20  # bytes copied from the store per read
_ENTRY = re.compile(r"([0-9a-f]{32})-([A-Za-z0-9._-]*)\.(data|meta|lock|dl|ahead|part-\d+)")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Counts:
    """What the cache did in this process."""

    hits: int = 0  # shard opens served from the cache
    misses: int = 0  # shard opens that fetched their shard into the cache
    fetched_bytes: int = 0  # bytes fetched from the store into the cache
    evicted_bytes: int = 0  # bytes of entries removed to stay under the limit
    corrupt: int = 0  # entries found damaged (a size other than their sidecar's, no sidecar), fetched again
    bypassed: int = 0  # shard opens read from the store because the cache could not take them
    ahead: int = 0  # shards fetched by read-ahead (loader.cache_ahead) before their worker opened them
    ahead_failed: int = 0  # read-ahead fetches the store failed (the worker's own open then meets the error)


CACHE_COUNTS = tuple(f.name for f in fields(Counts))
"""The names of the node cache's counts, in the order of a batch's ``cache`` tensor: shard opens
served from the cache (hits), opens that fetched their shard into it (misses), bytes fetched from
the store into it, bytes evicted, damaged entries found (fetched again), and opens read from the
store because the cache could not take the shard (bypassed); then what read-ahead did
(``loader.cache_ahead``): shards it fetched (ahead; their bytes are in fetched_bytes, their opens
are hits) and fetches of it the store failed (ahead_failed)."""
_counts = Counts()
_taken = Counts()
_guard = threading.Lock()
_caches: dict[tuple[str, int | None], NodeCache | None] = {}
_warned: set[tuple[str, str]] = set()


def _forget_after_fork() -> None:
    # A DataLoader worker counts what it does itself (a copy of its parent's counts would be
    # reported twice), and must not wait on a lock another parent thread held at the fork.
    global _counts, _taken, _guard
    _counts, _taken, _guard = Counts(), Counts(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def counts() -> Counts:
    """This process's counts since it began (a DataLoader worker's: since it was forked)."""
    with _guard:
        return replace(_counts)


def take_counts() -> tuple[int, ...]:
    """The counts added since the last call in this process, in ``CACHE_COUNTS`` order: each
    batch carries them (delivery/batches.py), so a trainer sums its batches' to count a rank's."""
    global _taken
    with _guard:
        now = replace(_counts)
        delta = tuple(a - b for a, b in zip(astuple(now), astuple(_taken), strict=True))
        _taken = now
    return delta


def _count(**added: int) -> None:
    with _guard:
        for name, n in added.items():
            setattr(_counts, name, getattr(_counts, name) + n)


def cacheable(url: str) -> bool:
    """A shard the cache takes: http(s), s3:// and gs://. Local files are read where they are, and a
    ``pipe:`` command's output is the command's to repeat."""
    return url.startswith(CACHED_PREFIXES)


def entry_name(url: str) -> str:
    """The entry's name in the folder, without its kind: a hash of the whole URL, then the URL's
    last part made safe (never a path: no ``/``, and never ``.`` or ``..``, as it begins with the hash)."""
    digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    last = url.rstrip("/").rsplit("/", 1)[-1].partition("?")[0]
    return f"{digest}-{_UNSAFE.sub('_', last)[-TAIL:]}"


def warn_once(folder: str, cause: str, message: str) -> None:
    """One warning line per folder and cause in this process, however many shards meet it."""
    with _guard:
        if (folder, cause) in _warned:
            return
        _warned.add((folder, cause))
    log.warning("shard cache %s (loader.cache_dir): %s", folder, message)


def prepare(folder: str, limit: int | None) -> int | None:
    """Make the folder ready in this process (before its DataLoader workers start): the limit in
    effect, or None where the folder cannot be used (said in one warning line). Workers given
    that limit share their rank's, rather than each working out its own from the free space."""
    cache = node_cache(folder, limit)
    return None if cache is None else cache.limit


def node_cache(folder: str, limit: int | None) -> NodeCache | None:
    """This process's cache in ``folder`` (None where it cannot be used), made once."""
    key = (folder, limit)
    with _guard:
        if key in _caches:
            return _caches[key]
    try:
        cache: NodeCache | None = NodeCache(folder, limit)
    except OSError as exc:
        _warn_local(folder, exc)
        cache = None
    with _guard:
        cache = _caches.setdefault(key, cache)
        if cache is not None:
            _caches.setdefault((folder, cache.limit), cache)
        return cache


def _warn_local(folder: str, error: OSError) -> None:
    if error.errno in _FULL:
        warn_once(folder, "full disk", f"its disk is full ({describe(error)}); shards are read from the store")
    else:
        warn_once(folder, "unwritable", f"cannot be written ({describe(error)}); shards are read from the store")


def open_cached(
    url: str,
    folder: str,
    limit: int | None,
    start: int,
    fetch: Callable[[], Any],
    direct: Callable[[], IO[bytes]],
) -> IO[bytes]:
    """The shard at ``url`` from byte ``start``: from its entry in ``folder``, fetched there first
    with ``fetch()`` (the whole object, as a stream) where it is missing; ``direct()`` (the store,
    as without a cache) where the cache cannot take it."""
    cache = node_cache(folder, limit)
    if cache is None:
        _count(bypassed=1)
        return direct()
    return cache.open(url, start, fetch, direct)


class CacheFull(Exception):
    """Read-ahead cannot fetch a shard into the cache now (no room, the folder cannot be written,
    the store did not say the shard's size, or read-ahead was stopped): it stops reading ahead."""


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


def fetch_ahead(
    url: str, folder: str, limit: int | None, fetch: Callable[[], Any], stop: threading.Event
) -> Pin | None:
    """Fetch the shard at ``url`` into the cache before its worker opens it: its entry, pinned
    (``Pin``), where it is there now; None where the store failed (counted in ahead_failed; the
    worker's own open meets the error and reports it) or another process is fetching it (the
    worker's open waits for that download). Raises CacheFull where the cache cannot take it now,
    without a warning: the worker's own open says why, once. Setting ``stop`` ends a download
    between two reads of the store."""
    cache = node_cache(folder, limit)
    if cache is None or not cacheable(url):
        raise CacheFull(url)
    return cache.fetch_ahead(url, fetch, stop)


def write_part(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to a download's part file: the one place shard bytes are written (a
    full disk raises OSError(ENOSPC) here)."""
    while data:
        data = data[os.write(fd, data) :]


class _LocalError(Exception):
    """Writing the cache failed (not reading the store): the shard is read from the store instead."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _NoRoom(Exception):
    """The cache cannot hold this shard now; the reason was warned about."""


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
    """The paths of one entry."""

    def __init__(self, folder: str, name: str) -> None:
        self.base = os.path.join(folder, name)
        self.data, self.meta = f"{self.base}.data", f"{self.base}.meta"
        self.lock, self.dl = f"{self.base}.lock", f"{self.base}.dl"
        self.ahead = f"{self.base}.ahead"

    def part(self) -> str:
        return f"{self.base}.part-{os.getpid()}"


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
def _locked(path: str) -> Iterator[None]:
    fd = acquire(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)  # type: ignore[arg-type]


def _unlink(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _content_length(headers: Any) -> int | None:
    value = str(headers.get("Content-Length") or "").strip() if headers is not None else ""
    return int(value) if value.isdigit() else None


def _read_meta(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


class NodeCache:
    """One folder's cache, as one process uses it."""

    def __init__(self, folder: str, limit: int | None) -> None:
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.budget_lock = os.path.join(self.folder, BUDGET_LOCK)
        with _locked(self.budget_lock):  # also proves the folder can be written
            used, _ = self.scan()  # and clears the parts dead processes left
        if limit is None:
            # Half of what the cache could hold when it starts: what it holds plus the free space,
            # so a folder filled by an earlier run keeps its entries, and the disk keeps room for others.
            free = os.statvfs(self.folder)
            limit = (used + free.f_bavail * free.f_frsize) // 2
        self.limit = limit
        self.too_big: set[str] = set()  # URLs larger than the limit: straight to the store
        self.largest = 0  # the largest shard this process fetched: what read-ahead expects to need room for

    def open(self, url: str, start: int, fetch: Callable[[], Any], direct: Callable[[], IO[bytes]]) -> IO[bytes]:
        entry = Entry(self.folder, entry_name(url))
        try:
            lock = acquire(entry.lock, fcntl.LOCK_SH)  # waits only while an entry is being evicted
        except OSError as exc:
            return self._bypass(exc, direct)
        assert lock is not None
        try:
            fd = self._verified(entry, url)
            if fd is not None:
                _count(hits=1)
            else:
                fd = self._fill(entry, url, fetch)
        except _LocalError as exc:
            os.close(lock)
            return self._bypass(exc.error, direct)
        except _NoRoom:
            os.close(lock)
            _count(bypassed=1)
            return direct()
        except BaseException:
            os.close(lock)
            raise
        return CachedFile(fd, lock, start)

    def fetch_ahead(self, url: str, fetch: Callable[[], Any], stop: threading.Event) -> Pin | None:
        """``fetch_ahead`` in this folder."""
        if url in self.too_big:
            raise CacheFull(url)
        entry = Entry(self.folder, entry_name(url))
        try:
            lock = acquire(entry.lock, fcntl.LOCK_SH)  # held until pinned: no eviction in between
        except OSError:
            raise CacheFull(url) from None
        assert lock is not None
        try:
            fd = self._verified(entry, url)
            if fd is None:
                fd = self._fill_ahead(entry, url, fetch, stop)
                if fd is None:
                    return None
            os.close(fd)
            try:
                pin = acquire(entry.ahead, fcntl.LOCK_SH)
            except OSError:
                raise CacheFull(url) from None
            assert pin is not None
            return Pin(pin)
        finally:
            os.close(lock)

    def _fill_ahead(self, entry: Entry, url: str, fetch: Callable[[], Any], stop: threading.Event) -> int | None:
        """_fill for read-ahead: it never waits for another's download, counts what it fetched as
        ahead (not a miss: no shard was opened), and swallows the store's errors."""
        try:
            dl = acquire(entry.dl, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise CacheFull(url) from None
        if dl is None:
            return None  # being fetched by another: the worker's open waits for that download
        try:
            fd = self._verified(entry, url)
            if fd is not None:
                return fd
            if os.path.exists(entry.data):
                _count(corrupt=1)
            if not self._room_for(self.largest):
                raise CacheFull(url)  # not worth a request that would be dropped
            try:
                _unlink(entry.data, entry.meta, *self._parts(entry))
                return self._download(entry, url, fetch, stop)
            except (_NoRoom, _LocalError):
                raise CacheFull(url) from None
            except Exception:  # noqa: BLE001 (the store's error: the worker's own open reports it)
                _count(ahead_failed=1)
                return None
        finally:
            os.close(dl)

    def _bypass(self, error: OSError, direct: Callable[[], IO[bytes]]) -> IO[bytes]:
        _warn_local(self.folder, error)
        _count(bypassed=1)
        return direct()

    def _verified(self, entry: Entry, url: str) -> int | None:
        """The entry's file, open, where it is complete (the size its sidecar records); touched,
        so eviction takes the least recently used first."""
        meta = _read_meta(entry.meta)
        if meta is None or meta.get("url") != url:
            return None
        try:
            fd = os.open(entry.data, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if os.fstat(fd).st_size != meta.get("size"):
            os.close(fd)
            return None
        with contextlib.suppress(OSError):  # another user's entry: read, but not ours to touch
            os.utime(fd)
        return fd

    def _fill(self, entry: Entry, url: str, fetch: Callable[[], Any]) -> int:
        """The entry's file, fetched unless another process did it while this one waited."""
        try:
            dl = acquire(entry.dl, fcntl.LOCK_EX)  # waits for a download of this shard in flight
        except OSError as exc:
            raise _LocalError(exc) from None
        try:
            fd = self._verified(entry, url)
            if fd is not None:
                _count(hits=1)
                return fd
            if os.path.exists(entry.data):  # there, but not as its sidecar says: never read it
                _count(corrupt=1)
            try:
                _unlink(entry.data, entry.meta, *self._parts(entry))  # parts: nobody else holds .dl
            except OSError as exc:
                raise _LocalError(exc) from None
            if url in self.too_big:
                raise _NoRoom
            return self._download(entry, url, fetch)
        finally:
            os.close(dl)  # type: ignore[arg-type]

    def _parts(self, entry: Entry) -> list[str]:
        name = os.path.basename(entry.base)
        return [os.path.join(self.folder, f) for f in os.listdir(self.folder) if f.startswith(f"{name}.part-")]

    def _download(self, entry: Entry, url: str, fetch: Callable[[], Any], stop: threading.Event | None = None) -> int:
        """The entry fetched; ``stop`` given: for read-ahead, which takes only a shard whose size
        the store says (so that it never goes past the limit), and stops when it is set."""
        stream = fetch()
        try:
            headers = getattr(stream, "headers", None)
            size = _content_length(headers)
            if stop is not None and size is None:
                raise _NoRoom
            part = entry.part()
            fd = self._reserve(part, url, size, ahead=stop is not None)
            try:
                written = self._copy(stream, fd, size, url, stop)
                if size is not None and written != size:
                    raise OSError(f"the store sent {written} of its {size} bytes")
                meta = {"url": url, "size": written}
                for key in ("ETag", "Last-Modified"):
                    if headers is not None and headers.get(key):
                        meta[key.lower()] = str(headers.get(key))
                self._finish(fd, part, entry, meta)
            except BaseException:
                _unlink(part)
                raise
            finally:
                os.close(fd)
            self.largest = max(self.largest, written)
            if stop is None:
                _count(misses=1, fetched_bytes=written)
            else:
                _count(ahead=1, fetched_bytes=written)
            if size is None:  # nothing was reserved for it: make room now
                with _locked(self.budget_lock):
                    self._evict(0)
            return os.open(entry.data, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            stream.close()

    def _reserve(self, part: str, url: str, size: int | None, ahead: bool = False) -> int:
        """The download's part file, made ``size`` bytes long where the store said, once older
        entries are evicted to make room for it; _NoRoom where they cannot be. For read-ahead
        (``ahead``) entries pinned by read-ahead are spared too, and nothing is warned about."""
        if ahead and size is not None and size > self.limit:
            raise _NoRoom  # the worker's own open warns, and marks it too big
        if size is not None and size > self.limit:
            self.too_big.add(url)
            warn_once(
                self.folder,
                "too big",
                f"{url} is {size} bytes, more than loader.cache_limit={self.limit}; "
                f"shards larger than the limit are read from the store",
            )
            raise _NoRoom
        try:
            with _locked(self.budget_lock):
                if not self._evict(size or 0, spare_pinned=ahead):
                    if ahead:
                        raise _NoRoom
                    warn_once(
                        self.folder,
                        "in use",
                        f"the entries in use leave no room under loader.cache_limit={self.limit}; "
                        f"shards that do not fit are read from the store",
                    )
                    raise _NoRoom
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                try:
                    if size:
                        _allocate(fd, size)
                except BaseException:
                    os.close(fd)
                    _unlink(part)
                    raise
                return fd
        except OSError as exc:
            raise _LocalError(exc) from None

    def _copy(self, stream: Any, fd: int, size: int | None, url: str, stop: threading.Event | None = None) -> int:
        """The store's bytes into the part file; an error reading the store is raised as it is
        (the shard fails as it would without a cache), one writing the file as _LocalError."""
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        written = 0
        while True:
            n = stream.readinto(buffer)
            if not n:
                return written
            if stop is not None and stop.is_set():
                raise _NoRoom  # read-ahead stopped: its worker is done
            if size is None and written + n > self.limit:
                self.too_big.add(url)
                warn_once(
                    self.folder,
                    "too big",
                    f"{url} is more than loader.cache_limit={self.limit} bytes; "
                    f"shards larger than the limit are read from the store",
                )
                raise _NoRoom
            try:
                write_part(fd, view[:n])
            except OSError as exc:
                raise _LocalError(exc) from None
            written += n

    def _finish(self, fd: int, part: str, entry: Entry, meta: dict) -> None:
        """The sidecar, then the data under its name: a reader finds both complete or a missing entry."""
        try:
            os.fsync(fd)
            with open(entry.meta, "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(part, entry.data)
            folder = os.open(self.folder, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(folder)  # the rename survives a crash of the node
            finally:
                os.close(folder)
        except OSError as exc:
            _unlink(entry.meta)
            raise _LocalError(exc) from None

    def scan(self) -> tuple[int, list[tuple[float, int, str]]]:
        """(bytes held, entries as (mtime, size, base path)); parts of dead downloads are removed,
        parts in flight count at their full size. Called under the budget lock."""
        used, entries = 0, []
        for name in os.listdir(self.folder):
            match = _ENTRY.fullmatch(name)
            kind = match.group(3) if match else ""
            if kind != "data" and not kind.startswith("part-"):
                continue
            path = os.path.join(self.folder, name)
            base = path[: -len(kind) - 1]
            if kind.startswith("part-"):
                dl = acquire(f"{base}.dl", fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
                if dl is not None or not os.path.exists(f"{base}.dl"):
                    _unlink(path)  # no download holds it: its process is gone
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

    def _room_for(self, size: int) -> bool:
        """Whether read-ahead could make room for ``size`` bytes now, evicting nothing: before it
        asks the store for a shard it would have to drop."""
        try:
            with _locked(self.budget_lock):
                used, entries = self.scan()
                free = self.limit - used
                for _, n, base in sorted(entries):
                    if free >= size:
                        break
                    if _evictable(base):
                        free += n
        except OSError:
            return False
        return free >= size

    def _evict(self, room: int, spare_pinned: bool = False) -> bool:
        """Evict least recently used entries nobody reads until ``room`` more bytes fit under the
        limit; False where they cannot. ``spare_pinned``: pass over the entries read-ahead holds
        for their workers too. Called under the budget lock."""
        used, entries = self.scan()
        for _, size, base in sorted(entries):
            if used + room <= self.limit:
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
                    _unlink(f"{base}.data", f"{base}.meta", f"{base}.dl", f"{base}.ahead", f"{base}.lock")
                finally:
                    os.close(dl)
            finally:
                os.close(lock)
            used -= size
            _count(evicted_bytes=size)
        return used + room <= self.limit


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


def _allocate(fd: int, size: int) -> None:
    """Give the part file its size now: its blocks (where the file system can) or a sparse length."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _FULL:
            raise
        os.ftruncate(fd, size)  # a file system without fallocate
