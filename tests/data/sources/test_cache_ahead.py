"""Read-ahead into the node cache (loader.cache_ahead, sources/ahead.py): while a worker reads a
shard, the next ones of its plan are fetched into the cache, so its opens are hits; the first
batch does not wait for it; 0 turns it off; a failed fetch is neither retried nor warned about
twice; it never evicts an entry in use or one fetched ahead, nor goes past the limit; its thread
ends with the epoch.

The store is a local HTTP server that logs each request and can hold a response; the worker's
opens (cache.open_cached, in-process loaders) are logged into the same sequence, and the order of
events is set by waiting on the server's events, never by time.
"""

from __future__ import annotations

import gc
import http.server
import threading
from pathlib import Path

import pytest

from tests.conftest import write_tiny_shards
from tests.helpers.loading import cfg
from tests.helpers.polling import wait_for
from tests.helpers.servers import http_server
from wdsdist.data import Loader
from wdsdist.data.delivery import stream
from wdsdist.data.sources import ahead as ahead_module
from wdsdist.data.sources import cache, cachefiles
from wdsdist.data.sources.access import Access
from wdsdist.data.sources.ahead import ReadAhead

WAIT = 30  # seconds an event is waited for before the test fails (never a pause): the suite may load 2 cores heavily


class Store(http.server.BaseHTTPRequestHandler):
    """Files under ``root``; every request is appended to ``log`` as ("get", path) and sets
    ``seen[path]``. Where ``hold_after_first``, every request for a shard but the first is sent
    half, then ``holding`` is set and it waits for ``release``."""

    root: Path
    log: list
    seen: dict[str, threading.Event]
    hold_after_first: bool
    holding: threading.Event
    release: threading.Event
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path
        with self.lock:
            self.log.append(("get", path))
            self.seen.setdefault(path, threading.Event()).set()
            held = self.hold_after_first and any(k == "get" and p.endswith(".tar") for k, p in self.log[:-1])
        file = self.root / path.lstrip("/")
        if not file.is_file():
            self.send_error(404)
            return
        body = file.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if held:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.holding.set()
                self.release.wait(WAIT)
                body = body[len(body) // 2 :]
            self.wfile.write(body)
        except OSError:
            pass


@pytest.fixture
def store(tmp_path, monkeypatch):
    """(base URL, handler class) for ``tmp_path/data``; the worker's opens are logged as ("open",
    path), each one waiting first until the server has had a request for that path where
    ``handler.wait_ahead`` (so that read-ahead got there first, whatever the threads' timing)."""
    handler = type(
        "AheadStore",
        (Store,),
        {
            "root": (tmp_path / "data").resolve(),
            "log": [],
            "seen": {},
            "hold_after_first": False,
            "holding": threading.Event(),
            "release": threading.Event(),
            "wait_ahead": False,
            "snapshots": [],  # at each open: the tar paths requested before it
        },
    )
    open_cached = cache.open_cached

    def logged(url, *args, **kwargs):
        path = "/" + url.split("/", 3)[3]
        opens = [p for kind, p in handler.log if kind == "open"]
        if handler.wait_ahead and opens:  # the first shard is the worker's own
            with handler.lock:
                event = handler.seen.setdefault(path, threading.Event())
            assert event.wait(WAIT), f"read-ahead never asked for {path}"
        with handler.lock:
            handler.snapshots.append((path, {p for kind, p in handler.log if kind == "get" and p.endswith(".tar")}))
            handler.log.append(("open", path))
        return open_cached(url, *args, **kwargs)

    monkeypatch.setattr(cache, "open_cached", logged)
    with http_server(handler, on_close=handler.release.set) as url:
        cache.take_counts()  # what earlier tests in this process did is not this loader's
        yield url, handler


def shard_gets(handler) -> dict[str, int]:
    gets: dict[str, int] = {}
    for kind, path in handler.log:
        if kind == "get" and path.endswith(".tar"):
            gets[path] = gets.get(path, 0) + 1
    return gets


def opens(handler) -> list[str]:
    return [path for kind, path in handler.log if kind == "open"]


def summed(batches) -> dict[str, int]:
    total = sum(b["cache"] for b in batches)
    return dict(zip(cache.CACHE_COUNTS, total.tolist(), strict=True))


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wdsdist-cache-ahead"]


@pytest.mark.parametrize("split", ["samples", "shards"])
def test_each_shard_after_the_first_is_fetched_ahead_once_and_opened_as_a_hit(tmp_path, store, split):
    write_tiny_shards(tmp_path / "data", [6] * 6, "s")
    base, handler = store
    handler.wait_ahead = True
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=2, split=split)
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 36
    assert shard_gets(handler) == {f"/s-{i:06d}.tar": 1 for i in range(6)}  # each downloaded once
    counted = summed(batches)
    assert (counted["misses"], counted["hits"], counted["ahead"], counted["ahead_failed"]) == (1, 5, 5, 0)
    # Never more than 2 ahead: before the worker opens its n-th shard, read-ahead asked for none past n + 1.
    order = opens(handler)
    for n, (_, requested) in enumerate(handler.snapshots):
        assert requested <= set(order[: n + 2]), (n, order, requested)
    assert not ahead_threads()  # the epoch is over, and so is its read-ahead


