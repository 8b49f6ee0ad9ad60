"""From a user's images to a model they can use: scikit-learn's handwritten digits (real images
no test drew) as an ImageFolder tree, makeshards.py, a run given no data.num_classes, predict.py
on the held-out folder, the exported weights in plain torchvision and through ONNX Runtime, a
fine-tuned start against a start from scratch, a timm model, and the bad inputs' one lines."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, one_error_line, run_script
from tests.helpers.digits import NAMES, digits_tree

COMMON = ["trainer.device=cpu", "trainer.workers=1", "trainer.batch_size=32", "trainer.log_every=10"]
# 16 pixels: the 8x8 digits lose nothing (the source run's val top-1 is 99.2 %, as at 32) and a
# step costs a third of 32's (bench/results/2026-11-28-finetune-16px.md)
COMMON += ["trainer.ckpt_every=0", "data.image_size=16", "data.crop_scale=[0.6,1.0]"]


def shards(root: Path, tmp: Path) -> tuple[str, str]:
    for split in ("train", "val"):
        proc = run_script(
            str(ROOT / "makeshards.py"),
            "--source",
            str(root / split),
            "--shards",
            str(tmp / "shards"),
            "--prefix",
            f"{root.name}-{split}",
        )
        assert proc.returncode == 0, proc.stderr
    return (str(tmp / "shards" / f"{root.name}-{split}.index.json") for split in ("train", "val"))  # type: ignore[return-value]


def train(tmp: Path, name: str, train_index: str, val_index: str, *extra: str) -> tuple[Path, dict, str]:
    run_dir = tmp / name
    proc = run_script(
        "train.py", "data=shards", f"data.train_shards={train_index}", f"data.val_shards={val_index}",
        f"run_dir={run_dir}", *COMMON, *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, json.loads((run_dir / "summary.json").read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Four digits, 80 training and 30 held-out images each, trained 60 steps from scratch."""
    tmp = tmp_path_factory.mktemp("digits")
    root = tmp / "digits"
    digits_tree(root, [0, 1, 2, 3], train=80, val=30)
    train_index, val_index = shards(root, tmp)
    run_dir, summary, said = train(tmp, "run", train_index, val_index, "trainer.steps=60", "trainer.eval_every=0")
    return {"tmp": tmp, "root": root, "run": run_dir, "summary": summary, "said": said, "val": val_index}


