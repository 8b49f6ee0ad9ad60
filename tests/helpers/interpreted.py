"""Runs decode=gpu's Triton kernels under Triton's interpreter, in a process of its own:
``TRITON_INTERPRET=1`` must be set before Triton is imported, which the suite's own processes
have done long before. ``kernels(cases)`` gives each case's output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def kernels(cases: dict, folder: Path) -> dict:
    """name -> (src, places, geometry, size) in, name -> the batch BatchResize makes out."""
    given, made = folder / "cases.pt", folder / "made.pt"
    torch.save(cases, given)
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, str(given), str(made)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(made, weights_only=False)


def main(given: str, made: str) -> None:
    from wdsdist.data.decode.resize import BatchResize

    out = {}
    for name, (src, places, geometry, size) in torch.load(given, weights_only=False).items():
        resize = BatchResize(size, torch.device("cpu"))
        assert resize.kernels, "the interpreter is not on"
        out[name] = resize(src, places, geometry)
    torch.save(out, made)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