def test_the_first_batch_comes_while_the_read_ahead_is_held_by_the_store(tmp_path, store, monkeypatch):
    write_tiny_shards(tmp_path / "data", [6] * 4, "s")
    base, handler = store
    handler.hold_after_first = True  # all but the worker's first open: read-ahead's
    handler.wait_ahead = True
    collate = stream.collate

    def after_read_ahead_is_held(*args, **kwargs):
        assert handler.holding.wait(WAIT), "read-ahead never asked for a shard"
        return collate(*args, **kwargs)

    monkeypatch.setattr(stream, "collate", after_read_ahead_is_held)
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=2, split="shards", mode="epoch")
    batches = iter(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    first = next(batches)  # made while read-ahead's download is held half-way
    assert len(first["label"]) == 4 and not handler.release.is_set()
    [(held_first, _)] = [(p, n) for p, n in shard_gets(handler).items() if p != opens(handler)[0]]
    handler.release.set()
    rest = list(batches)
    assert sum(len(b["label"]) for b in [first, *rest]) == 24
    # The worker that reached the shard being fetched waited for that download: none came twice.
    assert set(shard_gets(handler).values()) == {1} and len(shard_gets(handler)) == 4
    assert held_first == opens(handler)[1]
    assert summed([first, *rest])["misses"] == 1 and not ahead_threads()


def test_cache_ahead_0_fetches_each_shard_only_when_it_is_opened(tmp_path, store):
    write_tiny_shards(tmp_path / "data", [6] * 4, "s")
    base, handler = store
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=0)
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 24
    order = opens(handler)
    for n, (_, requested) in enumerate(handler.snapshots):
        assert requested == set(order[:n])  # nothing asked for before its open
    counted = summed(batches)
    assert (counted["misses"], counted["hits"], counted["ahead"]) == (4, 0, 0)
    assert not ahead_threads()


