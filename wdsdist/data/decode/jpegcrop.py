"""RandomResizedCrop + RandomHorizontalFlip that decode only the crop's region of a JPEG.

A training crop keeps on average about half of an image (RandomResizedCrop's area scale is
uniform in [0.08, 1]), yet torchvision decodes all of it. ``jpegcrop.c`` asks libjpeg-turbo
for the region alone: rows above it are only entropy-decoded, columns beside it are not
transformed, rows below it are not read (a progressive JPEG is read whole first). The pixels
equal a whole decode's (tests check it bit for bit), and the random draws are torchvision's
own (those of the same ``v2.RandomResizedCrop``'s ``make_params``, draws.py), so one seed gives the same images
with or without this module, also where libjpeg refuses a file and torchvision decodes it.
Damage that lies wholly below the crop goes unnoticed, except a file cut short: only JPEGs
that end with their end-of-image marker are region-decoded.
What it saves per core is measured by bench.py ((e) against (d)): bench/results/2026-11-21-loader.md.

Where the region is at least 2, 4 or 8 times the output size in both sides, it is decoded
at that fraction of its size (libjpeg's DCT scaling), so the resize still only shrinks it
(``downscale``, off by default; such pixels differ from a bilinear shrink of the full decode, which
may cost accuracy: bench/results/2026-11-25-decode-downscale-accuracy.md).

The same library holds the policies' dearest ops in Pillow's arithmetic (augment_ops.py uses them).

The C part is compiled at pip install time (setup.py), or else on first use, with the system's C
compiler against the system's libjpeg-turbo (Debian: ``gcc libjpeg62-turbo-dev``), then into
``.build/`` (``WDSDIST_BUILD``). Without them ``load()`` says why and the loader decodes whole
images as before.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import hashlib
import math
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from wdsdist.data.decode.draws import CropDraw

SOURCE = Path(__file__).with_name("jpegcrop.c")
JPEG_MAGIC = b"\xff\xd8\xff"
_MSG_LEN = 200  # libjpeg's JMSG_LENGTH_MAX
SYMBOLS = ("jpegcrop_decode", "augment_affine", "augment_sharpness", "augment_lut", "augment_color")
# -ffp-contract=off: no fused multiply-adds, so the augmentations' float arithmetic is Pillow's
CFLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")  # setup.py builds it at pip install time with these too
_loaded: dict[Path, ctypes.CDLL | str] = {}


def build_dir() -> Path:
    """``WDSDIST_BUILD``; else the checkout's ``.build/``; else, for an installed package (no
    checkout around it: site-packages is no place to build in), the user's cache folder."""
    if os.environ.get("WDSDIST_BUILD"):
        return Path(os.environ["WDSDIST_BUILD"])
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() or (root / ".git").exists():
        return root / ".build"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "wdsdist"


def load(where: Path | None = None, cc: str | None = None) -> ctypes.CDLL | str:
    """The compiled library, or a one-line reason why there is none: the one pip install built
    (setup.py), else one built here on first use into ``where`` (``build_dir()``)."""
    if where is None and (lib := installed()) is not None:
        return lib
    where = where or build_dir()
    if where not in _loaded:
        _loaded[where] = _load(where, cc or os.environ.get("CC", "cc"))
    return _loaded[where]


def source_tag() -> str:
    """The source's hash on this machine's architecture: in a build's file name, and in the one
    pip install makes (its jpegcrop_tag())."""
    return hashlib.sha256(SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:12]


@functools.cache
def installed() -> ctypes.CDLL | None:
    """The library pip install built beside this file (setup.py), if it is there and was built
    from this very source."""
    for path in sorted(SOURCE.parent.glob("_jpegcrop*.so")):
        lib = _open(path)
        if isinstance(lib, str) or not _complete(lib) or not hasattr(lib, "jpegcrop_tag"):
            continue
        lib.jpegcrop_tag.restype = ctypes.c_char_p
        if lib.jpegcrop_tag().decode() == source_tag():
            return _configured(lib)
    return None


def _load(where: Path, cc: str) -> ctypes.CDLL | str:
    path = where / f"jpegcrop-{source_tag()}.so"
    remove_dead_temporaries(where)
    if not path.exists():
        failed = _build(where, path, cc)
        if failed:
            return failed
    lib = _open(path)
    if not isinstance(lib, str) and not _complete(lib):
        # The name carries the source's hash, so this is no older build of ours but a damaged or
        # foreign file: build it anew once. dlopen hands back a loaded library by its name, so
        # the bad one is closed first.
        _ctypes.dlclose(lib._handle)
        failed = _build(where, path, cc)
        if failed:
            return f"{path} has no jpegcrop_decode (a damaged or foreign file), and {failed}"
        lib = _open(path)
        if not isinstance(lib, str) and not _complete(lib):
            _ctypes.dlclose(lib._handle)
            return f"{path} has no jpegcrop_decode even when rebuilt from {SOURCE.name}"
    if isinstance(lib, str):
        return lib
    return _configured(lib)


