"""The peers' environment for ``bench.py --peers``: .bench-venv/, made from bench/requirements-peers.txt.

Kept apart from .venv so the peers (and the numpy they pin) never reach the trainer or the tests.
Rebuilt only when the requirements file's hash changes: the hash is written last, so an install
that failed or was killed is rebuilt on the next run rather than used half made.
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
# The torch trap (see requirements-peers.txt): a torchvision that does not match torch imports
# but fails at its first operator, so the check runs one.
CHECK = (
    "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5); print(torch.__version__)"
)


def _hash(path: Path) -> str:
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
    return info if info.get("sha256") == _hash(REQUIREMENTS) and python().exists() else None


def ensure(base: str | None = None) -> dict:
    """.bench-venv for the current requirements file, built if needed; returns its stamp."""
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
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True, cwd=ROOT)
    torch = subprocess.run([str(python()), "-c", CHECK], check=True, capture_output=True, text=True).stdout.strip()
    info = {
        "sha256": _hash(REQUIREMENTS),
        "install_s": round(time.perf_counter() - start, 1),
        "size_mb": round(_size_mb(VENV)),
        "torch": torch,
    }
    (VENV / STAMP).write_text(json.dumps(info))  # last: the environment is complete
    return info


if __name__ == "__main__":
    print(json.dumps(ensure()))
