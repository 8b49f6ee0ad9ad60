"""examples/ddp_loop.py under torchrun with 2 CPU processes: equal batches, every sample of an
epoch once plus the stated padding, and an interrupted run that resumes exactly."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_script, write_tiny_shards

pytestmark = pytest.mark.slow  # real training processes

COUNTS = [7, 5, 9, 5, 4]  # 30 samples: 2 ranks x batch 4 -> 4 batches per rank, 2 of them padding
N, BATCH, RANKS = sum(COUNTS), 4, 2


def ddp_loop(tmp: Path, index: Path, *extra: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    result = run_script(
        str(torchrun),
        f"--nproc_per_node={RANKS}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(ROOT / "examples" / "ddp_loop.py"),
        str(index),
        f"--batch-size={BATCH}",
        "--image-size=16",
        "--num-classes=10",
        f"--ckpt={tmp / 'ckpt.pt'}",
        f"--trace={tmp / 'trace'}",
        *extra,
        cwd=tmp,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


def traces(tmp: Path) -> dict[int, list[dict]]:
    return {r: [json.loads(line) for line in (tmp / f"trace.{r}.jsonl").read_text().splitlines()] for r in range(RANKS)}


def epoch_positions(by_rank: dict[int, list[dict]], epoch: int) -> list[int]:
    return [p for entries in by_rank.values() for e in entries if e["epoch"] == epoch for p in e["pos"]]


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    return write_tiny_shards(tmp_path_factory.mktemp("shards"), COUNTS, size=16)


@pytest.fixture(scope="module")
def straight(index, tmp_path_factory) -> dict[int, list[dict]]:
    tmp = tmp_path_factory.mktemp("straight")
    ddp_loop(tmp, index, "--epochs=2")
    return traces(tmp)


def test_every_rank_gets_the_same_batches_and_every_sample_once_per_epoch(straight):
    per_rank = -(-N // (RANKS * BATCH))
    for epoch in (0, 1):
        assert [e["batches"] for r in range(RANKS) for e in straight[r] if e["epoch"] == epoch] == [per_rank] * RANKS
        assert all(len(e["pos"]) == per_rank * BATCH for r in range(RANKS) for e in straight[r])
        seen = epoch_positions(straight, epoch)
        assert sorted(p for p in seen if p < N) == list(range(N))
        assert len(seen) - N == per_rank * RANKS * BATCH - N  # the padding, stated by the plan
    # a new order every epoch
    assert epoch_positions(straight, 0) != epoch_positions(straight, 1)


def test_a_stopped_run_resumes_exactly_where_it_stopped(index, straight, tmp_path):
    ddp_loop(tmp_path, index, "--epochs=2", "--stop-after=2")  # two batches of epoch 0 per rank
    first = traces(tmp_path)
    assert [len(first[r][0]["pos"]) for r in range(RANKS)] == [2 * BATCH] * RANKS
    ddp_loop(tmp_path, index, "--epochs=2")  # the same checkpoint, the same layout
    both = traces(tmp_path)
    for r in range(RANKS):
        rank_epoch0 = [p for e in both[r] if e["epoch"] == 0 for p in e["pos"]]
        assert rank_epoch0 == straight[r][0]["pos"]  # the rest of epoch 0, in the straight run's order
        assert [e["pos"] for e in both[r] if e["epoch"] == 1] == [straight[r][1]["pos"]]
