"""loader.decode=gpu without a GPU: the path's functions run on CPU tensors (decode/gpu.py's
device() is pointed at the CPU), so its batches are checked against the default path's, sample
for sample, skip for skip, pixels within a grey level, and across a resume."""

from __future__ import annotations

import collections
import io
import random
import time
from pathlib import Path

import pytest
import torch
import webdataset as wds
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

from tests.conftest import run_script, write_tiny_shards
from tests.helpers.jpegs import encode
from tests.helpers.loading import taken
from wdsdist.data import DataError, Loader, LoaderConfig, UserError
from wdsdist.data.decode import gpu
from wdsdist.data.decode.draws import CropDraw
from wdsdist.data.decode.gpu import BatchDecoder, Drawn, gpu_takes, pack
from wdsdist.data.decode.jpegcrop import crop_decoder
from wdsdist.data.decode.sample import make_transform, prepare_sample
from wdsdist.data.delivery.gpubatches import decoded_ahead
from wdsdist.data.sources.index import index_path, write_index


@pytest.fixture
def on_cpu(monkeypatch):
    """decode=gpu's device is the CPU: the same functions, on CPU tensors."""
    monkeypatch.setattr(gpu, "device", lambda: torch.device("cpu"))


def noise_jpeg(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def decodes(data: bytes) -> bool:
    try:
        decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        return False
    return True


def damaged(data: bytes, seed: int) -> bytes:
    """Bytes overwritten in the entropy-coded data, or the file cut short (ending, or not, as a JPEG does)."""
    rng = random.Random(seed)
    raw = bytearray(data)
    if seed % 3 == 0:
        cut = bytes(raw[: rng.randrange(200, len(raw) - 2)])
        return cut + b"\xff\xd9" if seed % 2 else cut
    for _ in range(1 + seed % 5):
        raw[rng.randrange(400, len(raw) - 2)] = rng.randrange(256)
    return bytes(raw)


def mixed_shards(root: Path) -> str:
    """Four shards of photo-like JPEGs and one of what the GPU decoder is not given or cannot
    take: damaged JPEGs (those libjpeg-turbo decodes, or that the CPU path refuses in the worker),
    a PNG, a CMYK, a greyscale and a progressive JPEG, a bad label."""
    write_tiny_shards(root, [40, 40, 40, 40], size=72)
    cmyk = io.BytesIO()
    Image.new("CMYK", (72, 60), (10, 200, 30, 5)).save(cmyk, format="JPEG")
    png = io.BytesIO()
    Image.new("RGB", (72, 60), (40, 90, 200)).save(png, format="PNG")
    special = {7: ("jpg", cmyk.getvalue()), 9: ("png", png.getvalue()), 11: ("jpg", encode(80, 64, 3, mode="L"))}
    special[13] = ("jpg", encode(96, 72, 4, progressive=True))
    with wds.TarWriter(str(root / "tiny-000004.tar")) as w:
        for i in range(40):
            suffix, data = special.get(i, ("jpg", encode(90, 70, seed=i)))
            if i % 5 == 1:
                bad = damaged(data, i)
                data = bad if decodes(bad) or not bad.endswith(b"\xff\xd9") else data
            label = "x" if i == 17 else str(i % 10)
            w.write({"__key__": f"b{i:04d}", suffix: data, "cls": label})
    shards = [(str(p), 40) for p in sorted(root.glob("tiny-*.tar"))]
    index = index_path(str(root), "tiny")
    write_index(index, shards, name="tiny")
    return index


def batches(index: str, decode: str, n: int | None = None, state: dict | None = None, **kw) -> list[dict]:
    # max_bad: the mixed shards' damaged samples are the point, not the limit
    options = {"batch_size": 8, "workers": 2, "image_size": 32, "mode": "epoch", "image_key": "jpg;png", "max_bad": 1.0}
    out, after = taken(index, LoaderConfig(**(options | kw), decode=decode), n, state)
    return out + [after] if n is not None and len(out) == n else out


def assert_same_batches(cpu: list[dict], gpu_: list[dict]) -> None:
    assert len(cpu) == len(gpu_)
    for a, b in zip(cpu, gpu_, strict=True):
        for name in ("id", "pos", "label", "bad"):
            assert torch.equal(a[name], b[name]), name
        assert b["image"].dtype == torch.uint8 and b["image"].shape == a["image"].shape
        assert b["image"].is_contiguous(memory_format=torch.channels_last)
        diff = (a["image"].int() - b["image"].int()).abs().flatten().float()
        # The GPU path resizes in floating point, the CPU path uint8 with integer weights
        assert torch.quantile(diff, 0.999) <= 2 and diff.mean() < 0.25, (diff.max(), diff.mean())


def test_gpu_takes_8_bit_huffman_jpegs_of_1_or_3_components_only():
    cmyk = io.BytesIO()
    Image.new("CMYK", (30, 20), (1, 2, 3, 4)).save(cmyk, format="JPEG")
    assert gpu_takes(encode(90, 70, 1))
    assert gpu_takes(encode(90, 70, 2, progressive=True))
    assert gpu_takes(encode(90, 70, 3, mode="L"))
    assert not gpu_takes(cmyk.getvalue())
    arithmetic = bytearray(encode(90, 70, 1))
    arithmetic[arithmetic.find(b"\xff\xc0") + 1] = 0xC9  # the same frame header, arithmetic-coded
    assert not gpu_takes(bytes(arithmetic))
    # Cut inside its headers, garbage, a length that walks off the end: never taken, never an error
    data = encode(90, 70, 1)
    assert not any(gpu_takes(data[:k]) for k in range(0, data.find(b"\xff\xc0") + 10))
    assert not gpu_takes(b"\xff\xd8\xff\xe0\xff\xff" + bytes(20))
    assert not gpu_takes(b"garbage")


def test_the_gpu_paths_batches_equal_the_cpu_paths_bad_and_other_images_included(tmp_path, on_cpu):
    index = mixed_shards(tmp_path / "s")
    cpu = batches(index, "cpu")
    gpu_ = batches(index, "gpu")
    assert len(cpu) >= 23 and sum(int(b["bad"][:, 0].sum()) for b in cpu) >= 2  # damaged, bad label
    assert_same_batches(cpu, gpu_)


def test_the_gpu_paths_pixels_equal_the_cpu_paths_over_photos_and_noise(tmp_path, on_cpu):
    root = tmp_path / "n"
    root.mkdir()
    for k in range(2):
        with wds.TarWriter(str(root / f"tiny-{k:06d}.tar")) as w:
            for i in range(24):
                sizes = [(500, 375), (333, 500), (150, 90), (64, 48)]
                w_, h = sizes[i % 4]
                data = noise_jpeg(w_, h, 100 * k + i) if i % 2 else encode(w_, h, seed=100 * k + i)
                w.write({"__key__": f"n{k}{i:04d}", "jpg": data, "cls": str(i % 10)})
    index = index_path(str(root), "tiny")
    write_index(index, [(str(p), 24) for p in sorted(root.glob("*.tar"))], name="tiny")
    assert_same_batches(batches(index, "cpu", image_size=224), batches(index, "gpu", image_size=224))


def test_a_run_on_the_gpu_path_resumes_exactly_and_as_the_cpu_path_does(tmp_path, on_cpu):
    index = mixed_shards(tmp_path / "s")
    whole = batches(index, "gpu")
    first = batches(index, "gpu", n=7)
    state = first.pop()
    cpu_first = batches(index, "cpu", n=7)
    assert cpu_first.pop() == state  # the same position, whichever path made the batches
    rest = batches(index, "gpu", state=state)
    # Every sample once, in the same batches, across the resume (the draws of the resumed
    # workers are new ones, on either path)
    for a, b in zip(whole, first + rest, strict=True):
        assert all(torch.equal(a[name], b[name]) for name in ("id", "pos", "label", "bad"))
    assert_same_batches(batches(index, "cpu", state=state), rest)


def test_a_jpeg_no_decoder_takes_is_filled_from_the_next_good_row_and_counted():
    good = encode(90, 70, 1)
    bad = bytearray(good)
    bad[bad.find(b"\xff\xc0") + 12] = 3  # its first component's quantization table: none such
    assert gpu_takes(bytes(bad)) and not decodes(bytes(bad))
    png = torch.full((3, 16, 16), 7, dtype=torch.uint8)
    rows = [Drawn(good, (0, 0, 70, 90, 0), "a"), Drawn(bytes(bad), (0, 0, 70, 90, 1), "b"), png]
    rows.append(Drawn(good, (10, 5, 40, 50, 1), "d"))
    batch = {
        "jpeg": pack(rows),
        "label": torch.tensor([0, 1, 2, 3]),
        "id": torch.arange(12).view(4, 3),
        "pos": torch.arange(4),
        "bad": torch.tensor([[0, 0], [2, 0], [0, 1], [0, 0]]),
        "key": ["a", "b", "c", "d"],
    }
    decoder = BatchDecoder(16, torch.device("cpu"))
    made = decoder.decode(batch)
    assert made["failed"] == [1] and len(made["label"]) == 4  # the caller counts every row consumed first
    out = decoder.hand_over(made, total_of=lambda epoch: 100)
    # the row stays, filled from the next good row (its image, label and key), marked as padding
    assert out["label"].tolist() == [0, 2, 2, 3] and out["key"] == ["a", "c", "c", "d"]
    assert out["id"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # its own id: consumed
    assert out["pos"].tolist() == [0, 102, 2, 3] and out["bad_samples"] == ["b"]
    assert out["bad"].tolist() == [[0, 0], [3, 0], [0, 1], [0, 0]]  # its loss counted on its own row
    assert torch.equal(out["image"][1], png) and torch.equal(out["image"][2], png)  # the worker's own decode
    assert dict(decoder.counts) == {"gpu": 2, "cpu": 1, "failed": 1}


def test_decode_gpu_without_cuda_stops_in_one_line(tmp_path):
    index = write_tiny_shards(tmp_path / "s", [8])
    code = (
        "import torch; from wdsdist.data import Loader, LoaderConfig\n"
        "torch.cuda.is_available = lambda: False\n"
        f"Loader({str(index)!r}, LoaderConfig(batch_size=4, workers=0, decode='gpu'), rank=0, world=1)\n"
    )
    with pytest.raises(UserError, match=r"^loader\.decode=gpu: torch sees no CUDA GPU here .*use loader\.decode=cpu"):
        exec(compile(code, "<test>", "exec"), {})
    # The trainer's line: one error line and exit 2, no traceback
    done = run_script("train.py", "loader.decode=gpu", "trainer.steps=1", f"outputs={tmp_path}")
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: loader.decode=gpu: this run trains on the CPU (trainer.device=auto: torch sees no")
    assert line.endswith("use loader.decode=cpu, the default")
    assert "Traceback" not in done.stderr


def test_options_decode_gpu_refuses_what_it_cannot_do():
    with pytest.raises(UserError, match=r"^decode=tpu: cpu, gpu or auto"):
        LoaderConfig(batch_size=4, decode="tpu")
    with pytest.raises(UserError, match=r"^decode=gpu: gpu does not apply with loader.cross_shuffle"):
        LoaderConfig(batch_size=4, decode="gpu", cross_shuffle=10)
    with pytest.raises(UserError, match=r"^gpu_decoder=nvjpeg: auto, nvimgcodec or torchvision"):
        LoaderConfig(batch_size=4, decode="gpu", gpu_decoder="nvjpeg")


@pytest.mark.parametrize("threads", [1, 3])
def test_the_decode_threads_keep_order_raise_in_order_and_stop_with_their_caller(threads):
    pulled = []

    def source(n, fail_at=None):
        for i in range(n):
            if i == fail_at:
                raise DataError(f"worker failed at {i}")
            pulled.append(i)
            yield {"i": i}

    def decode(batch):  # the later batches of a round finish first: the order is the threads' to keep
        time.sleep(0.002 * ((-batch["i"]) % 4))
        if batch["i"] == 13:
            raise RuntimeError("decoder failed at 13")
        return batch | {"decoded": True}

    def ahead(batches, setup=lambda: None):
        return decoded_ahead(batches, [(decode, setup)] * threads)

    assert [b["i"] for b in ahead(source(12))] == list(range(12))
    got = []
    with pytest.raises(DataError, match="worker failed at 3"):
        for batch in ahead(source(12, fail_at=3)):
            got.append(batch["i"])
    assert got == [0, 1, 2]
    got.clear()
    with pytest.raises(RuntimeError, match="decoder failed at 13"):  # in its place: every batch before it
        for batch in ahead(source(20)):
            got.append(batch["i"])
    assert got == list(range(13))
    pulled.clear()
    batches = ahead(source(100))
    assert next(batches)["decoded"]
    batches.close()  # the caller stops: the threads end, each at most a batch ahead and one in hand
    assert len(pulled) <= 1 + 2 * threads
    with pytest.raises(RuntimeError, match="in setup"):
        next(ahead(source(3), lambda: (_ for _ in ()).throw(RuntimeError("in setup"))))


def test_three_decode_threads_give_the_cpu_paths_batches_and_add_up_their_counts(tmp_path, on_cpu):
    index = mixed_shards(tmp_path / "s")

    def epoch(**kw) -> tuple[list[dict], Loader]:
        cfg = LoaderConfig(batch_size=8, workers=2, image_size=32, mode="epoch", max_bad=1.0, **kw)
        loader = Loader(index, cfg, rank=0, world=1)
        torch.manual_seed(0)
        return list(loader), loader

    cpu, _ = epoch(decode="cpu")
    gpu_, loader = epoch(decode="gpu", gpu_decode_threads=3)
    assert_same_batches(cpu, gpu_)
    counts = loader.decode_counts
    assert counts["gpu"] + counts["cpu"] == sum(len(b["label"]) for b in gpu_) and counts["gpu"] > 0
    host = loader.decode_host
    assert "3 decode threads" in host["decoder"] and host["batches"] > 0
    assert 0 < host["decode_cpu_ms"] <= host["decode_ms"] + 0.5 and host["resize_ms"] > 0
    with pytest.raises(UserError, match=r"^gpu_decode_threads=0: 1 or more"):
        LoaderConfig(batch_size=4, decode="gpu", gpu_decode_threads=0)


@pytest.mark.parametrize("train, region", [(True, True), (True, False), (False, True)])
def test_a_share_decoded_in_the_workers_gives_the_cpu_paths_batches_the_same_jpegs_each_run(
    tmp_path, on_cpu, train, region
):
    index = mixed_shards(tmp_path / "s")

    def epoch(share: float, decode: str = "gpu", **kw) -> tuple[list[dict], collections.Counter]:
        options = {"batch_size": 8, "workers": 2, "image_size": 32, "mode": "epoch", "train": train, "max_bad": 1.0}
        options["decode_region"] = region  # off: the workers crop from torchvision's whole decode
        cfg = LoaderConfig(**options, decode=decode, gpu_decode_share=share, **kw)
        loader = Loader(index, cfg, rank=0, world=1)
        torch.manual_seed(0)
        return list(loader), collections.Counter(loader.decode_counts or {})

    cpu, _ = epoch(1.0, "cpu")
    all_gpu, on_gpu = epoch(1.0)
    half, split = epoch(0.5)
    none, workers_only = epoch(0.0)
    for batches_ in (all_gpu, half, none):
        assert_same_batches(cpu, batches_)
    images = sum(len(b["label"]) for b in cpu)
    assert on_gpu["gpu"] + on_gpu["cpu"] == split["gpu"] + split["cpu"] == workers_only["cpu"] == images
    # About half of what the GPU took goes to the workers; with none, nothing reaches the GPU
    assert 0.25 * on_gpu["gpu"] <= split["gpu"] <= 0.75 * on_gpu["gpu"] and workers_only["gpu"] == 0
    # The workers decode as the CPU path does: with no share on the GPU, the very same pixels
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(cpu, none, strict=True))
    # The same JPEGs go to the GPU in a second run
    again, split_again = epoch(0.5)
    assert split_again == split and all(torch.equal(a["image"], b["image"]) for a, b in zip(half, again, strict=True))
    with pytest.raises(UserError, match=r"^gpu_decode_share=1.5: a share between 0 and 1"):
        LoaderConfig(batch_size=4, decode="gpu", gpu_decode_share=1.5)


@pytest.mark.parametrize("region", [True, False])
def test_a_jpeg_the_workers_cannot_decode_draws_as_on_the_cpu_path_before_the_next_crop(region):
    """A JPEG whose header reads but whose data libjpeg refuses, left to the workers: the next
    sample's crop is the CPU path's (a draw made for the refused one would shift every later crop)."""
    good = encode(90, 70, seed=3)
    bad = bytearray(good)
    sof = bad.find(b"\xff\xc0")
    bad[sof + 11] = 3  # its first component names quantization table 3, which no DQT defines
    assert gpu_takes(bytes(bad)) and not decodes(bytes(bad))

    def crops(decode: str) -> list:
        cfg = LoaderConfig(batch_size=2, image_size=32, decode=decode, gpu_decode_share=0.0, decode_region=region)
        transform = make_transform(cfg)
        crop = crop_decoder(transform, False) if region else None
        draw = CropDraw(*transform.transforms) if decode == "gpu" else None
        torch.manual_seed(0)
        out = []
        for key, data in (("a", bytes(bad)), ("b", good), ("c", good)):
            sample = {"__url__": "u", "__key__": key, "jpg": data, "cls": b"1"}
            try:
                out.append(prepare_sample(sample, cfg, transform, crop, draw)()[0])
            except DataError:
                out.append(None)
        return out

    cpu, workers = crops("cpu"), crops("gpu")
    assert cpu[0] is None and workers[0] is None
    assert all(torch.equal(a, b) for a, b in zip(cpu[1:], workers[1:], strict=True))


def test_epochs_cut_to_nbatches_read_on_the_gpu_path_as_on_the_cpu_path(tmp_path, on_cpu):
    index = mixed_shards(tmp_path / "s")

    def two_epochs(decode: str) -> list[dict]:
        cfg = LoaderConfig(batch_size=8, workers=2, image_size=32, mode="epoch", nbatches=3, decode=decode)
        loader = Loader(index, cfg, rank=0, world=1)
        torch.manual_seed(0)
        return [batch for _ in range(2) for batch in loader]

    cpu, gpu_ = two_epochs("cpu"), two_epochs("gpu")
    assert len(cpu) == len(gpu_) == 6
    assert_same_batches(cpu[:3], gpu_[:3])
    # The next epoch's samples; its draws depend on how far the persistent workers had made
    # batches ahead when the cut came, on either path
    for a, b in zip(cpu, gpu_, strict=True):
        assert all(torch.equal(a[name], b[name]) for name in ("id", "pos", "label", "bad"))


def test_the_lightning_datamodule_decodes_on_the_gpu_through_the_same_option(tmp_path, on_cpu):
    from wdsdist.lightning import WdsDataModule

    index = write_tiny_shards(tmp_path / "s", [16, 16], size=48)
    cfg = LoaderConfig(mode="epoch", batch_size=8, image_size=32, workers=0, decode="gpu")
    data = WdsDataModule(str(index), cfg, val_shards=str(index))
    loader = data.train_dataloader()
    batches = list(loader)
    assert len(batches) == 4 and all(b["image"].shape == (8, 3, 32, 32) for b in batches)
    assert loader.decode_counts == {"gpu": 32, "cpu": 0, "failed": 0}
    # Evaluation goes through the same decoder (here on CPU tensors), resized and centre-cropped
    assert sum(len(b["label"]) for b in data.val_dataloader()) == 32
