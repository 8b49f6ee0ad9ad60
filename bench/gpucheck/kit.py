#!/usr/bin/env python3
"""``./run gpu-kit [DIR]``: what ``./run gpu-check`` needs on a GPU machine that reaches no
package index, made here, where pip reaches PyPI.

A GPU image brings python3 with torch, torchvision and the common libraries, but not the
trainer's config stack nor the shard reader. The kit holds them as wheels at the versions
requirements.txt pins (omegaconf's parser, antlr4-python3-runtime, has only an sdist on PyPI,
so it is built into a wheel here), plus the region decoder (jpegcrop, compiled here against
Debian's libjpeg-turbo) with that libjpeg beside it: a bare image has neither a C compiler's
libjpeg headers nor the library. ``./run gpu-check`` installs the wheels into a folder of its
own and puts the build folder on WDSDIST_BUILD and LD_LIBRARY_PATH.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

# What a GPU image lacks of requirements.txt (torch, torchvision, numpy, pillow, matplotlib,
# tensorboard, tqdm and pyyaml are there; boto3 is only read for s3:// and gs:// shards).
NEEDED = ("hydra-core", "omegaconf", "webdataset", "braceexpand")
SDIST_ONLY = "antlr4-python3-runtime"  # hydra-core's and omegaconf's parser: no wheel on PyPI
LIMIT_MB = 60  # the kit travels with the working tree to the GPU machine
# decode=gpu's decoder (the [gpu] extra), each release to be tried on the GPU (nvImageCodec#55:
# region decode crashes on some GPUs in 0.9.0), and the nvJPEG it loads. Each wheel is cut to what
# decode=gpu loads (one Python's module, the JPEG extensions): the two whole ones are 57 MB.
NVIMGCODEC_RELEASES = ("0.8.0.22", "0.9.0.20")
# nvJPEG 13.2 or newer: before it, nvImageCodec's hardware decoder refuses a region with chroma
# interpolation (bench/results/2026-11-28-gpu-check.md).
NVJPEG = "nvidia-nvjpeg==13.3.2.43"
KEEP_EXTENSIONS = ("libnvjpeg_ext", "libjpeg_turbo_ext")
PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")

PROG = "./run gpu-kit"  # what its usage and errors name


def normalized(name: str) -> str:
    """A project name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(requirements: str) -> dict[str, str]:
    """name -> version of every ``name==version`` line of a requirements file."""
    found = {}
    for line in requirements.splitlines():
        m = PIN.match(line)
        if m:
            found[normalized(m.group(1))] = m.group(2)
    return found


def wanted(requirements: str, antlr_version: str) -> tuple[list[str], str]:
    """The wheels to download (``name==version``) and the sdist to build into one."""
    pinned = pins(requirements)
    missing = [name for name in NEEDED if name not in pinned]
    if missing:
        raise SystemExit(f"error: requirements.txt pins no version of {', '.join(missing)}: the kit takes its pins")
    return [f"{name}=={pinned[name]}" for name in NEEDED], f"{SDIST_ONLY}=={antlr_version}"


def antlr_version() -> str:
    """The antlr4 runtime that this environment resolved for the pinned hydra-core and omegaconf."""
    try:
        return importlib.metadata.version(SDIST_ONLY)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"error: {SDIST_ONLY} is not installed here: run ./run venv first") from None


def libjpeg_in(ldd: str) -> Path | None:
    """Where libjpeg.so.62 resolves, from ``ldd``'s output (or ``ldconfig -p``'s)."""
    m = re.search(r"^\s*libjpeg\.so\.62\b[^\n]*?=>\s*(/\S+)", ldd, re.MULTILINE)
    return Path(m.group(1)) if m else None


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"]
    print("  " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def fetch_wheels(kit: Path, python_version: str) -> None:
    for old in kit.glob("*.whl"):  # one version of each: two would stop the install there
        old.unlink()
    wheels, sdist = wanted((ROOT / "requirements.txt").read_text(), antlr_version())
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version, "-d", str(kit), *wheels)
    pip("wheel", "--no-deps", "-w", str(kit), sdist)


