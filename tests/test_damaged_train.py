"""train.py on damaged digits: epoch 0 trains every good sample once, no rank ends the epoch
early, and the epoch's line names the damaged samples; an unreadable shard past data.max_bad
stops every rank at one step, with one line naming it (docs/reliability.md)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.damaged import DAMAGED, PER_SHARD, TOTAL, damage, positions, unreadable, write_digits
from tests.helpers.training import SMALL_MODEL, ranks

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
