"""One cache of remote shards per node (loader.cache_dir, sources/cache.py): every rank, worker and
later run on the node reads a shard the store sent once; concurrent readers wait for one download;
a damaged entry is fetched again, never read; the folder stays under its limit without removing a
file in use; a cache that cannot take a shard leaves it to the store with one warning line; names
stay inside the folder; a downloader killed mid-file leaves nothing that stops the next reader.

The stores are local HTTP servers that count the body bytes they send. Processes wait on one
another through events and pipes, never by time.
"""

from __future__ import annotations

import errno
import hashlib
import http.server
import json
import multiprocessing
import os
import re
import signal
import threading
from pathlib import Path

import pytest

from tests.conftest import write_tiny_shards
from tests.helpers.loading import cfg
from tests.helpers.servers import Servers, counting_store
from tests.helpers.training import overrides, ranks
from wdsdist.data import CACHE_COUNTS, Loader
from wdsdist.data.sources import cache, cachefiles, opener

WAIT = 120  # seconds a test waits for another process's signal before it fails (never a pause)
FORK = multiprocessing.get_context("fork")
NAME = re.compile(r"[0-9a-f]{32}-[A-Za-z0-9._-]*\.(data|meta|lock|dl|ahead|part-\d+)|cache\.lock")


class Store(http.server.BaseHTTPRequestHandler):
    """Files under ``root`` (whole, 200: Range is ignored), and any path in ``extra`` as its bytes;
    ``sent`` counts the body bytes of each path, ``gets`` its requests. A path in ``hold`` is sent
    half, then waits for ``release`` (once), and ``started`` is set when it has sent that half."""

    root: Path
    extra: dict[str, bytes]
    sent: dict[str, int]
    gets: dict[str, int]
    hold: set[str]
    started: threading.Event
    release: threading.Event
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path
        body = self.extra.get(path)
        if body is None:
            file = (self.root / path.lstrip("/")).resolve()
            if not file.is_relative_to(self.root) or not file.is_file():
                self.send_error(404)
                return
            body = file.read_bytes()
        with self.lock:
            self.gets[path] = self.gets.get(path, 0) + 1
            held = path in self.hold
            self.hold.discard(path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()[:16]}"')
        self.end_headers()
        try:
            if held:
                self._send(path, body[: len(body) // 2])
                self.started.set()
                self.release.wait(WAIT)
                body = body[len(body) // 2 :]
            self._send(path, body)
        except OSError:
            pass  # the reader was killed

    def _send(self, path: str, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()
        with self.lock:
            self.sent[path] = self.sent.get(path, 0) + len(data)


@pytest.fixture
def store(tmp_path):
    """A factory: store(root) -> (base URL, its handler class with the counts)."""
    servers = Servers()

    def serve(root: Path):
        handler = type(
            "TestStore",
            (Store,),
            {
                "root": root.resolve(),
                "extra": {},
                "sent": {},
                "gets": {},
                "hold": set(),
                "started": threading.Event(),
                "release": threading.Event(),
            },
        )
        return servers.start(handler, on_close=handler.release.set), handler

    with servers:
        yield serve


def tar_bytes(sent: dict[str, int]) -> int:
    return sum(n for path, n in sent.items() if path.endswith(".tar"))


def access(folder: Path, limit: int | None = None) -> opener.Access:
    return opener.Access(cache_dir=str(folder), cache_limit=limit, http_retry_s=0)


def read_all(url: str, folder: Path, limit: int | None = None, start: int = 0, span=None) -> bytes:
    with opener.open_shard(url, access(folder, limit), start=start, span=span) as stream:
        return stream.read()


def since(before: cache.Counts) -> dict[str, int]:
    now = cache.counts()
    return {name: getattr(now, name) - getattr(before, name) for name in CACHE_COUNTS}


def held_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".data" or ".part-" in p.name)


# ---------------------------------------------------------------- 1. a node's ranks, two runs


@pytest.mark.slow  # two jobs of two ranks
def test_two_ranks_two_epochs_fetch_each_shard_once_and_a_second_run_fetches_none(tmp_path, store):
    train = write_tiny_shards(tmp_path / "data" / "train", [24] * 4, "train", size=32)
    val = write_tiny_shards(tmp_path / "val", [8, 8], "val", size=32)
    dataset = sum(p.stat().st_size for p in train.parent.glob("*.tar"))
    base, counts = store(tmp_path / "data")
    spec = f"{base}/train/train.index.json"
    folder = tmp_path / "cache"
    for run, limit in (("first", dataset * 1.05), ("second", 0)):
        extra = ("loader.mode=epoch", "trainer.epochs=2", f"loader.cache_dir={folder}", "trainer.ckpt_every=0")
        proc = ranks(2, *overrides({"train": spec, "val": str(val)}, tmp_path / run, *extra))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "shard cache" not in proc.stderr  # no warning: the cache took every shard
        sent = tar_bytes(counts.sent)
        assert sent <= limit, f"{run} run: the store sent {sent} shard bytes, the data set is {dataset}"
        counts.sent.clear()
        # What the trainer reports: every rank's cache counts summed, in summary.json and the done line.
        reported = json.loads((tmp_path / run / "summary.json").read_text())["cache"]
        fetched = reported["fetched_bytes"]
        # Each shard fetched once: by its worker's open (a miss) or by read-ahead before it (ahead).
        assert (reported["misses"] + reported["ahead"], fetched) == ((4, sent) if run == "first" else (0, 0)), reported
        assert reported["hits"] >= (4 if run == "first" else 8) and reported["corrupt"] == reported["bypassed"] == 0
        assert (
            f"node cache: {reported['hits']} hits, {reported['misses']} misses, {fetched / 1e6:.1f} MB"
            in (tmp_path / run / "train.log").read_text()
        )
    assert len(list(folder.glob("*.data"))) == 4


# ---------------------------------------------------------------- 2. concurrent readers


def _read_in_child(url: str, folder: str, go, out) -> None:
    go.wait(WAIT)
    data = read_all(url, Path(folder))
    out.put((hashlib.sha256(data).hexdigest(), cache.counts().misses, cache.counts().hits))


def test_concurrent_readers_of_one_shard_cause_one_download(tmp_path, store):
    write_tiny_shards(tmp_path / "data", [12], "s")
    base, counts = store(tmp_path / "data")
    url, path = f"{base}/s-000000.tar", "/s-000000.tar"
    counts.hold.add(path)  # the first download waits half-way, so the others meet it in flight
    go, out = FORK.Barrier(5), FORK.Queue()
    readers = [FORK.Process(target=_read_in_child, args=(url, str(tmp_path / "cache"), go, out)) for _ in range(4)]
    for reader in readers:
        reader.start()
    go.wait(WAIT)  # all four start together
    assert counts.started.wait(WAIT)
    counts.release.set()
    results = [out.get(timeout=WAIT) for _ in readers]
    for reader in readers:
        reader.join(WAIT)
    expected = hashlib.sha256((tmp_path / "data" / "s-000000.tar").read_bytes()).hexdigest()
    assert [r[0] for r in results] == [expected] * 4
    assert sorted((r[1], r[2]) for r in results) == [(0, 1), (0, 1), (0, 1), (1, 0)]
    assert counts.gets[path] == 1 and counts.sent[path] == len((tmp_path / "data" / "s-000000.tar").read_bytes())


# ---------------------------------------------------------------- 3. damaged entries


def test_a_truncated_or_unlabelled_entry_is_fetched_again_and_counted(tmp_path, store):
    write_tiny_shards(tmp_path / "data", [12], "s")
    base, counts = store(tmp_path / "data")
    url, folder = f"{base}/s-000000.tar", tmp_path / "cache"
    whole = (tmp_path / "data" / "s-000000.tar").read_bytes()
    before = cache.counts()
    assert read_all(url, folder) == whole
    [data] = folder.glob("*.data")
    meta = data.with_suffix(".meta").read_text()
    assert f'"size": {len(whole)}' in meta and '"etag"' in meta
    os.truncate(data, len(whole) // 2)  # cut short: a crash, a full disk, a person
    assert read_all(url, folder, start=512) == whole[512:]
    data.with_suffix(".meta").unlink()  # a file without its sidecar: nobody can say it is whole
    assert read_all(url, folder) == whole
    assert read_all(url, folder) == whole  # and now it is used
    assert since(before) | {"fetched_bytes": 0} == {
        "hits": 1,
        "misses": 3,
        "fetched_bytes": 0,
        "evicted_bytes": 0,
        "corrupt": 2,
        "bypassed": 0,
        "ahead": 0,
        "ahead_failed": 0,
    }
    assert since(before)["fetched_bytes"] == 3 * len(whole) == counts.sent["/s-000000.tar"]


# ---------------------------------------------------------------- 4. the limit


def test_eviction_keeps_the_folder_under_the_limit_and_never_removes_an_open_file(tmp_path, store):
    index = write_tiny_shards(tmp_path / "data", [6] * 6, "s")
    base, _ = store(tmp_path / "data")
    urls = [f"{base}/s-{i:06d}.tar" for i in range(6)]
    size = max(p.stat().st_size for p in index.parent.glob("*.tar"))
    limit, folder = 2 * size + size // 2, tmp_path / "cache"  # room for two entries
    before = cache.counts()
    first = opener.open_shard(urls[0], access(folder, limit))
    [entry] = folder.glob("*.data")
    for url in urls[1:5]:
        os.utime(entry, (1, 1))  # the least recently used of all, and open
        read_all(url, folder, limit)
        assert held_bytes(folder) <= limit
        assert entry.exists()
    assert first.read() == (index.parent / "s-000000.tar").read_bytes()  # read to the end after all that
    first.close()
    read_all(urls[5], folder, limit)
    assert not entry.exists() and held_bytes(folder) <= limit
    assert len(list(folder.glob("*.data"))) == 2
    counted = since(before)
    assert counted["misses"] == 6 and counted["evicted_bytes"] >= 3 * min(
        p.stat().st_size for p in index.parent.glob("*.tar")
    )


def test_a_hit_marks_its_entry_used_and_a_shard_over_the_limit_goes_to_the_store(tmp_path, store, capsys):
    write_tiny_shards(tmp_path / "data", [6, 6], "s")
    base, counts = store(tmp_path / "data")
    folder = tmp_path / "cache"
    read_all(f"{base}/s-000000.tar", folder)
    [entry] = folder.glob("*.data")
    os.utime(entry, (1, 1))
    read_all(f"{base}/s-000000.tar", folder)
    assert entry.stat().st_mtime > 1
    small, before = tmp_path / "small", cache.counts()
    whole = (tmp_path / "data" / "s-000001.tar").read_bytes()
    for _ in range(3):
        assert read_all(f"{base}/s-000001.tar", small, limit=len(whole) - 1) == whole
    assert since(before)["bypassed"] == 3 and not list(small.glob("*.data"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "shard cache" in line]
    assert len(warnings) == 1 and "more than loader.cache_limit" in warnings[0]


# ---------------------------------------------------------------- 5. when the cache cannot take a shard


def test_an_unwritable_cache_folder_leaves_the_shards_to_the_store_with_one_line(tmp_path, store, capsys):
    write_tiny_shards(tmp_path / "data", [6, 6, 6, 6], "s")
    base, counts = store(tmp_path / "data")
    (tmp_path / "blocker").write_text("a file where the cache's parent folder should be")
    config = cfg(cache_dir=str(tmp_path / "blocker" / "cache"), workers=2)
    batches = list(Loader(f"{base}/s.index.json", config, rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 24
    assert {p for p in counts.gets if p.endswith(".tar")} == {f"/s-{i:06d}.tar" for i in range(4)}
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot be written (NotADirectoryError" in warnings[0]


def test_a_full_disk_leaves_the_shards_to_the_store_with_one_line(tmp_path, store, capsys, monkeypatch):
    write_tiny_shards(tmp_path / "data", [6, 6, 6, 6], "s")
    base, _ = store(tmp_path / "data")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cachefiles, "write_part", full)
    cache.take_counts()  # what earlier tests in this process did is not this loader's
    before = cache.counts()
    folder = tmp_path / "cache"
    batches = list(Loader(f"{base}/s.index.json", cfg(cache_dir=str(folder)), rank=0, world=1))
    assert sum(len(b["label"]) for b in batches) == 24
    assert sum(b["cache"] for b in batches).tolist() == [0, 0, 0, 0, 0, 4, 0, 0]  # the counts ride on the batches
    assert since(before)["bypassed"] == 4
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "its disk is full (OSError: No space left on device)" in warnings[0]
    assert sorted(p.name for p in folder.iterdir() if ".part-" in p.name or p.suffix == ".data") == []


# ---------------------------------------------------------------- 6. names


def test_a_hostile_name_stays_inside_the_cache_and_equal_base_names_are_two_entries(tmp_path, store):
    write_tiny_shards(tmp_path / "data", [6], "s")
    base, counts = store(tmp_path / "data")
    whole = (tmp_path / "data" / "s-000000.tar").read_bytes()
    hostile = ["/..%2F..%2F..%2Fescaped.tar", "/a/b/../../../escaped.tar", "/x/%2E%2E"]
    for path in hostile + ["/bucket-a/train.tar", "/bucket-b/train.tar"]:
        counts.extra[path] = whole
    folder = tmp_path / "deep" / "cache"
    for path in hostile + ["/bucket-a/train.tar", "/bucket-b/train.tar"]:
        assert read_all(base + path, folder) == whole
    assert [p for p in tmp_path.rglob("*escaped*") if p.parent != folder] == []
    assert [p for p in (tmp_path / "deep").rglob("*") if p.parent != folder and p != folder] == []
    assert all(NAME.fullmatch(p.name) for p in folder.iterdir()), sorted(p.name for p in folder.iterdir())
    assert len(list(folder.glob("*.data"))) == 5
    names = [cache.entry_name(f"s3://{b}/train-000000.tar") for b in ("one", "two")]
    assert names[0] != names[1] and all(n.endswith("-train-000000.tar") for n in names)
    assert "/" not in cache.entry_name("http://h/../..") and cache.entry_name("http://h/../..")[32:] == "-.."


# ---------------------------------------------------------------- 7. a downloader killed mid-file


def _download_in_child(url: str, folder: str, wrote, span) -> None:
    write = cachefiles.write_part

    def signalled(fd, data):
        write(fd, data)
        wrote.set()

    cachefiles.write_part = signalled
    read_all(url, Path(folder), start=span[0] if span else 0, span=span)


@pytest.mark.parametrize("span", [None, (1000, None)], ids=["whole", "span"])
def test_a_downloader_killed_mid_file_leaves_the_cache_usable_and_its_part_is_cleared(tmp_path, store, span):
    # Larger than a copy's read (cachefiles.CHUNK), so the first half reaches the part file on its own.
    shard = tmp_path / "data" / "big.tar"
    shard.parent.mkdir()
    shard.write_bytes(os.urandom(3 * cachefiles.CHUNK))
    base, counts = store(tmp_path / "data")
    url, path, folder = f"{base}/big.tar", "/big.tar", tmp_path / "cache"
    counts.hold.add(path)
    wrote = FORK.Event()
    child = FORK.Process(target=_download_in_child, args=(url, str(folder), wrote, span))
    child.start()
    assert wrote.wait(WAIT)  # half the shard is in its part file, and its locks are held
    [part] = [p for p in folder.iterdir() if ".part-" in p.name]
    assert part.name.endswith(f".part-{child.pid}")
    os.kill(child.pid, signal.SIGKILL)
    child.join(WAIT)
    counts.release.set()
    before = cache.counts()
    lo = span[0] if span else 0
    assert read_all(url, folder, start=lo, span=span) == shard.read_bytes()[lo:]
    assert not part.exists() and not [p for p in folder.iterdir() if ".part-" in p.name]
    assert since(before)["misses"] == 1 and counts.gets[path] == 2


# ---------------------------------------------------------------- 8. span entries: a node's part of a shard


@pytest.mark.parametrize("ranged", [True, False], ids=["store-honours-range", "store-ignores-range"])
def test_a_span_entry_fetches_only_its_bytes_once_and_serves_every_read_inside_it(tmp_path, store, ranged):
    """loader.shard_order=node keeps a node's part of a shard another node reads the rest of as a
    span entry: one ranged request for exactly its bytes (a store that ignores Range is read from
    its start, and only the span kept), every later read inside the span a hit, and the object's
    other spans and the whole object entries of their own."""
    shard = tmp_path / "data" / "part.tar"
    shard.parent.mkdir()
    data = os.urandom(50_000)
    shard.write_bytes(data)
    servers = Servers()
    with servers:
        if ranged:
            handler, sent = counting_store(shard.parent)
            base = servers.start(handler)
        else:
            base, counts = store(shard.parent)
            sent = counts.sent
        _read_spans(f"{base}/part.tar", tmp_path / "cache", data, sent if ranged else None)


def _read_spans(url: str, folder: Path, data: bytes, sent: dict | None) -> None:
    before = cache.counts()
    span = (10_000, 30_000)
    assert read_all(url, folder, start=12_345, span=span) == data[12_345:30_000]
    assert read_all(url, folder, start=10_000, span=span) == data[10_000:30_000]
    got = since(before)
    assert (got["misses"], got["hits"], got["fetched_bytes"]) == (1, 1, 20_000)
    [entry] = folder.glob("*.data")
    assert entry.name.endswith("-part.tar.10000-30000.data") and entry.stat().st_size == 20_000
    meta = json.loads(entry.with_suffix(".meta").read_text())
    assert (meta["url"], meta["size"], meta["range"]) == (url, 20_000, [10_000, 30_000])
    assert read_all(url, folder, start=40_000, span=(30_000, None)) == data[40_000:]  # to the end: its own entry
    assert read_all(url, folder) == data  # and the whole object another
    assert sorted(p.stat().st_size for p in folder.glob("*.data")) == [20_000, 20_000, 50_000]
    if sent is not None:
        assert sent["/part.tar"] == 20_000 + 20_000 + 50_000  # each entry's bytes, once
    with pytest.raises(ValueError, match="lies before the span"):
        read_all(url, folder, start=5, span=span)


@pytest.mark.parametrize("ranged", [True, False], ids=["store-honours-range", "store-ignores-range"])
def test_a_span_past_the_objects_end_reserves_only_what_the_store_sends(tmp_path, store, ranged):
    """An index's offsets are the data's word: a span whose end lies far past the object (a stale
    or hostile index) is held to what the store answers, so it neither evicts entries for room
    it never fills nor fails a read that the store serves."""
    folder = tmp_path / "data"
    folder.mkdir()
    data, kept = os.urandom(50_000), os.urandom(30_000)
    (folder / "part.tar").write_bytes(data)
    (folder / "kept.tar").write_bytes(kept)
    servers = Servers()
    with servers:
        base = servers.start(counting_store(folder)[0]) if ranged else store(folder)[0]
        cache_dir, limit = tmp_path / "cache", 1_000_000 + 40_000
        assert read_all(f"{base}/kept.tar", cache_dir, limit) == kept
        span = (10_000, 10_000 + 1_000_000)
        assert read_all(f"{base}/part.tar", cache_dir, limit, start=10_000, span=span) == data[10_000:]
        assert read_all(f"{base}/part.tar", cache_dir, limit, start=20_000, span=span) == data[20_000:]
    assert sorted(p.stat().st_size for p in cache_dir.glob("*.data")) == [30_000, 40_000]


def test_a_part_left_by_a_dead_process_is_cleared_when_the_next_process_starts(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    stale = folder / f"{'0' * 32}-x.tar.part-999999"
    stale.write_bytes(b"x" * 1000)
    cache.NodeCache(str(folder), 10_000)
    assert not stale.exists()


def test_local_shards_are_read_where_they_are_even_with_a_cache_folder(tmp_path):
    """The cache is for remote shards only: a local file is never copied into it, and the batches
    are those of a loader without it (the cache costs local shards nothing)."""
    index = write_tiny_shards(tmp_path / "local", [6, 5, 7], "local")
    folder = tmp_path / "cache"
    plain = Loader(str(index), cfg(mode="epoch"))
    cached = Loader(str(index), cfg(mode="epoch", cache_dir=str(folder)))
    assert [b["key"] for b in cached] == [b["key"] for b in plain]
    assert not [p for p in folder.rglob("*") if p.is_file() and p.name != "cache.lock"]
