"""simdist.py from the outside: the classic demonstration, its two fixes, the options, bad input.

The classic runs go through a subprocess (exit codes and output as a user sees them); the
other options run in-process through ``simdist.main`` to save a torch start-up per case.
"""

from __future__ import annotations

import re
import subprocess
import traceback

import pytest

from tests.conftest import run_script
from tests.helpers.simdist import ranks, run_main
from wdsdist.errors import UserError
from wdsdist.simdist import cli as simdist


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("simdist-cache"))


def cli(*args: str, cache: str | None = None) -> subprocess.CompletedProcess:
    extra = ["--cache", cache] if cache else []
    return run_script("simdist.py", *args, *extra)


def test_default_fails_40_30_30(cache):
    p = cli(cache=cache)
    assert p.returncode == 1, p.stderr
    assert "parameters:" in p.stdout
    assert ranks(p.stdout) == {0: 40, 1: 30, 2: 30}
    assert "rank 0: 40 batches of 10 (400 samples)" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == (
        "FAILED: ranks deliver different numbers of batches: 40 (rank 0), 30 (ranks 1-2)"
    )
    # The advice names the numbers and the fixes.
    assert "9 or 18 shards" in p.stdout
    assert "--nbatches 30" in p.stdout and "--nbatches 40 --dsrepeat 2" in p.stdout
    assert "coverage epoch 0: 1000 samples delivered, 1000 distinct of 1000" in p.stdout


def test_small_nbatches_succeeds(cache):
    p = cli("--nbatches", "30", cache=cache)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ranks(p.stdout) == {0: 30, 1: 30, 2: 30}
    assert p.stdout.rstrip().splitlines()[-1] == "SUCCESS: same batches in all ranks (30 per rank per epoch)"
    assert "missing 100 (10.0%)" in p.stdout  # the cut drops rank 0's last 10 batches


def test_larger_nbatches_needs_dsrepeat(cache, capsys):
    code, out, _ = run_main(capsys, "--nbatches", "40", "--cache", cache)
    assert code == 1
    assert ranks(out) == {0: 40, 1: 30, 2: 30}
    assert "--nbatches 40 is more than ranks 1-2 can deliver" in out
    assert "--dsrepeat 2" in out and "--nbatches 30 or less" in out

    p = cli("--nbatches", "40", "--dsrepeat", "2", cache=cache)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ranks(p.stdout) == {0: 40, 1: 40, 2: 40}
    assert "SUCCESS: same batches in all ranks" in p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("coverage epoch 0"))
    assert "1200 samples delivered" in line and "--dsrepeat/--repeat read data more than once" in line


def test_auto_reports_drops(cache, capsys):
    code, out, _ = run_main(capsys, "--nbatches", "auto", "--cache", cache)
    assert code == 0
    assert "auto -> 30 (the most every rank reaches)" in out
    assert "samples per epoch: 900 delivered for 1000 in the data set: drops 100 (10.0%), repeats 0 (0.0%)" in out


def test_auto_with_dsrepeat_reports_repeats(capsys):
    code, out, _ = run_main(capsys, "--plan", "--nbatches", "auto", "--dsrepeat", "2")
    assert code == 0
    assert "auto -> 60" in out
    assert "repeats 800 (80.0%)" in out and "drops 0 (0.0%)" in out


def test_loader_repeat_reaches_n(cache, capsys):
    code, out, _ = run_main(
        capsys, "--nbatches", "40", "--repeat", "2", "--nepochs", "2", "--nworkers", "2", "--cache", cache
    )
    assert code == 0, out
    assert re.findall(r"^epoch \d:$", out, re.M) == ["epoch 0:", "epoch 1:"]
    assert ranks(out) == {0: 40, 1: 40, 2: 40}
    for e in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"coverage epoch {e}"))
        assert "1200 samples delivered" in line


def test_showsplits_showopen_and_plot(cache, capfd, tmp_path):
    png = tmp_path / "layout.png"
    # File-descriptor capture: the shard traces come from the loader's worker processes.
    code, out, err = run_main(
        capfd, "--showsplits", "--showopen", "--plot", str(png), "--nbatches", "30", "--cache", cache
    )
    assert code == 0
    assert "rank 0: 4 shards [0, 3, 6, 9], 400 samples" in out
    assert "  worker 0: 2 shards [0, 9], 200 samples, 20 batches" in out
    assert "  worker 2: 1 shard [8], 100 samples, 10 batches" in out
    # Shard opens and closes come from the loader's workers, as they happen.
    assert re.search(r"rank 0 worker 0 open  .*simdist-000000\.tar", err)
    assert re.search(r"rank 2 worker 2 close .*simdist-000008\.tar", err)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_mode_same_lines_as_real(cache, capsys):
    args = ["--nshards", "7", "--samples-per-shard", "30+-12", "--seed", "3", "--size", "2", "--nworkers", "2"]
    args += ["--batch-size", "4", "--partial"]
    code_plan, plan_out, _ = run_main(capsys, "--plan", *args)
    code_real, real_out, _ = run_main(capsys, *args, "--cache", cache)
    plan_lines = [x for x in plan_out.splitlines() if x.startswith("rank")]
    real_lines = [x for x in real_out.splitlines() if x.startswith("rank")]
    assert plan_lines and plan_lines == real_lines
    assert code_plan == code_real
    assert "warning" not in real_out


