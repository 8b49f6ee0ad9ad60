"""A store that goes away for a while costs no sample: a remote shard read that fails with a
transient error (refused, cut, 5xx) is opened again from the byte it reached, within
data.http_retry_s of failure without progress; a permanent error (404) is not retried; a server
that never answers ends the read, naming itself and the option (retry.py).

The servers misbehave by a plan of request counts, never by time. The first pause between tries
is made short so the retries cost milliseconds.
"""

from __future__ import annotations

import http.server
import socket

import pytest

from tests.conftest import one_error_line, run_script, write_tiny_shards
from tests.helpers.loading import cfg, keys_and_bad
from tests.helpers.servers import Servers
from wdsdist.data.delivery.pipeline import make_eval_loader
from wdsdist.data.plan.order import shard_order
from wdsdist.data.sources import opener, retry, shardspec
from wdsdist.errors import DataError

LONG = 30.0  # data.http_retry_s where a test's failures must never exhaust it


class _Planned(http.server.BaseHTTPRequestHandler):
    """Serves ``data`` at any path, misbehaving as ``plan`` says, one entry per request:
    ``close`` (hang up without an answer), ``cut`` (the headers and part of the body, then hang
    up), an HTTP status (sent as an error), or ``serve``; once the plan is used up, every request
    is served. ``ranges`` logs each request's Range header."""

    data: bytes = b""
    plan: list = []
    ranges: list = []
    honour_range = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        want = self.headers.get("Range")
        self.ranges.append(want)
        action = self.plan.pop(0) if self.plan else "serve"
        if action == "close":
            return
        if isinstance(action, int):
            self.send_error(action)
            return
        first = int(want.removeprefix("bytes=").partition("-")[0]) if want and self.honour_range else 0
        body = self.data[first:]
        self.send_response(206 if first else 200)
        if first:
            self.send_header("Content-Range", f"bytes {first}-{len(self.data) - 1}/{len(self.data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if action == "cut":
            body = body[: len(body) // 2 + 100]  # mid-member: the shard's images are larger than 100 bytes
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the client hung up after the part it needed


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE", 0.005)


@pytest.fixture
def shard(tmp_path):
    """(path, keys in order) of one local shard of 6 samples."""
    index = write_tiny_shards(tmp_path / "local", [6], "tiny")
    path = index.parent / "tiny-000000.tar"
    keys, _ = keys_and_bad(make_eval_loader([shardspec.Shard(str(path), 6)], 0, 1, cfg()))
    assert len(keys) == 6
    return path, keys


@pytest.fixture
def planned(shard):
    """A factory: planned(plan, honour_range=True) -> (base URL, the handler class)."""
    with Servers() as servers:

        def make(plan, honour_range=True):
            attrs = {"data": shard[0].read_bytes(), "plan": list(plan), "ranges": [], "honour_range": honour_range}
            handler = type("Handler", (_Planned,), attrs)
            return servers.start(handler), handler

        yield make


@pytest.mark.parametrize("failure", [503, "close"])
def test_a_store_that_fails_then_serves_delivers_every_sample_once_in_order(shard, planned, failure, capfd):
    base, handler = planned([failure] * 3)
    loader = make_eval_loader([shardspec.Shard(f"{base}/tiny-000000.tar", 6)], 0, 1, cfg(http_retry_s=LONG))
    keys, bad = keys_and_bad(loader)
    assert keys == shard[1] and bad == [0, 0]
    assert len(handler.ranges) == 4  # three failures, then the read that served it
    assert capfd.readouterr().err == ""  # a retry prints nothing


@pytest.mark.parametrize("honour_range", [True, False])
def test_a_body_cut_mid_shard_is_resumed_where_it_stopped(shard, planned, honour_range):
    base, handler = planned(["cut"], honour_range)
    loader = make_eval_loader([shardspec.Shard(f"{base}/tiny-000000.tar", 6)], 0, 1, cfg(http_retry_s=LONG))
    keys, bad = keys_and_bad(loader)
    assert keys == shard[1] and bad == [0, 0]
    size = len(handler.data)
    assert handler.ranges == [None, f"bytes={size // 2 + 100}-"]  # from the byte reached


def test_a_span_cut_twice_is_resumed_to_the_same_bytes(planned):
    base, handler = planned(["cut", "cut"])
    data, start, end = handler.data, 1000, len(handler.data) - 1500
    with opener.open_shard(f"{base}/x.tar", opener.Access(http_retry_s=LONG), start=start, end=end) as stream:
        got = stream.read()
    assert got == data[start:end]
    assert [r.partition("-")[2] for r in handler.ranges] == [str(end - 1)] * 3  # each try keeps the span's end


def _failing_first(**kw):
    """A loader config whose shard order reads the first of two shards first, so its failure
    is counted on the other's samples."""
    seed = next(s for s in range(100) if shard_order([0, 1], s, 0, 1)[0] == 0)
    return cfg(seed=seed, **kw)


def test_a_missing_shard_is_not_retried_but_skipped_and_counted(shard, planned, capfd):
    base, handler = planned([404])
    missing = shardspec.Shard(f"{base}/gone.tar", 6)
    good = shardspec.Shard(str(shard[0]), 6)
    keys, bad = keys_and_bad(make_eval_loader([missing, good], 0, 1, _failing_first(http_retry_s=LONG)))
    assert keys == shard[1] and bad == [0, 1]
    assert handler.ranges == [None]  # one request
    assert f"warning: skipped: {base}/gone.tar: cannot read shard: HTTPError: HTTP Error 404" in capfd.readouterr().err


def test_a_store_answering_503_for_the_whole_wait_fails_its_shard_saying_so(shard, planned, capfd):
    base, handler = planned([503] * 10_000)
    busy = shardspec.Shard(f"{base}/tiny-000000.tar", 6)
    good = shardspec.Shard(str(shard[0]), 6)
    keys, bad = keys_and_bad(make_eval_loader([busy, good], 0, 1, _failing_first(http_retry_s=0.2)))
    assert keys == shard[1] and bad == [0, 1]  # the server answered: a failed shard, not a dead store
    err = capfd.readouterr().err
    tries = len(handler.ranges)
    assert f"{base}/tiny-000000.tar: cannot read shard: HTTPError: HTTP Error 503: Service Unavailable; " in err
    assert f"gave up after {tries} tries over " in err and " s (data.http_retry_s=0.2)" in err


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_store_that_never_answers_ends_the_read_naming_server_and_option():
    port = _closed_port()
    dead = [shardspec.Shard(f"http://127.0.0.1:{port}/tiny-000000.tar", 6)]
    # Not strict, yet not skipped: every shard on that server would fail alike.
    with pytest.raises(DataError) as err:
        list(make_eval_loader(dead, 0, 1, cfg(strict=False, http_retry_s=0.5)))
    message = str(err.value)
    assert message.startswith(f"http://127.0.0.1:{port} does not answer: tried for ")
    assert f"to read http://127.0.0.1:{port}/tiny-000000.tar" in message
    assert "Connection refused" in message and "data.http_retry_s=0.5 " in message


def test_a_dead_store_seen_in_a_dataloader_worker_ends_the_job_with_one_line():
    # In a process of its own, as train.py runs it: run_job turns the worker's error into one line.
    url = f"http://127.0.0.1:{_closed_port()}/tiny-000000.tar"
    code = (
        "from wdsdist.data import LoaderConfig, Shard\n"
        "from wdsdist.data.delivery.pipeline import make_eval_loader\n"
        "from wdsdist.train.config import run_job\n"
        "config = LoaderConfig(batch_size=4, workers=1, image_size=8, http_retry_s=0.3)\n"
        f"run_job(lambda: list(make_eval_loader([Shard({url!r}, 6)], 0, 1, config)))\n"
    )
    proc = run_script("-c", code, timeout=120)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith(f"error: {url.rsplit('/', 1)[0]} does not answer: tried for ") and url in line
    assert line.endswith("data.http_retry_s=0.3 sets how long a read waits for it to come back")


def test_no_retry_with_zero_fails_the_shard_at_once(planned, capfd):
    base, handler = planned([503])
    shards = [shardspec.Shard(f"{base}/tiny-000000.tar", 6), shardspec.Shard(f"{base}/tiny-000001.tar", 6)]
    keys, bad = keys_and_bad(make_eval_loader(shards, 0, 1, _failing_first(http_retry_s=0)))
    assert len(keys) == 6 and bad == [0, 1]
    assert len(handler.ranges) == 2
    assert "HTTPError: HTTP Error 503: Service Unavailable\n" in capfd.readouterr().err


# ---------------------------------------------------------------- the budget, on a clock of its own


class _Failing:
    """A source that gives ``chunk`` bytes of ``data`` from its start, then fails."""

    def __init__(self, data: bytes, start: int, chunk: int):
        self.data, self.pos, self.left = data, start, chunk

    def readinto(self, buffer) -> int:
        if self.pos >= len(self.data):
            return 0
        if not self.left:
            raise ConnectionResetError(104, "Connection reset by peer")
        n = min(len(buffer), self.left, len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos, self.left = self.pos + n, self.left - n
        return n

    def close(self):
        pass


class _Clock:
    def __init__(self):
        self.now, self.pauses = 0.0, []

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds + 10.0  # each try takes 10 s (a timeout)


def test_progress_resets_the_budget_and_pauses_double_to_their_cap(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE", 0.5)
    data, clock = bytes(range(256)) * 40, _Clock()
    # Each try gives 100 new bytes, then fails: 100 failures in a row, each 10 s after the last
    # progress, never a budget of 15 s spent.
    reader = retry.Resuming(
        "http://h/x.tar", lambda at: _Failing(data, at, 100), 0, None, 15.0, lambda: "http://h:80", **_on(clock)
    )
    assert reader.read() == data
    assert set(clock.pauses) == {0.5}  # each failure was the first since progress
    # No progress at all: pauses 0.5, 1, 2, 4, 5, 5 ... until 60 s have passed since the first failure.
    clock = _Clock()
    reader = retry.Resuming(
        "http://h/x.tar", lambda at: _Failing(data, at, 0), 0, None, 60.0, lambda: "http://h:80", **_on(clock)
    )
    with pytest.raises(retry.GaveUp) as err:
        reader.read()
    assert not isinstance(err.value, retry.StoreDown)  # the server answered, then reset: not down
    assert clock.pauses == [0.5, 1.0, 2.0, 4.0, 5.0]
    assert err.value.tries == 6 and str(err.value).startswith("ConnectionResetError: Connection reset by peer; ")


def _on(clock: _Clock) -> dict:
    return {"pause": clock.pause, "clock": clock}


@pytest.mark.parametrize(
    "error,transient,unanswered",
    [
        (ConnectionRefusedError(111, "Connection refused"), True, True),
        (TimeoutError("timed out"), True, True),
        (OSError(113, "No route to host"), True, True),
        (socket.gaierror(-3, "Temporary failure in name resolution"), True, True),
        (retry.Unavailable("http://s3 answered SlowDown: slow down"), True, False),
        (OSError("the store ignored the byte range"), False, False),
        (ValueError("bad range"), False, False),
    ],
)
def test_what_is_transient_and_what_is_a_store_not_answering(error, transient, unanswered):
    assert retry.transient(error) is transient
    assert retry.unanswered(error) is unanswered


def test_http_statuses_are_transient_only_for_5xx_and_429():
    import urllib.error

    def status(code):
        return urllib.error.HTTPError("http://h/x.tar", code, "", {}, None)

    assert [retry.transient(status(c)) for c in (500, 502, 503, 429)] == [True] * 4
    assert [retry.transient(status(c)) for c in (404, 403, 400, 416)] == [False] * 4
    assert not any(retry.unanswered(status(c)) for c in (503, 404))
    assert not retry.transient(urllib.error.URLError("redirect to ftp://h/x refused"))
    assert retry.unanswered(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")))
    assert retry.server_of("https://store.example/a/b.tar") == "https://store.example:443"
    assert retry.server_of("http://[::1]:8080/b.tar") == "http://[::1]:8080"
