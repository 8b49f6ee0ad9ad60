"""Region decoding (wdsdist/jpegcrop): the crop's pixels equal a whole decode's, the random draws
are torchvision's, and whatever libjpeg refuses goes back to torchvision's whole decode."""

from __future__ import annotations

import functools
import io
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from tests.conftest import ROOT, run_script, write_tiny_shards
from tests.helpers.jpegs import LIB, encode, first_batches, needs_lib, whole
from wdsdist.data.decode import jpegcrop
from wdsdist.data.decode.jpegcrop import CropDecoder, JpegError, crop_decoder, region
from wdsdist.data.decode.sample import decode_sample, make_transform
from wdsdist.data.options import LoaderConfig
from wdsdist.errors import DataError

# Only a machine without a C compiler or libjpeg's headers and library may skip these; any other
# build failure is a failure (test_it_builds_wherever_a_compiler_and_libjpeg_are).
MISSING = isinstance(LIB, str) and any(s in LIB for s in ("no C compiler", "jpeglib.h", "-ljpeg"))


def test_it_builds_wherever_a_compiler_and_libjpeg_are():
    assert not isinstance(LIB, str) or MISSING, LIB


ENCODINGS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(progressive=True),
    "grayscale": dict(mode="L"),
}


@needs_lib
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_region_pixels_equal_a_whole_decode(encoding):
    width, height = 203, 157  # neither a multiple of 8 nor of 16
    data = encode(width, height, seed=3, **ENCODINGS[encoding])
    full = whole(data).permute(1, 2, 0)  # HWC, as region() gives
    rng = random.Random(0)
    regions = [(0, 0, width, height), (0, 0, 1, 1), (width - 1, height - 1, 1, 1), (0, 50, 17, 9)]
    regions += [(width - 33, 0, 33, height), (16, 16, 16, 16), (15, 17, 100, 40)]
    for _ in range(40):
        w, h = rng.randint(1, width), rng.randint(1, height)
        regions.append((rng.randint(0, width - w), rng.randint(0, height - h), w, h))
    for x, y, w, h in regions:
        got = region(LIB, data, x, y, w, h)
        assert got.shape == (h, w, 3)
        assert torch.equal(got, full[y : y + h, x : x + w]), f"{encoding}: region {w}x{h}+{x}+{y}"


@needs_lib
def test_region_outside_the_image_is_an_error_not_a_read_past_it():
    data = encode(64, 48)
    for x, y, w, h in [(60, 0, 5, 5), (0, 44, 5, 5), (-1, 0, 5, 5), (0, 0, 0, 5)]:
        with pytest.raises(JpegError, match="outside the 64x48 image"):
            region(LIB, data, x, y, w, h)


@needs_lib
def test_crop_decoder_gives_the_transforms_own_images():
    """Same seed, same image: the draws are v2.RandomResizedCrop's and v2.RandomHorizontalFlip's,
    the pixels those of the whole decode cropped, resized and flipped."""
    cfg = LoaderConfig(batch_size=4, image_size=48, crop_scale=(0.08, 1.0))
    transform = make_transform(cfg)
    decoder = crop_decoder(transform, downscale=False)
    assert isinstance(decoder, CropDecoder)
    for i, (w, h) in enumerate([(120, 90), (90, 120), (203, 157), (64, 64)]):
        data = encode(w, h, seed=i)
        for seed in range(25):
            torch.manual_seed(seed)
            got = decoder(data, w, h, functools.partial(whole, data))
            torch.manual_seed(seed)
            want = transform(whole(data))
            assert got.shape == (3, 48, 48)
            assert torch.equal(got, want), f"image {w}x{h}, seed {seed}"
    # The flip's draw follows the crop's: on these seeds it went both ways.
    outcomes = set()
    for seed in range(25):
        torch.manual_seed(seed)
        transform.transforms[0].make_params([torch.empty(3, 90, 120)])
        outcomes.add(torch.rand(1).item() < 0.5)
    assert outcomes == {True, False}


def test_crop_decoder_only_for_crop_then_flip():
    lib = LIB if not isinstance(LIB, str) else None
    eval_transform = make_transform(LoaderConfig(batch_size=4, train=False))
    assert crop_decoder(eval_transform, downscale=True, lib=lib or "x") is None
    assert crop_decoder(make_transform(LoaderConfig(batch_size=4)), downscale=True, lib="no compiler") is None