def _configured(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' argument types set."""
    int_p = ctypes.POINTER(ctypes.c_int)
    lib.jpegcrop_decode.argtypes = [ctypes.c_char_p, ctypes.c_ulong, int_p, int_p] + [ctypes.c_int] * 5
    lib.jpegcrop_decode.argtypes += [ctypes.c_void_p, ctypes.c_char_p]
    ptr, size = ctypes.c_void_p, ctypes.c_int
    lib.augment_affine.argtypes = [ptr, size, size, ptr, ctypes.POINTER(ctypes.c_double), ptr]
    lib.augment_sharpness.argtypes = [ptr, size, size, ptr, ctypes.c_float]
    lib.augment_blend_lut.argtypes = [size, ctypes.c_float, ptr]
    lib.augment_lut.argtypes = [ptr, size, ptr, ptr]
    lib.augment_histogram.argtypes = [ptr, size, ptr, size]
    lib.augment_color.argtypes = [ptr, size, ptr, ctypes.c_float]
    return lib


def _complete(lib: ctypes.CDLL) -> bool:
    return all(hasattr(lib, name) for name in SYMBOLS)


def _open(path: Path) -> ctypes.CDLL | str:
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        return f"cannot load {path}: {exc}"


_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
_TEMP = re.compile(r"tmp(?:-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[0-9a-f]{8})?.*\.so")
STALE_TEMP_S = 600.0  # a compile takes about a second; a temporary this old has no live writer


def _build(where: Path, path: Path, cc: str) -> str | None:
    """Compile SOURCE into ``path`` (atomically: a temporary, then a rename); None, or why not."""
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) to build {SOURCE.name}"
    # Named after its writer (host and pid), so a later load can tell a killed compile's
    # leftover from a live compile's file.
    tmp = where / f"tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.so"
    try:
        where.mkdir(parents=True, exist_ok=True)
        try:
            command = [cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-ljpeg", "-lm"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
                said = [ln for ln in lines if "fatal error" in ln or "cannot find" in ln]
                said += [ln for ln in lines if "error" in ln] + lines
                return f"cannot build {SOURCE.name}: {said[0]}"
            os.chmod(tmp, 0o755)  # other users (the Docker image's) must load it too
            os.replace(tmp, path)  # atomic: processes building at once each finish their own file
        finally:
            tmp.unlink(missing_ok=True)  # a failed compile's partial output
    except OSError as exc:
        return f"cannot build {SOURCE.name} in {where}: {exc}"
    return None


def remove_dead_temporaries(where: Path) -> list[Path]:
    """Remove the temporaries (tmp*.so) of compiles that were killed: this host's whose process
    is gone, and any older than STALE_TEMP_S (another host's, or an older naming's)."""
    removed = []
    try:
        names = os.listdir(where)
    except OSError:
        return removed
    for name in names:
        m = _TEMP.fullmatch(name)
        if m is None:
            continue
        p = where / name
        try:
            dead = m["host"] == _HOST and not _alive(int(m["pid"]))
            if dead or time.time() - p.lstat().st_mtime > STALE_TEMP_S:
                p.unlink()
                removed.append(p)
        except OSError:  # gone already, or a read-only build directory (the Docker image's)
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class JpegError(Exception):
    """libjpeg refused the data (its own message)."""


class CropDecoder:
    """``crop`` then ``flip`` on a JPEG's bytes, decoding only the crop's region."""

    def __init__(self, lib: ctypes.CDLL, crop: v2.RandomResizedCrop, flip: v2.RandomHorizontalFlip, downscale: bool):
        self.lib, self.crop, self.flip, self.downscale = lib, crop, flip, downscale
        self.draw = CropDraw(crop, flip)  # (width, height) -> (crop, flip), as the v2 transforms draw them
        self._msg = ctypes.create_string_buffer(_MSG_LEN)

    @staticmethod
    def takes(data: bytes) -> bool:
        """A JPEG that ends with its end-of-image marker. The region decode stops after the
        crop's last row, so it would not notice a file cut short below the crop; torchvision's
        whole decode does (and refuses it), so such a file goes there."""
        return data.startswith(JPEG_MAGIC) and data[-64:].rstrip(b"\0").endswith(b"\xff\xd9")

    def size(self, data: bytes) -> tuple[int, int]:
        """(width, height) from the header; JpegError if libjpeg cannot read it."""
        return _call(self.lib, data, 0, 0, 0, 0, 0, None, msg=self._msg)  # denom 0: the header only

    def scale(self, height: int, width: int) -> int:
        """The DCT scale's denominator for a region of height x width: 1, or the largest of
        2, 4, 8 that leaves it at least the output size in both sides."""
        out_h, out_w = self.crop.size
        if self.downscale:
            for denom in (8, 4, 2):
                if height // denom >= out_h and width // denom >= out_w:
                    return denom
        return 1

    def region_of(self, width: int, height: int, p: dict) -> tuple[int, int, int, int, int]:
        """(denom, x, y, w, h): the region of a ``width`` x ``height`` image that the crop ``p`` (from
        ``draw``) decodes, in pixels of the image decoded at 1/denom of its size."""
        top, left, h, w = p["top"], p["left"], p["height"], p["width"]
        denom = self.scale(h, w)
        if denom > 1:  # the region in the scaled image, which is ceil(size / denom) pixels
            x0, y0 = left // denom, top // denom
            x1 = min(math.ceil((left + w) / denom), math.ceil(width / denom))
            y1 = min(math.ceil((top + h) / denom), math.ceil(height / denom))
            left, top, w, h = x0, y0, x1 - x0, y1 - y0
        return denom, left, top, w, h

    def render(self, data: bytes, width: int, height: int, drawn: tuple[dict, bool], whole) -> torch.Tensor:
        """The uint8 CHW crop that ``drawn`` (from ``draw``) says, resized and maybe flipped. Where
        libjpeg refuses the data (CMYK, a warning), the crop is taken from ``whole()``,
        torchvision's decode. It draws nothing and keeps nothing, so threads may run it at once."""
        p, flip = drawn
        size, interpolation, antialias = self.crop.size, self.crop.interpolation, self.crop.antialias
        denom, left, top, w, h = self.region_of(width, height, p)
        try:
            out = region(self.lib, data, left, top, w, h, denom).permute(2, 0, 1)
            image = F.resize(out, size, interpolation, antialias=antialias)
        except JpegError:
            image = F.resized_crop(whole(), **p, size=size, interpolation=interpolation, antialias=antialias)
        return F.horizontal_flip(image) if flip else image

    def __call__(self, data: bytes, width: int, height: int, whole: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``draw`` then ``render``: the random draws stay those of the transform (and every later
        sample's with them), also where torchvision decodes the file."""
        return self.render(data, width, height, self.draw(width, height), whole)


def region(lib: ctypes.CDLL, data: bytes, x: int, y: int, w: int, h: int, denom: int = 1, msg=None) -> torch.Tensor:
    """Pixels x..x+w, y..y+h of a JPEG decoded at 1/denom of its size, as a uint8 HWC RGB tensor."""
    out = torch.empty(h, w, 3, dtype=torch.uint8)
    _call(lib, data, denom, x, y, w, h, out.data_ptr(), msg=msg)
    return out


def _call(lib: ctypes.CDLL, data: bytes, *args, msg=None) -> tuple[int, int]:
    """jpegcrop_decode; the image's (width, height), or JpegError with libjpeg's message."""
    msg = msg if msg is not None else ctypes.create_string_buffer(_MSG_LEN)
    width, height = ctypes.c_int(), ctypes.c_int()
    if lib.jpegcrop_decode(data, len(data), ctypes.byref(width), ctypes.byref(height), *args, msg):
        raise JpegError(msg.value.decode(errors="replace"))
    return width.value, height.value


def crop_decoder(transform: v2.Transform, downscale: bool, lib: ctypes.CDLL | str | None = None) -> CropDecoder | None:
    """A CropDecoder doing what ``transform`` does, if it is RandomResizedCrop then
    RandomHorizontalFlip and the library loads; else None (decode whole images)."""
    lib = load() if lib is None else lib
    steps = getattr(transform, "transforms", [])
    if isinstance(lib, str) or len(steps) != 2:
        return None
    crop, flip = steps
    if not isinstance(crop, v2.RandomResizedCrop) or not isinstance(flip, v2.RandomHorizontalFlip):
        return None
    return CropDecoder(lib, crop, flip, downscale)
