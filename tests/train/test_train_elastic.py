"""Elastic resume (gloo, CPU): a checkpoint of one layout resumed on another, with
loader.split=samples in epoch mode, mid-epoch and at an epoch's end. Every sample of the
interrupted epoch is delivered exactly once across the two runs, plus exactly the stated padding;
every rank trains the same steps, and no rank hangs. Each rank traces the positions it trained on
(faults.trace_for_test), which name the samples through the epoch's shard order. The ranks are
forked with torchrun's environment (tests/helpers/training.py's ``ranks``): the resize is the
trainer's and the loader's work, not torchrun's agent's, whose re-forming of a job
tests/cluster/test_cluster_faults.py and tests/train/test_faults_train.py hold."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import write_tiny_shards
from tests.helpers.trace import traced
from tests.helpers.training import load, ranks
from wdsdist.data.plan.order import shard_order
from wdsdist.data.plan.splits import rank_batches

pytestmark = pytest.mark.slow  # real training processes

COUNTS = [13, 29, 7, 21]  # 70 samples, uneven
N, BS, SEED = sum(COUNTS), 4, 0


def args(index: Path, run: Path, workers: int, *extra: str) -> list[str]:
    return [
        f"data.train_shards={index}",
        "data.val_shards=null",
        "data.synthetic=null",
        "data.image_size=32",
        "data.num_classes=10",
        "model.name=squeezenet1_1",
        f"trainer.workers={workers}",
        f"trainer.batch_size={BS}",
        "trainer.log_every=1",
        f"seed={SEED}",
        "loader.mode=epoch",
        "loader.shuffle_buffer=10",
        f"run_dir={run}",
        *extra,
    ]


def sequence(epoch: int) -> list[int]:
    """The sample numbers of an epoch's sample sequence (shards in the epoch's seeded order)."""
    first = list(itertools.accumulate(COUNTS, initial=0))
    return [first[i] + j for i in shard_order(range(len(COUNTS)), SEED, epoch, 1) for j in range(COUNTS[i])]


def layout(world: int, workers: int) -> str:
    return f"{world} rank{'s' * (world != 1)} x {workers} worker{'s' * (workers != 1)}"


def run(nproc: int, workers: int, index: Path, run_dir: Path, trace: Path, *extra: str) -> dict:
    trace.mkdir()
    proc = ranks(nproc, *args(index, run_dir, workers, *extra), env={"WDSDIST_TEST_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("old,new", [((2, 2), (3, 1)), ((3, 1), (1, 2))], ids=["2x2-3x1", "3x1-1x2"])
def test_a_resize_delivers_every_sample_of_the_interrupted_epoch_once_but_the_stated_padding(tmp_path, old, new):
    """One epoch on the old layout, checkpoints after 3 steps and at the epoch's end; resumed on
    the new layout for the rest of epoch 0 (mid; and for 2x2 -> 3x1 also from the end: none of
    it), then epoch 1 whole."""
    index = write_tiny_shards(tmp_path / "train", COUNTS, "train", size=32)
    first = tmp_path / "first"
    k_old = rank_batches(N, old[0], BS, "pad")
    summary = run(*old, index, first, tmp_path / "trace1", "trainer.epochs=1", "trainer.ckpt_every=3", "trainer.keep=9")
    assert summary["rank_steps"] == [k_old] * old[0]
    # At an epoch's end nothing is re-split whatever the layouts: once is enough.
    stops = (("mid", 3), ("end", k_old)) if old == (2, 2) else (("mid", 3),)
    for stop, done in stops:
        resumed(tmp_path, index, old, new, stop, done, first / f"ckpt-{done:07d}.pt")


def resumed(tmp_path: Path, index: Path, old, new, stop: str, done: int, ckpt: Path) -> None:
    second, trace = tmp_path / f"second-{stop}", tmp_path / f"trace-{stop}"
    summary = run(*new, index, second, trace, "trainer.epochs=2", f"trainer.resume={ckpt}")
    log = (second / "train.log").read_text()
    before, after = traced(tmp_path / "trace1" / "start-1", done), traced(trace / "start-1")
    assert sorted(before) == list(range(old[0])) and sorted(after) == list(range(new[0]))
    steps = summary["rank_steps"]
    assert len(set(steps)) == 1 and len(set(summary["rank_params"])) == 1  # every rank in step: none hung
    k_old, k_new = rank_batches(N, old[0], BS, "pad"), rank_batches(N, new[0], BS, "pad")
    layouts = f"{layout(*old)} -> {layout(*new)}"
    if stop == "mid":
        line = re.search(
            rf"resize: {layouts}, epoch 0: (\d+) samples remain, (\d+) batches of {BS} per rank, padding (\d+)", log
        )
        assert line, log
        remaining, k_resumed, padding = map(int, line.groups())
        assert k_resumed == rank_batches(remaining, new[0], BS, "pad") and 0 <= padding < new[0] * BS
    else:
        assert f"resize: {layouts}" in log and "at the start of epoch 1: nothing to re-split" in log
        k_resumed, padding = 0, 0
    assert steps[0] == done + k_resumed + k_new  # the resumed epoch's batches, then a whole one on the new layout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(second), size_guidance={"scalars": 0}).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("data/padded_samples")]
    whole = [(done + k_resumed, k_new * new[0] * BS - N)]
    assert logged == ([(done, padding)] if stop == "mid" else []) + whole  # each epoch's own padding, at its start
    epoch0 = [p for r in before.values() for e, pos in r for p in pos if e == 0]
    epoch0 += [p for r in after.values() for e, pos in r for p in pos if e == 0]
    assert all(len(pos) == BS for part in (before, after) for r in part.values() for _, pos in r)
    # Every sample of epoch 0, none twice as itself; duplicates only the padding, as stated (a
    # padding copy delivered before its original stands in for it).
    assert max(Counter(p for p in epoch0 if p < N).values()) == 1 and {p % N for p in epoch0} == set(range(N))
    assert len(epoch0) - N <= sum(p >= N for p in epoch0)
    padded = [p for p in epoch0 if p >= N]
    old_padding = k_old * old[0] * BS - N
    assert all(p - N < N for p in padded)
    assert len(padded) == (
        old_padding if stop == "end" else padding + sum(p >= N for r in before.values() for _, pos in r for p in pos)
    )
    samples = Counter(sequence(0)[p % N] for p in epoch0)
    assert set(samples) == set(range(N)) and sum(n - 1 for n in samples.values()) <= len(padded)
    # The next epoch: whole, on the new layout.
    epoch1 = [p for r in after.values() for e, pos in r for p in pos if e == 1]
    assert sorted(p for p in epoch1 if p < N) == list(range(N)) and len(epoch1) == k_new * new[0] * BS
    ckpt = load(second / "latest.pt")
    assert [s["point"]["epoch"] for s in ckpt["loader"]["ranks"]] == [2] * new[0] and "elastic" not in ckpt["loader"][
        "ranks"
    ][0]


@pytest.mark.parametrize("split", ["shards", "samples", None])
def test_another_layout_in_epoch_mode_needs_split_samples(split, tmp_path):
    """In-process: what the loader does with a checkpoint's loader state of another layout."""
    from wdsdist.data import Loader, LoaderConfig
    from wdsdist.errors import UserError

    index = write_tiny_shards(tmp_path, [6, 6])
    cfg = LoaderConfig(batch_size=2, workers=1, mode="epoch", split=split)
    loader = Loader(str(index), cfg, rank=0, world=1)
    with pytest.raises(UserError) as exc:
        # every rank's entry as an older version wrote it, without the options a re-split needs
        old = [{"rank": r, "world": 2, "workers": 1, "point": {"epoch": 0, "workers": {}}} for r in range(2)]
        loader.load_state_dict({"format": "wdsdist-loader-v1", "ranks": old}, "ckpt-0000002.pt")
    if split == "shards":
        assert str(exc.value) == (
            "ckpt-0000002.pt was saved with 2 ranks x 1 worker, now 1 rank x 1 worker: loader.mode=epoch resumes on "
            "another layout only with loader.split=samples (with split=shards: the same ranks and workers)"
        )
    else:  # every rank's state goes to the re-split (split=samples is the epoch default), which wants its keys
        expected = "ckpt-0000002.pt was saved with 2 ranks x 1 worker, now 1 rank x 1 worker, and"
        assert str(exc.value).startswith(expected)
        assert "lacks what a re-split needs" in str(exc.value)
