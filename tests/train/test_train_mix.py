"""The trainer on several data sets (data.sources, data.val_sources; issue 30): each source's
samples per epoch as the loader's plan states them, one accuracy per held-out source, and the
refusals in one line (other sources on resume, data.sources beside data.train_shards)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import one_error_line, run_script, write_tiny_shards
from tests.helpers.config import compose_config
from tests.helpers.training import VAL_COUNTS, overrides, ranks
from tests.helpers.training import shards as shards  # noqa: F401  (the module's fixture)
from wdsdist.data import Loader, LoaderConfig, Source
from wdsdist.data.plan.mix import coverage, epoch_total
from wdsdist.data.plan.splits import rank_batches
from wdsdist.train import config

pytestmark = pytest.mark.slow  # real training processes

# Uneven shards. An epoch reads all of big, half of small (6, then the other 7) and 3 of tiny.
COUNTS = {"big": [6, 5], "small": [7, 6], "tiny": [4]}
SETTINGS = {"big": {"repeat": 1}, "small": {"repeat": 0.5}, "tiny": {"samples": 3}}
BS = 8


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sources")
    train = {name: str(write_tiny_shards(root / name, counts, name, size=32)) for name, counts in COUNTS.items()}
    val = {
        name: str(write_tiny_shards(root / f"{name}-val", [3 + i], f"{name}-val", size=32))
        for i, name in enumerate(COUNTS)
    }
    return {"train": train, "val": val}


def sources_override(key: str, specs: dict, settings: dict | None = None) -> str:
    items = []
    for name, spec in specs.items():
        extra = "".join(f",{k}:{v}" for k, v in (settings or {}).get(name, {}).items())
        items.append(f"{{name:{name},shards:'{spec}'{extra}}}")
    return f"{key}=[{','.join(items)}]"


def mix_args(shards, sets, run_dir: Path, *extra: str, settings: dict = SETTINGS) -> list[str]:
    return overrides(
        shards,
        run_dir,
        sources_override("data.sources", sets["train"], settings),
        sources_override("data.val_sources", sets["val"]),
        "loader.mode=epoch",
        "trainer.epochs=2",
        f"trainer.batch_size={BS}",
        "trainer.log_every=3",
        *extra,
        train_spec="null",
    )


@pytest.fixture(scope="module")
def mixed_run(shards, sets, tmp_path_factory):
    """Two epochs of the three sources on two ranks (one worker each), evaluated
    at the end on data.val_shards and each of data.val_sources: (run directory, stdout,
    TensorBoard events). Two ranks: the counts in the lines are both ranks' (all-reduced)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path_factory.mktemp("mix") / "run"
    proc = ranks(2, *mix_args(shards, sets, run, "trainer.workers=1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
    return run, proc.stdout, events


def planned(sets, world: int = 2) -> list[dict[str, int]]:
    """What the loader's plan says each of the two epochs delivers of each source on ``world``
    ranks, its padding included."""
    cfg = LoaderConfig(batch_size=BS, workers=2, mode="epoch", image_size=32)
    mix = Loader([Source(name, spec, **SETTINGS[name]) for name, spec in sets["train"].items()], cfg).mix
    out = []
    for epoch in range(2):
        total = epoch_total(mix, epoch)
        padding = rank_batches(total, world, BS, "pad") * world * BS - total
        out.append({row["name"]: row["samples"] + row["padding"] for row in coverage(mix, epoch, padding, BS)})
    return out


def test_each_epochs_samples_per_source_are_the_plans_in_the_log_and_tensorboard(sets, mixed_run):
    run, stdout, events = mixed_run
    want = planned(sets)
    # 20 and 21 samples, padded to 2 batches of 8 on each of 2 ranks: both ranks run 2 steps an epoch
    assert [sum(w.values()) for w in want] == [32, 32]
    assert want[0]["small"] + want[1]["small"] >= sum(COUNTS["small"])  # the two halves of small
    lines = [line for line in stdout.splitlines() if line.startswith("epoch ")]
    assert lines == [
        f"epoch {e} ended at step {2 * (e + 1)}: samples per source "
        + ", ".join(
            f"{name} {n} ({100 * n / 32:.1f}%, {setting})"
            for (name, n), setting in zip(want[e].items(), ["repeat=1", "repeat=0.5", "samples=3"], strict=True)
        )
        for e in range(2)
    ]
    (done,) = [line for line in stdout.splitlines() if line.startswith("done: ")]
    assert "samples per source " + ", ".join(f"{name} {want[0][name] + want[1][name]}" for name in COUNTS) in done
    for name in COUNTS:
        per_epoch = events.Scalars(f"data/epoch_source/{name}")
        assert [(e.step, e.value) for e in per_epoch] == [(2, want[0][name]), (4, want[1][name])]
        # per log line (every 3 steps, and the last): the same samples, window by window
        windows = events.Scalars(f"data/source/{name}")
        assert [e.step for e in windows] == [3, 4]
        assert sum(e.value for e in windows) == want[0][name] + want[1][name]


def test_each_val_source_has_its_own_accuracy_beside_val_shards(sets, mixed_run):
    import json

    run, stdout, events = mixed_run
    summary = json.loads((run / "summary.json").read_text())
    sizes = {name: 3 + i for i, name in enumerate(COUNTS)}
    assert {name: r["samples"] for name, r in summary["val_sources"].items()} == sizes
    assert summary["val_samples"] == sum(VAL_COUNTS)  # data.val_shards, evaluated as before
    assert summary["source_samples"] == {name: sum(w[name] for w in planned(sets)) for name in COUNTS}
    tags = set(events.Tags()["scalars"])
    assert {"val/top1", "val/loss"} <= tags
    for name, r in summary["val_sources"].items():
        assert [(e.step, e.value) for e in events.Scalars(f"val/top1/{name}")] == [(4, pytest.approx(r["top1"]))]
        assert f"val/loss/{name}" in tags
    (line,) = [line for line in stdout.splitlines() if line.startswith("eval at step 4")]
    assert (
        "val top-1 per source: "
        + ", ".join(f"{name} {100 * r['top1']:.2f}% ({sizes[name]})" for name, r in summary["val_sources"].items())
        in line
    )


def test_other_sources_on_resume_are_refused_in_one_line(shards, sets, mixed_run, tmp_path):
    run, _, _ = mixed_run
    changed = {**SETTINGS, "tiny": {"samples": 2}}
    proc = run_script(
        "train.py", *mix_args(shards, sets, tmp_path / "again", f"trainer.resume={run}", settings=changed)
    )
    assert proc.returncode == 2
    # the loader's refusal, at start-up, naming the checkpoint and the change
    assert one_error_line(proc).startswith(
        f"error: {run / 'latest.pt'} was saved with other data.sources "
        "(tiny: ['samples=3', 4] then, ['samples=2', 4] now): give the same sources"
    )
    assert "loss " not in proc.stdout  # refused at start-up, before a step


def test_sources_beside_train_shards_are_refused_in_one_line(shards, sets, tmp_path):
    args = [a for a in mix_args(shards, sets, tmp_path / "run") if not a.startswith("data.train_shards=")]
    proc = run_script("train.py", *args, f"data.train_shards={shards['train']}")
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: data.train_shards={shards['train']} and data.sources are both given: train on one of them"
    )


def test_the_mix_experiment_composes_without_train_shards():
    cfg = compose_config(["+experiment=mix"])
    config.check(cfg)
    assert cfg.data.train_shards is None and cfg.data.val_shards is None
    assert [(s.name, s.weight) for s in cfg.data.sources] == [("base", 0.6), ("extra", 0.3), ("rare", 0.1)]
    assert [s.name for s in cfg.data.val_sources] == ["base", "extra", "rare"]
    # data.sources beside the data group's own train_shards: the hint says how to drop them
    cfg = compose_config(["data.sources=[{name:a,shards:a.index.json}]"])
    with pytest.raises(config.UserError, match=r"add data.train_shards=null\)$"):
        config.check(cfg)
