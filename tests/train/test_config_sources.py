"""One source per config field: the Hydra schema's data and loader sections are the loader's own
option classes, each rule is checked in one place, and WebDataset is used by its public names."""

from __future__ import annotations

import dataclasses
import hashlib
import types

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.config import compose_config
from wdsdist import simdist
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig, SampleOptions, StreamOptions, parse_nbatches
from wdsdist.data.plan.splits import plan
from wdsdist.errors import UserError
from wdsdist.train import config
from wdsdist.train.trainer import loader_config

CPU = types.SimpleNamespace(device=torch.device("cpu"), local_world=1)


def names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_data_and_loader_sections_are_the_loaders_option_classes():
    """A loader option is declared once: the schema extends the class the loader itself uses."""
    assert issubclass(config.DataConfig, SampleOptions)
    assert {f.name: f.type for f in dataclasses.fields(config.TrainConfig)}["loader"] == "StreamOptions"
    schema, loader = OmegaConf.structured(config.TrainConfig), LoaderConfig(batch_size=1)
    for name in names(StreamOptions):
        assert schema.loader[name] == getattr(loader, name), name
    for name in names(SampleOptions):
        if name != "num_classes":  # the trainer needs it given; the loader can go without
            value = schema.data[name]
            assert (tuple(value) if name == "crop_scale" else value) == getattr(loader, name), name


# Each data and loader field away from its default (test_the_trainer_hands_every_loader_option_over)
CHANGED = {
    "image_key": "png",
    "label_key": "label",
    "image_size": 40,
    "crop_scale": [0.5, 0.9],
    "num_classes": 7,
    "strict": True,
    "max_bad": 0.25,
    "allow_pipe": True,
    "trust_index": True,
    "max_pixels": 1234,
    "max_member_bytes": 5678,
    "http_timeout": 3.5,
    "http_min_rate": 9,
    "http_retry_s": 7.5,
    "s3_endpoint_url": "http://minio.local:9000",
    "gs_endpoint_url": "http://gcs.local:4443",
    "epoch_samples": 1000,
    "augment": "randaugment",
    "augment_n": 3,
    "augment_m": 7,
    "random_erase": 0.25,
    "mean": [0.5, 0.4, 0.3],
    "eval_size": 48,
    "eval_resize": 50,
}
STREAM = {
    "mode": "epoch",
    "split": "shards",
    "remainder": "drop",
    "shard_order": "global",  # the default: node needs split=samples (tested below)
    "nbatches": 26,
    "dsrepeat": 3,
    "shuffle_buffer": 11,
    "cross_shuffle": 12,
    "prefetch": 4,
    "decode_region": False,
    "decode_downscale": True,
    # decode=gpu is refused beside cross_shuffle and decode_downscale: it is handed over below
    "gpu_decoder": "torchvision",
    "gpu_decode_threads": 2,
    "gpu_decode_share": 0.5,
    "warm_start": False,
    "read_late": False,
    "cache_dir": None,  # the test's own folder
    "cache_limit": "500MiB",
    "cache_ahead": 5,
    "mix": "stratified",
}


def test_the_trainer_hands_every_loader_option_over(tmp_path):
    """Each data/loader field, set away from its default on the command line, reaches the loader."""
    changed = CHANGED
    stream = STREAM | {"cache_dir": str(tmp_path / "cache")}
    assert sorted(changed) == sorted(names(SampleOptions))
    assert sorted(stream) == sorted(set(names(StreamOptions)) - {"decode"})
    overrides = [f"data.{k}={v}" for k, v in changed.items()] + [f"loader.{k}={v}" for k, v in stream.items()]
    cfg = compose_config([*overrides, "trainer.batch_size=5", "trainer.workers=3", "data.synthetic=null"])
    config.check(cfg)
    lcfg = loader_config(cfg, CPU, 42)
    got = {k: getattr(lcfg, k) for k in [*changed, *stream]}
    assert got == changed | stream | {"crop_scale": (0.5, 0.9), "cache_limit": 500 << 20, "mean": (0.5, 0.4, 0.3)}
    assert (lcfg.batch_size, lcfg.workers, lcfg.seed, lcfg.pin_memory, lcfg.train) == (5, 3, 42, False, True)
    gpu = compose_config(["loader.decode=gpu", "trainer.workers=2", "data.synthetic=null"])
    config.check(gpu)
    assert loader_config(gpu, CPU, 0).decode == "gpu"
    auto = compose_config(["loader.decode=auto", "data.synthetic=null"])
    config.check(auto)
    chosen = loader_config(auto, CPU, 0)  # a run on the CPU: its batches are not pinned for a GPU
    assert (chosen.decode, chosen.decode_why) == ("cpu", "auto: the batches stay on the CPU, pin_memory off")


def test_the_node_order_and_the_ranks_per_node_reach_the_loader():
    """loader.shard_order=node from the command line; the ranks per node from torchrun's
    LOCAL_WORLD_SIZE, which Dist carries (wdsdist/cluster/distributed.py reads it)."""
    cfg = compose_config(
        ["loader.mode=epoch", "loader.shard_order=node", "trainer.batch_size=5", "data.synthetic=null"]
    )
    config.check(cfg)
    lcfg = loader_config(cfg, types.SimpleNamespace(device=torch.device("cpu"), local_world=8), 0)
    assert (lcfg.shard_order, lcfg.node_ranks, lcfg.by_samples) == ("node", 8, True)
    wrong = compose_config(["loader.mode=repeat", "loader.shard_order=node", "data.synthetic=null"])
    with pytest.raises(UserError, match=r"loader.shard_order=node: only applies with loader.split=samples"):
        config.check(wrong)


