"""The recipe's tools in the training process, each for what it means: mixup and cutmix's label
weights are the mixed pixels' shares and replay by step; the EMA is the average computed by hand
and comes back from a checkpoint; accumulated micro-batches make the big batch's step; clipping
bounds the norm; weight decay by kind of parameter; the size schedule in the loader's units; the
default model compiles without a graph break; and each option's bad values in one line."""

from __future__ import annotations

import contextlib
import io
import types

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from tests.helpers.config import compose_config
from wdsdist.cluster.distributed import Dist
from wdsdist.errors import UserError
from wdsdist.train import config, recipe
from wdsdist.train.ema import Ema
from wdsdist.train.mixing import BatchMix
from wdsdist.train.model import build_model, compiled, param_groups, synced_batchnorm
from wdsdist.train.step import train_step
from wdsdist.train.trainer import epoch_steps

# ---------------------------------------------------------------- mixup and cutmix


def rows_of(values: list[float], size: int = 12) -> torch.Tensor:
    """A batch whose row i is the constant values[i] (float, N x 3 x size x size)."""
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, size, size).clone()


@pytest.mark.parametrize("mixup, cutmix", [(0.4, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_the_label_weights_are_the_mixed_pixels_shares(mixup, cutmix):
    values, labels = [10.0, 20.0, 40.0, 80.0], torch.tensor([0, 1, 2, 3])
    mix = BatchMix(mixup, cutmix, num_classes=5, seed=7, rank=1)
    kinds = set()
    for step in range(40):
        images, targets = mix(rows_of(values), labels, step)
        assert torch.allclose(targets.sum(1), torch.ones(4))
        for i in range(4):
            own, other = values[i], values[i - 1]  # each row is mixed with the one before it (roll by 1)
            share = float(targets[i, labels[i]])
            assert abs(share + float(targets[i, labels[i - 1]]) - 1) < 1e-6
            row = images[i]
            if bool(((row == own) | (row == other)).all()):  # cutmix: a box of the other image
                kinds.add("cutmix")
                assert abs(float((row == own).float().mean()) - share) < 1e-6, (step, i)
            else:  # mixup: every pixel the same blend
                kinds.add("mixup")
                assert torch.allclose(row, torch.full_like(row, share * own + (1 - share) * other), atol=1e-4)
    assert kinds == {name for name, alpha in (("mixup", mixup), ("cutmix", cutmix)) if alpha}


def test_a_steps_mix_is_drawn_again_the_same_and_leaves_the_callers_generator_alone():
    mix = BatchMix(0.2, 1.0, num_classes=5, seed=3, rank=0)
    images, labels = torch.rand(6, 3, 10, 10), torch.arange(6) % 5
    torch.manual_seed(11)
    first = mix(images, labels, step=5, micro=1)
    after = torch.rand(1)
    again = mix(images, labels, step=5, micro=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    torch.manual_seed(11)
    mix(images, labels, step=5, micro=1)
    assert torch.rand(1) == after  # the mix drew from its own seed, not the caller's stream
    others = [mix(images, labels, step=s)[1] for s in range(8)]
    assert len({tuple(t.flatten().tolist()) for t in others}) == 8
    rank = BatchMix(0.2, 1.0, num_classes=5, seed=3, rank=1)(images, labels, step=5, micro=1)
    assert not torch.equal(rank[1], first[1])  # ranks mix their batches differently


# ---------------------------------------------------------------- EMA


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()


def changed(model: nn.Module, step: int) -> None:
    """The model after a training step: new weights and running statistics."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.train()(torch.randn(8, 4, generator=gen, dtype=torch.float64))  # BatchNorm's statistics and count move


def test_the_ema_is_the_average_computed_by_hand_and_comes_back_from_a_checkpoint():
    model = small_net()
    ema = Ema(model, decay=0.95, every=2, warmup=True)
    hand = {k: v.detach().clone().double() for k, v in model.state_dict().items()}
    updates = 0
    for step in range(1, 21):
        changed(model, step)
        ema.maybe_update(model, step)
        if step % 2:
            continue
        d = min(0.95, (1 + updates) / (10 + updates))
        updates += 1
        for k, v in model.state_dict().items():
            hand[k] = d * hand[k] + (1 - d) * v.double() if v.is_floating_point() else v.double()
    assert ema.updates == updates == 10
    for k, v in ema.model.state_dict().items():
        assert torch.allclose(v.double(), hand[k], atol=1e-6, rtol=0), k
    assert ema.model.state_dict()["1.num_batches_tracked"] == model.state_dict()["1.num_batches_tracked"]
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    back = Ema(small_net(), decay=0.95, every=2)
    back.load_state_dict(torch.load(buf, weights_only=True))
    assert back.updates == 10 and back.decay_now() == ema.decay_now()
    for k, v in ema.model.state_dict().items():
        assert torch.equal(back.model.state_dict()[k], v), k
    changed(model, 99)
    ema.update(model)
    back.update(model)
    for a, b in zip(ema.model.state_dict().values(), back.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the step


def step_run(model: nn.Module, accum: int, clip: float | None = None, lr: float = 0.05) -> types.SimpleNamespace:
    """What train_step reads of a Run, for one process in float64."""
    cfg = OmegaConf.create(
        {"optim": {"label_smoothing": 0.1, "clip_grad_norm": clip}, "trainer": {"accum_steps": accum}}
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-3)
    on_device = types.SimpleNamespace(images=lambda x: x, labels=lambda y: y, autocast=contextlib.nullcontext)
    return types.SimpleNamespace(
        cfg=cfg, opt=opt, model=model, ddp_model=model, on_device=on_device, mix=None, ema=None,
        lr_at=lambda step: lr, sync=lambda now: contextlib.nullcontext(),
    )  # fmt: skip


def no_norm_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).double()


def test_four_micro_batches_of_16_make_the_step_of_one_batch_of_64():
    gen = torch.Generator().manual_seed(2)
    images, labels = (
        torch.randn(64, 3, 8, 8, generator=gen, dtype=torch.float64),
        torch.randint(0, 5, (64,), generator=gen),
    )
    whole, split = no_norm_net(), no_norm_net()
    train_step(step_run(whole, 1), [{"image": images, "label": labels}], [0.0], step=0)
    micro = [{"image": images[i : i + 16], "label": labels[i : i + 16]} for i in range(0, 64, 16)]
    done, _ = train_step(step_run(split, 4), micro, [0.0] * 4, step=0)
    assert len(done) == 4
    start = no_norm_net().parameters()
    moved = max((a - b).abs().max().item() for a, b in zip(whole.parameters(), start, strict=True))
    assert moved > 1e-3  # the step did something
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6


def test_clipping_leaves_the_gradients_norm_at_most_the_limit():
    model, gen = no_norm_net(), torch.Generator().manual_seed(3)
    batch = {"image": 50 * torch.randn(16, 3, 8, 8, generator=gen, dtype=torch.float64), "label": torch.arange(16) % 5}
    _, norm = train_step(step_run(model, 1, clip=0.5), [batch], [0.0], step=0)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert norm > 0.5 and float(after) <= 0.5 + 1e-9


# ---------------------------------------------------------------- weight decay, sizes, compile, sync_bn


def test_weight_decay_by_kind_of_parameter_and_one_group_by_default():
    cfg = compose_config(["data.synthetic=null", "data.num_classes=10"])
    model = build_model(cfg)
    (only,) = param_groups(cfg, model)
    assert only["params"] == list(model.parameters()) and only["weight_decay"] == cfg.optim.weight_decay
    cfg = compose_config(["optim.norm_weight_decay=0", "optim.bias_weight_decay=0.5", "data.num_classes=10"])
    groups = {g["weight_decay"]: g["params"] for g in param_groups(cfg, model)}
    named = {id(p): n for n, p in model.named_parameters()}
    assert sorted(groups) == [0.0, cfg.optim.weight_decay, 0.5]
    assert {named[id(p)] for p in groups[0.5]} == {n for n in named.values() if n.endswith("bias")}
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert {named[id(p)] for p in groups[0.0]} == {f"{n}.weight" for n in norms}
    assert sum(map(len, groups.values())) == len(list(model.parameters()))


def test_the_size_schedule_comes_to_steps_or_epochs_in_the_loaders_units():
    cfg = compose_config(
        ["data.image_size=[[0,160],[0.5,176],[0.75,192]]", "trainer.steps=100", "trainer.accum_steps=2"]
    )
    assert recipe.schedule(cfg) == ((0, 160), (100, 176), (150, 192)) and recipe.largest(cfg) == 192
    cfg = compose_config(["data.image_size=[[0,160],[0.87,192]]", "loader.mode=epoch", "trainer.epochs=88"])
    assert recipe.schedule(cfg) == ((0, 160), (77, 192))
    assert recipe.schedule(compose_config([])) == ()


class EpochLoader:
    """What epoch_steps reads of a Loader: in epoch 1 of 10 batches, 3 done."""

    epoch, batches_done, batches_per_epoch = 1, 3, 10

    def __len__(self) -> int:
        return 10


def test_epochs_come_to_whole_steps_of_micro_batches():
    assert epoch_steps(EpochLoader(), epochs=3, done=5) == 5 + 7 + 10
    assert epoch_steps(EpochLoader(), epochs=3, done=5, accum=4) == 5 + 17 // 4


def test_the_default_model_compiles_without_a_graph_break():
    cfg = compose_config([])
    model = build_model(cfg).eval()
    explained = torch._dynamo.explain(model)(torch.zeros(2, 3, 32, 32))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert recipe.compile_choice("auto", "cpu")[0] is False and recipe.compile_choice(True, "cpu")[0] is True


def test_a_compiled_model_gives_the_eager_ones_logits(monkeypatch):
    monkeypatch.setenv("WDSDIST_TEST_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(3, 3, 8, 8)
    assert torch.allclose(compiled(model)(x), model(x), atol=1e-6)


def test_sync_batchnorm_converts_for_gpus_and_is_refused_on_the_cpu_with_several_ranks():
    cfg = compose_config(["trainer.sync_bn=true"])
    model = small_net()
    assert synced_batchnorm(model, cfg, Dist(0, 1, 0, torch.device("cpu"))) is model  # one rank: nothing to sync
    with pytest.raises(UserError, match="trainer.sync_bn=true: torch's SyncBatchNorm syncs GPU tensors only"):
        synced_batchnorm(model, cfg, Dist(0, 2, 0, torch.device("cpu")))
    synced = synced_batchnorm(model, cfg, Dist(0, 2, 0, torch.device("cuda", 0)))
    assert isinstance(synced[1], nn.SyncBatchNorm) and synced[0].weight is model[0].weight


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.accum_steps=0", "trainer.accum_steps=0: must be >= 1"),
        ("trainer.mixup=-1", "trainer.mixup=-1.0: an alpha >= 0 (0: off)"),
        ("trainer.ema.decay=1", "trainer.ema.decay=1.0: in [0, 1) (0: no EMA)"),
        ("trainer.ema.every=0", "trainer.ema.every=0: must be >= 1 (steps)"),
        ("trainer.compile=sometimes", "trainer.compile=sometimes: false, true or auto"),
        ("optim.clip_grad_norm=0", "optim.clip_grad_norm=0.0: must be > 0, or null"),
        ("optim.norm_weight_decay=-1", "optim.norm_weight_decay=-1.0: must be >= 0, or null"),
        ("data.image_size=[[0.5,160],[0.8,192]]", "data.image_size=[[0.5,160],[0.8,192]]: pixels (>= 8), or"),
        ("data.image_size=[[0,160],[1,192]]", "from a fraction of training in [0, 1)"),
        ("data.image_size=4", "data.image_size=4: must be >= 8"),
        ("data.augment=trivial", "data.augment=trivial: none, trivialaugment, randaugment, autoaugment"),
        ("data.random_erase=2", "data.random_erase=2.0: a probability between 0 and 1"),
        ("data.eval_resize=20", "data.eval_resize=20: must be >= the evaluation's crop"),
    ],
)
def test_a_bad_recipe_value_stops_at_start_in_one_line_naming_it(override, message):
    with pytest.raises(UserError) as err:
        config.check(compose_config([override]))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.image_size=[[0,16],[0.5,32]]", "loader.mode=epoch"], "a schedule in epoch mode counts epochs"),
        (["data.image_size=[[0,16],[0.5,32]]", "loader.cross_shuffle=8"], "needs each batch from one worker"),
        (["model.name=vit_b_16", "data.eval_size=48", "data.image_size=32"], "vit_b_16 takes one input size"),
    ],
)
def test_a_recipe_option_that_does_not_go_with_another_is_refused_naming_both(overrides, message):
    with pytest.raises(UserError, match=message):
        config.check(compose_config(overrides))


def test_the_exported_config_names_the_ema_and_evaluations_sizes_which_predict_takes(tmp_path):
    from wdsdist.model.classify import load_model
    from wdsdist.train import export

    overrides = ["data.image_size=[[0,16],[0.5,24]]", "data.eval_size=20", "data.eval_resize=28", "data.num_classes=10"]
    cfg = compose_config([*overrides, "data.classes=[a,b,c,d,e,f,g,h,i,j]"])
    model = build_model(cfg)
    ema = Ema(model, decay=0.9)
    ema.update(model)
    export.export(str(tmp_path), cfg, ema.model, step=7, ema=ema)
    _, said = load_model(str(tmp_path))
    assert (said["image_size"], said["resize"], said["train_size"], said["weights"]) == (20, 28, 24, "ema")
    assert said["ema"] == {"decay": 0.9, "every": 1, "updates": 1}