def slim_member(name: str, python_tag: str) -> bool:
    """Whether a wheel member is what decode=gpu loads: not the other Pythons' modules, the other
    codecs' extensions, the headers, the DICOM tools, nor the ``nvidia/__init__.py`` that would
    make ``nvidia`` a regular package and hide torch's CUDA libraries' namespace."""
    if name == "nvidia/__init__.py" or "/include/" in name or "/tools/" in name or name.endswith("/RECORD"):
        return False
    if "nvimgcodec_impl.cpython-" in name:
        return f"nvimgcodec_impl.{python_tag}-" in name
    if "/extensions/" in name and not name.endswith("/"):
        return name.rsplit("/", 1)[1].startswith(KEEP_EXTENSIONS)
    return True


def slim_wheel(wheel: Path, out: Path, python_tag: str) -> Path:
    """``wheel`` rewritten into ``out`` with only the members slim_member keeps, and its RECORD."""
    import base64
    import hashlib
    import zipfile

    target = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record, record_name = [], next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.is_dir() or not slim_member(info.filename, python_tag):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record_name, "\n".join(record + [f"{record_name},,"]) + "\n")
    return target


def fetch_gpu_decoder(kit: Path, python_version: str) -> None:
    """kit/nvimgcodec/: nvJPEG's wheel, and each nvImageCodec release cut down in a folder of its own."""
    folder = kit / "nvimgcodec"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (28, 27, 17)] + ["--platform=manylinux2014_x86_64"]
    common = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version, *platforms]
    pip(*common, "-d", str(folder), NVJPEG)
    tag = "cpython-" + python_version.replace(".", "")
    for release in NVIMGCODEC_RELEASES:
        whole = folder / "whole"
        pip(*common, "-d", str(whole), f"nvidia-nvimgcodec-cu13=={release}")
        (folder / release).mkdir()
        for wheel in whole.glob("*.whl"):
            slim_wheel(wheel, folder / release, tag)
        shutil.rmtree(whole)


def build_jpegcrop(build: Path) -> Path:
    """jpegcrop compiled into ``build`` (the file name carries its source's hash), with the
    libjpeg it links beside it; older builds there removed."""
    from wdsdist.data.decode import jpegcrop

    for old in build.glob("jpegcrop-*.so"):
        if old.name != f"jpegcrop-{jpegcrop.source_tag()}.so":
            old.unlink()
    lib = jpegcrop.load(build)
    if isinstance(lib, str):
        raise SystemExit(f"error: jpegcrop: {lib} (Debian: apt-get install gcc libjpeg62-turbo-dev)")
    so = Path(lib._name)
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    found = libjpeg_in(ldd) or libjpeg_in(subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout)
    if found is None:
        raise SystemExit(f"error: cannot find the libjpeg.so.62 that {so.name} links (ldd, ldconfig -p)")
    shutil.copyfile(found.resolve(), build / "libjpeg.so.62")  # the file itself, not a link
    return so


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default="gpu-kit", help="the kit's folder (default gpu-kit/, git-ignored)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = p.parse_args(argv)
    kit = Path(args.dir).resolve()
    (kit / "build").mkdir(parents=True, exist_ok=True)
    print(f"gpu-kit: wheels into {kit}", flush=True)
    fetch_wheels(kit, args.python_version)
    fetch_gpu_decoder(kit, args.python_version)
    so = build_jpegcrop(kit / "build")
    print(f"gpu-kit: {so.name} and libjpeg.so.62 in {kit / 'build'}", flush=True)
    for f in sorted(kit.rglob("*")):
        if f.is_file():
            print(f"  {f.relative_to(kit)}  {f.stat().st_size / 1e3:.0f} kB")
    total = size_of(kit)
    print(f"gpu-kit: {total / 1e6:.1f} MB in all (at most {LIMIT_MB} MB)", flush=True)
    if total > LIMIT_MB * 1e6:
        print(f"error: the kit is {total / 1e6:.1f} MB, over {LIMIT_MB} MB", file=sys.stderr)
        return 1
    print(f"on the GPU machine, with {kit.name}/ beside ./run: ./run gpu-check --kit {kit.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
