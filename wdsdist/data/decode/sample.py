"""One raw sample -> (uint8 CHW image, label), inside a DataLoader worker.

A JPEG is decoded by torchvision's libjpeg-turbo decoder, or only where its training crop falls
(jpegcrop); PNG, GIF and WebP by PIL. An image's size comes from its header and is refused above
``max_pixels`` before anything is allocated. Every failure is a DataError naming the shard and key.
"""

from __future__ import annotations

import contextlib
import io
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from wdsdist.data.decode import augment as augments
from wdsdist.data.decode import jpegcrop
from wdsdist.data.decode.gpu import Drawn, gpu_takes
from wdsdist.data.decode.jpegcrop import CropDecoder, JpegError
from wdsdist.data.options import LoaderConfig
from wdsdist.data.tar.tarread import Oversized
from wdsdist.errors import DataError

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they remain the
# libjpeg-turbo/libpng decoders that work here, so keep the warning out of every worker's log.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities", category=DeprecationWarning)
# decode_image only reads its input, so it gets the sample's bytes without a copy; torch warns
# that the buffer is read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _find(sample: dict, keys: str) -> Any:
    for k in keys.split(";"):
        if k in sample:
            return sample[k]
    return None


def make_transform(cfg: LoaderConfig, size: int | None = None) -> v2.Transform:
    """Training: RandomResizedCrop to ``size`` (default: image_size) and a flip; evaluation:
    resize the shorter side and centre-crop (LoaderConfig.eval_crop)."""
    if cfg.train:
        size = size or cfg.image_size
        return v2.Compose(
            [v2.RandomResizedCrop(size, scale=tuple(cfg.crop_scale), antialias=True), v2.RandomHorizontalFlip()]
        )
    resize, crop = cfg.eval_crop
    return v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])


def make_augment(cfg: LoaderConfig, size: int) -> augments.SampleAugment | None:
    """The training images' augmentations after the crop (data.augment, data.random_erase), or None."""
    if not cfg.train or not augments.SampleAugment.wanted(cfg.augment, cfg.random_erase):
        return None
    return augments.SampleAugment(cfg.augment, cfg.augment_n, cfg.augment_m, cfg.random_erase, cfg.mean, size)


# Not JPEG: decoded by PIL, whose decoders raise on damaged data where torchvision's libpng path
# crashes the process (a PNG with one flipped byte in its image data: "libpng error: IDAT:
# incorrect data check", then a segmentation fault). Only the formats torchvision read: PIL
# also opens formats whose loading runs a program (EPS runs Ghostscript).
_PIL_FORMATS = ("PNG", "GIF", "WEBP")
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I")