@needs_lib
def test_downscale_only_where_the_region_stays_at_least_the_output_size():
    decoder = crop_decoder(make_transform(LoaderConfig(batch_size=4, image_size=224)), downscale=True)
    assert decoder.scale(447, 1000) == 1  # half of 447 < 224: decoded whole
    assert decoder.scale(448, 448) == 2
    assert decoder.scale(900, 1000) == 4
    assert decoder.scale(1792, 1792) == 8
    assert decoder.scale(5000, 1791) == 4
    off = crop_decoder(make_transform(LoaderConfig(batch_size=4, image_size=224)), downscale=False)
    assert off.scale(5000, 5000) == 1


@needs_lib
def test_downscaled_crops_are_close_to_the_whole_decode():
    cfg = LoaderConfig(batch_size=4, image_size=64, crop_scale=(0.5, 1.0))
    transform = make_transform(cfg)
    decoder = crop_decoder(transform, downscale=True)
    data = encode(640, 480, seed=5)
    scaled = 0
    for seed in range(20):
        torch.manual_seed(seed)
        p = transform.transforms[0].make_params([torch.empty(3, 480, 640)])
        scaled += decoder.scale(p["height"], p["width"]) > 1
        torch.manual_seed(seed)
        got = decoder(data, 640, 480, functools.partial(whole, data))
        torch.manual_seed(seed)
        want = transform(whole(data))
        assert got.shape == want.shape == (3, 64, 64)
        diff = (got.float() - want.float()).abs().mean().item()
        assert diff < 4.0, f"seed {seed}: mean difference {diff:.2f} of 255"
    assert scaled == 20  # every crop here is at least 2x the output: all went through DCT scaling


def _outcome(sample, cfg, transform, decoder=None):
    try:
        return decode_sample(sample, cfg, transform, decoder)
    except DataError as exc:
        return str(exc)


@needs_lib
def test_a_jpeg_cut_short_is_judged_by_torchvision_wherever_the_crop_falls():
    """The region decode stops after the crop's last row, so it would take a file cut short
    below the crop; such files go to torchvision's whole decode, whatever it decides."""
    cfg = LoaderConfig(batch_size=4, image_size=32)
    transform = make_transform(cfg)
    decoder = crop_decoder(transform, downscale=True)
    good = encode(300, 200)
    for cut in (0.5, 0.8, 0.95):
        sample = {"__url__": "s.tar", "__key__": "k", "jpg": good[: int(len(good) * cut)], "cls": b"3"}
        assert not decoder.takes(sample["jpg"])
        for seed in range(30):
            torch.manual_seed(seed)
            want = _outcome(sample, cfg, transform)
            torch.manual_seed(seed)
            got = _outcome(sample, cfg, transform, decoder)
            assert type(got) is type(want)
            assert got == want if isinstance(want, str) else torch.equal(got[0], want[0])
    assert decoder.takes(good) and decoder.takes(good + b"\0" * 10)
    garbage = {"__url__": "s.tar", "__key__": "g", "jpg": b"\xff\xd8\xff" + b"\x00" * 100 + b"\xff\xd9", "cls": b"1"}
    with pytest.raises(DataError, match=r"s.tar: sample 'g': cannot decode image"):
        decode_sample(garbage, cfg, transform, decoder)


@needs_lib
def test_a_jpeg_libjpeg_refuses_keeps_the_draws_of_every_later_sample():
    """A CMYK JPEG (libjpeg cannot make RGB of it) is cropped from torchvision's decode with the
    crop already drawn, so it and the samples after it are those of the plain transform."""
    cfg = LoaderConfig(batch_size=4, image_size=32)
    transform = make_transform(cfg)
    decoder = crop_decoder(transform, downscale=False)
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(encode(120, 90, seed=1))).convert("CMYK").save(cmyk, format="JPEG", quality=90)
    datas = [encode(120, 90, seed=2), cmyk.getvalue()] + [encode(120, 90, seed=s) for s in range(3, 8)]
    with pytest.raises(JpegError):
        region(LIB, cmyk.getvalue(), 0, 0, 10, 10)
    samples = [{"__url__": "s.tar", "__key__": str(i), "jpg": d, "cls": b"1"} for i, d in enumerate(datas)]
    for seed in range(5):
        torch.manual_seed(seed)
        want = [decode_sample(s, cfg, transform)[0] for s in samples]
        torch.manual_seed(seed)
        got = [decode_sample(s, cfg, transform, decoder)[0] for s in samples]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"seed {seed}"


