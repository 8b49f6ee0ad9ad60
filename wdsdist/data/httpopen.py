"""The one way http(s) is read: shard index fetches and shard streams alike.

urllib, never a shell, with limits a broken or hostile server cannot get around:
  - each read waits at most ``timeout`` seconds (the socket timeout);
  - in every ``timeout`` seconds spent waiting on the server, ``min_rate`` bytes per second of
    that wait must arrive, headers included. The per-read timeout alone lets a server that
    drips one byte at a time hold a shard for hours. Only time blocked in the socket counts, so
    a slow reader (a worker whose batches wait in a full prefetch queue) leaves the data in the
    kernel's buffer and never trips it; a deadline per shard would, or would have to be hours;
  - redirects are followed to http(s) only (urllib's default also follows ftp://).
"""

from __future__ import annotations

import functools
import http.client
import io
import time
import urllib.error
import urllib.parse
import urllib.request

SCHEMES = ("http", "https")
DEFAULT_MIN_RATE = 65536  # bytes/s: 64 streams (8 ranks x 8 workers) on a 100 Mbit/s link still get 3x this


class _Meter:
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
    def __init__(self, raw: io.RawIOBase, meter: _Meter) -> None:
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

    def __init__(self, sock, meter: _Meter) -> None:
        self._sock, self._meter = sock, meter

    def makefile(self, mode: str = "r", buffering: int | None = None, **kw):
        if mode != "rb":
            return self._sock.makefile(mode, buffering, **kw)
        return io.BufferedReader(_MeteredRaw(self._sock.makefile("rb", buffering=0), self._meter))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _Metered:
    """Mixed into http.client's connections: the socket, once connected (and TLS set up), is metered."""

    def __init__(self, *args, meter: _Meter, **kw) -> None:
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
        meter = _Meter(req.timeout, self.min_rate)
        return self.do_open(functools.partial(_HTTPConnection, meter=meter), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, min_rate: int) -> None:
        super().__init__()
        self.min_rate = min_rate

    def https_open(self, req):
        meter = _Meter(req.timeout, self.min_rate)
        return self.do_open(functools.partial(_HTTPSConnection, meter=meter), req, context=self._context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in SCHEMES:
            fp.close()
            raise urllib.error.URLError(f"redirect to {newurl} refused: only http(s) redirects are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def open_url(
    url: str, timeout: float, min_rate: int = DEFAULT_MIN_RATE, start: int = 0, end: int | None = None
) -> http.client.HTTPResponse:
    """Open an http(s) URL for reading with the limits above (``min_rate`` 0: no rate check),
    from byte ``start`` up to ``end`` (exclusive; None: the end) with a Range request: a server
    that does not answer it with those bytes (206) is an error, not a silent whole file.
    Raises OSError (URLError, HTTPError, TimeoutError) naming what went wrong."""
    if urllib.parse.urlsplit(url).scheme.lower() not in SCHEMES:
        raise urllib.error.URLError(f"not an http(s) URL: {url}")
    if start < 0 or (end is not None and end <= start):
        raise ValueError(f"{url}: bad byte range {start}-{end}")
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
    if start == 0 and end is None:
        return opener.open(url, timeout=timeout)
    wanted = f"bytes={start}-{'' if end is None else end - 1}"
    response = opener.open(urllib.request.Request(url, headers={"Range": wanted}), timeout=timeout)
    if response.status != 206 or not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
        response.close()
        raise OSError(f"the server ignored the byte range {wanted} (answered {response.status}, not 206)")
    return response


def read_capped(url: str, limit: int, timeout: float, min_rate: int = DEFAULT_MIN_RATE) -> bytes:
    """The body of an http(s) URL, refused (ValueError) when it is larger than ``limit`` bytes;
    never holds more than ``limit`` + 1 bytes of it."""
    with open_url(url, timeout, min_rate) as response:
        length = response.headers.get("Content-Length", "")
        if length.strip().isdigit() and int(length) > limit:
            raise ValueError(f"it is {int(length)} bytes, more than the limit of {limit}")
        data = response.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is more than the limit of {limit} bytes")
    return data