def test_plan_mode_reads_no_data(tmp_path, capsys):
    # An index whose shards do not exist: plan mode only needs the counts in it.
    import json

    index = tmp_path / "x.index.json"
    shardlist = [{"url": f"x-{i:06d}.tar", "nsamples": 100 + i} for i in range(12)]
    index.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": shardlist}))
    code, out, _ = run_main(capsys, "--plan", "--shards", str(index), "--size", "2", "--nworkers", "3")
    assert code == 0
    assert "samples       1266 (100..111 per shard, mean 105.5)" in out
    assert ranks(out) == {0: 62, 1: 62}  # 206, 210, 214 and 208, 212, 216 samples per worker


def test_plan_scale_100000_shards_1024_ranks(capsys):
    args = ["--plan", "--nshards", "100000", "--samples-per-shard", "1000+-50", "--size", "1024", "--nworkers", "8"]
    code, out, _ = run_main(capsys, *args, "--batch-size", "64")
    assert code == 1
    assert "batches per rank: " in out and "distinct counts over 1024 ranks" in out
    assert len(out.splitlines()) < 60  # a summary, not 1024 lines
    code, out, _ = run_main(capsys, *args, "--batch-size", "64", "--nbatches", "auto")
    assert code == 0
    m = re.search(r"drops (\d+) \((\d+\.\d)%\)", out)
    assert m and int(m.group(1)) > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "0"], "argument --size: must be >= 1, got 0"),
        (["--batch-size", "-3"], "argument --batch-size: must be >= 1, got -3"),
        (["--nworkers", "-1"], "argument --nworkers: must be >= 0, got -1"),
        (["--nbatches", "0"], "argument --nbatches: must be >= 1 or auto, got 0"),
        (["--nbatches", "many"], "argument --nbatches: expected an integer or auto, got 'many'"),
        (["--size", "two"], "argument --size: expected an integer, got 'two'"),
        (["--sise", "2"], "unrecognized arguments: --sise 2"),
        (["--dsrepeat", "0"], "argument --dsrepeat: must be >= 1, got 0"),
        (["--cross-shuffle", "-5"], "argument --cross-shuffle: must be >= 0, got -5"),
        (["--plan", "--nshards", "0"], "argument --nshards: must be >= 1, got 0"),
        (["--plan", "--samples-per-shard", "100+-x"], "expected N or N+-D"),
        (["--plan", "--samples-per-shard", "100+-100"], "the spread 100 must be less than 100"),
        (["--plan", "--samples-per-shard", "0"], "--samples-per-shard must be >= 1, got 0"),
        (["--shards", "/nonexistent/s-{000..009}.tar"], "matches no file"),
        (["--plan", "--shards", "pipe:cat s-{000..009}.tar"], "--plan needs sample counts"),
    ],
)
def test_bad_input_one_line_exit_2(args, message, capsys):
    with pytest.raises(UserError, match=re.escape(message)):
        simdist.main(args)


def test_bad_input_cli():
    p = cli("--size", "0")
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.strip().splitlines() == ["error: argument --size: must be >= 1, got 0 (see simdist.py --help)"]
    p = cli("--shards", "/nonexistent/s-{000..009}.tar")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: shard spec '/nonexistent/s-{000..009}.tar' matches no file"]


def test_real_mode_needs_the_files_an_index_lists(tmp_path):
    index = tmp_path / "gone.index.json"
    index.write_text('{"shardlist": [{"url": "gone-000000.tar", "nsamples": 5}]}')
    with pytest.raises(UserError, match=r"1 of 1 shards of .* do not exist, first .*gone-000000\.tar; --plan"):
        simdist.main(["--shards", str(index)])


def test_real_mode_bad_sample_is_one_line(tmp_path):
    import webdataset as wds

    from wdsdist.simdist import write_synthetic_shards

    write_synthetic_shards([4, 4, 4], str(tmp_path), "s")
    with wds.TarWriter(str(tmp_path / "s-000003.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"bad-{i}", "jpg": b"not a jpeg", "cls": "1"})
    with pytest.raises(UserError, match=r"s-000003\.tar: sample 'bad-\d'") as err:
        simdist.main(["--shards", str(tmp_path / "s-{000000..000003}.tar"), "--size", "2", "--nworkers", "2"])
    assert "\n" not in str(err.value) and "cannot decode image" in str(err.value)
    # The worker's error (the UserError's context) holds the rank's DataLoader iterator in a reference
    # cycle (its traceback's frames). Left to the garbage collector, which closes the iterator's queues
    # before it runs the iterator's shutdown, the workers never hear they should stop: a later test's
    # collection waited 10 s for each (bench/results/2026-11-29-suite-time.md). Freed here, they stop.
    traceback.clear_frames(err.value.__context__.__traceback__)


def test_the_options_are_typed_once_frozen_and_refuse_a_bad_value_in_one_line() -> None:
    import dataclasses

    options = simdist.parse(["--plan", "--size", "4", "--mix", "a:100", "b:50"])
    assert (options.size, options.plan, len(options.mix)) == (4, True, 2)
    assert isinstance(options.mix, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.size = 5  # type: ignore[misc]
    one = simdist.parse(["--plan"])
    for change, message in (
        ({"plot": "ranks.jpg"}, "--plot ranks.jpg: give a .png file name"),
        ({"size": 0}, "--size must be >= 1, got 0"),
        ({"cache_size": 10}, "--cache-size needs --shard-bytes (the bytes each shard costs to fetch)"),
    ):
        with pytest.raises(UserError) as err:
            dataclasses.replace(one, **change)
        assert str(err.value) == message
