"""examples/ddp_loop.py as 2 CPU ranks with torchrun's environment: equal batches, every sample of
an epoch once plus the stated padding, and an interrupted run that resumes exactly."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_script, write_tiny_shards

pytestmark = pytest.mark.slow  # real training processes

COUNTS = [7, 5, 9, 5, 4]  # 30 samples: 2 ranks x batch 4 -> 4 batches per rank, 2 of them padding
N, BATCH, RANKS = sum(COUNTS), 4, 2


def ddp_loop(tmp: Path, index: Path, *extra: str, resnet: bool = False) -> None:
    """The example's ranks with the environment torchrun gives them, forked from the preloaded
    Python (tests/preloaded.py): the example's own launch line is in its --help (tested below).
    Its ResNet-18 is a one-convolution net unless ``resnet`` (tests/helpers/small_model.py): the
    order of the data is what the tests without it check."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    small = [] if resnet else [str(ROOT / "tests" / "helpers" / "small_model.py")]
    result = run_script(
        *small,
        str(ROOT / "examples" / "ddp_loop.py"),
        str(index),
        f"--batch-size={BATCH}",
        "--image-size=16",
        "--num-classes=10",
        f"--ckpt={tmp / 'run' / 'ckpt.pt'}",  # a folder not made yet: the loop makes it at start
        f"--trace={tmp / 'trace'}",
        *extra,
        cwd=tmp,
        env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        ranks=RANKS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp / "out").write_text(result.stdout)


def test_a_checkpoint_that_cannot_be_written_stops_the_loop_at_start(index, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = str(ROOT / "examples" / "ddp_loop.py")
    result = run_script(script, str(index), f"--ckpt={blocker / 'run' / 'ckpt.pt'}", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: {blocker / 'run' / 'ckpt.pt'}: cannot make its folder {blocker / 'run'}: Not a directory"
    ]


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


# ---------------------------------------------------------------- the examples learn


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, Path]:
    """The data the docs make (the built-in synthetic classes: 5 shapes x 2 colours), smaller:
    1200 training and 400 validation images at 32 pixels, in shards of 300 and 200."""
    root = tmp_path_factory.mktemp("synthetic")
    for split, n, per in (("train", 1200, 300), ("val", 400, 200)):
        proc = run_script(
            "makeshards.py", "--synthetic", str(n), "--split", split, "--size", "32", "--maxcount", str(per),
            "--shards", str(root), "--prefix", f"syn-{split}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    return root / "syn-train.index.json", root / "syn-val.index.json"


# 400 validation samples of 10 classes: by chance top-1 is 0.1 +- 0.015; 0.3 is 13 standard deviations off.
# At SMALL the examples' ResNet-18 reached 0.377-0.438 (DDP loop) and 0.407-0.472 (Lightning) over 5 data
# seeds, on half the CPU of 3 epochs at 16 pixels (bench/results/2026-11-28-examples-tests.md).
ABOVE_CHANCE = 0.3
EPOCHS = 2
SMALL = (f"--epochs={EPOCHS}", "--batch-size=32", "--image-size=8")


def test_the_ddp_loop_learns_well_above_chance_and_says_when_a_run_is_done(synthetic, tmp_path):
    train, val = synthetic
    ddp_loop(tmp_path, train, *SMALL, f"--val={val}", resnet=True)
    out = (tmp_path / "out").read_text()
    top1 = [float(x) for x in re.findall(r"val top-1 ([0-9.]+)", out)]
    assert len(top1) == EPOCHS and top1[-1] > ABOVE_CHANCE, out
    ddp_loop(tmp_path, train, *SMALL, f"--val={val}", resnet=True)  # again: the checkpoint is at the end
    again = (tmp_path / "out").read_text()
    assert f"is at epoch {EPOCHS}: the run is done (--epochs {EPOCHS})" in again and "val top-1" not in again


def test_the_lightning_example_learns_well_above_chance(synthetic, tmp_path):
    train, val = synthetic
    proc = run_script(
        str(ROOT / "examples" / "lightning_train.py"), str(train), f"--val={val}", "--devices=2",
        "--accelerator=cpu", "--workers=1", f"--ckpt-dir={tmp_path / 'ckpt'}", *SMALL,
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    top1 = [float(x) for x in re.findall(r"epoch \d+: top-1 ([0-9.]+) on 400 samples", proc.stdout)]
    assert len(top1) == EPOCHS and top1[-1] > ABOVE_CHANCE, proc.stdout[-3000:]


def test_a_val_set_with_fewer_shards_than_devices_is_one_line(synthetic, tmp_path):
    train, val = synthetic
    one = write_tiny_shards(tmp_path / "one", [5], prefix="one", size=16)
    proc = run_script(
        str(ROOT / "examples" / "lightning_train.py"), str(train), f"--val={one}", "--devices=2",
        "--accelerator=cpu", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: --val {one}: fewer shards than --devices 2; write more, smaller shards"


@pytest.mark.parametrize("example", ["ddp_loop.py", "lightning_train.py"])
def test_an_examples_help_shows_its_launch_line_and_each_default(example):
    proc = run_script(str(ROOT / "examples" / example), "--help")
    assert proc.returncode == 0
    launch = "torchrun --nproc_per_node=2 examples/ddp_loop.py" if example == "ddp_loop.py" else "--devices 2"
    assert launch in proc.stdout and "(default: 2)" in proc.stdout and "(default: 32)" in proc.stdout
