"""decode=gpu's batched crop-resize-flip (decode/resize.py, resize_kernels.py) and its decoders
(decode/codecs.py), on CPU tensors: Triton's interpreter runs the kernels, nvImageCodec's CPU
backend its region decode. Each is held to the CPU path's pixels."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from tests.conftest import write_tiny_shards
from tests.helpers.jpegs import encode
from wdsdist.data import EvalLoader, LoaderConfig, UserError
from wdsdist.data.decode import codecs, gpu
from wdsdist.data.decode.resize import BatchResize, Place, eval_geometry, reference, train_geometry

HAVE_NVIMGCODEC = codecs.nvimgcodec_version() is not None
needs_nvimgcodec = pytest.mark.skipif(not HAVE_NVIMGCODEC, reason="nvImageCodec (the [gpu] extra) is not installed")


def noise(width: int, height: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), generator=g, dtype=torch.uint8)


def photo(width: int, height: int, seed: int) -> torch.Tensor:
    return decode_jpeg(torch.frombuffer(bytearray(encode(width, height, seed)), dtype=torch.uint8))


def packed(images: list[torch.Tensor]) -> tuple[torch.Tensor, list[Place]]:
    """CHW images as the decoders leave them: H x W x 3, one after another in one buffer."""
    chunks, places, start = [], [], 0
    for image in images:
        _, h, w = image.shape
        chunks.append(image.permute(1, 2, 0).flatten())
        places.append(Place(start, w * 3, h, w))
        start += h * w * 3
    return torch.cat(chunks), places


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within one grey level at p99.9 (the CPU path resizes uint8 with integer weights)."""
    assert a.shape == b.shape
    diff = (a.int() - b.int()).abs().flatten().float()
    assert torch.quantile(diff, 0.999) <= 1, (diff.max(), diff.mean())
    assert diff.mean() < 0.25


SETS = {"photos": photo, "noise": noise}
TRAIN, EVAL = 32, 24
EVALUATION = v2.Compose([v2.Resize(round(EVAL / 0.875), antialias=True), v2.CenterCrop(EVAL)])


def training_case(make):
    """Five images, their drawn crops (as the CPU path draws them), every other one flipped."""
    crop = v2.RandomResizedCrop(TRAIN, antialias=True)
    torch.manual_seed(3)
    images = [make(w, h, seed) for seed, (w, h) in enumerate([(90, 70), (40, 64), (150, 120), (33, 31), (70, 90)])]
    boxes = [crop.make_params([image]) for image in images]
    regions = [
        image[:, p["top"] : p["top"] + p["height"], p["left"] : p["left"] + p["width"]]
        for image, p in zip(images, boxes, strict=True)
    ]
    src, places = packed(regions)
    flips = [i % 2 for i in range(len(images))]
    return images, boxes, flips, src, places


def evaluation_case(make):
    images = [make(w, h, seed) for seed, (w, h) in enumerate([(90, 70), (41, 64), (29, 200), (27, 28)])]
    src, places = packed(images)
    return images, src, places, [eval_geometry(p.height, p.width, EVAL) for p in places]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Every case through the kernels, under the interpreter, in one process."""
    pytest.importorskip("triton")
    from tests.helpers.interpreted import kernels

    cases = {}
    for name, make in SETS.items():
        _, _, flips, src, places = training_case(make)
        cases[f"train-{name}"] = (src, places, [train_geometry(TRAIN, f) for f in flips], TRAIN)
        cases[f"unflipped-{name}"] = (src, places, [train_geometry(TRAIN, 0)] * len(places), TRAIN)
        _, src, places, geometry = evaluation_case(make)
        cases[f"eval-{name}"] = (src, places, geometry, EVAL)
    return kernels(cases, tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("name", SETS)
def test_the_kernels_make_the_cpu_paths_training_crops_within_a_grey_level(made, name):
    images, boxes, flips, _, _ = training_case(SETS[name])
    out = made[f"train-{name}"]
    assert out.shape == (5, 3, TRAIN, TRAIN) and out.dtype == torch.uint8
    assert out.is_contiguous(memory_format=torch.channels_last)
    for image, p, flip, row in zip(images, boxes, flips, out, strict=True):
        want = F.resized_crop(image, **p, size=[TRAIN, TRAIN], antialias=True)  # the CPU path's uint8 resize
        close(row, want.flip(-1) if flip else want)
    # A flip is exact: the same draws unflipped give the mirror image, value for value
    unflipped = made[f"unflipped-{name}"]
    assert all(torch.equal(out[i], unflipped[i].flip(-1) if flips[i] else unflipped[i]) for i in range(5))


@pytest.mark.parametrize("name", SETS)
def test_the_kernels_make_the_cpu_paths_evaluation_crops_within_a_grey_level(made, name):
    images, src, places, geometry = evaluation_case(SETS[name])
    out = made[f"eval-{name}"]
    assert out.shape == (4, 3, EVAL, EVAL)
    for image, row in zip(images, out, strict=True):
        close(row, EVALUATION(image))
    # torch's per-image reference, which runs where neither a GPU nor the interpreter is
    close(reference(src, places, geometry, EVAL), out)


def test_the_reference_runs_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    resize = BatchResize(16, torch.device("cpu"))
    assert not resize.kernels and "per image" in resize.how
    src, places = packed([photo(40, 30, 1)])
    assert resize(src, places, [train_geometry(16, 1)]).shape == (1, 3, 16, 16)


def _kernels_faked(monkeypatch, launch) -> None:
    """BatchResize takes the kernels' road on CPU tensors outside the interpreter, with ``launch``
    in the kernels' place."""
    pytest.importorskip("triton")
    from wdsdist.data.decode import resize, resize_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(resize, "kernels_here", lambda device: True)
    monkeypatch.setattr(resize_kernels, "launch", launch)


