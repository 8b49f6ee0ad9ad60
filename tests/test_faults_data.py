"""Bad data never hangs a rank: corrupt, missing and hostile shards are skipped and counted,
or with strict=True stop with an error naming them."""

import functools
import http.server
import os
import struct
import threading
import zlib

import pytest

from tests.conftest import jpeg
from wdsdist import shardspec
from wdsdist.errors import UserError
from wdsdist.pipeline import DataError, LoaderConfig, make_eval_loader, make_loader


def cfg(**kw):
    base = dict(batch_size=4, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=0)
    return LoaderConfig(**(base | kw))


def keys_and_bad(loader):
    keys, bad = [], [0, 0]
    for b in loader:
        keys += b["key"]
        bad[0] += int(b["bad"][:, 0].sum())
        bad[1] += int(b["bad"][:, 1].sum())
    return keys, bad


@pytest.fixture
def three_shards(tiny_shards):
    return tiny_shards([6, 6, 6])


def test_truncated_and_garbage_shards_are_skipped_and_counted(three_shards, capfd):
    folder = three_shards.parent
    data = (folder / "tiny-000001.tar").read_bytes()
    (folder / "tiny-000001.tar").write_bytes(data[: len(data) // 2 + 100])  # cut mid-member
    (folder / "tiny-000002.tar").write_bytes(os.urandom(5000))
    # Order the shards so the broken ones come first and their counts ride on later samples.
    shards = [shardspec.Shard(str(folder / f"tiny-{i:06d}.tar"), 6) for i in (1, 2, 0)]
    keys, bad = keys_and_bad(make_eval_loader(shards, 0, 1, cfg()))
    assert set(f"s{i:07d}" for i in range(6)) <= set(keys)  # the good shard, whole
    assert 6 <= len(keys) < 12  # part of the truncated one
    assert bad[1] == 2  # two shards failed
    err = capfd.readouterr().err
    assert "tiny-000001.tar: cannot read shard" in err and "tiny-000002.tar: cannot read shard" in err
    with pytest.raises(DataError, match="tiny-00000[12].tar: cannot read shard"):
        list(make_eval_loader(shards, 0, 1, cfg(strict=True)))


def test_missing_shard_warns_or_in_strict_mode_stops(three_shards, capfd):
    folder = three_shards.parent
    os.remove(folder / "tiny-000001.tar")
    spec = f"{folder}/tiny-{{000000..000002}}.tar"
    with pytest.raises(UserError, match=r"1 of 3 shards do not exist, first .*tiny-000001.tar"):
        make_loader(spec, 0, 1, cfg(mode="repeat", strict=True))
    loader = make_loader(spec, 0, 1, cfg(mode="repeat"))
    assert "tiny-000001.tar; going on without them" in capfd.readouterr().err
    assert len(next(iter(loader))["key"]) == 4
    # A missing shard listed in an index fails when opened: skipped and counted.
    index_shards = shardspec.expand(str(three_shards))
    keys, bad = keys_and_bad(make_eval_loader(index_shards[1:2] + index_shards[::2], 0, 1, cfg()))
    assert len(keys) == 12 and bad[1] == 1


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(three_shards):
    handler = functools.partial(_Quiet, directory=str(three_shards.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_shards_read_and_a_dead_server_fails_fast(http_root):
    keys, _ = keys_and_bad(make_eval_loader(shardspec.expand(f"{http_root}/tiny-{{000000..000002}}.tar"), 0, 1, cfg()))
    assert len(keys) == 18
    dead = [shardspec.Shard("http://127.0.0.1:9/tiny-000000.tar", 6)]
    with pytest.raises(DataError, match=r"http://127.0.0.1:9/tiny-000000.tar: cannot read shard: URLError"):
        list(make_eval_loader(dead, 0, 1, cfg(strict=True, http_timeout=5)))


def test_shell_metacharacters_in_an_http_url_are_never_run(http_root, tmp_path):
    marker = tmp_path / "pwned"
    url = f"{http_root}/tiny-000000.tar;touch {marker};$(touch {marker})`touch {marker}`"
    loader = make_eval_loader([shardspec.Shard(url, 6)], 0, 1, cfg())
    with pytest.raises(DataError, match="read no sample"):
        list(loader)
    assert not marker.exists()


def test_pipe_urls_run_only_when_allowed(three_shards, tmp_path):
    url = f"pipe:cat {three_shards.parent}/tiny-000000.tar"
    keys, _ = keys_and_bad(make_eval_loader([shardspec.Shard(url, 6)], 0, 1, cfg(allow_pipe=True)))
    assert len(keys) == 6
    with pytest.raises(UserError, match=r"pipe:cat .*: pipe: URLs are refused \(allow_pipe is false\)"):
        make_eval_loader([shardspec.Shard(url, 6)], 0, 1, cfg(allow_pipe=False))
    with pytest.raises(UserError, match="pipe: URLs are refused"):
        make_loader(f"{three_shards.parent}/tiny-000000.tar::{url}", 0, 1, cfg(mode="repeat", allow_pipe=False))


def _png_declaring(width, height):
    """A tiny PNG whose header claims width x height pixels (its data is a few bytes)."""

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decompression_bomb_is_a_corrupt_sample_not_an_allocation(tmp_path):
    import webdataset as wds

    path = tmp_path / "bomb.tar"
    with wds.TarWriter(str(path)) as w:
        w.write({"__key__": "bomb", "png": _png_declaring(100_000, 100_000), "cls": "1"})
        w.write({"__key__": "fine", "jpg": jpeg(1)[0], "cls": "2"})
    keys, bad = keys_and_bad(make_eval_loader([shardspec.Shard(str(path), 2)], 0, 1, cfg()))
    assert keys == ["fine"] and bad == [1, 0]
    with pytest.raises(DataError, match=r"'bomb': .*(100000x100000 pixels exceeds max_pixels|decompression bomb)"):
        list(make_eval_loader([shardspec.Shard(str(path), 2)], 0, 1, cfg(strict=True)))
