"""wdsdist/preload.py: the [gpu] extra's nvJPEG found beside nvImageCodec and loaded before
torchvision's copy; nothing done without the extra, once torchvision is in, or for a broken file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from wdsdist import preload


def extra(root, nvimgcodec=True, nvjpeg=True, content=b"not an ELF file"):
    if nvimgcodec:
        (root / "nvidia" / "nvimgcodec").mkdir(parents=True)
    if nvjpeg:
        lib = root / preload.LIBRARY
        lib.parent.mkdir(parents=True)
        lib.write_bytes(content)
    return root


def test_the_extras_nvjpeg_is_found_only_where_nvimagecodec_is_installed(tmp_path):
    both = extra(tmp_path / "both")
    alone = extra(tmp_path / "alone", nvimgcodec=False)
    codec_only = extra(tmp_path / "codec", nvjpeg=False)
    assert preload.extra_nvjpeg([str(alone)]) is None  # nvJPEG without nvImageCodec: not ours to load
    assert preload.extra_nvjpeg([str(codec_only)]) is None
    assert preload.extra_nvjpeg(["", str(codec_only), str(both)]) == both / preload.LIBRARY
    # nvImageCodec in one folder, the nvJPEG wheel in another (two site-packages)
    assert preload.extra_nvjpeg([str(codec_only), str(alone)]) == alone / preload.LIBRARY


def test_a_file_that_does_not_load_is_passed_over_and_torchvision_first_means_nothing_is_loaded(tmp_path):
    site = extra(tmp_path / "site")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import wdsdist.preload as p; "
        "print(p.loaded); import torchvision; p.loaded = None; p.nvjpeg(); print(p.loaded)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]  # a broken library: not loaded, no error


def test_with_the_extra_its_nvjpeg_is_loaded_before_torchvision_under_its_soname(tmp_path):
    # a real shared library (libm), named as the wheel names nvJPEG: mapped from that path
    libm = next(
        Path(d) / "libm.so.6" for d in ("/lib/x86_64-linux-gnu", "/usr/lib64") if (Path(d) / "libm.so.6").exists()
    )
    site = extra(tmp_path / "site", content=libm.read_bytes())
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import wdsdist, torchvision; "
        "print(wdsdist.preload.loaded); print(any(sys.argv[1] in l for l in open('/proc/self/maps')))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(site / preload.LIBRARY), "True"]