def test_where_triton_cannot_compile_the_resize_goes_on_per_image_and_says_so_once(monkeypatch, caplog):
    tries = []

    def launch(*args):
        tries.append(1)
        raise RuntimeError("compile failed\nno C compiler found")

    _kernels_faked(monkeypatch, launch)
    resize = BatchResize(16, torch.device("cpu"))
    src, places = packed([photo(40, 30, 1), noise(20, 50, 2)])
    geometry = [train_geometry(16, 1), train_geometry(16, 0)]
    with caplog.at_level("WARNING", logger="wdsdist.data.decode.resize"):
        first, second = resize(src, places, geometry), resize(src, places, geometry)
    assert torch.equal(first, reference(src, places, geometry, 16)) and torch.equal(first, second)
    assert len(tries) == 1 and not resize.kernels and "Triton failed here: RuntimeError" in resize.how
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].endswith("no C compiler found")


def test_decode_threads_first_launches_take_turns_and_later_ones_run_at_once(monkeypatch):
    import threading
    import time

    lock, running, most = threading.Lock(), [0], [0]

    def first(*args):  # Triton's compile: counts how many run at once
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    _kernels_faked(monkeypatch, first)
    src, places = packed([photo(40, 30, 1)])
    resizes = [BatchResize(16, torch.device("cpu")) for _ in range(3)]

    def in_threads() -> None:
        threads = [threading.Thread(target=r, args=(src, places, [train_geometry(16, 0)])) for r in resizes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    in_threads()
    assert most[0] == 1 and all(r.launched for r in resizes)  # one at a time
    from wdsdist.data.decode import resize_kernels

    together = threading.Barrier(3, timeout=30)  # passes only with all three launches under way at once
    monkeypatch.setattr(resize_kernels, "launch", lambda *args: together.wait())
    in_threads()
    assert not together.broken and together.n_waiting == 0


@needs_nvimgcodec
@pytest.mark.parametrize("regions", [True, False], ids=["regions", "whole-then-crop"])
def test_nvimagecodec_decodes_the_drawn_regions_as_libjpeg_turbo_does(regions):
    codec = codecs.NvImageCodec(torch.device("cpu"), None, regions=regions)
    datas = [encode(90, 70, 1), encode(64, 80, 2), encode(120, 100, 3, mode="L")]
    wanted = [(10, 5, 40, 50), None, (0, 0, 100, 120)]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    src, places = codec.decode(tensors, wanted)
    assert all(p is not None for p in places)
    for data, region, p in zip(tensors, wanted, places, strict=True):
        turbo = decode_jpeg(data, mode=ImageReadMode.RGB)
        if region is not None:
            top, left, h, w = region
            turbo = turbo[:, top : top + h, left : left + w]
        got = src[p.start : p.start + (p.height - 1) * p.stride + p.width * 3].as_strided(
            (3, p.height, p.width), (1, p.stride, 3)
        )
        assert torch.equal(got, turbo)  # libjpeg-turbo's chroma upsampling: the same values
    # The buffer is reused: a second batch of the same sizes takes no new one
    buffer = codec.arena.buffer
    codec.decode(tensors, wanted)
    assert codec.arena.buffer.data_ptr() == buffer.data_ptr()


@needs_nvimgcodec
def test_nvimagecodec_refuses_what_it_cannot_decode_and_the_batch_goes_on():
    codec = codecs.NvImageCodec(torch.device("cpu"), None)
    good = encode(60, 40, 1)
    bad = bytearray(good)
    bad[bad.find(b"\xff\xc0") + 12] = 3  # a quantization table that is not there
    tensors = [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in (good, bytes(bad), b"\xff\xd8junk")]
    _, places = codec.decode(tensors, [(0, 0, 40, 60)] * 3)
    assert places[0] is not None and places[1] is None and places[2] is None


def test_without_the_extra_torchvisions_decoder_is_used_and_named(monkeypatch):
    monkeypatch.setattr(codecs, "nvimgcodec_version", lambda: None)
    decoder = gpu.BatchDecoder(16, torch.device("cpu"))
    assert isinstance(decoder.codec, codecs.TorchvisionCodec)
    assert "torchvision's nvJPEG" in decoder.described and "pixels differ" in decoder.described
    with pytest.raises(UserError, match=r"^loader.gpu_decoder=nvimgcodec: nvidia-nvimgcodec-cu13 is not installed"):
        gpu.BatchDecoder(16, torch.device("cpu"), engine="nvimgcodec")


@needs_nvimgcodec
def test_with_the_extra_but_no_cuda_decode_gpu_stops_in_one_line_naming_it():
    with pytest.raises(UserError) as caught:
        gpu.device()
    line = str(caught.value)
    assert "\n" not in line and "torch sees no CUDA GPU" in line and codecs.NVIMGCODEC in line


def test_decode_auto_takes_the_gpu_with_cuda_and_the_extra_else_the_cpu_and_says_why(monkeypatch):
    from wdsdist.train.run import loader_line

    def auto(**kw) -> LoaderConfig:
        return LoaderConfig(batch_size=8, workers="auto", decode="auto", **kw)

    # Here: no CUDA; and a loader whose batches stay on the CPU never decodes on a GPU
    assert (auto(pin_memory=True).decode, auto(pin_memory=True).decode_why) == ("cpu", "auto: torch sees no CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto().decode == "cpu" and "pin_memory off" in auto().decode_why
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.0.20")
    chosen = auto(pin_memory=True)
    assert (chosen.decode, chosen.decode_why) == ("gpu", "auto: a CUDA GPU and nvImageCodec 0.9.0.20, the [gpu] extra")
    assert "decode=gpu: workers only read and draw" in chosen.workers_why  # workers=auto sized for it
    assert loader_line(chosen, "nvImageCodec").endswith(
        "by nvImageCodec (loader.decode=auto: a CUDA GPU and nvImageCodec 0.9.0.20, the [gpu] extra)"
    )
    assert auto(pin_memory=True, cross_shuffle=8).decode_why == "auto: loader.cross_shuffle needs the CPU path"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    left = auto(pin_memory=True)
    assert (left.decode, left.decode_why) == ("cpu", f"auto: {codecs.NVIMGCODEC}, the [gpu] extra, is not installed")
    assert "(loader.decode=auto: " in loader_line(left) and "on the CPU, in the workers" in loader_line(left)


def test_decode_auto_keeps_its_reason_through_data_sources_and_gives_way_to_a_transform(tmp_path, monkeypatch):
    from torchvision.transforms import v2 as transforms

    from wdsdist.data import Loader, Source
    from wdsdist.data.delivery.mixing import mix_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.0.20")
    monkeypatch.setattr(gpu, "device", lambda: torch.device("cpu"))  # decode=gpu's functions on CPU tensors
    cfg = LoaderConfig(batch_size=4, workers="auto", decode="auto", pin_memory=True, split="samples")
    assert cfg.decode == "gpu" and cfg.decode_why and cfg.workers_why
    mixed = mix_config(cfg)  # data.sources: a changed copy of the config
    assert (mixed.decode_why, mixed.workers_why) == (cfg.decode_why, cfg.workers_why)
    # A transform runs in the workers on decoded images: auto decodes on the CPU, workers sized for it
    index = write_tiny_shards(tmp_path / "s", [8, 8], size=40)
    loader = Loader(str(index), cfg, rank=0, world=1, transform=transforms.RandomHorizontalFlip())
    assert loader.config.decode == "cpu" and loader.config.decode_why == (
        "auto: a transform runs in the workers on decoded images"
    )
    assert "less 1 for the training process" in loader.config.workers_why
    both = [Source("tiny", str(index))]
    assert Loader(both, cfg, rank=0, world=1).config.decode_why == cfg.decode_why
    with pytest.raises(UserError, match="a transform runs in the workers"):  # asked for: still refused
        Loader(str(index), LoaderConfig(batch_size=4, decode="gpu"), rank=0, world=1, transform=lambda x: x)


@pytest.mark.parametrize("engine", ["nvimgcodec", "torchvision"])
def test_decode_gpu_evaluates_on_the_cpu_paths_samples_and_labels(tmp_path, monkeypatch, engine):
    if engine == "nvimgcodec" and not HAVE_NVIMGCODEC:
        pytest.skip("nvImageCodec (the [gpu] extra) is not installed")
    monkeypatch.setattr(gpu, "device", lambda: torch.device("cpu"))
    index = write_tiny_shards(tmp_path / "s", [12, 12, 9], size=56)
    base = {"batch_size": 8, "workers": 2, "image_size": 32, "mode": "epoch"}
    cpu = list(EvalLoader(str(index), LoaderConfig(**base)))
    on_gpu = EvalLoader(str(index), LoaderConfig(**base, decode="gpu", gpu_decoder=engine))
    got = list(on_gpu)
    assert [len(b["label"]) for b in got] == [len(b["label"]) for b in cpu]
    for a, b in zip(cpu, got, strict=True):
        assert torch.equal(a["label"], b["label"]) and torch.equal(a["id"], b["id"])
        assert b["image"].is_contiguous(memory_format=torch.channels_last)
        close(b["image"], a["image"])


class _RefusesRegions:
    """nvImageCodec's decoder as the hardware one behaves under an nvJPEG older than 13.2: every
    region refused (the call with places given), whole images decoded."""

    def __init__(self, decoder):
        self.decoder, self.region_calls = decoder, 0

    def decode(self, streams, images=None, **kw):
        if images is None:  # the whole images of the refused ones, into buffers of its own
            return self.decoder.decode(streams, **kw)
        self.region_calls += 1
        return [None] * len(streams) if self.region_calls == 1 else self.decoder.decode(streams, images=images, **kw)


@needs_nvimgcodec
def test_a_decoder_that_refuses_every_region_goes_on_with_whole_images_and_the_same_pixels():
    codec = codecs.NvImageCodec(torch.device("cpu"), None)
    codec.decoder = _RefusesRegions(codec.decoder)
    tensors = [torch.frombuffer(bytearray(encode(64 + i, 48, i)), dtype=torch.uint8) for i in range(8)]
    wanted = [(i, 2 * i, 30, 40) for i in range(8)]

    def crops():
        src, places = codec.decode(tensors, wanted)
        assert all(p is not None for p in places)
        return [
            src[p.start : p.start + (p.height - 1) * p.stride + p.width * 3].as_strided(
                (3, p.height, p.width), (1, p.stride, 3)
            )
            for p in places
        ]

    first = crops()  # refused, then each whole image decoded and its crop copied out
    assert not codec.regions and "refused every region" in codec.name
    for got, data, (top, left, h, w) in zip(crops(), tensors, wanted, strict=True):  # whole images, cut
        want = decode_jpeg(data, mode=ImageReadMode.RGB)[:, top : top + h, left : left + w]
        assert torch.equal(got, want)
        assert torch.equal(first.pop(0), want)


def test_the_environment_tunes_nvimagecodec_and_a_wrong_backend_is_one_line():
    env = {
        "WDSDIST_NVIMGCODEC_BACKENDS": "HW_GPU_ONLY:0.75, GPU_ONLY",
        "WDSDIST_NVIMGCODEC_OPTIONS": ":fancy_upsampling=1",
        "WDSDIST_NVIMGCODEC_REGIONS": "0",
        "WDSDIST_NVIMGCODEC_CPU_THREADS": "2",
    }
    assert codecs.tuning(env) == {
        "backends": ("HW_GPU_ONLY:0.75", "GPU_ONLY"),
        "options": ":fancy_upsampling=1",
        "regions": False,
        "cpu_threads": 2,
    }
    assert codecs.tuning({}) == {}
    with pytest.raises(UserError, match=r"^WDSDIST_NVIMGCODEC_CPU_THREADS='two': a number of threads"):
        codecs.tuning({"WDSDIST_NVIMGCODEC_CPU_THREADS": "two"})
    if not HAVE_NVIMGCODEC:
        return
    import nvidia.nvimgcodec as nv

    # The CPU backend with two host threads decodes as libjpeg-turbo does
    data = torch.frombuffer(bytearray(encode(90, 70, 5)), dtype=torch.uint8)
    codec = codecs.NvImageCodec(torch.device("cpu"), None, cpu_threads=2)
    src, [place] = codec.decode([data], [(4, 6, 30, 40)])
    want = decode_jpeg(data, mode=ImageReadMode.RGB)[:, 4:34, 6:46].permute(1, 2, 0)
    assert place is not None and torch.equal(codec.arena.view(place), want)

    assert codecs._backend(nv, "v", "HW_GPU_ONLY:0.75").load_hint == pytest.approx(0.75)
    wrong = [("HW:1", "has no backend 'HW'; it has CPU_ONLY"), ("GPU_ONLY:half", "'half' is not a share")]
    for spec, said in [*wrong, ("GPU_ONLY:1.5", "'1.5' is not a share between 0 and 1")]:
        with pytest.raises(UserError, match=said) as caught:
            codecs._backend(nv, "v", spec)
        assert "\n" not in str(caught.value)
