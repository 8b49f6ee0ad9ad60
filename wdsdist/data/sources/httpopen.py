"""The one way http(s) is read: shard index fetches and shard streams alike.

urllib, never a shell, with limits a broken or hostile server cannot get around:
  - each read waits at most ``timeout`` seconds (the socket timeout);
  - in every ``timeout`` seconds spent waiting on the server, ``min_rate`` bytes per second of
    that wait must arrive, headers included. The per-read timeout alone lets a server that
    drips one byte at a time hold a shard for hours. Only time blocked in the socket counts, so
    a slow reader (a worker whose batches wait in a full prefetch queue) leaves the data in the
    kernel's buffer and never trips it; a deadline per shard would, or would have to be hours;
  - redirects are followed to http(s) only (urllib's default also follows ftp://).

A part of a body is asked for with a Range request; a server that ignores it and sends the
whole body (200) is read from its start with the bytes before the part dropped, so a caller
always gets the bytes it asked for, never others. That is also how the opener resumes a shard
read that failed midway (retry.py), which is why a body cut short must be told from its end
(``length``, and IncompleteRead while dropping).
"""

from __future__ import annotations

import functools
import http.client
import io
import re
import time
import urllib.error
import urllib.parse
import urllib.request

SCHEMES = ("http", "https")
DEFAULT_MIN_RATE = 65536  # bytes/s: 64 streams (8 ranks x 8 workers) on a 100 Mbit/s link still get 3x this
_CHUNK = 1 << 20  # bytes per read when dropping the start of a body whose server ignored Range
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class Meter:
    """Counts bytes and the seconds spent waiting for them; too few per window is an error."""

    def __init__(self, window: float, min_rate: int) -> None:
        self.window, self.min_rate = window, min_rate
        self.waited, self.got = 0.0, 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.waited += seconds
        self.got += nbytes
        if self.waited < self.window:
            return
        if self.got < self.min_rate * self.waited:
            raise TimeoutError(
                f"too slow: {self.got} bytes in {self.waited:.1f} s of waiting on the server, "
                f"less than http_min_rate={self.min_rate} bytes/s"
            )
        self.waited, self.got = 0.0, 0


class _MeteredRaw(io.RawIOBase):
    def __init__(self, raw: io.RawIOBase, meter: Meter) -> None:
        self._raw, self._meter = raw, meter

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:  # type: ignore[override]
        start = time.monotonic()
        n = self._raw.readinto(buffer)
        self._meter.add(n or 0, time.monotonic() - start)
        return n

    def close(self) -> None:
        self._raw.close()  # the socket's own file: releases its reference to the socket
        super().close()


class _MeteredSocket:
    """A connected socket whose read file goes through a meter; everything else is the socket."""

    def __init__(self, sock, meter: Meter) -> None:
        self._sock, self._meter = sock, meter

    def makefile(self, mode: str = "r", buffering: int | None = None, **kw):
        if mode != "rb":
            return self._sock.makefile(mode, buffering, **kw)
        return io.BufferedReader(_MeteredRaw(self._sock.makefile("rb", buffering=0), self._meter))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _Metered:
    """Mixed into http.client's connections: the socket, once connected (and TLS set up), is metered."""

    def __init__(self, *args, meter: Meter, **kw) -> None:
        super().__init__(*args, **kw)
        self._meter = meter

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock = _MeteredSocket(self.sock, self._meter)  # type: ignore[has-type]


