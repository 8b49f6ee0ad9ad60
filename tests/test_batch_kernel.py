"""The batch kernel (decode/batch.py, jpegcrop_batch in jpegcrop.c): a batch's JPEG crops decoded,
resized and flipped in one native call give torchvision's own pixels, refuse what libjpeg refuses
(the loader then takes torchvision's path), and leave the loader's batches as they were."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from tests.conftest import write_tiny_shards
from tests.helpers.jpegs import LIB, encode, first_batches, needs_lib, whole
from wdsdist.data.decode.batch import RegionJob, render_jobs, rendered
from wdsdist.data.decode.jpegcrop import crop_decoder
from wdsdist.data.sources.index import index_path, write_index

pytestmark = needs_lib

# torch resizes uint8 with integer weights on AVX2 and AVX-512 machines (the kernel's arithmetic,
# so equal pixels); on others in floating point, which may differ by a grey level here and there.
EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def noise_jpeg(width: int, height: int, seed: int) -> bytes:
    """Pure noise: every pixel differs from its neighbours, the hardest case for a resize."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def job(data: bytes, size: int, seed: int, downscale: bool = False) -> RegionJob:
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    crop = crop_decoder(transform, downscale, LIB)
    torch.manual_seed(seed)
    width, height = crop.size(data)
    return RegionJob(crop, data, width, height, crop.draw(width, height), lambda: whole(data), seed)


def torchvision_pixels(j: RegionJob) -> torch.Tensor:
    """What v2.RandomResizedCrop(antialias=True) + the flip make of the whole decode for that crop."""
    p, flip = j.drawn
    image = F.resized_crop(whole(j.data), **p, size=list(j.crop.crop.size), antialias=True)
    return F.horizontal_flip(image) if flip else image


def test_the_kernels_pixels_are_torchvisions_resized_crop():
    rng = random.Random(7)
    images = [encode(w, h, seed=i) for i, (w, h) in enumerate([(500, 375), (203, 157), (640, 480), (96, 300)])]
    images += [noise_jpeg(w, h, seed=i) for i, (w, h) in enumerate([(500, 375), (333, 500), (150, 90)])]
    diffs = []
    for size in (224, 64, 37):  # one output size per call, as in a batch
        jobs = [job(data, size, seed=rng.randrange(10**6)) for data in images for _ in range(6)]
        got, reasons = render_jobs(jobs, threads=3)
        assert reasons == [None] * len(jobs)
        for j, image in zip(jobs, got, strict=True):
            assert image.shape == (size, size, 3)
            diffs.append((image.permute(2, 0, 1).int() - torchvision_pixels(j).int()).abs().flatten())
    diff = torch.cat(diffs).float()
    if EXACT:
        assert diff.max() == 0
    assert torch.quantile(diff[::7], 0.999) <= 1 and diff.mean() < 0.25


def test_downscaled_regions_are_the_per_image_paths_pixels():
    data = encode(640, 480, seed=3)
    jobs = [job(data, 64, seed=s, downscale=True) for s in range(24)]
    assert any(j.params()[0] > 1 for j in jobs)  # some crops are decoded at 1/2, 1/4 or 1/8
    got, reasons = render_jobs(jobs)
    assert reasons == [None] * len(jobs)
    for j, image in zip(jobs, got, strict=True):
        per_image, _ = j()  # CropDecoder.render: the region at that scale, then torch's resize
        assert torch.equal(image.permute(2, 0, 1), per_image) or not EXACT


def test_threads_change_nothing():
    jobs = [job(encode(300, 200, seed=i), 48, seed=i) for i in range(20)]
    one, _ = render_jobs(jobs, threads=1)
    four, _ = render_jobs(jobs, threads=4)
    assert all(torch.equal(a, b) for a, b in zip(one, four, strict=True))


