"""What an index or a server can make the loader open, and how long it can hold it: hostile
indexes (served and local) run nothing and reach nothing outside their place, bad entries are
one line naming them, and a dripping, redirecting or oversized server is a named failure."""

from __future__ import annotations

import functools
import http.server
import json
import threading
import time

import pytest

from tests.conftest import one_error_line, run_script, write_tiny_shards
from tests.helpers.loading import Quiet, cfg, keys_and_bad
from tests.helpers.simdist import simdist as simdist_script
from tests.helpers.training import overrides
from wdsdist.data.delivery.pipeline import make_eval_loader
from wdsdist.data.sources import shardspec
from wdsdist.errors import DataError, UserError

DRIP_INTERVAL = 0.02  # seconds between the bytes a dripping server sends
DRIP_TIMEOUT = 0.5  # http_timeout in the drip tests: each byte comes well within it
# A drip is a transient failure, retried for data.http_retry_s; these tests are of the first try.
DRIP = {"http_timeout": DRIP_TIMEOUT, "http_retry_s": 0}


class _Hostile(Quiet):
    """Serves its folder, plus a few misbehaving paths."""

    def do_GET(self):
        if self.path == "/drip.tar":  # a well-formed reply whose body comes one byte at a time
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self._drip(b"\0" * 1000)
        elif self.path == "/drip-headers.tar":  # headers one byte at a time, never finished
            self.wfile.write(b"HTTP/1.0 200 OK\r\n")
            self._drip(b"X-Slow: " + b"a" * 1000)
        elif self.path.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/redirect/"))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/endless.index.json":  # no Content-Length, more bytes than any limit
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"shardlist": [' + b" " * 100_000)
        else:
            super().do_GET()

    def _drip(self, data: bytes) -> None:
        # Stops when the client hangs up (or after 20 s, so no thread outlives a broken test).
        try:
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(DRIP_INTERVAL)
        except OSError:
            pass


@pytest.fixture
def served(tmp_path):
    """A folder of three tiny shards (and room for indexes) behind a misbehaving server."""
    index = write_tiny_shards(tmp_path / "www", [6, 6, 6], "tiny")
    handler = functools.partial(_Hostile, directory=str(index.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", index.parent
    server.shutdown()
    server.server_close()


def write_index(path, *entries) -> str:
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": list(entries)}))
    return str(path)


# ---------------------------------------------------------------- what an index may name


def hostile_entries(marker):
    return {
        "pipe": f"pipe:id > {marker}; cat x.tar",
        "absolute": "/etc/passwd",
        "dotdot": "../tiny-000000.tar",
        "dotdot-inside-a-path": "sub/../../tiny-000000.tar",
        "other-origin": "http://127.0.0.1:9/tiny-000000.tar",
        "protocol-relative": "//127.0.0.1:9/tiny-000000.tar",
        "file-url": "file:///etc/passwd",
    }


@pytest.mark.parametrize(
    "where,kind",
    [("served", kind) for kind in hostile_entries("m")]
    + [("local", kind) for kind in hostile_entries("m") if kind != "other-origin"],  # a local index may name URLs
)
def test_a_hostile_index_entry_is_refused_naming_it_and_runs_nothing(served, tmp_path, where, kind):
    base, folder = served
    marker = tmp_path / "PWNED"
    url = hostile_entries(marker)[kind]
    good = {"url": "tiny-000000.tar", "nsamples": 6}
    (folder / "sub").mkdir()
    (folder / "sub" / "tiny-000000.tar").write_bytes((folder / "tiny-000000.tar").read_bytes())
    index = write_index(folder / "sub" / "hostile.index.json", good, {"url": url, "nsamples": 6})
    spec = f"{base}/sub/hostile.index.json" if where == "served" else index
    # Even with allow_pipe: the user allowed pipe: specs they type, not ones an index brings.
    with pytest.raises(UserError) as err:
        shardspec.expand(spec, access=shardspec.Access(allow_pipe=True))
    assert str(err.value).startswith(f"{spec}: shardlist[1]: refused {url!r}: ")
    assert "data.trust_index=true" in str(err.value)
    assert not marker.exists()


def test_a_served_index_with_a_pipe_entry_stops_train_with_one_line(served, tmp_path):
    base, folder = served
    marker = tmp_path / "PWNED"
    hostile = {"url": f"pipe:id > {marker}; cat x.tar", "nsamples": 6}
    write_index(folder / "train.index.json", hostile, hostile)  # one shard for each of the 2 workers
    shards = {"train": f"{base}/train.index.json", "val": str(folder / "tiny.index.json")}
    proc = run_script("train.py", *overrides(shards, tmp_path / "run", "data.allow_pipe=true"))
    assert not marker.exists()
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: data.train_shards: {base}/train.index.json: shardlist[0]: refused 'pipe:id > {marker}; cat x.tar': "
        "an index may not run a shell command (data.trust_index=true with data.allow_pipe=true allows it)"
    )


def test_relative_entries_of_an_index_stay_usable(served):
    base, folder = served
    write_index(
        folder / "sub.index.json",
        {"url": "./tiny-000000.tar", "nsamples": 6},
        {"url": "a/../tiny-000001.tar", "nsamples": 6},
    )
    remote = shardspec.expand(f"{base}/sub.index.json")
    assert [s.url for s in remote] == [f"{base}/tiny-000000.tar", f"{base}/tiny-000001.tar"]
    same_origin = write_index(folder / "abs.index.json", {"url": f"{base}/tiny-000002.tar", "nsamples": 6})
    assert shardspec.expand(f"{base}/abs.index.json")[0].url == f"{base}/tiny-000002.tar"
    keys, bad = keys_and_bad(make_eval_loader(remote + shardspec.expand(same_origin), 0, 1, cfg()))
    assert len(keys) == 18 and bad == [0, 0]


def test_trust_index_lets_a_legitimate_index_of_absolute_paths_and_pipes_through(served, tmp_path):
    _, folder = served
    entries = [{"url": str(folder / f"tiny-{i:06d}.tar"), "nsamples": 6} for i in range(2)]
    entries.append({"url": f"pipe:cat {folder}/tiny-000002.tar", "nsamples": 6})
    index = write_index(tmp_path / "elsewhere.index.json", *entries)
    with pytest.raises(UserError, match=r"shardlist\[0\]: refused .*: an absolute path"):
        shardspec.expand(index)
    with pytest.raises(
        UserError, match=r"shardlist\[2\]: 'pipe:cat .*': pipe: URLs are refused \(allow_pipe is false\)"
    ):
        shardspec.expand(index, access=shardspec.Access(trust_index=True))
    trusted = cfg(trust_index=True, allow_pipe=True)
    shards = shardspec.expand(index, access=trusted.access)
    assert [s.url for s in shards] == [e["url"] for e in entries]
    keys, bad = keys_and_bad(make_eval_loader(index, 0, 1, trusted))
    assert len(keys) == 18 and bad == [0, 0]


def test_simdist_reads_an_index_outside_its_shards_folder_only_with_trust_index(served, tmp_path, capsys):
    _, folder = served
    output = tmp_path / "idx" / "tiny.index.json"
    output.parent.mkdir()
    proc = run_script("makeshards.py", "--index", f"{folder}/tiny-{{000000..000002}}.tar", "--output", str(output))
    assert proc.returncode == 0, proc.stderr
    assert "names shards outside its folder" in proc.stderr and "data.trust_index=true" in proc.stderr
    args = ["--plan", "--shards", str(output), "--size", "1", "--nworkers", "1"]
    with pytest.raises(UserError, match=r"shardlist\[0\]: refused '\.\./www/tiny-000000\.tar': it leads outside"):
        simdist_script.main(args)
    assert simdist_script.main([*args, "--trust-index"]) == 0
    assert "18 in the data set" in capsys.readouterr().out


# ---------------------------------------------------------------- the index's schema and size


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"url": 12345, "nsamples": 6}, '"url" must be a non-empty string, got 12345'),
        ({"url": "tiny-000000.tar", "nsamples": -40}, '"nsamples" must be an integer >= 0, got -40'),
        ({"url": "tiny-000000.tar"}, 'no "nsamples" in {"url": "tiny-000000.tar"}'),
    ],
)
def test_a_malformed_index_entry_stops_train_with_one_line_naming_it(served, tmp_path, entry, message):
    _, folder = served
    index = write_index(folder / "bad.index.json", {"url": "tiny-000001.tar", "nsamples": 6}, entry)
    shards = {"train": index, "val": str(folder / "tiny.index.json")}
    proc = run_script("train.py", *overrides(shards, tmp_path / "run"))
    assert proc.returncode == 2
    assert one_error_line(proc) == f"error: data.train_shards: {index}: shardlist[1]: {message}"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": true}]}',
            r'shardlist\[0\]: "nsamples" must be an integer >= 0, got true',
        ),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1.5}]}',
            r'shardlist\[0\]: "nsamples" must be an integer >= 0, got 1.5',
        ),
        ('{"shardlist": [{"url": "", "nsamples": 1}]}', r'shardlist\[0\]: "url" must be a non-empty string, got ""'),
        (
            '{"shardlist": [["a.tar", 1]]}',
            r'shardlist\[0\]: must be an object with url and nsamples, got \["a.tar", 1\]',
        ),
        ('{"shardlist": {"url": "a.tar"}}', "not a shard index"),
        ("[1, 2]", "not a shard index"),
        ("{", "not a shard index \\(not JSON"),
        ("[" * 100_000, "not a shard index \\(not JSON"),
        (b"\xff\xfe{}", "cannot read shard index .*utf-8"),
    ],
)
def test_malformed_indexes_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.index.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=message) as err:
        shardspec.expand(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["tiny.index.json", "endless.index.json"])
