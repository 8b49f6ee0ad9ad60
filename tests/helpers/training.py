"""Real train.py runs for the tests: tiny shards, a tiny config, one process or torchrun on gloo."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import webdataset as wds

from tests.conftest import run_script, write_tiny_shards

VAL_COUNTS = [7, 13, 5, 11, 9]  # 45 samples: unequal per rank and per worker, partial batches
TRAIN_COUNTS = [24] * 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    train = write_tiny_shards(root / "train", TRAIN_COUNTS, "train", size=32)
    pattern = str(root / "train" / f"train-{{000000..{len(TRAIN_COUNTS) - 1:06d}}}.tar")
    val = write_tiny_shards(root / "val", VAL_COUNTS, "val", size=32)
    labels = Counter()
    for tar in sorted((root / "val").glob("*.tar")):
        for sample in wds.WebDataset(str(tar), shardshuffle=False):
            labels[int(sample["cls"])] += 1
    return {
        "train": str(train),
        "train_pattern": pattern,
        "val": str(val),
        "val_classes": [labels[c] for c in range(10)],
    }


# The trainer's default model, ResNet-18, cost these runs more than anything else at their sizes:
# every step updates (and across ranks all-reduces) its 11 M weights, 6x a SqueezeNet 1.1 step's
# CPU at 32 pixels, and each checkpoint is 85 MB (SqueezeNet's: 5 MB). Where the model is not the
# point (the data's path, counts, resumes, checkpoints' contents) the runs train SqueezeNet; a test
# whose point is the default model adds RESNET (its overrides come after these).
SMALL_MODEL = "model.name=squeezenet1_1"
RESNET = ("model.name=resnet18", "model.stem=imagenet")


def overrides(shards, run_dir: Path, *extra: str, train_spec: str | None = None) -> list[str]:
    """A tiny, fast configuration: 32-pixel images, SqueezeNet 1.1, batch 8."""
    return [
        f"data.train_shards={train_spec or shards['train']}",
        f"data.val_shards={shards['val']}",
        "data.synthetic=null",
        "data.image_size=32",
        "data.num_classes=10",
        SMALL_MODEL,
        "trainer.batch_size=8",
        "trainer.workers=2",
        "trainer.log_every=1",
        "loader.shuffle_buffer=20",
        f"run_dir={run_dir}",
        *extra,
    ]


# The fault tests' runs (tests/train/test_faults_train.py, tests/train/test_faults_checkpoints.py): no
# evaluation, one loader worker.
FAST = ("data.val_shards=null", "trainer.workers=1")


def fast_args(shards, run_dir: Path, *extra: str, train_spec: str | None = None) -> list[str]:
    return overrides(shards, run_dir, *FAST, *extra, train_spec=train_spec)


def train(shards, run_dir: Path, *extra: str, train_spec: str | None = None) -> dict:
    proc = run_script("train.py", *overrides(shards, run_dir, *extra, train_spec=train_spec))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The venv's torchrun (its launcher forked from the preloaded Python; the ranks fresh)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return run_script(*cmd, "train.py", *args, env={"OMP_NUM_THREADS": "1", **(env or {})})


def ranks(nproc: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """train.py as ``nproc`` ranks on this node, forked from the preloaded Python with the
    environment torchrun gives its workers (tests/preloaded.py): for the tests whose point is
    what the ranks do, not torchrun itself (its agent, restarts, elastic resizes and faults keep
    ``torchrun``). Each rank spares the 4 s of CPU a fresh interpreter spends importing torch and
    torchvision (bench/results/2026-11-28-suite-where-the-time-goes.md)."""
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return run_script("train.py", *args, env=env, ranks=nproc)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
