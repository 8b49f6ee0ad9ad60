"""The peers' environment for ``bench.py --peers``: .bench-venv/, made from bench/requirements-peers.txt.

Kept apart from .venv so the peers (and the numpy they pin) never reach the trainer or the tests.
Rebuilt only when the requirements file's hash changes: the hash is written last, so an install
that failed or was killed is rebuilt on the next run rather than used half made. FFCV is built
from source in a step of its own: without its C headers the other peers still install, and its
row says why it is missing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"
VENV = ROOT / ".bench-venv"
STAMP = ".requirements.json"
SOURCE_BUILT = ("ffcv",)  # sdists that compile against system headers (Debian: libopencv-dev, libturbojpeg0-dev)
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


def split_requirements(text: str) -> tuple[list[str], list[str]]:
    """The requirement lines: (installed from wheels, built from source), comments dropped."""
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    reqs = [ln for ln in lines if ln]
    built = [r for r in reqs if r.split("==")[0].strip().lower() in SOURCE_BUILT]
    return [r for r in reqs if r not in built], built


def ensure(base: str | None = None) -> dict:
    """.bench-venv for the current requirements file, built if needed; returns its stamp
    (``not_built``: each source-built peer that failed, with pip's last error line)."""
    info = stamp()
    if info is not None:
        return info
    base = base or shutil.which("python3.11") or sys.executable
    if VENV.exists():
        shutil.rmtree(VENV)
    print(f"making .bench-venv from {REQUIREMENTS.relative_to(ROOT)} (several GB; minutes)", file=sys.stderr)
    start = time.perf_counter()
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    pip = [str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    wheels, built = split_requirements(REQUIREMENTS.read_text())
    subprocess.run([*pip, *wheels], check=True, cwd=ROOT)
    not_built = {}
    for req in built:
        out = subprocess.run([*pip, "--no-deps", req], capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            said = [ln.strip() for ln in out.stderr.splitlines() if "error" in ln.lower()] or [out.stderr.strip()]
            not_built[req.split("==")[0]] = said[0][:300]
            print(f"warning: {req} did not build: {said[0][:300]}", file=sys.stderr)
    torch = subprocess.run([str(python()), "-c", CHECK], check=True, capture_output=True, text=True).stdout.strip()
    info = {
        "sha256": file_hash(REQUIREMENTS),
        "install_s": round(time.perf_counter() - start, 1),
        "size_mb": round(_size_mb(VENV)),
        "torch": torch,
        "not_built": not_built,
    }
    (VENV / STAMP).write_text(json.dumps(info))  # last: the environment is complete
    return info


if __name__ == "__main__":
    print(json.dumps(ensure()))