def _decode_other(data: bytes, where: str, max_pixels: int) -> torch.Tensor:
    """A PNG, GIF or WebP as a uint8 RGB CHW tensor, by PIL; an animation gives its first frame.

    The pixel budget counts every frame, as declared by the file (the frame count of a GIF is
    found by walking its blocks, none decoded): torchvision decodes all of them, so a GIF under a
    kilobyte with a 2000x2000 canvas and 40 one-pixel frames would cost hundreds of MB
    (tests/data/test_faults_data.py holds the budget).
    """
    try:
        with Image.open(io.BytesIO(data), formats=_PIL_FORMATS) as img:
            frames = getattr(img, "n_frames", 1)
            width, height = img.size
            if width * height * frames > max_pixels:
                what = f"{width}x{height} pixels" + (f" x {frames} frames" if frames > 1 else "")
                raise DataError(f"{where}: image of {what} exceeds max_pixels={max_pixels}")
            img.seek(0)
            if img.mode in _SIXTEEN_BIT:  # 16-bit grey: keep the high byte (convert() would clip)
                img = img.convert("I").point(lambda v: v * (1 / 256))
            rgb = img.convert("RGB")
            pixels = torch.frombuffer(rgb.tobytes(), dtype=torch.uint8)
    except DataError:
        raise
    except Image.UnidentifiedImageError:
        raise DataError(f"{where}: cannot decode image: not a JPEG, PNG, GIF or WebP image") from None
    except Exception as exc:  # untrusted bytes: whatever PIL raises, the sample is bad, not the run
        raise DataError(f"{where}: cannot decode image: {exc.__class__.__name__}: {exc}") from None
    return pixels.view(rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()


def decode_sample(
    sample: dict, cfg: LoaderConfig, transform: v2.Transform, crop: CropDecoder | None = None
) -> tuple[torch.Tensor, int]:
    """Raw sample -> (uint8 CHW image, label); raises DataError naming the shard and key.
    With ``crop``, a JPEG is decoded only where ``transform``'s crop falls (jpegcrop)."""
    return prepare_sample(sample, cfg, transform, crop)()


@dataclass(frozen=True)
class Augmented:
    """A sample's pixels with its augmentation draws applied (SampleAugment.apply): drawn in the
    stream's order, applied when the pixels are made."""

    make: Callable[[], tuple[torch.Tensor, int]]
    augment: augments.SampleAugment
    drawn: augments.Drawn

    def __call__(self) -> tuple[torch.Tensor, int]:
        image, label = self.make()
        return self.augment.apply(image, self.drawn), label


def _augmented(make: Callable, augment: augments.SampleAugment | None) -> Callable:
    """``make`` with the augmentations drawn now (after its crop's draws), or ``make`` itself."""
    return make if augment is None else Augmented(make, augment, augment.draw())


@dataclass(frozen=True)
class RegionJob:
    """A JPEG whose crop and flip are drawn; calling it makes the pixels (CropDecoder.render:
    jpegcrop's region decode, else torchvision's whole decode)."""

    crop: CropDecoder
    data: bytes
    width: int
    height: int
    drawn: tuple[dict, bool]
    whole: Callable[[], torch.Tensor]
    label: int

    def __call__(self) -> tuple[torch.Tensor, int]:
        return self.crop.render(self.data, self.width, self.height, self.drawn, self.whole), self.label


def prepare_sample(
    sample: dict,
    cfg: LoaderConfig,
    transform: v2.Transform,
    crop: CropDecoder | None = None,
    draw: Callable[[int, int], tuple[dict, bool]] | None = None,
    augment: augments.SampleAugment | None = None,
    size: int | None = None,
) -> Callable[[], tuple[torch.Tensor | Drawn, int]]:
    """decode_sample in two steps. This one checks the sample and makes its random draws, so it
    runs in the stream's order; for a JPEG that ``crop`` takes, the function it returns (a
    RegionJob) makes the pixels, drawing nothing and sharing nothing, so threads may run several
    at once (the worker's first batch: warmstart.py). Other images are decoded here. Either step
    raises DataError naming the shard and key. With ``draw`` (loader.decode=gpu), a JPEG that the
    GPU decoder takes comes out undecoded, as a gpu.Drawn with the crop and flip ``draw`` made,
    where the CPU path makes the same draws (decode/gpu.py), and at ``size`` (its batch's). With
    ``augment``, its draws follow the crop's, and the function applies them to the crop
    (decode/augment.py); a gpu.Drawn carries them to the device (decode/gpu_augment.py)."""
    where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
    data, label = _find(sample, cfg.image_key), _find(sample, cfg.label_key)
    if data is None or label is None:
        missing = cfg.image_key if data is None else cfg.label_key
        present = sorted(k for k in sample if not k.startswith("__"))
        raise DataError(f"{where}: no {missing!r} in it (has {', '.join(present)})")
    for what, value in (("image", data), ("label", label)):
        if isinstance(value, Oversized):
            raise DataError(f"{where}: {what} of {value.size} bytes exceeds max_member_bytes={cfg.max_member_bytes}")
    # The label first: a bad one costs no decode.
    try:
        value = int(label.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{where}: label {label[:20]!r} is not an integer") from None
    if cfg.num_classes is not None and not 0 <= value < cfg.num_classes:
        raise DataError(f"{where}: label {value} is outside 0..{cfg.num_classes - 1} (num_classes={cfg.num_classes})")
    data = bytes(data)
    if not data.startswith(jpegcrop.JPEG_MAGIC):
        return _augmented(_ready(transform(_decode_other(data, where, cfg.max_pixels)), value), augment)

    def whole() -> torch.Tensor:
        try:
            return decode_image(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
        except (RuntimeError, ValueError) as exc:
            raise DataError(f"{where}: cannot decode image: {exc}") from None

    region = crop is not None and crop.takes(data)
    width, height = _jpeg_size(data, where, crop if region else None, cfg.max_pixels)
    # decode=gpu: the GPU's share of the JPEGs it takes; the others go on as on the CPU path
    if draw is not None and CropDecoder.takes(data) and gpu_takes(data) and on_gpu(where, cfg.gpu_decode_share):
        p, flip = draw(width, height)
        drawn = augment.draw() if augment is not None else None  # after the crop's, as below
        box = (p["top"], p["left"], p["height"], p["width"], int(flip))
        return _ready(Drawn(data, box, where, size, drawn), value)
    if region:
        return _augmented(RegionJob(crop, data, width, height, crop.draw(width, height), whole, value), augment)
    return _augmented(_ready(transform(whole()), value), augment)


def on_gpu(where: str, share: float) -> bool:
    """Whether decode=gpu's GPU decodes this JPEG (loader.gpu_decode_share): a hash of its shard
    and key against the share, so the same JPEGs go there in every run and after a resume."""
    return share >= 1.0 or zlib.crc32(where.encode("utf-8", "replace")) < share * 2**32


def eval_image(data: bytes, cfg: LoaderConfig, where: str) -> torch.Tensor:
    """An image's bytes as evaluation makes them (``cfg.train`` False): decoded, resized and
    centre-cropped by the same functions as in the evaluation loader's workers, uint8 CHW;
    DataError naming ``where`` for an image that cannot be decoded or is too large."""
    transform = make_transform(cfg)
    if not data.startswith(jpegcrop.JPEG_MAGIC):
        return transform(_decode_other(data, where, cfg.max_pixels))
    _jpeg_size(data, where, None, cfg.max_pixels)
    try:
        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError) as exc:
        raise DataError(f"{where}: cannot decode image: {exc}") from None
    return transform(image)


def _jpeg_size(data: bytes, where: str, crop: CropDecoder | None, max_pixels: int) -> tuple[int, int]:
    """A JPEG's (width, height) from its header (libjpeg's through ``crop``, else PIL's): a
    decompression bomb is refused before anything is allocated. DataError naming the sample."""
    size = None
    if crop is not None:
        with contextlib.suppress(JpegError):  # torchvision then decodes it, or says what is wrong
            size = crop.size(data)
    try:
        if size is None:
            with Image.open(io.BytesIO(data), formats=("JPEG",)) as header:
                size = header.size
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: cannot decode image: {exc}") from None
    width, height = size
    if width * height > max_pixels:
        raise DataError(f"{where}: image of {width}x{height} pixels exceeds max_pixels={max_pixels}")
    return width, height


def _ready(image: torch.Tensor | Drawn, label: int) -> Callable[[], tuple[torch.Tensor | Drawn, int]]:
    return lambda: (image, label)