def test_a_404_met_by_read_ahead_is_not_retried_and_reported_once_by_the_worker(tmp_path, store, capsys):
    write_tiny_shards(tmp_path / "data", [6] * 4, "s")
    (tmp_path / "data" / "s-000001.tar").unlink()  # the index names it; the store has it no more
    base, handler = store
    handler.wait_ahead = True
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=2, split="shards", http_retry_s=0, partial=True)
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 18
    assert opens(handler)[0] != "/s-000001.tar"  # the epoch's order puts it where read-ahead comes first
    # read-ahead's one try, then the worker's open
    assert shard_gets(handler)["/s-000001.tar"] == 2, (handler.log, opens(handler))
    counted = summed(batches)
    assert counted["ahead_failed"] == 1 and counted["ahead"] == 2 and counted["bypassed"] == 0
    assert int(sum(b["bad"][:, 1].sum() for b in batches)) == 1  # the worker's open: skipped, counted
    lines = [line for line in capsys.readouterr().err.splitlines() if "s-000001" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: skipped:") and "404" in lines[0]


def test_read_ahead_never_evicts_an_entry_in_use_or_fetched_ahead_and_stays_under_the_limit(tmp_path, store):
    index = write_tiny_shards(tmp_path / "data", [6] * 6, "s")
    size = max(p.stat().st_size for p in index.parent.glob("*.tar"))
    folder, limit = tmp_path / "cache", 2 * size + size // 2  # room for two entries: in use and next
    base, handler = store
    handler.wait_ahead = True
    held: list[int] = []
    get = Store.do_GET

    def measured(self):
        if self.path.endswith(".tar"):
            held.append(held_bytes(folder))
        get(self)

    handler.do_GET = measured
    config = cfg(cache_dir=str(folder), cache_limit=limit, cache_ahead=2, split="shards")
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 36
    assert max(held) <= limit and held_bytes(folder) <= limit
    # Nothing fetched ahead was evicted before its open (it would be fetched again), none of the
    # worker's opens found the cache full of entries in use (it would read from the store).
    assert shard_gets(handler) == {f"/s-{i:06d}.tar": 1 for i in range(6)}, handler.log
    counted = summed(batches)
    assert (counted["hits"], counted["ahead"], counted["bypassed"]) == (5, 5, 0)
    assert counted["evicted_bytes"] >= 4 * min(p.stat().st_size for p in index.parent.glob("*.tar"))


def test_read_ahead_counts_a_fetch_before_its_entry_shows(tmp_path, store, monkeypatch):
    """A worker's open finds an entry as soon as it shows, and its last batch carries the counts
    made until then: read-ahead's count made after the entry showed could come too late for any
    batch (seen under load: 4 of 5 counted)."""
    write_tiny_shards(tmp_path / "data", [6] * 4, "s")
    base, handler = store
    handler.wait_ahead = True
    events: list[str] = []
    count, finish = cache.count, cachefiles.Entry.finish

    def counting(**added):
        if added.get("ahead"):
            events.append("counted")
        count(**added)

    def finishing(self, *args, **kwargs):
        finish(self, *args, **kwargs)
        events.append("shown")

    monkeypatch.setattr(cache, "count", counting)
    monkeypatch.setattr(cachefiles.Entry, "finish", finishing)
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=2, split="shards")
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert summed(batches)["ahead"] == 3
    # the worker's own fetch shows once; each of read-ahead's is counted, then shows
    assert events == ["shown"] + ["counted", "shown"] * 3, events


def held_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".data" or ".part-" in p.name)