@needs_lib
def test_a_jpeg_bomb_is_refused_from_its_header():
    data = bytearray(encode(16, 16))
    sof = data.index(b"\xff\xc0")  # baseline frame header: length(2) precision(1) height(2) width(2)
    data[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    cfg = LoaderConfig(batch_size=4, image_size=32)
    transform = make_transform(cfg)
    decoder = crop_decoder(transform, downscale=True)
    assert decoder.size(bytes(data)) == (60000, 60000)
    sample = {"__url__": "s.tar", "__key__": "bomb", "jpg": bytes(data), "cls": b"1"}
    with pytest.raises(DataError, match=r"'bomb': image of 60000x60000 pixels exceeds max_pixels"):
        decode_sample(sample, cfg, transform, decoder)


@needs_lib
def test_loader_batches_are_the_same_with_and_without_region_decoding(tmp_path):
    index = write_tiny_shards(tmp_path / "s", [40, 40, 40, 40], size=72)
    a = first_batches(index, 12, decode_region=True, decode_downscale=False)
    b = first_batches(index, 12, decode_region=False)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["id"], y["id"])
        assert torch.equal(x["image"], y["image"])


def test_without_the_library_the_loader_says_so_once_and_decodes_whole_images(tmp_path, monkeypatch, capfd):
    index = write_tiny_shards(tmp_path / "s", [40, 40], size=72)
    want = first_batches(index, 4, decode_region=False)
    monkeypatch.setattr(jpegcrop, "load", lambda: "no C compiler (cc) to build jpegcrop.c")
    got = first_batches(index, 4)
    notes = [line for line in capfd.readouterr().err.splitlines() if "jpegcrop" in line]
    assert notes == ["note: no C compiler (cc) to build jpegcrop.c; decoding whole JPEGs (slower)"]
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x["image"], y["image"])


def test_build_failures_say_why(tmp_path):
    assert jpegcrop.load(tmp_path / "a", "no-such-cc") == "no C compiler (no-such-cc) to build jpegcrop.c"
    fake = tmp_path / "fakecc"
    fake.write_text(
        "#!/bin/sh\necho 'In file included from x.c:1:' >&2\n"
        "echo 'x.c:14: fatal error: jpeglib.h: No such file' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    reason = jpegcrop.load(tmp_path / "b", str(fake))
    assert reason == "cannot build jpegcrop.c: x.c:14: fatal error: jpeglib.h: No such file"
    assert list((tmp_path / "b").iterdir()) == []  # no half-written library left behind
    # A linker that fails removes its output itself; its own line, not collect2's, is the reason.
    fake.write_text(
        '#!/bin/sh\nfor a; do [ "$prev" = -o ] && rm -f "$a"; prev=$a; done\n'
        "echo '/usr/bin/ld: cannot find -ljpeg: No such file or directory' >&2\n"
        "echo 'collect2: error: ld returned 1 exit status' >&2\nexit 1\n"
    )
    reason = jpegcrop.load(tmp_path / "c", str(fake))
    assert reason == "cannot build jpegcrop.c: /usr/bin/ld: cannot find -ljpeg: No such file or directory"


@needs_lib
def test_a_fresh_build_dir_gets_a_working_library(tmp_path):
    lib = jpegcrop.load(tmp_path / "fresh")
    assert not isinstance(lib, str), lib
    built = list((tmp_path / "fresh").iterdir())
    assert [p.suffix for p in built] == [".so"]
    assert built[0].stat().st_mode & 0o755 == 0o755  # other users (the Docker image's) load it too
    data = encode(40, 30)
    assert torch.equal(region(lib, data, 5, 5, 10, 10), whole(data).permute(1, 2, 0)[5:15, 5:15])


def test_decode_sample_without_a_decoder_is_unchanged():
    cfg = LoaderConfig(batch_size=4, image_size=16)
    transform = v2.Compose([v2.CenterCrop(16)])
    data = encode(40, 30)
    image, label = decode_sample({"__url__": "u", "__key__": "k", "jpg": data, "cls": b" 7\n"}, cfg, transform)
    assert label == 7 and torch.equal(image, whole(data)[:, 7:23, 12:28])
    assert jpegcrop.JPEG_MAGIC == data[:3]


def _plant_library_without_the_symbol(where) -> str:
    """A loadable shared library in the name jpegcrop builds, without jpegcrop_decode: a damaged
    or foreign file (a copy of Python's own _ctypes extension, so no compiler is needed)."""
    import _ctypes
    import hashlib
    import platform
    import shutil

    tag = hashlib.sha256(jpegcrop.SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:12]
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"jpegcrop-{tag}.so"
    shutil.copyfile(_ctypes.__file__, path)
    return str(path)


def test_a_library_without_the_symbol_is_a_note_and_whole_decodes(tmp_path, monkeypatch, capfd):
    index = write_tiny_shards(tmp_path / "s", [40, 40], size=72)
    want = first_batches(index, 4, decode_region=False)
    planted = _plant_library_without_the_symbol(tmp_path / "build")
    monkeypatch.setenv("WDSDIST_BUILD", str(tmp_path / "build"))
    monkeypatch.setenv("CC", "no-such-cc")  # so it cannot be rebuilt
    got = first_batches(index, 4)
    notes = [line for line in capfd.readouterr().err.splitlines() if "jpegcrop" in line]
    assert notes == [
        f"note: {planted} has no jpegcrop_decode (a damaged or foreign file), and no C compiler (no-such-cc) "
        f"to build jpegcrop.c; decoding whole JPEGs (slower)"
    ]
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x["image"], y["image"])


