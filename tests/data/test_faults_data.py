"""Bad data never hangs a rank: corrupt, missing and hostile shards are skipped and counted,
or with strict=True stop with an error naming them."""

import functools
import http.server
import os
import struct
import tarfile
import threading
import zlib

import pytest

from tests.conftest import jpeg
from tests.helpers.loading import Quiet, cfg, keys_and_bad
from wdsdist.data.delivery.pipeline import make_eval_loader, make_loader
from wdsdist.data.sources import shardspec
from wdsdist.errors import DataError, UserError


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


@pytest.fixture
def http_root(three_shards):
    handler = functools.partial(Quiet, directory=str(three_shards.parent))
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
    # data.http_retry_s=0: no retry, the shard fails at once (tests/data/sources/test_http_retry.py: the retries).
    with pytest.raises(DataError, match=r"http://127.0.0.1:9/tiny-000000.tar: cannot read shard: URLError"):
        list(make_eval_loader(dead, 0, 1, cfg(strict=True, http_timeout=5, http_retry_s=0)))


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


# ---------------------------------------------------------------- one bad sample never ends a run


def _png(mode: str = "RGB", size: int = 32, seed: int = 0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "LA": 2}.get(mode, 1)
    pixels = rng.integers(0, 256, (size, size, channels) if channels > 1 else (size, size), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(), "L" if mode == "P" else mode)
    if mode == "P":
        image = image.quantize(16)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _flip_idat_byte(png: bytes) -> bytes:
    """One byte of the compressed image data flipped, the chunk's CRC made right again: only the
    zlib check notices (libpng: "IDAT: incorrect data check")."""
    raw = bytearray(png)
    at = raw.index(b"IDAT")
    length = struct.unpack(">I", raw[at - 4 : at])[0]
    raw[at + 4 + length // 2] ^= 0xFF
    raw[at + 4 + length : at + 8 + length] = struct.pack(">I", zlib.crc32(bytes(raw[at : at + 4 + length])))
    return bytes(raw)


def _shard(path, samples) -> str:
    import webdataset as wds

    with wds.TarWriter(str(path)) as w:
        for sample in samples:
            w.write(sample)
    return str(path)


_READ_IN_A_CHILD = """
import sys
from wdsdist.data.sources import shardspec
from wdsdist.data.options import LoaderConfig
from wdsdist.data.delivery.pipeline import make_eval_loader
cfg = LoaderConfig(batch_size=2, workers=int(sys.argv[2]), mode="epoch", image_size=8, with_keys=True,
                   shuffle_buffer=0, image_key="jpg;png")
keys, bad = [], 0
for batch in make_eval_loader([shardspec.Shard(sys.argv[1], 4)], 0, 1, cfg):
    keys += batch["key"]
    bad += int(batch["bad"][:, 0].sum())
print("read", sorted(keys), bad)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_png_with_a_flipped_byte_is_a_skipped_sample_not_a_crash(tmp_path, workers):
    # torchvision's libpng decode segfaults on this file: read in a child, so a crash fails the test.
    from tests.conftest import run_script

    samples = [{"__key__": f"k{i}", "jpg": jpeg(i)[0], "cls": "1"} for i in range(3)]
    samples.insert(1, {"__key__": "broken", "png": _flip_idat_byte(_png()), "cls": "1"})
    shard = _shard(tmp_path / "png.tar", samples)
    proc = run_script("-c", _READ_IN_A_CHILD, shard, str(workers), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "read ['k0', 'k1', 'k2'] 1" in proc.stdout
    assert "png.tar: sample 'broken': cannot decode image" in proc.stderr


@pytest.mark.parametrize("mode", ["RGB", "L", "P", "RGBA", "LA"])
def test_pngs_decode_to_the_pixels_torchvision_gave(mode):
    import torch
    from torchvision.io import ImageReadMode, decode_image

    from wdsdist.data.decode.sample import _decode_other

    data = _png(mode, size=24, seed=3)
    ours = _decode_other(data, "w", 10**9)
    theirs = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    assert ours.dtype == torch.uint8 and ours.shape == (3, 24, 24) and ours.is_contiguous()
    assert torch.equal(ours, theirs)


def test_a_16_bit_png_keeps_its_high_byte():
    import io

    import numpy as np
    from PIL import Image

    from wdsdist.data.decode.sample import _decode_other

    grey = np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    ours = _decode_other(buf.getvalue(), "w", 10**9)
    assert ours.tolist() == [(grey >> 8).tolist()] * 3


def _gif(width: int, height: int, frames: int) -> bytes:
    """A GIF with a width x height canvas and ``frames`` frames of one pixel each (the issue's
    940-byte GIF is _gif(2000, 2000, 40))."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0xF0, 0, 0) + bytes([0, 0, 0, 255, 255, 255]))
    for i in range(frames):
        out += b"\x21\xf9\x04\x04\x0a\x00\x00\x00"  # graphic control: 100 ms
        out += b"\x2c" + struct.pack("<HHHHB", i % width, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return bytes(out + b"\x3b")


def test_an_animation_counts_its_frames_in_the_pixel_budget_and_gives_its_first_frame(tmp_path):
    import io

    from PIL import Image

    # Within the budget: the first frame, as one RGB image.
    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]
    buf = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), c) for c in colours]
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    samples = [
        {"__key__": "anim", "gif": buf.getvalue(), "cls": "1"},
        {"__key__": "many", "gif": _gif(100, 100, 40), "cls": "2"},  # 100x100 x 40 frames > 100000 pixels
        *({"__key__": f"k{i}", "jpg": jpeg(i)[0], "cls": "3"} for i in range(3)),
    ]
    shard = [shardspec.Shard(_shard(tmp_path / "gif.tar", samples), 5)]
    loader = make_eval_loader(shard, 0, 1, cfg(image_key="jpg;gif", max_pixels=100_000))
    batches = list(loader)
    keys = [k for b in batches for k in b["key"]]
    assert keys == ["anim", "k0", "k1", "k2"]
    first = batches[0]["image"][0]
    assert first.shape == (3, 8, 8) and first[:, 0, 0].tolist() == list(colours[0])
    assert sum(int(b["bad"][:, 0].sum()) for b in batches) == 1
    with pytest.raises(DataError, match=r"'many': image of 100x100 pixels x 40 frames exceeds max_pixels=100000"):
        list(make_eval_loader(shard, 0, 1, cfg(image_key="jpg;gif", max_pixels=100_000, strict=True)))


