"""simdist --mix (issue 30, item 7): several data sets per epoch, source and rank. The numbers it
prints are the loader's own plan's (its Mix, windows, coverage, MixEpoch.counts over each rank's
span), checked against a Loader built on the same shards, not against figures written here; real
mode runs the loader and finds the plan's counts; a bad token is one line naming it, exit 2."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.conftest import run_script
from tests.helpers.simdist import run_main
from wdsdist import simdist
from wdsdist.data import Loader, LoaderConfig, Source
from wdsdist.data.plan.mix import MixEpoch, coverage, epoch_total, windows
from wdsdist.data.plan.splits import rank_batches
from wdsdist.errors import UserError
from wdsdist.simdist import cli as simdist_cli

SHARDS = {"big": [13, 7, 10, 5], "small": [4, 5], "tiny": [3]}


def source_rows(out: str, epoch: int) -> dict[str, list[str]]:
    """The source table of one epoch: name -> its cells."""
    block = out.split(f"\nepoch {epoch}: ", 1)[1].split("\n\n", 1)[0].splitlines()
    head = block.index(next(line for line in block if line.split()[:1] == ["source"]))
    rows = {}
    for line in block[head + 1 :]:
        if line.lstrip().startswith(("rank", "...", "the loader", "warning")):
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def rank_rows(out: str, epoch: int) -> dict[int, dict[str, int]]:
    block = out.split(f"\nepoch {epoch}: ", 1)[1].split("\n\n", 1)[0]
    return {
        int(r): {name: int(n) for name, n in re.findall(r"([\w.-]+) (\d+)", rest)}
        for r, rest in re.findall(r"^  rank +(\d+): (.*) \(\d+ batches", block, re.M)
    }


@pytest.mark.parametrize(
    "token, expected",
    [
        ("imagenet:1281167/1281:repeat=1", ("imagenet", "1281167/1281", "repeat", 1.0, (1281167, 1281))),
        ("photos:128000:weight=0.2", ("photos", "128000", "weight", 0.2, (128000, 1))),
        ("extra:5000/5:samples=300", ("extra", "5000/5", "samples", 300, (5000, 5))),
        ("plain:data/a-{000..009}.tar", ("plain", "data/a-{000..009}.tar", None, None, None)),
        ("web:https://host/a-{0..9}.tar:repeat=0.5", ("web", "https://host/a-{0..9}.tar", "repeat", 0.5, None)),
        ("two:http://a/x.tar::http://b/y.tar", ("two", "http://a/x.tar::http://b/y.tar", None, None, None)),
    ],
)
def test_a_source_is_name_data_and_an_optional_setting(token, expected):
    a = simdist.parse_mix_source(token)
    assert (a.name, a.data, a.key, a.value, a.described) == expected


@pytest.mark.parametrize(
    "token, why",
    [
        ("photos", "no data after the name"),
        ("photos:", "no data after the name"),
        ("pho tos:100", "the name 'pho tos'"),
        ("photos:100:weigth=0.2", "unknown setting 'weigth'"),
        ("photos:100:weight=lots", "weight='lots' is not a number"),
        ("photos:100:samples=2.5", "samples='2.5' is not a whole number"),
        ("photos:100:repeat=0", "repeat=0 must be > 0"),
        ("photos:repeat=2", "no data before the setting"),
        ("photos:10/20", "20 shards for 10 samples"),
        ("photos:0", "a described source needs at least one sample"),
    ],
)
def test_a_bad_token_is_one_line_naming_it(token, why):
    with pytest.raises(UserError) as caught:
        simdist_cli.main(["--plan", "--mix", "ok:100", token])
    message = str(caught.value)
    assert f"argument --mix: {token!r}: {why}" in message and "\n" not in message


def test_bad_syntax_exits_2_with_one_line_on_stderr():
    p = run_script("simdist.py", "--plan", "--mix", "imagenet:1281167/1281", "photos:128000:weigth=0.2")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "'photos:128000:weigth=0.2': unknown setting 'weigth'" in lines[0], p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mix", "a:100:weight=1"], "source 'a' has a weight: give data.epoch_samples"),
        (["--mix", "a:100", "a:50"], "two sources are named 'a'"),
        (["--mix", "a:100", "--split", "shards"], "data.sources needs loader.split=samples"),
        (["--mix", "a:100", "--shard-order", "node"], "loader.shard_order=node is not supported"),
        (["--mix", "a:100", "--nbatches", "3"], "it does not combine with --nbatches"),
        (["--mix", "a:100", "--nshards", "3"], "it does not combine with --nshards"),
        (["--epoch-samples", "100"], "--epoch-samples and --mix-batches describe several data sets"),
        (["--mix", "a:100", "--epoch-samples", "50", "--size", "4", "--batch-size", "16"], "refuses this layout"),
    ],
)
def test_what_the_loader_refuses_simdist_refuses_in_one_line(args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        simdist_cli.main(["--plan", *args])


SETTINGS = {
    "repeat": {"big": "repeat=0.5", "small": None, "tiny": "repeat=3"},
    "weights": {"big": "weight=0.6", "small": "weight=0.3", "tiny": "weight=0.1"},
    "samples and weight": {"big": "samples=20", "small": "weight=1", "tiny": "repeat=2.5"},
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_the_printed_numbers_are_the_loaders_plan(capsys, tiny_shards, setting, remainder):
    specs = {name: str(tiny_shards(counts, prefix=name)) for name, counts in SHARDS.items()}
    chosen = SETTINGS[setting]
    world, size, nepochs = 3, 4, 3
    tokens = [f"{n}:{specs[n]}" + (f":{chosen[n]}" if chosen[n] else "") for n in SHARDS]
    code, out, _ = run_main(
        capsys,
        *["--plan", "--mix", *tokens, "--epoch-samples", "40", "--remainder", remainder],
        *["--size", str(world), "--nworkers", "2", "--batch-size", str(size), "--nepochs", str(nepochs)],
    )
    assert code == 0, out
    # The loader's own Mix of the same shards: what every number below comes from.
    kw = {n: dict([chosen[n].split("=")]) if chosen[n] else {} for n in SHARDS}
    sources = [Source(n, specs[n], **{k: float(v) for k, v in kw[n].items()}) for n in SHARDS]
    config = LoaderConfig(batch_size=size, workers=2, mode="epoch", epoch_samples=40, remainder=remainder)
    mix = Loader(sources, config, rank=0, world=world).mix
    for epoch in range(nepochs):
        total = epoch_total(mix, epoch)
        k = rank_batches(total, world, size, remainder)
        span = k * size
        padded = max(0, world * span - total)
        mixed = MixEpoch(mix, 0, epoch, size)
        rows = source_rows(out, epoch)
        assert f"epoch {epoch}: {total} samples in the sequence; {world} ranks x {k} batches of {size}" in out
        plan_rows = zip(coverage(mix, epoch, padded, size), windows(mix, epoch), strict=True)
        for s, (row, (first, n)) in enumerate(plan_rows):
            name = row["name"]
            cells = rows[name]
            assert cells[1] == row["setting"] and int(cells[2]) == row["samples"] == n
            assert float(cells[3]) == pytest.approx(row["passes"], abs=5e-4)
            a, b = map(float, cells[4].split(".."))
            assert (a, b) == pytest.approx((first / mix.sources[s].size, (first + n) / mix.sources[s].size), abs=5e-4)
            dropped = mixed.counts(world * span, total)[s] if total > world * span else 0
            assert int(cells[5]) == (row["padding"] if remainder == "pad" else dropped)
            of = mixed.sources(np.arange(world * span)).reshape(-1, size)
            per_batch = (of == s).sum(axis=1)
            assert cells[6] == simdist.mix._range(int(per_batch.min()), int(per_batch.max()))
        ranks = rank_rows(out, epoch)
        assert set(ranks) == set(range(world))
        for r in range(world):
            assert list(ranks[r].values()) == mixed.counts(r * span, (r + 1) * span)
    assert out.rstrip().endswith("per rank per epoch)") or "per rank in epochs" in out


def test_real_mode_runs_the_loader_and_finds_the_plans_counts(capsys, tmp_path):
    code, out, _ = run_main(
        capsys,
        *["--mix", "a:60/3:repeat=0.5", "b:23/2", "c:7:repeat=3", "--mix-batches", "stratified"],
        *["--size", "2", "--nworkers", "1", "--batch-size", "8", "--nepochs", "2", "--cache", str(tmp_path)],
    )
    assert code == 0, out
    assert out.count("the loader delivered the plan's counts on every rank") == 2
    assert "warning" not in out
    assert "simdist --mix (real:" in out


def test_a_layout_too_big_to_run_is_planned_per_source_and_rank(capsys):
    code, out, _ = run_main(
        capsys,
        *["--plan", "--mix", "imagenet:1281167/1281", "photos:128000/128:weight=0.2", "--epoch-samples", "1500000"],
        *["--size", "256", "--nworkers", "8", "--batch-size", "256", "--nepochs", "2"],
    )
    assert code == 0, out
    k = rank_batches(1_500_000, 256, 256, "pad")
    assert f"256 ranks x {k} batches of 256 = {256 * k * 256}: {256 * k * 256 - 1_500_000} padded" in out
    rows = source_rows(out, 1)
    assert rows["imagenet"][2] == "1281167" and rows["photos"][2] == str(1_500_000 - 1_281_167)
    assert rows["photos"][4] == "1.710..3.419"  # epoch 1 goes on where epoch 0 stopped in the stream
    assert "... 248 ranks not shown (--verbose shows all)" in out
    ranks = rank_rows(out, 0)
    assert all(sum(r.values()) == k * 256 for r in ranks.values())
    assert out.rstrip().splitlines()[-1] == f"SUCCESS: same batches in all ranks ({k} per rank per epoch)"