def test_an_oversized_index_is_refused(served, monkeypatch, name):
    base, folder = served
    monkeypatch.setattr(shardspec, "MAX_INDEX_BYTES", 100)  # tiny.index.json is ~300 bytes
    with pytest.raises(UserError, match=rf"cannot read shard index {base}/{name}: .*more than the limit of 100"):
        shardspec.expand(f"{base}/{name}")
    with pytest.raises(UserError, match="more than the limit of 100 bytes"):
        shardspec.expand(str(folder / "tiny.index.json"))


# ---------------------------------------------------------------- servers that drip or redirect


@pytest.mark.parametrize("path", ["drip.tar", "drip-headers.tar"])
def test_a_dripping_server_fails_its_shard_naming_url_and_reason(served, capfd, path):
    base, _ = served
    slow = f"{base}/{path}"
    shards = [shardspec.Shard(slow, 6), shardspec.Shard(f"{base}/tiny-000000.tar", 6)]
    keys, _ = keys_and_bad(make_eval_loader(shards, 0, 1, cfg(**DRIP)))
    assert sorted(keys) == [f"s{i:07d}" for i in range(6)]  # the good shard, whole (the slow one: a warning)
    err = capfd.readouterr().err
    assert f"warning: skipped: {slow}: cannot read shard: TimeoutError: too slow: " in err
    assert "less than http_min_rate=65536 bytes/s" in err
    with pytest.raises(DataError, match=f"{slow}: cannot read shard: TimeoutError: too slow"):
        list(make_eval_loader(shards, 0, 1, cfg(strict=True, **DRIP)))


