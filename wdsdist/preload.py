"""The [gpu] extra's nvJPEG, loaded before torchvision's copy (run from ``wdsdist/__init__``).

torchvision's CUDA wheels carry an nvJPEG of their own under the soname ``libnvjpeg.so.13``.
nvImageCodec opens nvJPEG by that soname, and the dynamic loader hands it the copy already in the
process: once torchvision is imported, nvImageCodec decodes with torchvision's nvJPEG (13.0), whose
hardware decoder refuses a region with chroma interpolation. Loaded first, and locally (so that
torchvision still binds its own), the extra's nvJPEG (13.2 or newer) is the one nvImageCodec gets.
Without the extra, or once torchvision is imported, this does nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)
LIBRARY = Path("nvidia", "cu13", "lib", "libnvjpeg.so.13")
loaded: str | None = None  # the path loaded; None where nothing was


def extra_nvjpeg(paths: list[str]) -> Path | None:
    """The first nvJPEG of the nvidia-nvjpeg wheel on ``paths``, where nvImageCodec is installed too."""
    if not any((Path(p) / "nvidia" / "nvimgcodec").is_dir() for p in paths if p):
        return None
    return next((Path(p) / LIBRARY for p in paths if p and (Path(p) / LIBRARY).is_file()), None)


def nvjpeg() -> None:
    global loaded
    if "torchvision" in sys.modules:
        return
    lib = extra_nvjpeg(sys.path)
    if lib is None:
        return
    import ctypes

    try:
        ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
        loaded = str(lib)
    except OSError as exc:  # a broken install: nvImageCodec then finds what it finds
        log.debug("%s: not loaded: %s", lib, exc)