@needs_lib
def test_a_library_without_the_symbol_is_rebuilt(tmp_path):
    planted = _plant_library_without_the_symbol(tmp_path / "build")
    lib = jpegcrop.load(tmp_path / "build")
    assert not isinstance(lib, str), lib
    data = encode(40, 30)
    assert torch.equal(region(lib, data, 5, 5, 10, 10), whole(data).permute(1, 2, 0)[5:15, 5:15])
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == [os.path.basename(planted)]


def test_a_killed_compiles_temporaries_are_removed_on_the_next_load(tmp_path):
    where = tmp_path / "build"
    where.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = jpegcrop._HOST
    files = {
        f"tmp-{host}-{int(ended.stdout)}-0123abcd.so": False,  # this host, its compiler is gone
        f"tmp-{host}-{os.getpid()}-4567cdef.so": True,  # a live compile's
        "tmp-otherhost-12-89abcdef.so": True,  # another host's, recent: may be live
        "tmp-otherhost-13-0000ffff.so": False,  # another host's, old
        "tmpq8x_2kz1.so": False,  # an earlier version's (mkstemp), old
        "jpegcrop-000000000000.so": True,  # not a temporary
    }
    old = time.time() - 2 * jpegcrop.STALE_TEMP_S
    for name in files:
        (where / name).write_bytes(b"partial")
        if name in ("tmp-otherhost-13-0000ffff.so", "tmpq8x_2kz1.so"):
            os.utime(where / name, (old, old))
    assert jpegcrop.load(where, "no-such-cc") == "no C compiler (no-such-cc) to build jpegcrop.c"
    assert sorted(p.name for p in where.iterdir()) == sorted(name for name, kept in files.items() if kept)


def test_the_module_command_the_image_runs_loads_the_library():
    """Dockerfile and deploy/check-image.sh run `python3 -m wdsdist.tools.jpegcheck` in the
    image: the suite runs it too, so a module that moves fails here, not in a later image check."""
    proc = run_script("-m", "wdsdist.tools.jpegcheck", timeout=120)
    if "no C compiler" in proc.stdout or "headers" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.startswith("jpegcrop loaded: "), proc.stdout + proc.stderr
    for path in ("Dockerfile", "deploy/check-image.sh"):
        assert "-m wdsdist.tools.jpegcheck" in (ROOT / path).read_text(), path
