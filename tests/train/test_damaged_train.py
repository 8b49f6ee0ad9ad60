"""train.py on damaged digits: epoch 0 trains every good sample once, no rank ends the epoch
early, and the epoch's line names the damaged samples; an unreadable shard past data.max_bad
stops every rank at one step, with one line naming it (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import ROOT, run_script
from tests.helpers.damaged import DAMAGED, PER_SHARD, TOTAL, damage, positions, unreadable, write_digits
from tests.helpers.training import SMALL_MODEL, free_port, ranks

pytestmark = pytest.mark.slow  # real training processes

SEED = 0
BATCH = 32


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_digits(root / "clean")
    shutil.copytree(root / "clean", root / "bad")
    return {"bad": str(root / "bad" / "digits.index.json"), "lost": damage(root / "bad", DAMAGED), "root": root}


def args(spec: str, run_dir: Path, workers: int) -> list[str]:
    return [
        f"data.train_shards={spec}", "data.val_shards=null", "data.synthetic=null", "data.image_size=32",
        "data.num_classes=10", SMALL_MODEL, f"trainer.batch_size={BATCH}", f"trainer.workers={workers}",
        "loader.mode=epoch", "trainer.epochs=1", "trainer.log_every=10", f"run_dir={run_dir}",
    ]  # fmt: skip


def trained_positions(trace: Path) -> list[int]:
    out = []
    for name in os.listdir(trace / "start-1"):
        for line in (trace / "start-1" / name).read_text().splitlines():
            out += [int(p) for p in line.split()[2].split(",")]
    return out


@pytest.mark.parametrize("world, workers", [(1, 2), (3, 1)])
def test_train_py_trains_every_good_sample_of_epoch_0_and_names_the_damaged(digits, tmp_path, world, workers):
    proc = ranks(world, *args(digits["bad"], tmp_path / "run", workers), env={"WDSDIST_TEST_TRACE": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    at = positions(SEED, 0)
    trained = [p for p in trained_positions(tmp_path) if p < TOTAL]
    assert sorted(trained) == sorted(at[n] for n in range(TOTAL) if n not in digits["lost"])
    assert "ends early" not in out
    line = next(line for line in out.splitlines() if "damaged samples filled" in line)
    assert line.count("digits-") == 5 and "5 damaged samples" in line
    assert sorted(int(k) for k in re.findall(r"\.tar (\d{6})", line)) == sorted(digits["lost"])
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("data/epoch_lost_samples")] == [5]  # TensorBoard counts them


def test_an_unreadable_shard_past_max_bad_stops_every_rank_at_one_step_naming_it(digits, tmp_path):
    shutil.copytree(digits["root"] / "clean", tmp_path / "gone")
    unreadable(tmp_path / "gone", 3)
    spec = str(tmp_path / "gone" / "digits.index.json")
    proc = ranks(2, *args(spec, tmp_path / "run", 1), env={"WDSDIST_TEST_TRACE": str(tmp_path / "t")})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "past max_bad" in line]
    assert len(lines) == 1 and "digits-000003.tar unreadable" in lines[0], proc.stderr[-3000:]
    steps = [(tmp_path / "t" / "start-1" / f"rank-{r}.txt").read_text().splitlines() for r in range(2)]
    assert len(steps[0]) == len(steps[1]) < TOTAL // (2 * BATCH)  # both ranks stopped at one step, early
    assert f"every rank stops at step {len(steps[0])}" in lines[0]
    assert PER_SHARD  # the shard is a tenth of the data: past the 1 % default on the rank that reads it


def example(script: str, spec: str, tmp: Path, world: int, *extra: str) -> dict[int, list]:
    """An example's ranks (forked, torchrun's environment) on the damaged digits, one epoch; each
    rank's trace. Its ResNet-18 is a one-convolution net (tests/helpers/small_model.py)."""
    proc = run_script(
        str(ROOT / "tests" / "helpers" / "small_model.py"), str(ROOT / "examples" / script), spec,
        "--epochs=1", "--image-size=16", "--workers=1", f"--trace={tmp / 'trace'}", *extra, cwd=tmp,
        env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
        ranks=world, preload=("pytorch_lightning",) if script.startswith("lightning") else (),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    suffix = "json" if script.startswith("lightning") else "jsonl"
    files = {r: (tmp / f"trace.{r}.{suffix}").read_text() for r in range(world)}
    if suffix == "json":
        return {r: json.loads(text) for r, text in files.items()}
    return {r: [json.loads(line) for line in text.splitlines()] for r, text in files.items()}


def good_positions(lost: set[int]) -> list[int]:
    at = positions(SEED, 0)
    return sorted(at[n] for n in range(TOTAL) if n not in lost)


def test_the_ddp_loop_example_finishes_on_damaged_shards_with_every_good_sample(digits, tmp_path):
    traces = example("ddp_loop.py", digits["bad"], tmp_path, 3, "--batch-size=10", f"--ckpt={tmp_path / 'c.pt'}")
    assert {e["batches"] for r in range(3) for e in traces[r]} == {48}  # len(), the clean run's
    assert [len(e["pos"]) for r in range(3) for e in traces[r]] == [480] * 3  # 48 batches of 10 each: none hung
    seen = [p for r in range(3) for e in traces[r] for p in e["pos"] if p < TOTAL]
    assert sorted(seen) == good_positions(digits["lost"])


def test_the_lightning_module_finishes_on_damaged_shards_with_every_good_sample(digits, tmp_path):
    pytest.importorskip("pytorch_lightning")
    traces = example(
        "lightning_train.py", digits["bad"], tmp_path, 2, "--accelerator=cpu", "--devices=2", "--batch-size=32",
        "--schedule=constant", f"--ckpt-dir={tmp_path / 'ckpt'}",
    )  # fmt: skip
    assert len(traces[0]) == len(traces[1]) == -(-TOTAL // 64)
    seen = [p for r in range(2) for e in traces[r] for p in e["pos"] if p < TOTAL]
    assert sorted(seen) == good_positions(digits["lost"])
