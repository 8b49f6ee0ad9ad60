"""Exactness with every recipe tool on (TrivialAugment, random erasing, mixup or cutmix, EMA,
accumulation, clipping, a size schedule): a run stopped at an odd step and resumed trains on the
uninterrupted run's pixels, batch for batch, and ends with its weights and EMA; a run resumed on
another number of ranks gives each sample the pixels it had; every rank switches size at the
planned step. The pixels are each sample's uint8 crop as the loader hands it over
(WDSDIST_TEST_PIXELS: faults.pixels_for_test)."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import run_script
from tests.helpers.training import overrides, ranks, shards  # noqa: F401 (shards: a fixture)

pytestmark = pytest.mark.slow

EVERYTHING = (
    "data.val_shards=null",
    "model.name=shufflenet_v2_x0_5",
    "data.augment=trivialaugment",
    "data.random_erase=0.5",
    "trainer.mixup=0.2",
    "trainer.cutmix=1.0",
    "trainer.ema.decay=0.9",
    "trainer.accum_steps=2",
    "optim.clip_grad_norm=2.0",
    "optim.norm_weight_decay=0",
    "data.image_size=[[0,16],[0.5,24]]",
    "trainer.keep=5",
)


def rows(folder: Path, rank: int = 0) -> list[list[str]]:
    """The pixel trace: per sample, step micro epoch position size crc."""
    return [line.split() for line in (folder / f"rank-{rank}.txt").read_text().splitlines()]


def pixels_to(folder: Path) -> dict[str, str]:
    return {"WDSDIST_TEST_PIXELS": str(folder)}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_resumed_at_an_odd_step_trains_on_the_same_pixels_to_the_same_weights(shards, tmp_path):  # noqa: F811
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = (*EVERYTHING, "trainer.steps=7", "trainer.ckpt_every=3")
    proc = run_script(
        "train.py", *overrides(shards, straight, *common), env={"WDSDIST_TEST_PIXELS": str(tmp_path / "a")}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recipe: trivialaugment, random erasing p 0.5, mixup alpha 0.2 or cutmix alpha 1 per batch" in proc.stdout
    assert "data.image_size: 16 px from step 0, 24 px from step 4" in proc.stdout
    resume = (*common, f"trainer.resume={straight / 'ckpt-0000003.pt'}")
    proc = run_script(
        "train.py", *overrides(shards, resumed, *resume), env={"WDSDIST_TEST_PIXELS": str(tmp_path / "b")}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    whole, again = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert len(whole) == 7 * 2 * 8 and again == [r for r in whole if int(r[0]) >= 3]
    assert {int(r[0]) for r in whole if r[4] == "16"} == {0, 1, 2, 3}  # the planned step: ceil(0.5 x 7)
    assert {int(r[0]) for r in whole if r[4] == "24"} == {4, 5, 6}
    assert len({r[5] for r in whole}) > 0.9 * len(whole)  # the crops and augmentations did draw
    a, b = (json.loads((d / "summary.json").read_text()) for d in (straight, resumed))
    assert a["rank_params"] == b["rank_params"] and a["steps"] == b["steps"] == 7
    assert digest(straight / "model.safetensors") == digest(resumed / "model.safetensors")  # the EMA's weights
    exported = json.loads((straight / "config.json").read_text())
    assert exported["weights"] == "ema" and exported["ema"]["updates"] == 7 and exported["image_size"] == 24


def test_every_rank_switches_size_at_an_epochs_start_and_a_resize_keeps_each_samples_pixels(shards, tmp_path):  # noqa: F811
    """Two ranks in epoch mode, the size schedule by epochs; resumed mid-epoch on one rank, the
    interrupted epoch re-split (split=samples): each sample's pixels are its own on any layout."""
    two, one = tmp_path / "two", tmp_path / "one"
    common = (*EVERYTHING, "loader.mode=epoch", "trainer.epochs=2", "trainer.ckpt_every=2", "trainer.workers=1")
    proc = ranks(2, *overrides(shards, two, *common), env=pixels_to(tmp_path / "a"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        by_step = defaultdict(set)
        for step, _, epoch, _, size, _ in rows(tmp_path / "a", rank):
            by_step[int(step)].add((int(epoch), int(size)))
        # 96 samples, 2 ranks x 8 x 2 micro-batches: 3 steps an epoch; epoch 1 at 24 pixels from step 3
        assert dict(by_step) == {s: {(s // 3, 16 if s < 3 else 24)} for s in range(6)}, rank
    resume = f"trainer.resume={two / 'ckpt-0000002.pt'}"
    proc = ranks(1, *overrides(shards, one, *common, resume), env=pixels_to(tmp_path / "b"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pixels = {(r[2], r[3]): r[5] for rank in range(2) for r in rows(tmp_path / "a", rank)}
    after = rows(tmp_path / "b")
    # the rest of epoch 0 (2 x 16 samples), then epoch 1 whole (96) on the new layout
    assert len(after) == 32 + 96
    assert all(pixels[r[2], r[3]] == r[5] for r in after)


def test_a_compiled_model_trains_under_ddp_and_evaluates(shards, tmp_path):  # noqa: F811
    """trainer.compile=true on two ranks: the DDP model that trains and the model evaluated are
    compiled (traced by dynamo; its eager backend spares the suite the code generation),
    the ranks agree, and the first step's line says it compiled."""
    run = tmp_path / "run"
    extra = ("model.name=squeezenet1_1", "trainer.workers=1", "trainer.steps=3", "trainer.compile=true")
    proc = ranks(2, *overrides(shards, run, *extra), env={"WDSDIST_TEST_COMPILE_BACKEND": "eager"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(compiling the model: trainer.compile)" in proc.stdout and "trainer.compile=true" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert len(set(summary["rank_params"])) == 1 and summary["val_samples"] == 45