@pytest.mark.parametrize(
    "key,value,rule",
    [
        ("loader.nbatches", "0", "an integer >= 1 or auto"),
        ("loader.nbatches", "many", "an integer >= 1 or auto"),
        ("loader.prefetch", "0", "must be >= 1"),
        ("loader.shuffle_buffer", "-1", "must be >= 0"),
        ("data.crop_scale", "[0.5,2]", "[lo, hi] in (0, 1]"),
        ("data.http_timeout", "0", "must be > 0 (seconds)"),
        ("data.http_retry_s", "-1", "must be >= 0 and finite (seconds; 0: no retry)"),
        ("data.image_size", "4", "must be >= 8"),
        ("trainer.batch_size", "0", "must be >= 1"),
        ("loader.cache_limit", "lots", "bytes >= 1: an integer, or a size such as 200GB or 500MiB"),
        ("loader.cache_limit", "0", "bytes >= 1: an integer, or a size such as 200GB or 500MiB"),
        ("loader.cache_limit", "20GB", "needs loader.cache_dir"),
        ("loader.cache_ahead", "-1", "must be >= 0 (shards; 0: no read-ahead)"),
    ],
)
def test_a_rule_says_the_same_from_the_command_line_and_from_python(key, value, rule):
    cfg = compose_config(["loader.mode=epoch", f"{key}={value}"])
    with pytest.raises(UserError) as hydra_side:
        config.check(cfg)
    assert str(hydra_side.value).startswith(f"{key}=") and str(hydra_side.value).endswith(f": {rule}")
    field = key.split(".")[1]
    given = OmegaConf.to_container(cfg)[key.split(".")[0]][field]
    with pytest.raises(UserError) as python_side:
        LoaderConfig(**({"batch_size": 4, "mode": "epoch"} | {field: given}))
    assert str(python_side.value) == str(hydra_side.value).split(".", 1)[1].replace("[0.5, 2.0]", "(0.5, 2.0)")


def test_options_of_epoch_mode_are_refused_in_the_others_alike():
    for key, value in (("nbatches", 5), ("dsrepeat", 2)):
        cfg = compose_config([f"loader.{key}={value}"])
        with pytest.raises(UserError, match=rf"^loader\.{key}={value}: only applies to loader.mode=epoch$"):
            config.check(cfg)
        with pytest.raises(UserError, match=rf"^{key}={value}: only applies to loader.mode=epoch$"):
            LoaderConfig(batch_size=4, **{key: value})


def test_nbatches_is_one_rule_for_the_planner_simdist_and_the_config():
    with pytest.raises(ValueError, match=r"^must be >= 1 or auto, got 0$"):
        plan([10, 10], 1, 1, 2, nbatches=0)
    with pytest.raises(UserError, match=r"^--nbatches must be >= 1 or auto, got 0$"):
        simdist.Settings(nbatches=0)
    with pytest.raises(UserError, match=r"^--nbatches expected an integer or auto, got 'x'$"):
        simdist.Settings(nbatches="x")
    assert [parse_nbatches(v) for v in (None, "auto", 3, "3")] == [None, "auto", 3, 3]
    # The command line gives an integer, a string or auto; the loader gets an int or auto.
    for given, expected in (("26", 26), ("auto", "auto")):
        cfg = compose_config(["loader.mode=epoch", f"loader.nbatches={given}"])
        config.check(cfg)
        assert loader_config(cfg, CPU, 0).nbatches == expected


def test_loader_order_is_what_it_was(tiny_shards):
    """The shuffle buffers and batching (WebDataset's filters) give the same samples in the same
    order as they did before the loader moved to their public names (keys, labels, ids)."""
    shards = tiny_shards([7, 13, 5, 11])
    cfg = LoaderConfig(
        batch_size=3, workers=0, mode="epoch", image_size=8, shuffle_buffer=10, cross_shuffle=6, with_keys=True, seed=3
    )
    loader = make_loader(str(shards), 0, 1, cfg)
    digest = hashlib.sha256()
    for _ in range(2):
        for batch in loader:
            digest.update(repr((batch["key"], batch["label"].tolist(), batch["id"].tolist())).encode())
    assert digest.hexdigest()[:16] == "7f307e8991dee23f"


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.train_shards=a-{0..1}.tar", "cannot parse 'data.train_shards=a-{0..1}.tar': mismatched input"),
        ("data=imagenett", "data=imagenett: no such option (available: imagenet, shards, synthetic)"),
        ("trainer.stepz=5", "trainer.stepz: no such config key; did you mean trainer.steps?"),
        ("loader.mode=epochs", "loader.mode: Invalid value 'epochs', expected one of [repeat, epoch, resampled]"),
    ],
)
def test_hydra_1_3_failures_become_one_line(override, message):
    """one_line reads what Hydra 1.3 puts on its exceptions (the override, the missing config
    file and its options); a newer Hydra must pass this test before the version pin moves."""
    assert hydra.__version__.startswith("1.3."), f"written against Hydra 1.3, found {hydra.__version__}"
    with pytest.raises(Exception) as failure:
        compose_config([override])
    line = config.one_line(failure.value)
    assert line.startswith(message) and "\n" not in line


def test_a_hydra_exception_without_its_1_3_attributes_is_still_one_line():
    from hydra.errors import MissingConfigException, OverrideParseException

    bare = OverrideParseException.__new__(OverrideParseException)
    Exception.__init__(bare, "something new\nwith detail")
    assert config.one_line(bare) == "something new"
    missing = MissingConfigException("no such thing\nmore", missing_cfg_file=None)
    assert config.one_line(missing) == "no such thing"
