"""Your own data without surprises: data=shards, shard keys named with the default data group, and
brace specs on the command line as the shell hands them over (quoted, or expanded by bash)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT, one_error_line, run_script, write_tiny_shards
from tests.helpers.config import compose_config
from tests.helpers.shards import make_image_folder
from wdsdist.errors import UserError
from wdsdist.train import config


def bash_words(command: str) -> list[str]:
    """The words bash hands a program for this command line (brace expansion and quotes applied)."""
    out = subprocess.run(["bash", "-c", f'printf "%s\\n" {command}'], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


# ---------------------------------------------------------------- data=shards


def test_data_shards_is_your_own_data_at_224_with_imagenet_normalisation():
    cfg = compose_config(["data=shards"])
    d = cfg.data
    assert (d.name, d.image_size, list(d.crop_scale), d.synthetic) == ("shards", 224, [0.08, 1.0], None)
    assert list(d.mean) == [0.485, 0.456, 0.406] and list(d.std) == [0.229, 0.224, 0.225]
    with pytest.raises(UserError) as missing:
        config.check(cfg)
    assert str(missing.value) == (
        "data.train_shards, data.val_shards: missing values; give them on the command line, "
        "e.g. data.train_shards=... data.val_shards=... (data.val_shards=null: no evaluation)"
    )


def test_data_imagenet_needs_its_val_shards_too():
    """A group's ??? for val_shards is kept (the schema's default is MISSING, not None): the
    ImageNet preset without held-out shards is an error, not a run without evaluation."""
    cfg = compose_config(["data=imagenet", "data.train_shards=/d/train.index.json"])
    with pytest.raises(UserError) as missing:
        config.check(cfg)
    assert str(missing.value) == (
        "data.val_shards: missing value; give it on the command line, e.g. data.val_shards=... "
        "(data.val_shards=null: no evaluation)"
    )
    config.check(compose_config(["data=imagenet", "data.train_shards=/d/t.index.json", "data.val_shards=null"]))


def test_the_readmes_own_data_commands_run_as_written(tmp_path):
    """makeshards from an ImageFolder tree, then data=shards on its index (here 1 step of 2 images
    at the group's 224 pixels)."""
    make_image_folder(tmp_path / "images" / "train", per_class=4)
    make_image_folder(tmp_path / "images" / "val", per_class=1)
    for split, n in (("train", 12), ("val", 3)):
        proc = run_script(
            str(ROOT / "makeshards.py"), "--source", f"images/{split}", "--shards", "shards", cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        said = re.fullmatch(r"wrote 1 shards, (\d+) samples, 3 classes in [\d.]+ s \(.*\) -> (.*)", proc.stdout.strip())
        assert said is not None and said.groups() == (str(n), f"shards/{split}.index.json"), proc.stdout
    proc = run_script(
        str(ROOT / "train.py"),
        "data=shards",
        "data.train_shards=shards/train.index.json",
        "data.val_shards=shards/val.index.json",
        "trainer.steps=1",
        "trainer.batch_size=2",
        "trainer.workers=1",
        "run_dir=run",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["val_samples"] == 3
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert "image_size: 224" in resolved and "num_classes: 3" in resolved  # from the index
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == summary["classes"]


# ---------------------------------------------------------------- shard keys with the default data group


@pytest.mark.parametrize("which", ["missing", "own index", "pattern"])
def test_own_shards_with_the_default_group_point_to_data_shards(which, tmp_path):
    """The synthetic group would write 10,000 generated images at a missing path and train on them,
    or refuse the user's shards; its 10 classes at 32 pixels are not theirs. One line instead, and
    nothing written."""
    index = write_tiny_shards(tmp_path / "mine", [3, 2], "mine")
    spec = {
        "missing": str(tmp_path / "typo" / "train.index.json"),
        "own index": str(index),
        "pattern": str(tmp_path / "mine" / "mine-{000000..000001}.tar"),
    }[which]
    proc = run_script("train.py", f"data.train_shards={spec}", "data.val_shards=null", f"outputs={tmp_path}/out")
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: data.train_shards={spec}: the default data=synthetic is its generated set (10 classes at 32 "
        f"pixels, written there if missing); for shards of your own add data=shards data.num_classes=N "
        f"(data=synthetic: write the synthetic set there)"
    )
    assert not (tmp_path / "typo").exists() and not (tmp_path / "out").exists()


def test_the_default_group_still_takes_its_paths_when_asked():
    """data=synthetic named, data.synthetic=null, or another group: the rule does not apply."""
    for overrides in (
        ["data=synthetic", "data.train_shards=/tmp/s/s-train.index.json"],
        ["data.synthetic=null", "data.train_shards=/d/t.index.json"],
        ["data.val_shards=null"],
    ):
        config.check(compose_config(overrides), overrides)


# ---------------------------------------------------------------- brace specs as the shell hands them over


def test_bash_expands_an_unquoted_brace_pattern_into_one_word_per_shard():
    """What reaches train.py: bash expands the whole word, key included; quoting keeps it one word."""
    assert bash_words("data.train_shards=http://h/web-{000000..000002}.tar") == [
        "data.train_shards=http://h/web-000000.tar",
        "data.train_shards=http://h/web-000001.tar",
        "data.train_shards=http://h/web-000002.tar",
    ]
    assert bash_words("'data.train_shards=http://h/web-{000000..000002}.tar'") == [
        "data.train_shards=http://h/web-{000000..000002}.tar"
    ]


@pytest.mark.parametrize(
    "typed,quote",
    [
        (
            "data.train_shards=http://h/web-{000000..000009}.tar",
            "'data.train_shards=http://h/web-{000000..000009}.tar'",
        ),
        ("data.val_shards=/d/val-{7..12}.tar", "'data.val_shards=/d/val-{7..12}.tar'"),
        ("data.train_shards=/d/{a,b}-{0..1}.tar", "'data.train_shards=/d/{a-0,a-1,b-0,b-1}.tar'"),
        ("data.train_shards=/d/x-{0..2}-{0..2}.tar", "the whole word, 'data.train_shards=...{A..B}...'"),
    ],
)
def test_a_brace_pattern_the_shell_expanded_is_one_line_that_says_to_quote_it(typed, quote):
    words = bash_words(typed)
    key, first, last = words[0].partition("=")[0], words[0].partition("=")[2], words[-1].partition("=")[2]
    with pytest.raises(UserError) as refused:
        config.shard_argv(["trainer.steps=2", *words])
    shown = f"{first} ... {last}" if len(words) > 2 else f"{first} {last}"
    assert str(refused.value) == (
        f"{key} is given {len(words)} times in a row ({shown}): the shell expanded a brace pattern? Quote it: {quote}; "
        f"Hydra would keep only the last one"
    )
    if quote.startswith("'"):  # the suggested word expands to exactly what the shell gave
        assert bash_words(quote.replace("'", "")) == words


def test_a_literal_brace_spec_for_a_shard_key_gets_hydras_quotes_and_nothing_else_changes():
    literal = [
        "data.train_shards=http://h/web-{000000..000009}.tar",
        "data.val_shards=pipe:curl -s http://h/val-{0..1}.tar",
        "++data.train_shards=/d/{a,b}.tar",
    ]
    assert [config.shard_argv([arg]) for arg in literal] == [
        ['data.train_shards="http://h/web-{000000..000009}.tar"'],
        ['data.val_shards="pipe:curl -s http://h/val-{0..1}.tar"'],
        ['++data.train_shards="/d/{a,b}.tar"'],
    ]
    untouched = [
        "data.train_shards=/d/train.index.json",
        'data.train_shards="/d/t-{0..1}.tar"',  # Hydra-quoted already (the README's '"..."' form)
        "data.train_shards='/d/t-{0..1}.tar'",
        "data.train_shards=${oc.env:SHARDS}",
        "data.val_shards=null",
        "data.train_shards=a.tar,b.tar",  # a sweep for -m, as Hydra reads it
        "model.name=web-{0..1}",  # not a shard key: Hydra refuses it with its hint to quote
        "data.name=x{",
        "~data.val_shards",
    ]
    for arg in untouched:  # one at a time: a shard key in two words in a row is an error
        assert config.shard_argv(["--cfg", "job", arg, "trainer.steps=5"]) == ["--cfg", "job", arg, "trainer.steps=5"]
    # Apart, a shard key given again is an override, as Hydra reads it (a script's default, then the user's).
    apart = ["data.train_shards=/d/a.index.json", "trainer.steps=5", "data.train_shards=/d/b.index.json"]
    assert config.shard_argv(apart) == apart


def test_a_literal_brace_spec_trains_and_a_bash_expanded_one_is_refused(tmp_path):
    root = tmp_path / "t"
    write_tiny_shards(root, [4, 4], "t", size=16)
    spec = f"{root}/t-{{000000..000001}}.tar"
    common = ["data=shards", "data.num_classes=10", "data.val_shards=null", "data.image_size=16"]
    small = ["trainer.steps=1", "trainer.batch_size=4", "trainer.workers=0", "model.stem=small"]
    proc = run_script("train.py", *common, *small, f"data.train_shards={spec}", f"run_dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"train_shards: {spec}" in (tmp_path / "run" / "config.yaml").read_text()
    typed = f"{shlex.quote(sys.executable)} train.py {' '.join(common)} data.train_shards={spec}"
    proc = subprocess.run(
        ["bash", "-c", typed], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"error: data.train_shards is given 2 times in a row ({root}/t-000000.tar ")
    assert f"Quote it: 'data.train_shards={spec}'" in proc.stderr
