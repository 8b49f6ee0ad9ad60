"""decode=gpu's JPEG decoders: a batch's regions decoded into one reused uint8 buffer.

Each decoder takes the batch's JPEGs and, per image, the region to decode (the training crop) or
None (the whole image: evaluation), and returns the buffer and where each region lies in it
(resize.Place), or None for an image it refused. resize.BatchResize then makes the batch of it.

- ``NvImageCodec`` (the ``[gpu]`` extra, nvidia-nvimgcodec-cu13): the batch in one call, each
  crop decoded as a region, on the hardware JPEG engines where the GPU has them and on its CUDA
  decoder otherwise, chroma upsampled with interpolation as libjpeg-turbo does, written into the
  reused buffer on the decode stream. Where it cannot decode a region it decodes the whole image
  and the crop is cut from it.
- ``TorchvisionCodec``, without the extra: torchvision's batched nvJPEG decode of whole images,
  each crop copied into the buffer. nvJPEG upsamples 4:2:0 chroma without interpolation, so its
  pixels are not libjpeg-turbo's (bench/results/2026-11-27-gpu-check.md).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from wdsdist.data.autos import NVIMGCODEC
from wdsdist.data.decode.resize import Place
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

Region = tuple[int, int, int, int]  # top, left, height, width
ALIGN = 256  # each region's first byte, as cudaMalloc aligns
# nvImageCodec releases whose region decode fails on the GPU (NVIDIA/nvImageCodec#55: a crash on
# H100 and B200 in 0.9.0): the whole image is decoded there and the crop cut from it.
REGIONS_BROKEN: tuple[str, ...] = ()
# On a GPU: the hardware JPEG engines first, the CUDA decoder for what they refuse (KIND[:share]).
BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY")
# Chroma upsampled with interpolation, as libjpeg-turbo does (nvImageCodec 0.8's default is off);
# the CUDA decoder's Huffman decoding on the GPU, where by default it runs on host threads for
# images of ImageNet's size.
OPTIONS = ":fancy_upsampling=1 nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"


@contextlib.contextmanager
def _stderr_to_log() -> Iterator[None]:
    """What a C library writes on stderr meanwhile, logged at debug level: nvImageCodec names the
    codecs' libraries it cannot load (JPEG 2000, TIFF), which decode=gpu does not use."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode("utf-8", "replace").strip()
            if text:
                log.debug("nvImageCodec said: %s", text)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One uint8 buffer on a device for a batch's regions, reused from batch to batch and grown
    when a batch needs more. The next batch's regions are written only after the last batch's
    resize has read them: both run on the decoder's stream, in order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def places(self, sizes: Sequence[tuple[int, int]]) -> list[Place]:
        """Room for regions of these (height, width), each at an aligned start."""
        places, start = [], 0
        for height, width in sizes:
            places.append(Place(start, width * 3, height, width))
            start += _aligned(height * width * 3)
        if self.buffer.numel() < start:
            self.buffer = torch.empty(int(start * 1.25), dtype=torch.uint8, device=self.device)
        return places

    def view(self, p: Place) -> torch.Tensor:
        """A place as an H x W x 3 tensor."""
        return self.buffer[p.start : p.start + p.height * p.stride].view(p.height, p.width, 3)