def test_an_oversized_member_is_a_skipped_sample_and_the_next_ones_follow(tmp_path):
    samples = [
        {"__key__": "k0", "jpg": jpeg(0)[0], "cls": "1"},
        {"__key__": "huge", "jpg": b"\xff\xd8\xff" + bytes(10_000), "cls": "1"},
        *({"__key__": f"k{i}", "jpg": jpeg(i)[0], "cls": "1"} for i in (1, 2)),
    ]
    shard = [shardspec.Shard(_shard(tmp_path / "big.tar", samples), 4)]
    keys, bad = keys_and_bad(make_eval_loader(shard, 0, 1, cfg(max_member_bytes=8192)))
    assert keys == ["k0", "k1", "k2"] and bad == [1, 0]
    with pytest.raises(DataError, match=r"big.tar: sample 'huge': image of 10003 bytes exceeds max_member_bytes=8192"):
        list(make_eval_loader(shard, 0, 1, cfg(max_member_bytes=8192, strict=True)))


def test_a_negative_member_size_skips_the_rest_of_its_shard_only(three_shards, tmp_path):
    from tests.helpers.shards import pax_record, raw_member

    members = [raw_member(f"e{i}.{ext}", data) for i in range(4) for ext, data in (("jpg", jpeg(i)[0]), ("cls", b"1"))]
    evil = raw_member("././@PaxHeader", pax_record("size", "-1"), tarfile.XHDTYPE) + raw_member("evil.jpg", b"")
    (tmp_path / "evil.tar").write_bytes(b"".join(members) + evil + bytes(1 << 20))
    # In this order the epoch's shuffle reads the bad shard first: its count rides on a later sample.
    shards = [
        shardspec.Shard(str(three_shards.parent / "tiny-000000.tar"), 6),
        shardspec.Shard(str(tmp_path / "evil.tar"), 5),
    ]
    keys, bad = keys_and_bad(make_eval_loader(shards, 0, 1, cfg()))
    # The good shard whole, the samples before the bad header (but the last: its group never closed).
    assert sorted(keys) == ["e0", "e1", "e2"] + [f"s{i:07d}" for i in range(6)]
    assert bad == [0, 1]
    with pytest.raises(DataError, match=r"evil.tar: cannot read shard: ReadError: evil.jpg: negative size -1"):
        list(make_eval_loader(shards, 0, 1, cfg(strict=True)))


def test_a_label_outside_num_classes_is_a_skipped_sample(tmp_path):
    samples = [{"__key__": f"k{i}", "jpg": jpeg(i)[0], "cls": str(label)} for i, label in enumerate([0, 10, 9, -1, 3])]
    shard = [shardspec.Shard(_shard(tmp_path / "labels.tar", samples), 5)]
    keys, bad = keys_and_bad(make_eval_loader(shard, 0, 1, cfg(num_classes=10)))
    assert keys == ["k0", "k2", "k4"] and bad == [2, 0]
    with pytest.raises(DataError, match=r"labels.tar: sample 'k1': label 10 is outside 0..9 \(num_classes=10\)"):
        list(make_eval_loader(shard, 0, 1, cfg(num_classes=10, strict=True)))


def test_a_bad_shard_read_on_every_pass_is_named_in_each_batch_that_counts_it(three_shards):
    folder = three_shards.parent
    (folder / "tiny-000002.tar").write_bytes(b"not a tar" * 100)
    bad_url = str(folder / "tiny-000002.tar")
    loader = make_loader(str(three_shards), 0, 1, cfg(mode="repeat", with_keys=False))
    reads, named = 0, []
    for _, batch in zip(range(12), loader, strict=False):  # 12 batches of 4: 4 passes over 12 good samples
        reads += int(batch["bad"][:, 1].sum())
        named += batch["bad_shards"]
    assert reads >= 3 and named == [bad_url] * reads