def test_a_redirect_off_http_is_refused_naming_it(served, capfd):
    base, _ = served
    to_ftp = f"{base}/redirect/ftp://127.0.0.1:9/tiny-000000.tar"
    to_http = f"{base}/redirect/{base}/tiny-000001.tar"
    shards = [shardspec.Shard(to_ftp, 6), shardspec.Shard(to_http, 6)]
    keys, _ = keys_and_bad(make_eval_loader(shards, 0, 1, cfg()))
    assert sorted(keys) == [f"s{i:07d}" for i in range(6, 12)]  # the http(s) redirect is followed
    err = capfd.readouterr().err
    assert f"{to_ftp}: cannot read shard: URLError: redirect to ftp://127.0.0.1:9/tiny-000000.tar refused" in err
    with pytest.raises(
        UserError, match=r"cannot read shard index .*: redirect to ftp://127.0.0.1:9/x.index.json refused"
    ):
        shardspec.expand(f"{base}/redirect/ftp://127.0.0.1:9/x.index.json")


def test_pipe_specs_need_allow_pipe_which_is_off_by_default(served):
    _, folder = served
    url = f"pipe:cat {folder}/tiny-000000.tar"
    with pytest.raises(UserError, match="pipe: URLs are refused"):
        make_eval_loader(url, 0, 1, cfg())
    keys, _ = keys_and_bad(make_eval_loader(url, 0, 1, cfg(allow_pipe=True)))
    assert len(keys) == 6
