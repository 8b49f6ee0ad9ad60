"""Shared fixtures: tiny generated shards and a way to run the project's scripts."""

from __future__ import annotations

import gc
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import webdataset as wds

from wdsdist.data.sources.index import index_path, write_index
from wdsdist.errors import console_logging
from wdsdist.tools import synthetic

ROOT = Path(__file__).resolve().parent.parent
# The library only logs; the tests read its messages as the tools print them (wdsdist.errors).
console_logging()

# One intra-op thread per torch process, here and in every process a test starts (they inherit
# the environment): the suite runs a pytest worker per core, each starting trainers and loader
# workers, and OpenMP threads spinning for cores the other processes hold made a tiny ResNet's
# steps 3-4x slower (a 4-step train run: 33 s with 2 threads, 14 s with 1 on this 2-core machine).
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or "1"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process imported torch already (webdataset)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts real training processes (train.py, torchrun, Lightning); -m 'not slow' skips them"
    )
    if not hasattr(config, "workerinput"):  # once, before pytest-xdist starts its workers
        compile_the_projects_modules()


def compile_the_projects_modules() -> None:
    """The bytecode of the project's own modules (wdsdist/, tests/helpers/), in __pycache__ beside
    them, as Python writes it by default. Where PYTHONDONTWRITEBYTECODE is set, nothing writes it,
    and each of the few hundred processes the suite starts (the preloaded Python's forks do not
    inherit the project's modules: tests/preloaded.py) compiled what it imported again: about 0.1 s
    of CPU for each train.py run. Up-to-date files are left as they are; a checkout that cannot
    be written to is left to compile as before."""
    if not sys.dont_write_bytecode:
        return  # every process writes what it compiles itself
    import compileall

    for folder in (ROOT / "wdsdist", ROOT / "tests" / "helpers"):
        try:
            compileall.compile_dir(folder, quiet=2)
        except OSError:
            pass


def pytest_collection_finish(session: pytest.Session) -> None:
    """What each pytest process holds once the tests are collected (torch, torchvision, pytest, the
    test modules: over a million objects) moves out of its garbage collector's reach. A full
    collection walked all of it, about 0.2 s of CPU each, and simdist's real mode collects once
    per rank to end that rank's DataLoader workers: a third of the CPU of the in-process tests
    that run it (tests/simdist/test_simdist_layouts.py: 18.9 s -> 8.2 s). What the tests make is
    collected as before; tests/data/delivery/test_worker_memory.py, which measures the collector,
    thaws it for its tests."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """The same again as each test module starts, once the modules before it have been torn down
    and their garbage collected: what a pytest process keeps of the tests it ran (their reports,
    caches) stays out of later collections, and a test that thawed the heap (tests/helpers/
    exactness.py's runs freeze and thaw it around each part) leaves it thawed for its module only."""
    gc.collect()
    gc.freeze()


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
    from wdsdist.data.delivery import workers

    workers._warned[0] = 0


@pytest.fixture
def tiny_shards(tmp_path):
    """A factory: tiny_shards([counts...]) -> index path."""

    def make(counts, prefix="tiny", size=8):
        return write_tiny_shards(tmp_path / prefix, list(counts), prefix, size)

    return make


_START_ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")  # before any test's monkeypatch
_preloaded: dict[tuple[str, ...], subprocess.Popen] = {}


def _preloaded_python(also: tuple[str, ...] = ()) -> subprocess.Popen:
    """tests/preloaded.py, importing the modules ``also`` names as well, started on the first
    run_script of this pytest process that asks for it."""
    if also not in _preloaded or _preloaded[also].poll() is not None:
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "preloaded.py"), *also],
            cwd=ROOT,
            env=_START_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        _preloaded[also] = server
    return _preloaded[also]


def _answer(server: subprocess.Popen, timeout: float | None) -> list[int] | None:
    """The next line from the server, as ints; None once the timeout passes."""
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([server.stdout], [], [], timeout)[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 64)
        if not chunk:
            raise RuntimeError(f"tests/preloaded.py ended (exit status {server.wait()})")
        line += chunk
    return [int(x) for x in line.split()]


def run_script(
    *args: str,
    cwd: Path | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
    ranks: int | None = None,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run a top-level script of the project (or -c CODE ARGS, -m MODULE ARGS, or the venv's torchrun)
    with the venv's Python, capturing its output. The process is forked from a Python that has torch, torchvision,
    webdataset and Hydra imported (tests/preloaded.py): a fresh process in all else, seconds
    sooner. ``ranks``: that many processes, the ranks of one job on this node, as torchrun
    starts them (tests/helpers/training.py's ``ranks``); their output in one stdout and stderr.
    ``preload``: modules to have imported as well, in a second such Python (for tests/lightning/test_lightning.py's
    runs: importing Lightning took 1.6 s of CPU in each rank)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    server = _preloaded_python(preload)
    with tempfile.TemporaryDirectory(prefix="run_script-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"argv": list(args), "cwd": str(cwd or ROOT), "env": env, "stdout": str(out), "stderr": str(err)}
        request |= {"ranks": ranks} if ranks is not None else {}
        server.stdin.write(json.dumps(request).encode() + b"\n")
        pids = _answer(server, None)
        status = _answer(server, timeout)
        if status is None:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            _answer(server, None)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    cmd = [sys.executable, *args]
    if status is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status[0]), stdout, stderr)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single 'error: ...' line a failing command must print (and nothing like a traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]