class _HTTPConnection(_Metered, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Metered, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, min_rate: int) -> None:
        super().__init__()
        self.min_rate = min_rate

    def http_open(self, req):
        meter = Meter(req.timeout, self.min_rate)
        return self.do_open(functools.partial(_HTTPConnection, meter=meter), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, min_rate: int) -> None:
        super().__init__()
        self.min_rate = min_rate

    def https_open(self, req):
        meter = Meter(req.timeout, self.min_rate)
        return self.do_open(functools.partial(_HTTPSConnection, meter=meter), req, context=self._context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in SCHEMES:
            fp.close()
            raise urllib.error.URLError(f"redirect to {newurl} refused: only http(s) redirects are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Window(io.RawIOBase):
    """The first ``length`` bytes of a response: what a Range request asked for, where the
    server sent more."""

    def __init__(self, response: http.client.HTTPResponse, length: int) -> None:
        self._response, self.left = response, length
        self.headers, self.status, self.url = response.headers, response.status, response.url

    def readable(self) -> bool:
        return True

    @property
    def length(self) -> int | None:
        """Bytes still to come that the server announced (as HTTPResponse.length; None where it
        did not say): nonzero where the data has ended, the connection was cut."""
        announced = self._response.length
        return None if announced is None else min(self.left, announced)

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        if n <= 0:
            return 0
        got = self._response.readinto(memoryview(buffer)[:n]) or 0
        self.left -= got
        return got

    def close(self) -> None:
        self._response.close()
        super().close()


def _ranged(url: str, response: http.client.HTTPResponse, start: int, end: int | None):
    """The response to a Range request for bytes ``start`` .. ``end - 1``, reading exactly those."""
    if response.status == 206:
        sent = response.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(sent.strip())
        if not match or int(match.group(1)) != start:
            raise urllib.error.URLError(f"{url}: asked for bytes from {start}, the server sent Content-Range {sent!r}")
        last = int(match.group(2))
    else:  # the whole body: drop what comes before start (never more than a chunk held at once)
        left = start
        while left > 0:
            got = len(response.read(min(left, _CHUNK)))
            if not got and response.length:  # the connection was cut, not a short body
                raise http.client.IncompleteRead(b"", response.length)
            if not got:
                raise urllib.error.URLError(f"{url}: the body ends before byte {start} (the server ignored Range)")
            left -= got
        last = None
    if end is not None and (last is None or last >= end):
        return _Window(response, end - start)
    return response


def open_url(
    url: str,
    timeout: float,
    min_rate: int = DEFAULT_MIN_RATE,
    *,
    start: int = 0,
    end: int | None = None,
    headers: dict[str, str] | None = None,
) -> http.client.HTTPResponse | io.RawIOBase:
    """Open an http(s) URL for reading with the limits above (``min_rate`` 0: no rate check).
    ``start``, ``end``: only the body's bytes ``start`` .. ``end - 1`` (``end`` None: to its end),
    by a Range request. ``headers`` (a token) go to this URL's server only, never on to where it
    redirects. Raises OSError (URLError, HTTPError, TimeoutError) naming what went wrong."""
    if urllib.parse.urlsplit(url).scheme.lower() not in SCHEMES:
        raise urllib.error.URLError(f"not an http(s) URL: {url}")
    if start < 0 or (end is not None and end <= start):
        raise ValueError(f"{url}: no bytes in the range {start} .. {end}")
    request = urllib.request.Request(url)
    for name, value in (headers or {}).items():
        request.add_unredirected_header(name, value)
    if start or end is not None:
        request.add_header("Range", f"bytes={start}-{'' if end is None else end - 1}")
    opener = urllib.request.OpenerDirector()
    # Only these handlers: no ftp:, file: or data: URL is ever opened, whatever a server says.
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        _HTTPHandler(min_rate),
        _HTTPSHandler(min_rate),
        urllib.request.HTTPDefaultErrorHandler(),
        _Redirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    response = opener.open(request, timeout=timeout)
    if not (start or end is not None):
        return response
    try:
        return _ranged(url, response, start, end)
    except BaseException:
        response.close()
        raise


def read_capped(
    url: str, limit: int, timeout: float, min_rate: int = DEFAULT_MIN_RATE, headers: dict[str, str] | None = None
) -> bytes:
    """The body of an http(s) URL, refused (ValueError) when it is larger than ``limit`` bytes;
    never holds more than ``limit`` + 1 bytes of it."""
    with open_url(url, timeout, min_rate, headers=headers) as response:
        length = response.headers.get("Content-Length", "")
        if length.strip().isdigit() and int(length) > limit:
            raise ValueError(f"it is {int(length)} bytes, more than the limit of {limit}")
        data = response.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is more than the limit of {limit} bytes")
    return data
