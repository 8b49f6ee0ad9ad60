"""The trainer end to end: real train.py runs (one process, and two under torchrun on gloo)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import one_error_line, run_script, write_tiny_shards
from tests.helpers.training import (
    RESNET,
    SMALL_MODEL,
    VAL_COUNTS,
    load,
    overrides,
    ranks,
    torchrun,
    train,
)
from tests.helpers.training import shards as shards  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.slow  # real training processes

SCALARS = {"train/loss", "train/acc", "train/lr", "perf/samples_per_s", "perf/data_wait", "val/top1", "val/loss"}


def assert_same(a, b, where="") -> None:
    """Nested state dicts equal, tensors exactly."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def one_process_run(shards, tmp_path_factory) -> tuple[Path, dict]:
    """4 steps on one process, evaluated and saved every 2: its run directory and summary. Tests
    only read it (a resume writes into its own run directory)."""
    run = tmp_path_factory.mktemp("one-process") / "run"
    return run, train(shards, run, "trainer.steps=4", "trainer.eval_every=2", "trainer.ckpt_every=2")


def test_one_process_writes_tensorboard_checkpoints_and_counts_every_val_sample(shards, one_process_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, summary = one_process_run
    assert summary["steps"] == 4 and summary["world"] == 1
    assert summary["val_samples"] == sum(VAL_COUNTS)
    assert summary["val_class_samples"] == shards["val_classes"]

    events = EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert SCALARS <= set(tags["scalars"])
    assert tags["images"] == ["train/batch"]
    assert [e.step for e in events.Scalars("val/top1")] == [2, 4]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    plugins = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins

    assert os.readlink(run / "latest.pt") == "ckpt-0000004.pt"
    assert sorted(p.name for p in run.glob("ckpt-*.pt")) == ["ckpt-0000002.pt", "ckpt-0000004.pt"]
    ckpt = load(run / "latest.pt")
    assert ckpt["step"] == 4 and ckpt["world"] == 1
    # No scheduler state: the learning rate is a function of the step.
    assert {"model", "optimizer", "rng", "loader", "config"} <= ckpt.keys() and "scheduler" not in ckpt
    assert ckpt["config"]["trainer"]["steps"] == 4
    assert ckpt["loader"]["ranks"][0]["point"]["epoch"] == 0
    assert "steps: 4" in (run / "config.yaml").read_text()
    assert not list(run.glob("*.tmp*"))


def test_resume_continues_at_the_saved_step_with_the_same_state(shards, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = ("optim=adamw", "trainer.ckpt_every=2", "trainer.keep=5")
    train(shards, a, "trainer.steps=4", *common)

    # Resuming at the last step trains nothing: what it saves again is what it loaded.
    summary = train(shards, b, f"trainer.resume={a / 'ckpt-0000004.pt'}", "trainer.steps=4", *common)
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 4
    saved, again = load(a / "ckpt-0000004.pt"), load(b / "ckpt-0000004.pt")
    for key in ("step", "model", "optimizer", "loader"):
        assert_same(saved[key], again[key], key)

    # Resuming mid-run continues the optimizer (AdamW counts its steps) and the loader exactly
    # where the first run was at the same step.
    summary = train(shards, c, f"trainer.resume={a / 'ckpt-0000002.pt'}", "trainer.steps=4", *common)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    resumed, straight = load(c / "ckpt-0000004.pt"), load(a / "ckpt-0000004.pt")
    assert resumed["step"] == 4
    assert {int(s["step"]) for s in resumed["optimizer"]["state"].values()} == {4}
    assert resumed["optimizer"]["param_groups"][0]["lr"] == straight["optimizer"]["param_groups"][0]["lr"]
    assert_same(resumed["loader"], straight["loader"], "loader")

    # resume=auto picks up the run directory's latest checkpoint.
    summary = train(shards, a, "trainer.resume=auto", "trainer.steps=6", *common)
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6


def old_factor(steps: int, warmup_frac: float):
    """The LambdaLR factor the trainer used before its learning rate became a function of the step."""
    import math

    warmup = int(steps * warmup_frac)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


@pytest.mark.parametrize("steps,warmup", [(300, 0.05), (4, 0.05), (10, 0.0), (7, 0.5)])
def test_the_learning_rate_of_each_step_is_the_lambdalr_value_it_replaced_bit_for_bit(steps, warmup):
    from wdsdist.train.model import lr_at

    base = 0.1 * 64 / 256
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=base)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, old_factor(steps, warmup))
    for step in range(steps + 2):  # LambdaLR's lr for step s is the one in effect before its s-th step()
        assert lr_at(step, base, steps, warmup) == opt.param_groups[0]["lr"] == sched.get_last_lr()[0], step
        opt.step()
        sched.step()