class _DeviceArray:
    """A place in the arena as nvImageCodec reads an external buffer (the CUDA array interface),
    made without torch's per-tensor bookkeeping."""

    def __init__(self, pointer: int, height: int, width: int):
        self.__cuda_array_interface__ = {
            "shape": (height, width, 3),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


def nvimgcodec_version() -> str | None:
    """The installed nvImageCodec's version, or None without the extra."""
    try:
        return importlib.metadata.version(NVIMGCODEC)
    except importlib.metadata.PackageNotFoundError:
        return None


class NvImageCodec:
    """nvImageCodec's decoder on ``device`` (CUDA; on the CPU its CPU backend, which is how the
    suite runs this path), writing on ``stream``; ``cpu_threads``: its host threads (0: one per
    core, nvImageCodec's default)."""

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        regions: bool | None = None,
        backends: Sequence[str] = BACKENDS,
        options: str = OPTIONS,
        cpu_threads: int = 0,
    ):
        # Its warnings go to stderr, one line per image it hands back to us (which we decode
        # another way and count): errors only, unless the user asked for more.
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "1")
        with _stderr_to_log():
            self.nv = nv = importlib.import_module("nvidia.nvimgcodec")
        self.version = nvimgcodec_version() or "?"
        self.device, self.stream = device, stream
        broken = device.type == "cuda" and self.version.startswith(REGIONS_BROKEN)
        self.regions = regions if regions is not None else not broken
        if device.type == "cuda":
            backends = [_backend(nv, self.version, b) for b in backends]
            device_id = device.index if device.index is not None else torch.cuda.current_device()
        else:
            backends, device_id = (
                [nv.Backend(nv.BackendKind.CPU_ONLY)],
                getattr(nv, "NVIMGCODEC_DEVICE_CPU_ONLY", -99999),
            )
        with _stderr_to_log():  # it loads its extensions here, and says on stderr which libraries it lacks
            self.decoder = nv.Decoder(
                device_id=device_id, max_num_cpu_threads=cpu_threads, backends=backends, options=options
            )
        self.params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
        self.arena = Arena(device)
        self.name = f"nvImageCodec {self.version}" + (
            "" if self.regions else " (whole images: its region decode is off)"
        )

    def decode(self, datas: Sequence[torch.Tensor], regions: Sequence[Region | None]) -> tuple[torch.Tensor, list]:
        """The batch in one call; an image it refuses is None in the places."""
        nv, parents, streams, sizes, wanted = self.nv, [], [], [], []
        for data, region in zip(datas, regions, strict=True):
            try:
                stream = nv.CodeStream(data.numpy())
                whole = (stream.height, stream.width)
            except Exception:  # noqa: BLE001 (untrusted bytes: the CPU fallback names the sample)
                parents.append(None), streams.append(None), sizes.append((0, 0)), wanted.append(None)
                continue
            parents.append(stream)
            if region is not None and self.regions:
                top, left, height, width = region
                stream = stream.get_sub_code_stream(region=nv.Region(top, left, top + height, left + width))
                sizes.append((height, width)), wanted.append(None)
            else:
                sizes.append(whole), wanted.append(region)
            streams.append(stream)
        places = self.arena.places(sizes)
        todo = [i for i, s in enumerate(streams) if s is not None]
        images = [nv.as_image(self._target(places[i]), self._stream_id()) for i in todo]
        results = self.decoder.decode(
            [streams[i] for i in todo], images=images, params=self.params, cuda_stream=self._stream_id()
        )
        out: list[Place | None] = [None] * len(datas)
        for i, image in zip(todo, results, strict=True):
            if image is not None:
                out[i] = places[i] if wanted[i] is None else _within(places[i], wanted[i])
        if self.regions:
            self._all_refused(todo, regions, out)
            self._whole_for_refused(parents, regions, places, out)
        return self.arena.buffer, out

    def _all_refused(self, todo: list[int], regions, out) -> None:
        """Where every region of a batch was refused, whole images from then on (one call, the
        crops cut by the resize) rather than two calls a batch."""
        asked = [i for i in todo if regions[i] is not None]
        if len(asked) < 8 or any(out[i] is not None for i in asked):
            return
        self.regions = False
        self.name += " (whole images: it refused every region)"
        log.info(
            "nvImageCodec %s refused all %d regions of a batch (its hardware decoder does, with chroma "
            "interpolation, under nvJPEG older than 13.2: is torchvision's copy the one loaded?); "
            "whole images from here on, the crops cut from them",
            self.version,
            len(asked),
        )

    def _whole_for_refused(self, parents, regions, places, out) -> None:
        """The regions nvImageCodec refused (its hardware decoder refuses a region with chroma
        interpolation before nvJPEG 13.2), decoded from their whole images in one more call and
        each crop copied into its place."""
        todo = [i for i, r in enumerate(regions) if out[i] is None and parents[i] is not None and r is not None]
        if not todo:
            return
        images = self.decoder.decode([parents[i] for i in todo], params=self.params, cuda_stream=self._stream_id())
        for i, image in zip(todo, images, strict=True):
            if image is None:
                continue
            top, left, height, width = regions[i]
            self.arena.view(places[i]).copy_(self._tensor(image)[top : top + height, left : left + width])
            out[i] = places[i]

    def _target(self, p: Place):
        if self.device.type == "cuda":
            return _DeviceArray(self.arena.buffer.data_ptr() + p.start, p.height, p.width)
        return self.arena.view(p).numpy()

    def _stream_id(self) -> int:
        return self.stream.cuda_stream if self.stream is not None else 0

    def _tensor(self, image) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.from_dlpack(image)
        return torch.from_numpy(np.asarray(image.cpu()))


def _backend(nv, version: str, spec: str):
    """``KIND`` or ``KIND:LOAD`` (the share of the batch it is offered, 0-1) as nvImageCodec's Backend."""
    kind, _, load = spec.partition(":")
    if not hasattr(nv.BackendKind, kind):
        kinds = ", ".join(k for k in dir(nv.BackendKind) if k.isupper())
        raise UserError(f"nvImageCodec {version} has no backend {kind!r}; it has {kinds}")
    try:
        hint = float(load) if load else 1.0
    except ValueError:
        hint = -1.0
    if not 0.0 <= hint <= 1.0:
        raise UserError(f"nvImageCodec backend {spec!r}: {load!r} is not a share between 0 and 1")
    return nv.Backend(getattr(nv.BackendKind, kind), load_hint=hint)