def damaged(data: bytes, seed: int) -> bytes:
    """A JPEG with bytes overwritten in its entropy-coded data, or cut short."""
    rng = random.Random(seed)
    raw = bytearray(data)
    if seed % 3 == 0:
        return bytes(raw[: rng.randrange(200, len(raw) - 2)]) + b"\xff\xd9"  # cut, but ends as a JPEG does
    for _ in range(1 + seed % 5):
        raw[rng.randrange(400, len(raw) - 2)] = rng.randrange(256)
    return bytes(raw)


def test_damaged_jpegs_are_refused_with_libjpegs_reason_or_decoded_never_a_crash():
    good = encode(320, 240, seed=1)
    jobs = [job(good, 64, seed=0)] + [job(damaged(good, s), 64, seed=s) for s in range(60)]
    images, reasons = render_jobs(jobs, threads=2)
    assert reasons[0] is None and torch.equal(images[0].permute(2, 0, 1), torchvision_pixels(jobs[0]))
    refused = [r for r in reasons if r is not None]
    assert refused, "no damaged file was refused: the damage did not reach the decoded rows"
    assert all(isinstance(r, str) and r for r in refused)


def test_rendered_keeps_order_and_leaves_what_it_cannot_make_to_the_per_image_path():
    good, cmyk = encode(200, 150, seed=2), io.BytesIO()
    Image.new("CMYK", (120, 90), (10, 200, 30, 5)).save(cmyk, format="JPEG")
    refused = job(cmyk.getvalue(), 32, seed=1)
    assert render_jobs([refused])[1] != [None]  # libjpeg will not make RGB of CMYK: its job stays a job
    items = [(0, {}, job(good, 32, seed=0)), (1, {}, "a marker"), (2, {}, refused), (3, {}, job(good, 32, seed=3))]
    calls = []
    out = list(rendered(iter(items), chunk=3, threads=lambda: 1, before=lambda: calls.append(1)))
    assert [seq for seq, _, _ in out] == [0, 1, 2, 3]
    assert isinstance(out[0][2], tuple) and isinstance(out[3][2], tuple) and out[1][2] == "a marker"
    assert out[2][2] is refused and calls == [1, 1]  # two windows, a kernel call in each


def test_an_error_ending_the_stream_comes_after_the_items_before_it():
    def items():
        yield 0, {}, job(encode(100, 80, seed=0), 16, seed=0)
        raise OSError("the store went away")

    out = rendered(items(), chunk=8, threads=lambda: 1)
    seq, _, done = next(out)
    assert seq == 0 and isinstance(done, tuple)
    with pytest.raises(OSError, match="went away"):
        next(out)


def test_the_loaders_batches_are_the_same_with_the_kernel_bad_samples_and_pngs_included(tmp_path):
    index = write_tiny_shards(tmp_path / "s", [40, 40, 40, 40], size=72)
    # One more shard: damaged JPEGs, a PNG, a CMYK JPEG (libjpeg refuses what torchvision decodes)
    path = tmp_path / "s" / "tiny-000004.tar"
    cmyk = io.BytesIO()
    Image.new("CMYK", (72, 60), (10, 200, 30, 5)).save(cmyk, format="JPEG")
    png = io.BytesIO()
    Image.new("RGB", (72, 60), (40, 90, 200)).save(png, format="PNG")
    with wds.TarWriter(str(path)) as w:
        for i in range(40):
            data = encode(90, 70, seed=i)
            data = damaged(data, i) if i % 5 == 1 else cmyk.getvalue() if i == 7 else data
            key = "png" if i == 9 else "jpg"
            w.write({"__key__": f"b{i:04d}", key: png.getvalue() if i == 9 else data, "cls": str(i % 10)})
    shards = [(str(p), 40) for p in sorted((tmp_path / "s").glob("tiny-*.tar"))]
    index = index_path(str(tmp_path / "s"), "tiny")
    write_index(index, shards, name="tiny")
    kernel = first_batches(index, 20, decode_batch=True, image_key="jpg;png")
    single = first_batches(index, 20, decode_batch=False, image_key="jpg;png")
    for a, b in zip(kernel, single, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["bad"], b["bad"])
        assert torch.equal(a["image"], b["image"]) or not EXACT
