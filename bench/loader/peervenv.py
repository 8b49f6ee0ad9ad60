"""The peers' environment for ``bench.py --peers``: .bench-venv/, made from bench/requirements-peers.txt.

Kept apart from .venv so the peers (and the numpy they pin) never reach the trainer or the tests.
Rebuilt only when the requirements file's hash changes: the hash is written last, so an install
that failed or was killed is rebuilt on the next run rather than used half made. FFCV is built
from source in a step of its own, against Debian packages nothing else here needs: where they
are missing it is not tried, the stamp says which packages (and the line that installs them),
the other peers still install, and the next run builds it once they are there.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"
VENV = ROOT / ".bench-venv"
STAMP = ".requirements.json"
# The sdists that compile against system headers: the pkg-config module each needs, and the
# Debian package that brings it (ffcv's setup.py asks pkg-config for opencv4 and libturbojpeg).
SOURCE_BUILT = {"ffcv": {"opencv4": "libopencv-dev", "libturbojpeg": "libturbojpeg0-dev"}}
# The peers that load system libraries at run time: the libraries, and the Debian package that
# brings them all (spdl opens whichever FFmpeg, 4 to 9, the machine has).
RUNTIME = {"spdl": (("avcodec", "avformat", "avfilter", "avdevice", "swscale", "avutil"), "ffmpeg")}
# The torch trap (see requirements-peers.txt): a torchvision that does not match torch imports
# but fails at its first operator, so the check runs one.
CHECK = (
    "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5); print(torch.__version__)"
)


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def python() -> Path:
    return VENV / "bin" / "python"


def stamp() -> dict | None:
    """What the last complete build recorded, or None if .bench-venv does not fit the requirements."""
    try:
        info = json.loads((VENV / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("sha256") == file_hash(REQUIREMENTS) and python().exists() else None


def _name(req: str) -> str:
    return req.split("==")[0].strip().lower()


def missing_packages(name: str) -> list[str]:
    """The Debian packages the peer ``name`` needs that this machine lacks: those a source-built
    peer compiles against (pkg-config too, which finds them), or those whose libraries it opens at
    run time; [] for a wheel that brings what it needs."""
    if name in RUNTIME:
        libraries, package = RUNTIME[name]
        return [package] if any(ctypes.util.find_library(lib) is None for lib in libraries) else []
    modules = SOURCE_BUILT.get(name, {})
    if not modules:
        return []
    if shutil.which("pkg-config") is None:
        return ["pkg-config", *modules.values()]
    return [pkg for module, pkg in modules.items() if subprocess.run(["pkg-config", "--exists", module]).returncode]


def install_line(packages: list[str]) -> str:
    return f"apt-get install -y {' '.join(packages)}"


def needs_line(name: str, packages: list[str]) -> str:
    """One line: what the peer needs and the command that installs it."""
    how = "opens at run time the libraries of" if name in RUNTIME else "builds from source against"
    return f"{name} {how} Debian's {', '.join(packages)}: {install_line(packages)} (as root)"


def split_requirements(text: str) -> tuple[list[str], list[str]]:
    """The requirement lines: (installed from wheels, built from source), comments dropped."""
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    reqs = [ln for ln in lines if ln]
    built = [r for r in reqs if _name(r) in SOURCE_BUILT]
    return [r for r in reqs if r not in built], built


def ensure(base: str | None = None) -> dict:
    """.bench-venv for the current requirements file, built if needed; returns its stamp
    (``not_built``: each source-built peer that is missing, with why: the packages it needs, or
    pip's error line). A peer left out for want of packages is built once they are installed."""
    info = stamp()
    if info is not None:
        return _retry(info)
    base = base or shutil.which("python3.11") or sys.executable
    if VENV.exists():
        shutil.rmtree(VENV)
    print(f"making .bench-venv from {REQUIREMENTS.relative_to(ROOT)} (several GB; minutes)", file=sys.stderr)
    start = time.perf_counter()
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    pip = [str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    wheels, built = split_requirements(REQUIREMENTS.read_text())
    subprocess.run([*pip, *wheels], check=True, cwd=ROOT)
    not_built, wanting = build_from_source(built)
    torch = subprocess.run([str(python()), "-c", CHECK], check=True, capture_output=True, text=True).stdout.strip()
    info = {
        "sha256": file_hash(REQUIREMENTS),
        "install_s": round(time.perf_counter() - start, 1),
        "size_mb": round(_size_mb(VENV)),
        "torch": torch,
        "not_built": not_built,
        "wanting": wanting,
    }
    (VENV / STAMP).write_text(json.dumps(info))  # last: the environment is complete
    return info


def build_from_source(reqs: list[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """pip-builds each of ``reqs`` into .bench-venv whose packages are here: (why each one that
    is not built, the packages each of those wants). A pip failure is said with its error line."""
    pip = [str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    not_built: dict[str, str] = {}
    wanting: dict[str, list[str]] = {}
    for req in reqs:
        name = _name(req)
        if packages := missing_packages(name):
            not_built[name], wanting[name] = needs_line(name, packages), packages
        else:
            out = subprocess.run([*pip, req], capture_output=True, text=True, cwd=ROOT)
            if out.returncode == 0:
                continue
            said = [ln.strip() for ln in out.stderr.splitlines() if "error" in ln.lower()] or [out.stderr.strip()]
            not_built[name] = f"pip: {said[0][:300]}"
        print(f"warning: {req} is not built: {not_built[name]}", file=sys.stderr)
    return not_built, wanting


def _retry(info: dict) -> dict:
    """The peers a build left out for want of packages that are now installed, built now; the
    stamp rewritten. A pip failure with the packages present is not retried (a new requirements
    file is)."""
    _, built = split_requirements(REQUIREMENTS.read_text())
    wanting = info.setdefault("wanting", dict.fromkeys(info.get("not_built", {}), []))  # an older stamp: any
    ready = [r for r in built if _name(r) in wanting and not missing_packages(_name(r))]
    if not ready:
        return info
    print(f"building {', '.join(ready)} into .bench-venv: the packages it wanted are installed now", file=sys.stderr)
    not_built, still = build_from_source(ready)
    for name in map(_name, ready):
        info["not_built"].pop(name, None)
        wanting.pop(name, None)
    info["not_built"] |= not_built
    info["wanting"] = wanting | still
    (VENV / STAMP).write_text(json.dumps(info))
    return info


if __name__ == "__main__":
    print(json.dumps(ensure()))
