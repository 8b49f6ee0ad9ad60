"""simdist --split samples: the classic demo becomes equal, with every sample covered but the
stated padding (or drop), in plan and in real mode, and plans at scale from arithmetic alone."""

from __future__ import annotations

import pytest

from tests.helpers.simdist import ranks, run_main
from wdsdist.errors import UserError
from wdsdist.simdist import cli as simdist


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("simdist-cache"))


@pytest.mark.parametrize("real", [False, True], ids=["plan", "real"])
def test_classic_demo_pads_20_and_misses_nothing(capsys, cache, real):
    args = ["--split", "samples", "--cache", cache] + ([] if real else ["--plan"])
    code, out, _ = run_main(capsys, *args)
    assert code == 0, out
    assert ranks(out) == {0: 34, 1: 34, 2: 34}
    assert "repeats 20 (2.0%)" in out and "drops 0 (0.0%)" in out
    assert out.rstrip().splitlines()[-1] == "SUCCESS: same batches in all ranks (34 per rank per epoch)"
    if real:
        assert "coverage epoch 0: 1020 samples delivered, 1000 distinct of 1000; duplicated 20 (2.0%), missing 0" in out


@pytest.mark.parametrize("real", [False, True], ids=["plan", "real"])
def test_classic_demo_with_drop_duplicates_nothing_and_misses_10(capsys, cache, real):
    args = ["--split", "samples", "--remainder", "drop", "--nepochs", "2", "--cache", cache]
    code, out, _ = run_main(capsys, *args, *([] if real else ["--plan"]))
    assert code == 0, out
    assert ranks(out) == {0: 33, 1: 33, 2: 33}
    assert "drops 10 (1.0%), repeats 0 (0.0%)" in out
    if real:
        for epoch in (0, 1):
            assert f"coverage epoch {epoch}: 990 samples delivered, 990 distinct of 1000; duplicated 0 (0.0%)" in out


def test_showsplits_gives_each_worker_its_span(capsys):
    code, out, _ = run_main(capsys, "--plan", "--split", "samples", "--showsplits")
    assert code == 0
    assert "rank 2: positions 680..1019, 340 samples, 34 batches" in out
    assert "  worker 2: positions 910..1019, 110 samples, 11 batches" in out


def test_cut_with_the_sample_split_counts_what_it_leaves_out(capsys):
    code, out, _ = run_main(capsys, "--plan", "--split", "samples", "--nbatches", "30")
    assert code == 0 and ranks(out) == {0: 30, 1: 30, 2: 30}
    assert "900 delivered for 1000 in the data set: drops 100 (10.0%), repeats 0" in out


def test_plan_at_scale(capsys):
    args = ["--plan", "--split", "samples", "--nshards", "100000", "--samples-per-shard", "1000+-50"]
    code, out, _ = run_main(capsys, *args, "--size", "1024", "--nworkers", "8", "--batch-size", "64")
    assert code == 0 and "batches per rank: 1526 on every one of 1024 ranks" in out
    assert "repeats 22254" in out and "drops 0 " in out


def test_too_few_samples_and_dsrepeat_are_refused_in_one_line(capsys):
    with pytest.raises(UserError, match=r"1000 samples are fewer than 3 ranks x 4 workers x batch size 100 = 1200"):
        simdist.main(["--plan", "--split", "samples", "--nworkers", "4", "--batch-size", "100"])
    with pytest.raises(UserError, match=r"--dsrepeat applies to --split shards"):
        simdist.main(["--plan", "--split", "samples", "--dsrepeat", "2"])
