"""simdist --resize-at K --to-size S2 --to-nworkers W2 (plan mode): a checkpoint after K batches and
an elastic resume on another layout, with the coverage over the whole epoch."""

from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/simdist/ -> the checkout
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers.simdist import run_main  # noqa: E402
from wdsdist.errors import UserError  # noqa: E402

SAMPLES = ["--plan", "--split", "samples"]


def after(out: str) -> dict[int, int]:
    """The new layout's ranks: the indented rank lines after the resize line."""
    return {int(r): int(n) for r, n in re.findall(r"^  rank +(\d+): (\d+) batches", out, re.M)}


def test_classic_demo_resized_mid_epoch_covers_every_sample(capsys):
    code, out, _ = run_main(capsys, *SAMPLES, "--resize-at", "13", "--to-size", "2", "--to-nworkers", "1")
    assert code == 0, out
    # 3 ranks x 13 batches x 10 = 390 delivered; the other 610 over 2 ranks: 31 batches each, 10 padded.
    assert "3 ranks x 3 workers delivered 390 samples; the epoch's other 610 positions (9 ranges" in out
    assert after(out) == {0: 31, 1: 31}
    assert "pads 10 (the remaining positions' first ones again; below 2 x 10)" in out
    assert "1010 samples delivered, 1000 distinct of 1000; duplicated 10 (1.0%), missing 0" in out
    assert out.rstrip().splitlines()[-1].startswith("SUCCESS: same batches in all ranks before (34 per rank")


def test_drop_across_a_resize_duplicates_nothing(capsys):
    code, out, _ = run_main(capsys, *SAMPLES, "--remainder", "drop", "--resize-at", "20", "--to-size", "4")
    assert code == 0, out
    # The old layout's dropped tail is part of what remains, and 400 split evenly over 4 x 10.
    assert after(out) == {0: 10, 1: 10, 2: 10, 3: 10}
    assert "1000 samples delivered, 1000 distinct of 1000; duplicated 0 (0.0%), missing 0" in out


def test_a_resize_at_the_epochs_end_leaves_nothing(capsys):
    code, out, _ = run_main(capsys, *SAMPLES, "--resize-at", "34", "--to-size", "1", "--to-nworkers", "2")
    assert code == 0, out
    assert "nothing remains of the epoch: the new layout starts with the next one" in out
    assert "1020 samples delivered, 1000 distinct of 1000; duplicated 20 (2.0%), missing 0" in out
    assert out.rstrip().splitlines()[-1].endswith("the resize falls at the epoch's end")


def test_old_padding_consumed_before_the_checkpoint_is_reported(capsys):
    # 70 samples, 3 ranks x batch 10: 3 batches per rank (90), rank 2 holds positions 60..89, and
    # its 70..79 (samples 0..9 again) go in its second batch, while rank 0 delivers 0..19 itself.
    code, out, _ = run_main(
        capsys, *SAMPLES, "--nshards", "7", "--samples-per-shard", "10", "--nworkers", "1", "--resize-at", "2",
        "--to-size", "2",
    )  # fmt: skip
    assert code == 0, out
    assert "the old layout's padding delivered before the checkpoint: 10" in out
    assert "missing 0" in out


def test_plan_at_scale_stays_arithmetic(capsys):
    code, out, _ = run_main(
        capsys, *SAMPLES, "--nshards", "100000", "--samples-per-shard", "1000+-50", "--size", "1024",
        "--nworkers", "8", "--batch-size", "64", "--resize-at", "700", "--to-size", "1000", "--to-nworkers", "6",
    )  # fmt: skip
    assert code == 0, out
    assert "(8190 ranges in the checkpoint)" in out
    assert "missing 0 (0.0%)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan", "--resize-at", "3"], "use it with --split samples"),
        ([*SAMPLES, "--resize-at", "35"], "--resize-at 35: every rank delivers 34 batches per epoch; use 0..34"),
        ([*SAMPLES, "--to-size", "2"], "give --resize-at too"),
        ([*SAMPLES, "--nbatches", "20", "--resize-at", "3"], "--resize-at with --nbatches: give one"),
    ],
)
def test_bad_resize_arguments_are_one_line(capsys, args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        run_main(capsys, *args)


@pytest.mark.parametrize("at", ["4", "11"])
def test_real_mode_resumes_the_training_loader_and_counts_what_the_plan_counts(capsys, tmp_path, at):
    """Real mode runs every old rank's loader for K batches and resumes the new layout's loaders
    from their states, as the trainer does: the keys delivered across the resize cover the epoch
    as the plan says here (the ranges differ: the real workers' shuffle buffers leave gaps; and
    where a shuffle brings padding before the checkpoint, which the plan's model of the workers'
    turns does not, the split of the duplicates between the two layouts differs)."""
    common = [
        "--split", "samples", "--nshards", "7", "--samples-per-shard", "9", "--size", "2", "--nworkers", "2",
        "--batch-size", "3", "--resize-at", at, "--to-size", "3", "--to-nworkers", "1", "--cache", str(tmp_path),
    ]  # fmt: skip
    outs = []
    for mode in (["--plan"], []):
        code, out, _ = run_main(capsys, *mode, *common)
        assert code == 0, out
        outs.append(out)
    coverage = [re.search(r"^coverage epoch 0 across the resize: .*$", out, re.M).group(0) for out in outs]
    assert coverage[0] == coverage[1]
    assert after(outs[0]) == after(outs[1])
    if at == "4":
        assert "69 samples delivered, 63 distinct of 63; duplicated 6 (9.5%), missing 0" in coverage[1]
        assert after(outs[1]) == {0: 5, 1: 5, 2: 5}
    else:
        assert "nothing remains of the epoch: the new layout starts with the next one" in outs[1]
