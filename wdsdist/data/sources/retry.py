"""A remote shard read that rides out a store gone away for a while (``data.http_retry_s``).

A store that restarts, fails over or sheds load answers nothing, or 5xx, for seconds to a
minute. Skipping every shard whose read fell in that window would silently lose its samples, so
a read that fails with a transient error is opened again from the byte it had reached (a Range
request; httpopen drops the bytes before it where a server ignores Range), after a pause that
doubles from ``FIRST_PAUSE`` up to ``MAX_PAUSE``. The tar parser above sees one continuous
stream, no byte twice and none missing, so no sample is delivered twice and none is lost. New
bytes reset the budget: a read gives up only after ``budget`` seconds of failures without
progress.

Transient: a connection refused, reset or cut (a body that ends before its Content-Length), no
route to the host, a name that does not resolve, a timeout (``http_timeout``, or the min-rate
meter), an answer of 5xx or 429. Anything else is the shard's or the user's to fix and fails at
once, as before: 404, 403 and other 4xx, a refused redirect, a Content-Range that does not fit,
a failed certificate check.

A read that gives up raises ``GaveUp`` (its shard is skipped and counted, as any failed read)
or, where the server did not answer at all (the last try failed to connect), ``StoreDown``:
not a bad shard but a store that is down, on which every other shard would fail alike, so the
loader ends the run with one line naming the server rather than skip them one by one.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import socket
import ssl
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from typing import Any

FIRST_PAUSE = 0.5  # seconds before the first retry; each next pause doubles
MAX_PAUSE = 5.0  # seconds between two tries at most: a store that is back is found soon
_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Unavailable(OSError):
    """A server answered 5xx or 429 (an object store's SlowDown or InternalError): it may
    answer later."""


class GaveUp(OSError):
    """A remote read that kept failing for its whole budget; the message ends with how long."""

    def __init__(self, url: str, last: BaseException, tries: int, seconds: float, budget: float) -> None:
        self.url, self.last, self.tries, self.seconds, self.budget = url, last, tries, seconds, budget
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"{describe(self.last)}; gave up after {self.tries} tries over {self.seconds:.1f} s "
            f"(data.http_retry_s={self.budget:g})"
        )


class StoreDown(GaveUp):
    """A remote read that gave up because the server did not answer at all: the store is down."""

    def __init__(self, url: str, last: BaseException, tries: int, seconds: float, budget: float, server: str) -> None:
        self.server = server
        super().__init__(url, last, tries, seconds, budget)

    def _message(self) -> str:
        return (
            f"{self.server} does not answer: tried for {self.seconds:.1f} s ({self.tries} tries, the last: "
            f"{describe(self.last)}) to read {self.url}; is the store down? data.http_retry_s={self.budget:g} "
            f"sets how long a read waits for it to come back"
        )


def describe(exc: BaseException) -> str:
    """``Class: reason`` of a failed read, in one line (a GaveUp says its own)."""
    if isinstance(exc, GaveUp):
        return str(exc)
    # webdataset appends streams to args; an OSError says more in strerror
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc.args[0] if exc.args else exc
    return f"{exc.__class__.__name__}: {reason}"


def unanswered(exc: BaseException) -> bool:
    """A connection-level failure: the server refused, did not answer in time, or cannot be
    reached (no route, no such name). Not an HTTP status, not bad data."""
    if isinstance(exc, urllib.error.HTTPError):
        return False
    if isinstance(exc, urllib.error.URLError):
        if not isinstance(exc.reason, OSError):  # a refused redirect, a Content-Range that does not fit
            return False
        exc = exc.reason
    if isinstance(exc, ssl.SSLError):
        return False
    return isinstance(exc, ConnectionError | TimeoutError | socket.gaierror) or getattr(exc, "errno", None) in (
        _UNREACHABLE
    )


def transient(exc: BaseException) -> bool:
    """A failure that a later try may not meet (see the module's docstring)."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code == 429
    if isinstance(exc, Unavailable | http.client.IncompleteRead | ssl.SSLEOFError):
        return True
    return unanswered(exc)


def server_of(url: str) -> str:
    """``scheme://host:port`` of a URL (the scheme's port where it names none)."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:  # a port that is no number: the URL as it is says the most
        return url
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}" if port else f"{scheme}://{host}"


class Resuming(io.RawIOBase):
    """A remote shard's bytes from ``start`` (to ``end``, exclusive, or its end), opened again
    at the byte reached where a transient failure cut them, for up to ``budget`` seconds of
    failures without progress. ``open_at(byte)`` opens the source from that byte; ``server()``
    names the server for StoreDown. ``pause`` and ``clock`` are time.sleep and time.monotonic
    but in tests."""

    def __init__(
        self,
        url: str,
        open_at: Callable[[int], Any],
        start: int,
        end: int | None,
        budget: float,
        server: Callable[[], str],
        *,
        pause: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.url, self.pos, self.end, self.budget = url, start, end, budget
        self._open_at, self._server, self._pause, self._clock = open_at, server, pause, clock
        self._failing_since: float | None = None  # when the failures since the last new byte began
        self._tries, self._next_pause = 0, FIRST_PAUSE
        self._stream = None
        self._stream = self._open()
        # The first answer's headers (Content-Length, ETag, Last-Modified) and status (200 where an
        # http server ignored Range): what the node cache (cache.py) checks a download against and records.
        self.headers = getattr(self._stream, "headers", None)
        self.status = getattr(self._stream, "status", None)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while True:
            if self._stream is None:
                if self.end is not None and self.pos >= self.end:
                    return 0
                self._stream = self._open()
            try:
                n = self._stream.readinto(buffer) or 0
                left = getattr(self._stream, "length", None)  # what the server said is still to come
                if not n and len(buffer) and left:
                    raise http.client.IncompleteRead(b"", left)
            except Exception as exc:  # noqa: BLE001 (a permanent one is raised again in _failed)
                self._drop()
                self._failed(exc, opening=False)
                continue
            if n:
                self.pos += n
                self._failing_since = None
            return n

    def close(self) -> None:
        self._drop()
        super().close()

    def _open(self):
        while True:
            try:
                return self._open_at(self.pos)
            except Exception as exc:  # noqa: BLE001 (as in readinto)
                self._failed(exc, opening=True)

    def _drop(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail its close too
                stream.close()

    def _failed(self, exc: Exception, opening: bool) -> None:
        """Raise ``exc`` where it is permanent, GaveUp or StoreDown where the budget is spent;
        else wait before the next try."""
        if not transient(exc):
            raise exc
        if isinstance(exc, urllib.error.HTTPError):
            exc.close()  # its body holds the connection
        now = self._clock()
        if self._failing_since is None:
            self._failing_since, self._tries, self._next_pause = now, 0, FIRST_PAUSE
        self._tries += 1
        waited = now - self._failing_since
        if waited >= self.budget:
            if opening and unanswered(exc):
                raise StoreDown(self.url, exc, self._tries, waited, self.budget, self._server()) from exc
            raise GaveUp(self.url, exc, self._tries, waited, self.budget) from exc
        self._pause(min(self._next_pause, self.budget - waited))
        self._next_pause = min(2 * self._next_pause, MAX_PAUSE)