def test_a_loader_left_mid_epoch_leaves_no_read_ahead_running(tmp_path, store):
    write_tiny_shards(tmp_path / "data", [6] * 6, "s")
    base, handler = store
    config = cfg(cache_dir=str(tmp_path / "cache"), cache_ahead=2, split="shards")
    batches = iter(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    next(batches)
    assert handler.seen.get(opens(handler)[0]) is not None
    del batches
    gc.collect()  # the stream's generators are closed, and with them the read-ahead
    assert not ahead_threads()
    assert not [p for p in (tmp_path / "cache").iterdir() if ".part-" in p.name]


def test_a_pin_that_comes_after_its_shard_was_opened_is_let_go_at_once(tmp_path, monkeypatch):
    """Read-ahead's fetch of a shard can end after the worker has opened that shard (the worker
    waited for the download): the pin must not outlive the open, or the entry stays unevictable
    and, in a tight cache, read-ahead finds no room for the shards after it."""
    worker_opened = {"b": threading.Event()}
    fetched: dict[str, Pin] = {}

    class Pin:
        closed = False

        def close(self) -> None:
            self.closed = True

    def fetch(url, access, stop, span):
        if url in worker_opened:
            assert worker_opened[url].wait(WAIT)  # the worker opens it meanwhile
        fetched[url] = Pin()
        return fetched[url]

    monkeypatch.setattr(ahead_module, "fetch_ahead", fetch)
    monkeypatch.setattr(ahead_module.cache, "cacheable", lambda url: True)
    plan = ReadAhead(["a", "b", "c"], lambda url: (url, None), Access(cache_dir=str(tmp_path)), depth=1)
    items = iter(plan)
    assert next(items) == "a"
    plan.opened()  # read-ahead starts on b, whose download ends only after the worker opened b
    assert next(items) == "b"
    plan.opened()
    worker_opened["b"].set()
    wait_for("c fetched", lambda: "c" in fetched, WAIT, 0.01)  # c is planned after b's open, so b's fetch is over
    with plan.cond:
        assert fetched["b"].closed and 1 not in plan.pins
    plan.close()
    assert fetched["c"].closed


def test_the_next_shard_is_fetched_once_room_comes_without_waiting_for_another_open(tmp_path, monkeypatch):
    """The cache had no room for the next shard when the worker opened its current one (an earlier
    shard's file was still open for its late reads): read-ahead looks again, rather than leave
    that shard to the worker's own open."""
    full = {"b": 2}  # b finds no room twice, then room
    fetched: list[str] = []
    tried: list[str] = []
    refused = {"c"}

    class Pin:
        def close(self) -> None:
            pass

    def fetch(url, access, stop, span):
        tried.append(url)
        if full.get(url):
            full[url] -= 1
            raise cache.NoRoomYet(url)
        if url in refused:  # the store was asked (no size, too big): not asked again
            raise cache.CacheFull(url)
        fetched.append(url)
        return Pin()

    monkeypatch.setattr(ahead_module, "fetch_ahead", fetch)
    monkeypatch.setattr(ahead_module.cache, "cacheable", lambda url: True)
    monkeypatch.setattr(ahead_module, "RETRY_S", 0.01)
    plan = ReadAhead(["a", "b", "c", "d"], lambda url: (url, None), Access(cache_dir=str(tmp_path)), depth=1)
    items = iter(plan)
    assert next(items) == "a"
    plan.opened()  # b is next: it is tried until it fits; c comes with b's open
    wait_for("b fetched", lambda: fetched == ["b"], WAIT, 0.01)
    assert full["b"] == 0
    assert next(items) == "b"
    plan.opened()
    # c is refused after the store was asked: dropped from the plan until the worker's next open
    wait_for("c dropped from the plan", lambda: plan.planned == 1, WAIT, 0.01)
    assert tried == ["b", "b", "b", "c"]
    assert next(items) == "c"
    plan.opened()
    wait_for("d fetched", lambda: fetched == ["b", "d"], WAIT, 0.01)
    assert tried.count("c") == 1
    plan.close()


def test_close_while_the_next_shard_finds_no_room_ends_read_ahead_without_its_retry_wait(tmp_path, monkeypatch):
    inside, leave = threading.Event(), threading.Event()

    def fetch(url, access, stop, span):
        inside.set()
        assert leave.wait(WAIT)  # close() comes while read-ahead is in here
        raise cache.NoRoomYet(url)

    monkeypatch.setattr(ahead_module, "fetch_ahead", fetch)
    monkeypatch.setattr(ahead_module.cache, "cacheable", lambda url: True)
    monkeypatch.setattr(ahead_module, "RETRY_S", 3600.0)  # a retry's wait would outlast the test
    plan = ReadAhead(["a", "b"], lambda url: (url, None), Access(cache_dir=str(tmp_path)), depth=1)
    items = iter(plan)
    assert next(items) == "a"
    plan.opened()
    assert inside.wait(WAIT)
    closing = threading.Thread(target=plan.close)
    closing.start()
    wait_for("close() stopping read-ahead", plan.stop.is_set, WAIT, 0.01)
    leave.set()
    closing.join(WAIT)
    assert not closing.is_alive() and not plan.thread.is_alive()