def _within(p: Place, region: Region) -> Place:
    """The region of a whole image at place ``p``, as a place of its own (the same rows)."""
    top, left, height, width = region
    return Place(p.start + top * p.stride + left * 3, p.stride, height, width)


class TorchvisionCodec:
    """torchvision's batched nvJPEG decode (no extra needed): whole images, each region copied
    into the arena (one copy per image)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.arena = Arena(device)
        self.name = "torchvision's nvJPEG (chroma upsampled without interpolation: pixels differ from the CPU path's)"

    def decode(self, datas: Sequence[torch.Tensor], regions: Sequence[Region | None]) -> tuple[torch.Tensor, list]:
        images = self._decode(list(datas))
        sizes = []
        for image, region in zip(images, regions, strict=True):
            if image is None:
                sizes.append((0, 0))
            else:
                sizes.append(region[2:] if region is not None else tuple(image.shape[1:]))
        places = self.arena.places(sizes)
        out: list[Place | None] = []
        for image, region, place in zip(images, regions, places, strict=True):
            if image is None:
                out.append(None)
                continue
            if region is not None:
                top, left, height, width = region
                image = image[:, top : top + height, left : left + width]
            self.arena.view(place).copy_(image.permute(1, 2, 0))
            out.append(place)
        return self.arena.buffer, out

    def _decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every JPEG decoded in one batched call; where that fails (one bad image fails the
        whole call), each on its own, None for those the device's decoder refuses."""
        if not datas:
            return []
        try:
            return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError:
            return [self._decode_one(data) for data in datas]

    def _decode_one(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return None


def planned(engine: str = "auto") -> str:
    """Which decoder ``choose`` will take, named for a start-up line, without starting it."""
    version = nvimgcodec_version()
    if engine == "torchvision" or version is None:
        why = "" if engine == "torchvision" else f" ({NVIMGCODEC}, the [gpu] extra, is not installed)"
        return f"torchvision's nvJPEG{why}: chroma upsampled without interpolation, pixels differ from the CPU path's"
    nvjpeg = "the [gpu] extra's nvJPEG" if extra_nvjpeg_mapped() else "the nvJPEG loaded first (torchvision's, if any)"
    return f"nvImageCodec {version} with {nvjpeg}: crops decoded as regions, chroma upsampled as libjpeg-turbo does"


def extra_nvjpeg_mapped() -> bool:
    """Whether the nvidia-nvjpeg wheel's library is mapped in this process (wdsdist/preload.py
    maps it when wdsdist is imported before torchvision)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith("nvidia/cu13/lib/libnvjpeg.so.13") for line in maps)
    except OSError:
        return False


def choose(device: torch.device, stream, engine: str = "auto"):
    """nvImageCodec where the extra is installed (``engine`` "auto" or "nvimgcodec"), else
    torchvision's decoder; UserError where nvimgcodec is asked for and missing."""
    if engine == "torchvision":
        return TorchvisionCodec(device)
    if nvimgcodec_version() is None:
        if engine == "nvimgcodec":
            raise UserError(
                f"loader.gpu_decoder=nvimgcodec: {NVIMGCODEC} is not installed (pip install 'wds-distributed[gpu]')"
            )
        return TorchvisionCodec(device)
    return NvImageCodec(device, stream, **tuning())


def tuning(env: dict | None = None) -> dict:
    """nvImageCodec's settings as the environment overrides them, to try another on a GPU
    (gpu-check's probe times several): WDSDIST_NVIMGCODEC_BACKENDS (comma-separated
    ``KIND[:share]``, tried in order), WDSDIST_NVIMGCODEC_OPTIONS (its decoder options, as
    nvImageCodec reads them), WDSDIST_NVIMGCODEC_REGIONS (0: decode whole images, cut the crops),
    WDSDIST_NVIMGCODEC_CPU_THREADS (its host threads; 0, the default: one per core)."""
    env = os.environ if env is None else env
    out: dict = {}
    if env.get("WDSDIST_NVIMGCODEC_BACKENDS"):
        out["backends"] = tuple(k.strip() for k in env["WDSDIST_NVIMGCODEC_BACKENDS"].split(",") if k.strip())
    if "WDSDIST_NVIMGCODEC_OPTIONS" in env:
        out["options"] = env["WDSDIST_NVIMGCODEC_OPTIONS"]
    if env.get("WDSDIST_NVIMGCODEC_REGIONS", "") in ("0", "1"):
        out["regions"] = env["WDSDIST_NVIMGCODEC_REGIONS"] == "1"
    threads = env.get("WDSDIST_NVIMGCODEC_CPU_THREADS", "").strip()
    if threads:
        if not threads.isdigit():
            raise UserError(f"WDSDIST_NVIMGCODEC_CPU_THREADS={threads!r}: a number of threads, 0 for one per core")
        out["cpu_threads"] = int(threads)
    return out
