"""predict.py's options are made once from the command line, frozen and checked: a bad value is
one line naming its option, before any model is loaded."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from wdsdist.errors import UserError
from wdsdist.predict.cli import options
from wdsdist.predict.options import PredictOptions


def test_the_command_line_becomes_one_frozen_object():
    opts = options(["outputs/run", "a.jpg", "shards/", "--top-k", "3", "--workers", "4", "--out-dir", "o"])
    assert opts == PredictOptions(model="outputs/run", inputs=("a.jpg", "shards/"), top_k=3, workers=4, out_dir="o")
    assert opts.whole_data_set and not dataclasses.replace(opts, export="onnx").whole_data_set
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.top_k = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--top-k", "0"], "--top-k=0: must be >= 1"),
        (["--batch-size", "-2"], "--batch-size=-2: must be >= 1"),
        (["--workers", "many"], "--workers=many: a number >= 0, or auto"),
    ],
)
def test_a_bad_value_is_refused_naming_its_option(argv, line):
    with pytest.raises(UserError) as refused:
        options(["outputs/run", "a.jpg", *argv])
    assert str(refused.value) == line


def test_predict_py_says_it_in_one_line_and_exits_non_zero(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), str(tmp_path / "no-run"), "a.jpg", "--top-k", "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["error: --top-k=0: must be >= 1"]