def test_the_classes_come_from_the_index_to_every_output(digits):
    run, summary = digits["run"], digits["summary"]
    assert json.loads((run / "classes.json").read_text()) == ["one", "three", "two", "zero"]  # makeshards' order
    assert summary["classes"] == ["one", "three", "two", "zero"]
    config = json.loads((run / "config.json").read_text())
    assert config["classes"] == summary["classes"] and config["num_classes"] == 4 and config["image_size"] == 16
    ckpt = torch.load(run / "latest.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == summary["classes"] and ckpt["config"]["data"]["num_classes"] == 4
    # The weakest classes are named in the summary and the last line
    weakest = summary["val_weakest"]
    assert len(weakest) == 3 and all(name in summary["classes"] for name, _ in weakest)
    assert f"weakest {weakest[0][0]} " in digits["said"]
    assert summary["val_top1"] > 0.6  # it learned


def test_predict_on_the_held_out_folder_gives_the_runs_own_top1(digits):
    proc = run_script("predict.py", str(digits["run"]), str(digits["root"] / "val"), "--format", "csv", "--top-k", "2")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert len(rows) == 120 and set(rows[0]) == {"image", "class1", "p1", "class2", "p2"}
    right = sum(Path(r["image"]).parent.name == r["class1"] for r in rows)
    assert right / len(rows) == pytest.approx(digits["summary"]["val_top1"], abs=1e-9)
    assert "predict: 120 images classified" in proc.stderr


def test_predict_names_and_skips_an_unreadable_image_and_writes_json_lines(digits, tmp_path):
    good = next((digits["root"] / "val" / "two").glob("*.png"))
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    proc = run_script("predict.py", str(digits["run"]), str(bad), str(good), "--format", "jsonl", "--top-k", "1")
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()
    got = json.loads(line)
    assert got["image"] == str(good) and got["top"][0]["class"] in NAMES and 0 < got["top"][0]["p"] <= 1
    assert re.search(rf"predict: {re.escape(str(bad))}: cannot decode image.*; skipped", proc.stderr)
    assert "1 images classified, 1 skipped" in proc.stderr


def test_the_exported_weights_load_into_plain_torchvision_as_the_docs_show(digits):
    """docs/predict.md's lines, run as written: the same logits as the trainer's own model."""
    from wdsdist.model import saved

    text = (ROOT / "docs" / "predict.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", text, re.S)
    space = {"RUN": str(digits["run"])}
    exec(code, space)
    plain = space["model"].eval()
    ours, _ = saved.load(str(digits["run"]))
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert (plain(images) - ours(images)).abs().max() <= 1e-5


def test_onnx_runtime_gives_torchs_logits(digits):
    proc = run_script("predict.py", str(digits["run"]), "--export", "onnx")
    assert proc.returncode == 0, proc.stderr
    diff = float(re.search(r"within ([0-9.e+-]+) of torch's", proc.stderr).group(1))
    assert (digits["run"] / "model.onnx").stat().st_size > 1_000_000 and diff <= 1e-4


def test_fine_tuning_from_the_digits_beats_training_from_scratch_on_a_small_set(digits):
    """A small set of another kind: digits 0-4 in dark ink on white, 4 training images each (the
    source run saw 0-3 white on black). 10 steps from the source run's weights (its head of 4
    replaced by one of 5) against 10 from scratch, seed by seed. Measured over eight seeds in
    bench/results/2026-11-28-finetune-16px.md: ahead on each, by 25.1 points on average (seeds 0
    and 1: +40.0, +22.7); at 16 pixels scratch catches up by 15-20 steps, so the test stops at 10."""
    tmp = digits["tmp"]
    small = tmp / "ink"
    digits_tree(small, [0, 1, 2, 3, 4], train=4, val=30, first=110, ink=True)
    train_index, val_index = shards(small, tmp)
    steps = ["trainer.steps=10", "trainer.eval_every=0", "trainer.batch_size=16"]
    gains = []
    for seed in (0, 1):
        scratch = train(tmp, f"scratch{seed}", train_index, val_index, *steps, f"seed={seed}")[1]["val_top1"]
        weights = f"model.weights={digits['run']}"
        _, tuned, said = train(tmp, f"tuned{seed}", train_index, val_index, *steps, f"seed={seed}", weights)
        assert "its head (fc, 4 outputs) replaced by a new one of 5" in said
        gains.append(tuned["val_top1"] - scratch)
    assert min(gains) > 0 and sum(gains) / len(gains) > 0.02, gains


def test_a_timm_model_trains_a_step(digits, tmp_path):
    pytest.importorskip("timm")
    train_index = str(digits["tmp"] / "shards" / "digits-train.index.json")
    run, summary, _ = train(
        tmp_path, "timm", train_index, digits["val"], "model.name=timm/resnet10t", "trainer.steps=1"
    )
    assert summary["steps"] == 1
    assert json.loads((run / "config.json").read_text())["library"] == "timm"


def test_bad_inputs_get_one_line_each(digits, tmp_path):
    train_index = str(digits["tmp"] / "shards" / "digits-train.index.json")
    cases = {
        "data.num_classes=7": (
            "error: data.num_classes=7: data.train_shards's index names 4 classes (one, three, two, zero); "
            "leave data.num_classes out to take the index's"
        ),
        f"model.weights={tmp_path}/none.safetensors": f"error: model.weights={tmp_path}/none.safetensors: no such file",
        "model.freeze_steps=5": "error: model.freeze_steps=5: needs model.weights (a pretrained start)",
        "model.name=timm/resnet_nope": "error: model.name=timm/resnet_nope: not a timm model",
    }
    for override, line in cases.items():
        proc = run_script(
            "train.py",
            "data=shards",
            f"data.train_shards={train_index}",
            "data.val_shards=null",
            f"run_dir={tmp_path}/r",
            *COMMON,
            "trainer.steps=1",
            override,
        )
        assert proc.returncode == 2, (override, proc.stderr[-2000:])
        assert one_error_line(proc).startswith(line), (override, one_error_line(proc))
    # predict.py refuses weights that do not fit the model its config names
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((digits["run"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"num_classes": 7}))
    (other / "model.safetensors").write_bytes((digits["run"] / "model.safetensors").read_bytes())
    proc = run_script("predict.py", str(other), str(digits["root"] / "val"))
    assert proc.returncode == 2 and one_error_line(proc).startswith(
        f"error: {other}/config.json: the weights do not fit resnet18"
    )


def test_torchvision_weights_offline_are_named_with_their_file_and_url(monkeypatch, tmp_path):
    from wdsdist.errors import UserError
    from wdsdist.model import weights

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    found = weights.find("DEFAULT", "resnet18")
    assert found.mean == [0.485, 0.456, 0.406] and found.image_size == 224
    with pytest.raises(
        UserError,
        match=r"^model.weights=DEFAULT: resnet18-f37072fd.pth is not in torch's cache \(.*\) and cannot be "
        r"fetched \(OSError\); put https://download.pytorch.org/models/resnet18-f37072fd.pth there",
    ):
        weights.state_dict(found)


def test_timm_without_its_extra_is_one_line(monkeypatch):
    import sys

    from wdsdist.errors import UserError
    from wdsdist.model.build import timm_model

    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(
        UserError,
        match=r"^model.name=timm/convnext_tiny: timm is not installed \(pip install 'wds-distributed\[timm\]'\)$",
    ):
        timm_model("convnext_tiny", 3)


def test_freeze_steps_train_only_the_new_head(digits, tmp_path):
    """model.freeze_steps=3 of 3 steps: every weight but the head's as the pretrained run left it."""
    from safetensors.torch import load_file

    train_index = str(digits["tmp"] / "shards" / "digits-train.index.json")
    steps = ["trainer.steps=3", "trainer.eval_every=0", f"model.weights={digits['run']}", "model.freeze_steps=3"]
    run, _, _ = train(tmp_path, "frozen", train_index, digits["val"], *steps)
    before, after = load_file(digits["run"] / "model.safetensors"), load_file(run / "model.safetensors")
    moved = sorted(k for k, v in after.items() if k.endswith("weight") and not torch.equal(v, before[k]))
    assert moved == ["fc.weight"]


def test_a_model_on_the_hub_starts_a_run_at_one_commit(digits, tmp_path):
    """model.weights=hf://ORG/NAME: the test Hub serves the digits run's model.safetensors and
    config.json as a model repo; the run reads them at the commit main names, and records it."""
    from tests.helpers.hub import Hub

    files = {name: (digits["run"] / name).read_bytes() for name in ("model.safetensors", "config.json")}
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}
    with Hub() as hub:
        commit = hub.add_repo("digits-org/resnet18-digits", files)
        train_index = str(digits["tmp"] / "shards" / "digits-train.index.json")
        steps = [*COMMON, "trainer.steps=2", "trainer.eval_every=0", "model.weights=hf://digits-org/resnet18-digits"]
        run = tmp_path / "hub-run"
        proc = run_script(
            "train.py", "data=shards", f"data.train_shards={train_index}", f"data.val_shards={digits['val']}",
            f"run_dir={run}", *steps, env={**env, "HF_ENDPOINT": hub.endpoint},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (
            f"model.weights=hf://digits-org/resnet18-digits: a pretrained start (read at hf://digits-org/resnet18-digits@{commit})"
            in proc.stdout + proc.stderr
        )
        ckpt = torch.load(run / "latest.pt", map_location="cpu", weights_only=False)
        assert ckpt["config"]["model"]["weights"] == f"hf://digits-org/resnet18-digits@{commit}"
        missing = run_script(
            "train.py", "data=shards", f"data.train_shards={train_index}", "data.val_shards=null",
            f"run_dir={tmp_path}/r2", *COMMON, "trainer.steps=1", "model.weights=hf://digits-org/no-such-model",
            env={**env, "HF_ENDPOINT": hub.endpoint},
        )  # fmt: skip
        assert missing.returncode == 2
        assert one_error_line(missing).startswith("error: model.weights=hf://digits-org/no-such-model: ")