def test_a_checkpoint_with_scheduler_state_from_before_resumes_at_this_runs_learning_rate(
    shards, one_process_run, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from wdsdist.train.model import lr_at

    a, b = one_process_run[0], tmp_path / "b"
    # What the trainer wrote before: LambdaLR's state, and its initial_lr in the optimizer's groups
    # (here of another lr: neither may be what the resumed run uses).
    ckpt = load(a / "ckpt-0000002.pt")
    ckpt["scheduler"] = {"base_lrs": [0.5], "last_epoch": 2, "_step_count": 3, "_last_lr": [0.25], "lr_lambdas": [None]}
    for group in ckpt["optimizer"]["param_groups"]:
        group["initial_lr"], group["lr"] = 0.5, 0.25
    torch.save(ckpt, tmp_path / "old.pt")

    summary = train(shards, b, f"trainer.resume={tmp_path / 'old.pt'}", "trainer.steps=4", "optim.lr=0.2")
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    base = 0.2 * 8 / 256  # this run's lr and global batch
    saved = load(b / "ckpt-0000004.pt")
    assert "scheduler" not in saved
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]] == [lr_at(3, base, 4, 0.05)]  # its last step's
    assert all("initial_lr" not in g for g in saved["optimizer"]["param_groups"])
    events = EventAccumulator(str(b), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/lr")]  # after each step: the next step's
    assert logged == [(s, pytest.approx(lr_at(s, base, 4, 0.05), rel=1e-6)) for s in (3, 4)]


def test_epoch_mode_runs_whole_epochs(shards, tmp_path):
    # 4 shards of 24 over 2 workers, batch 8: 12 batches per epoch. A brace pattern (quoted for
    # Hydra) instead of the index: epoch mode counts the samples from the tar headers.
    spec = f'"{shards["train_pattern"]}"'
    summary = train(
        shards, tmp_path / "run", "loader.mode=epoch", "trainer.epochs=2", "trainer.log_every=6", train_spec=spec
    )
    assert summary["steps"] == 24
    ckpt = load(tmp_path / "run" / "latest.pt")
    assert ckpt["loader"]["ranks"][0]["point"]["epoch"] == 2 and ckpt["loader"]["ranks"][0]["batches"] == 0


def test_two_ranks_agree_and_count_every_val_sample(shards, tmp_path):
    # The ranks forked with the environment torchrun gives them (tests/helpers/training.py): what
    # they do is the point here; torchrun's own agent runs this job in tests/train/test_faults_train.py
    # (a restart, SIGTERM) and tests/cluster/test_remote_and_multinode.py (two nodes, with evaluation).
    run = tmp_path / "run"
    proc = ranks(2, *overrides(shards, run, "trainer.steps=4", "trainer.ckpt_every=2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 2
    assert summary["rank_steps"] == [4, 4]
    assert summary["rank_params"][0] == summary["rank_params"][1]
    assert summary["val_samples"] == sum(VAL_COUNTS)
    assert summary["val_class_samples"] == shards["val_classes"]
    assert proc.stdout.count("done: 4 steps") == 1  # only rank 0 prints
    ckpt = load(run / "latest.pt")
    assert ckpt["world"] == 2 and [s["rank"] for s in ckpt["loader"]["ranks"]] == [0, 1]


@pytest.mark.parametrize("nproc,mode", [(1, "repeat"), (2, "epoch")], ids=["world1-repeat", "world2-epoch"])
def test_training_under_nccls_device_map_sends_no_cpu_tensor_through_the_default_group(shards, tmp_path, nproc, mode):
    # No GPU here: "cuda:gloo" gives the default group NCCL's device map (CUDA tensors only), so
    # every collective the trainer sends a CPU tensor or a pickled object through it fails, as
    # it would on GPUs: "No backend type associated with device type cpu". The model stays on
    # the CPU, so what it does on the device goes through the CPU group too. Repeat mode agrees
    # on the stop flag a step ahead, epoch mode every step; world 2 adds DDP and BatchNorm's
    # broadcast before evaluation.
    run = tmp_path / "run"
    extra = [*RESNET, "trainer.eval_every=2", "trainer.ckpt_every=2", "trainer.workers=1", f"loader.mode={mode}"]
    extra += ["trainer.epochs=1"] if mode == "epoch" else ["trainer.steps=3"]
    proc = ranks(nproc, *overrides(shards, run, *extra), env={"WDSDIST_TEST_BACKEND": "cuda:gloo"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    steps = 12 // nproc if mode == "epoch" else 3  # 4 shards of 24 in batches of 8 over the ranks (1 worker each)
    assert summary["rank_steps"] == [steps] * nproc
    assert len(set(summary["rank_params"])) == 1
    assert summary["val_samples"] == sum(VAL_COUNTS)
    assert summary["val_class_samples"] == shards["val_classes"]
    assert f"on {nproc} x cpu" in proc.stdout


def test_every_rank_refuses_a_layout_that_would_hang(tmp_path):
    train_index = write_tiny_shards(tmp_path / "train", [16, 16, 16], "train", size=16)
    args = [
        f"data.train_shards={train_index}",
        "data.val_shards=null",
        "data.synthetic=null",
        "data.image_size=16",
        "trainer.workers=1",
        "trainer.batch_size=4",
        "loader.mode=epoch",
        "loader.split=shards",  # whole shards: 3 over 2 ranks cannot be equal (split=samples, the default, is)
        f"run_dir={tmp_path / 'run'}",
    ]
    proc = torchrun(2, *args)
    assert proc.returncode != 0
    # Both ranks refuse; rank 0 says why, once (torchrun then adds its own failure report).
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "ranks deliver unequal batch counts per epoch (4..8)" in errors[0] and "loader.nbatches=4" in errors[0]
    assert "use loader.split=samples" in errors[0]
    assert "rank      : 1 (local_rank: 1)" in proc.stderr and "exitcode  : 2" in proc.stderr


def test_epochs_of_the_sample_split_end_together_on_every_rank(tmp_path):
    """Uneven shards that whole-shard splitting cannot share equally: split=samples (the default
    in epoch mode) gives both ranks 5 batches per epoch, pads 10 samples, and says so."""
    counts = [13, 29, 7, 21]  # 70 samples; 2 ranks x batch 8: 5 batches each, 80 delivered
    train_index = write_tiny_shards(tmp_path / "train", counts, "train", size=32)
    run = tmp_path / "run"
    args = [
        f"data.train_shards={train_index}",
        "data.val_shards=null",
        "data.synthetic=null",
        "data.image_size=32",  # SqueezeNet's smallest
        "data.num_classes=10",
        SMALL_MODEL,
        "trainer.workers=2",
        "trainer.batch_size=8",
        "trainer.epochs=3",
        "trainer.log_every=1",
        "loader.mode=epoch",
        "loader.shuffle_buffer=20",
        f"run_dir={run}",
    ]
    proc = ranks(2, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rank_steps"] == [15, 15] and len(set(summary["rank_params"])) == 1
    assert "ends early" not in proc.stdout + proc.stderr
    log = (run / "train.log").read_text()
    assert "split=samples: 5 batches of 8 per rank per epoch (80 samples), pad: 10 samples" in log
    ckpt = load(run / "latest.pt")
    assert [(s["point"]["epoch"], s["batches"]) for s in ckpt["loader"]["ranks"]] == [(3, 0), (3, 0)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()
    padded = events.Scalars("data/padded_samples")
    assert [(e.step, e.value) for e in padded] == [(0, 10.0), (5, 10.0), (10, 10.0)]


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.stepz=5", "trainer.stepz: no such config key; did you mean trainer.steps?"),
        ("trainer.steps=many", "trainer.steps: Value 'many' of type 'str' could not be converted to Integer"),
        ("data=imagenett", "data=imagenett: no such option (available: imagenet, shards, synthetic)"),
        ("loader.mode=epochs", "loader.mode: Invalid value 'epochs', expected one of [repeat, epoch, resampled]"),
        ("trainer.batch_size=0", "trainer.batch_size=0: must be >= 1"),
        ("data.image_size=-32", "data.image_size=-32: must be >= 8"),
        ("trainer.timeout_s=0", "trainer.timeout_s=0.0: must be > 0 (seconds)"),
        ("data.max_pixels=0", "data.max_pixels=0: must be >= 1"),
        ("data.strict=maybe", "data.strict: Value 'maybe' is not a valid bool (type str)"),
        ("data.strictt=true", "data.strictt: no such config key; did you mean data.strict?"),
        (
            "data=imagenet",
            "data.train_shards, data.val_shards: missing values; give them on the command line, "
            "e.g. data.train_shards=... data.val_shards=... (data.val_shards=null: no evaluation)",
        ),
        (
            "data.name=a-{0..1}",
            "cannot parse 'data.name=a-{0..1}': mismatched input '{' expecting <EOF>; "
            """quote a value with braces or commas: 'data.name="a-{0..1}"'""",
        ),
    ],
)
def test_a_bad_override_is_one_line_and_a_nonzero_exit(override, message, tmp_path):
    proc = run_script("train.py", override, f"outputs={tmp_path}", "data.synthetic=null")
    assert proc.returncode == 2
    assert one_error_line(proc) == f"error: {message}"
