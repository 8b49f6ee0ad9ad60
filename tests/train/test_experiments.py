"""Named experiments (conf/experiment/, lightning-hydra-template style): each composes through the
typed schema and passes the config check; smoke runs end to end."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from tests.conftest import ROOT, run_script
from tests.helpers.config import compose_config
from wdsdist.train import config, recipe


def test_imagenet_resnet50_is_the_readmes_imagenet_command():
    shards = ["data.train_shards=/d/imagenet-train.index.json", "data.val_shards=/d/imagenet-val.index.json"]
    cfg = compose_config(["+experiment=imagenet_resnet50", *shards])
    config.check(cfg)
    assert (cfg.data.name, cfg.data.num_classes, cfg.data.image_size, cfg.model.name) == (
        "imagenet",
        1000,
        224,
        "resnet50",
    )
    t = cfg.trainer
    assert (t.batch_size, t.workers, t.steps, t.eval_every, t.ckpt_every) == (128, "auto", 112600, 5000, 5000)
    assert cfg.data.train_shards == "/d/imagenet-train.index.json" and cfg.data.synthetic is None
    # Command-line values still win over the experiment's.
    assert compose_config(["+experiment=imagenet_resnet50", *shards, "trainer.steps=28150"]).trainer.steps == 28150


def test_imagenet_resnet50_needs_its_shards():
    cfg = compose_config(["+experiment=imagenet_resnet50"])
    with pytest.raises(MissingMandatoryValue) as missing:
        OmegaConf.to_container(cfg, throw_on_missing=True)
    assert config.one_line(missing.value).startswith("data.train_shards: missing value")


def test_smoke_composes_and_runs(tmp_path):
    cfg = compose_config(["+experiment=smoke"])
    config.check(cfg)
    assert cfg.data.train_shards.startswith("data/smoke/")  # not the default job's synthetic shards
    proc = run_script(str(ROOT / "train.py"), "+experiment=smoke", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == cfg.trainer.steps and summary["val_samples"] == cfg.data.synthetic.val_samples
    assert (tmp_path / "data" / "smoke" / "smoke-train.index.json").exists()


def test_finetune_is_a_pretrained_start_at_a_tenth_of_the_rate_with_the_head_first():
    shards = ["data=shards", "data.train_shards=/d/train.index.json", "data.val_shards=null"]
    cfg = compose_config(["+experiment=finetune", *shards])
    config.check(cfg)
    assert (cfg.model.weights, cfg.model.freeze_steps, cfg.optim.lr, cfg.optim.warmup) == ("DEFAULT", 50, 0.01, 0.1)
    assert compose_config(["+experiment=finetune", *shards, "model.weights=/runs/a"]).model.weights == "/runs/a"


IMAGENET = ["data.train_shards=/d/imagenet-train.index.json", "data.val_shards=/d/imagenet-val.index.json"]


def test_the_resnet50_v2_recipe_is_torchvisions_reference_command_in_our_keys():
    """torchvision's --lr 0.5 for 8 x 128, TrivialAugment, random erasing 0.1, mixup 0.2, cutmix 1,
    label smoothing 0.1, no decay on norms, EMA every 32 steps, train 176, evaluate 224 from 232."""
    cfg = compose_config(["+experiment=imagenet_resnet50_v2", *IMAGENET])
    config.check(cfg)
    d, t, o = cfg.data, cfg.trainer, cfg.optim
    assert (d.image_size, d.eval_size, d.eval_resize, d.augment, d.random_erase) == (
        176,
        224,
        232,
        "trivialaugment",
        0.1,
    )
    assert (t.mixup, t.cutmix, t.ema.every, t.epochs, cfg.loader.mode.value) == (0.2, 1.0, 32, 600, "epoch")
    assert o.lr * 8 * t.batch_size / 256 == 0.5 and (o.weight_decay, o.norm_weight_decay) == (2e-5, 0.0)
    assert 1 - t.ema.decay == pytest.approx(2e-5 * 8 * 128 * 32 / 600, rel=1e-3)  # the reference's adjustment
    assert (o.label_smoothing, o.warmup * 600) == (0.1, pytest.approx(5, abs=0.01))


def test_the_fast_recipe_is_ffcvs_progressive_resnet50():
    cfg = compose_config(["+experiment=imagenet_fast", *IMAGENET])
    config.check(cfg)
    assert recipe.schedule(cfg) == ((0, 160), (71, 192)) and recipe.largest(cfg) == 192
    assert (cfg.data.eval_size, cfg.data.eval_resize) == (224, 256)
    assert (cfg.optim.norm_weight_decay, cfg.optim.label_smoothing, cfg.trainer.epochs) == (0.0, 0.1, 88)
    assert cfg.optim.lr * 8 * 512 / 256 == pytest.approx(1.7)  # FFCV's lr for 8 GPUs x 512
