"""A node's cache of remote shards (``loader.cache_dir``): each http(s), s3:// or gs:// shard is
fetched from its store once per node, then read from a local file by every rank and DataLoader
worker of every run that names the same folder. Without it every epoch, and every run, reads the
whole data set from the store again.

``NodeCache`` is one process's use of a folder; the processes sharing it know nothing of one
another and meet only through the files and locks of cachefiles.py, whose docstring describes
that protocol. What a process's cache did is counted in cachecounts.py.

Where the cache cannot take a shard (larger than the limit, the rest in use, the folder not
writable, the disk full), it is read from the store as without a cache, with one warning line per
cause in the process, and the run goes on."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from typing import IO, Any

from wdsdist.data.sources import cachefiles
from wdsdist.data.sources.cachecounts import CACHE_COUNTS, Counts, count, counts, take_counts
from wdsdist.data.sources.cachefiles import FULL, CachedFile, Entry, Pin, Span, acquire, cacheable, entry_name, unlink
from wdsdist.data.sources.retry import describe

__all__ = ["CACHE_COUNTS", "CacheFull", "Counts", "NodeCache", "Pin", "Span", "cacheable", "counts", "entry_name"]
__all__ += ["NoRoomYet", "fetch_ahead", "open_cached", "prepare", "take_counts"]

log = logging.getLogger(__name__)
_guard = threading.Lock()
_caches: dict[tuple[str, int | None], NodeCache | None] = {}
_warned: set[tuple[str, str]] = set()


def _forget_after_fork() -> None:
    # A DataLoader worker must not wait on a lock another parent thread held at the fork.
    global _guard
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


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
    if error.errno in FULL:
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
    span: Span | None = None,
) -> IO[bytes]:
    """The shard at ``url`` from byte ``start``: from its entry in ``folder``, fetched there first
    with ``fetch()`` (the whole object, or its ``span`` of bytes, as a stream) where it is
    missing; ``direct()`` (the store, as without a cache) where the cache cannot take it."""
    cache = node_cache(folder, limit)
    if cache is None:
        count(bypassed=1)
        return direct()
    return cache.open(url, start, fetch, direct, span)


class CacheFull(Exception):
    """Read-ahead cannot fetch a shard into the cache now (no room, the folder cannot be written,
    the store did not say the shard's size, or read-ahead was stopped): it stops reading ahead."""


class NoRoomYet(CacheFull):
    """No room for the shard now, and nothing was asked of the store: read-ahead may look again."""


def fetch_ahead(
    url: str, folder: str, limit: int | None, fetch: Callable[[], Any], stop: threading.Event, span: Span | None = None
) -> Pin | None:
    """Fetch the shard at ``url`` into the cache before its worker opens it: its entry, pinned
    (``Pin``), where it is there now; None where the store failed (counted in ahead_failed; the
    worker's own open meets the error and reports it) or another process is fetching it (the
    worker's open waits for that download). Raises CacheFull where the cache cannot take it now,
    without a warning: the worker's own open says why, once. Setting ``stop`` ends a download
    between two reads of the store. ``span``: as open_cached's."""
    cache = node_cache(folder, limit)
    if cache is None or not cacheable(url):
        raise CacheFull(url)
    return cache.fetch_ahead(Entry(cache.folder, url, span), fetch, stop)


def _expected(stream: Any, headers: Any, span: Span | None) -> int | None:
    """The bytes a download of the object (or its ``span``) brings, where the store said (None
    where it did not). For a span, the store's answer to the Range, never more than the span: an
    index's offsets are the data's word, and an end past the object's must not reserve (evict)
    room the object does not fill. A server that ignored Range (200) announced the whole object,
    of which the stream holds the span's part."""
    size = cachefiles.content_length(headers)
    if span is None or size is None:
        return size
    lo, hi = span
    if getattr(stream, "status", None) == 200:
        return max(0, (size if hi is None else min(hi, size)) - lo)
    return size if hi is None else min(size, hi - lo)


class _LocalError(Exception):
    """Writing the cache failed (not reading the store): the shard is read from the store instead."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _NoRoom(Exception):
    """The cache cannot hold this shard now; the reason was warned about."""


class NodeCache:
    """One folder's cache, as one process uses it."""

    def __init__(self, folder: str, limit: int | None) -> None:
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.budget_lock = os.path.join(self.folder, cachefiles.BUDGET_LOCK)
        with cachefiles.locked(self.budget_lock):  # also proves the folder can be written
            used, _ = cachefiles.scan(self.folder)  # and clears the parts dead processes left
        if limit is None:
            # Half of what the cache could hold when it starts: what it holds plus the free space,
            # so a folder filled by an earlier run keeps its entries, and the disk keeps room for others.
            free = os.statvfs(self.folder)
            limit = (used + free.f_bavail * free.f_frsize) // 2
        self.limit = limit
        self.too_big: set[str] = set()  # entries (their base paths) larger than the limit: straight to the store
        self.largest = 0  # the largest shard this process fetched: what read-ahead expects to need room for

    def open(
        self, url: str, start: int, fetch: Callable[[], Any], direct: Callable[[], IO[bytes]], span: Span | None = None
    ) -> IO[bytes]:
        if span is not None and start < span[0]:
            raise ValueError(f"{url}: byte {start} lies before the span {span} its entry holds")
        entry = Entry(self.folder, url, span)
        try:
            lock = acquire(entry.lock, fcntl.LOCK_SH)  # waits only while an entry is being evicted
        except OSError as exc:
            return self._bypass(exc, direct)
        assert lock is not None
        try:
            fd = entry.verified()
            if fd is not None:
                count(hits=1)
            else:
                fd = self._fill(entry, fetch)
        except _LocalError as exc:
            os.close(lock)
            return self._bypass(exc.error, direct)
        except _NoRoom:
            os.close(lock)
            count(bypassed=1)
            return direct()
        except BaseException:
            os.close(lock)
            raise
        return CachedFile(fd, lock, start - (span[0] if span else 0))

    def fetch_ahead(self, entry: Entry, fetch: Callable[[], Any], stop: threading.Event) -> Pin | None:
        """``fetch_ahead`` in this folder."""
        url = entry.what
        if entry.base in self.too_big:
            raise CacheFull(url)
        try:
            lock = acquire(entry.lock, fcntl.LOCK_SH)  # held until pinned: no eviction in between
        except OSError:
            raise CacheFull(url) from None
        assert lock is not None
        try:
            fd = entry.verified()
            if fd is None:
                fd = self._fill_ahead(entry, fetch, stop)
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

    def _fill_ahead(self, entry: Entry, fetch: Callable[[], Any], stop: threading.Event) -> int | None:
        """_fill for read-ahead: it never waits for another's download, counts what it fetched as
        ahead (not a miss: no shard was opened), and swallows the store's errors."""
        url = entry.what
        try:
            dl = acquire(entry.dl, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise CacheFull(url) from None
        if dl is None:
            return None  # being fetched by another: the worker's open waits for that download
        try:
            fd = entry.verified()
            if fd is not None:
                return fd
            if os.path.exists(entry.data):
                count(corrupt=1)
            if not cachefiles.room_for(self.folder, self.limit, self.largest):
                raise NoRoomYet(url)  # not worth a request that would be dropped
            try:
                unlink(entry.data, entry.meta, *entry.parts())
                return self._download(entry, fetch, stop)
            except (_NoRoom, _LocalError):
                raise CacheFull(url) from None
            except Exception:  # noqa: BLE001 (the store's error: the worker's own open reports it)
                count(ahead_failed=1)
                return None
        finally:
            os.close(dl)

    def _bypass(self, error: OSError, direct: Callable[[], IO[bytes]]) -> IO[bytes]:
        _warn_local(self.folder, error)
        count(bypassed=1)
        return direct()

    def _fill(self, entry: Entry, fetch: Callable[[], Any]) -> int:
        """The entry's file, fetched unless another process did it while this one waited."""
        try:
            dl = acquire(entry.dl, fcntl.LOCK_EX)  # waits for a download of this shard in flight
        except OSError as exc:
            raise _LocalError(exc) from None
        try:
            fd = entry.verified()
            if fd is not None:
                count(hits=1)
                return fd
            if os.path.exists(entry.data):  # there, but not as its sidecar says: never read it
                count(corrupt=1)
            try:
                unlink(entry.data, entry.meta, *entry.parts())  # parts: nobody else holds .dl
            except OSError as exc:
                raise _LocalError(exc) from None
            if entry.base in self.too_big:
                raise _NoRoom
            return self._download(entry, fetch)
        finally:
            os.close(dl)  # type: ignore[arg-type]

    def _download(self, entry: Entry, fetch: Callable[[], Any], stop: threading.Event | None = None) -> int:
        """The entry fetched; ``stop`` given: for read-ahead, which takes only a shard whose size
        the store says (so that it never goes past the limit), and stops when it is set."""
        stream = fetch()
        try:
            headers = getattr(stream, "headers", None)
            size = _expected(stream, headers, entry.span)
            if stop is not None and size is None:
                raise _NoRoom
            part = entry.part()
            fd = self._reserve(part, entry, size, ahead=stop is not None)
            try:
                written = self._copy(stream, fd, size, entry, stop)
                if size is not None and written != size:
                    raise OSError(f"the store sent {written} of its {size} bytes")
                meta = entry.described(written)
                for key in ("ETag", "Last-Modified"):
                    if headers is not None and headers.get(key):
                        meta[key.lower()] = str(headers.get(key))
                # counted before the entry shows: read-ahead's count made later could miss the last batch
                kind = "misses" if stop is None else "ahead"
                count(**{kind: 1, "fetched_bytes": written})
                try:
                    entry.finish(fd, part, meta)
                except OSError as exc:
                    count(**{kind: -1, "fetched_bytes": -written})
                    raise _LocalError(exc) from None
            except BaseException:
                unlink(part)
                raise
            finally:
                os.close(fd)
            self.largest = max(self.largest, written)
            if size is None:  # nothing was reserved for it: make room now
                with cachefiles.locked(self.budget_lock):
                    self._evict(0)
            return os.open(entry.data, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            stream.close()

    def _reserve(self, part: str, entry: Entry, size: int | None, ahead: bool = False) -> int:
        """The download's part file, made ``size`` bytes long where the store said, once older
        entries are evicted to make room for it; _NoRoom where they cannot be. For read-ahead
        (``ahead``) entries pinned by read-ahead are spared too, and nothing is warned about."""
        if ahead and size is not None and size > self.limit:
            raise _NoRoom  # the worker's own open warns, and marks it too big
        if size is not None and size > self.limit:
            self.too_big.add(entry.base)
            warn_once(
                self.folder,
                "too big",
                f"{entry.what} is {size} bytes, more than loader.cache_limit={self.limit}; "
                f"shards larger than the limit are read from the store",
            )
            raise _NoRoom
        try:
            with cachefiles.locked(self.budget_lock):
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
                        cachefiles.allocate(fd, size)
                except BaseException:
                    os.close(fd)
                    unlink(part)
                    raise
                return fd
        except OSError as exc:
            raise _LocalError(exc) from None

    def _copy(self, stream: Any, fd: int, size: int | None, entry: Entry, stop: threading.Event | None = None) -> int:
        """The store's bytes into the part file; an error reading the store is raised as it is
        (the shard fails as it would without a cache), one writing the file as _LocalError."""
        buffer = bytearray(cachefiles.CHUNK)
        view = memoryview(buffer)
        written = 0
        while True:
            n = stream.readinto(buffer)
            if not n:
                return written
            if stop is not None and stop.is_set():
                raise _NoRoom  # read-ahead stopped: its worker is done
            if size is None and written + n > self.limit:
                self.too_big.add(entry.base)
                warn_once(
                    self.folder,
                    "too big",
                    f"{entry.what} is more than loader.cache_limit={self.limit} bytes; "
                    f"shards larger than the limit are read from the store",
                )
                raise _NoRoom
            try:
                cachefiles.write_part(fd, view[:n])
            except OSError as exc:
                raise _LocalError(exc) from None
            written += n

    def _evict(self, room: int, spare_pinned: bool = False) -> bool:
        """cachefiles.evict under this cache's limit, counting what it evicted. Called under the
        budget lock."""
        fits, evicted = cachefiles.evict(self.folder, self.limit, room, spare_pinned)
        if evicted:
            count(evicted_bytes=evicted)
        return fits
