"""Shared fixtures: tiny generated shards and a way to run the project's scripts."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import webdataset as wds

from wdsdist.data.index import index_path, write_index
from wdsdist.tools import synthetic

ROOT = Path(__file__).resolve().parent.parent

# One intra-op thread per torch process, here and in every process a test starts (they inherit
# the environment): the suite runs a pytest worker per core, each starting trainers and loader
# workers, and OpenMP threads spinning for cores the other processes hold made a tiny ResNet's
# steps 3-4x slower (a 4-step train run: 33 s with 2 threads, 14 s with 1 on this 2-core machine).
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or "1"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process imported torch already (webdataset)


def jpeg(index: int, size: int = 8) -> tuple[bytes, int]:
    img, label = synthetic.draw(index, size=size)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), label


def write_tiny_shards(outdir: Path, counts: list[int], prefix: str = "tiny", size: int = 8) -> Path:
    """Shards with the given sample counts (keys unique over all shards) and their index."""
    outdir.mkdir(parents=True, exist_ok=True)
    shards, n = [], 0
    for i, count in enumerate(counts):
        path = outdir / f"{prefix}-{i:06d}.tar"
        with wds.TarWriter(str(path)) as w:
            for _ in range(count):
                data, label = jpeg(n, size)
                w.write({"__key__": f"s{n:07d}", "jpg": data, "cls": str(label)})
                n += 1
        shards.append((str(path), count))
    index = Path(index_path(str(outdir), prefix))
    write_index(str(index), shards, name=prefix)
    return index


@pytest.fixture(autouse=True)
def fresh_skip_warnings():
    """The loader prints the first 20 skip warnings of a process: each test starts its own count,
    since in-process loaders (workers=0) share pytest's process."""
    from wdsdist.data import workers

    workers._warned[0] = 0


@pytest.fixture
def tiny_shards(tmp_path):
    """A factory: tiny_shards([counts...]) -> index path."""

    def make(counts, prefix="tiny", size=8):
        return write_tiny_shards(tmp_path / prefix, list(counts), prefix, size)

    return make


def run_script(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a top-level script of the project with the venv's Python, capturing its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single 'error: ...' line a failing command must print (and nothing like a traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]
