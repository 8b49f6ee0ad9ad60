"""A training image's augmentations in the loader's workers (data.augment, data.random_erase:
wdsdist/data/decode/augment.py), its own random draws (plan/seeds.sample_draws) and progressive
resizing (LoaderConfig.size_schedule), in-process: torchvision's own ops and draws, every op of a
policy reached, a sample's pixels its own on any layout and after a resume, and the size of each
batch as planned."""

from __future__ import annotations

import io
import tarfile
import types
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_image
from torchvision.transforms import v2

from tests.conftest import write_tiny_shards
from tests.helpers.exactness import every_rank
from wdsdist.data import EvalLoader, Loader, LoaderConfig, UserError
from wdsdist.data.decode.augment import INTERPOLATION, MAGNITUDE_BINS, SampleAugment
from wdsdist.data.plan.seeds import sample_draws

MEAN = (0.485, 0.456, 0.406)
POLICIES = {
    "trivialaugment": lambda: v2.TrivialAugmentWide(num_magnitude_bins=MAGNITUDE_BINS, interpolation=INTERPOLATION),
    "randaugment": lambda: v2.RandAugment(num_ops=2, magnitude=9, interpolation=INTERPOLATION),
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=INTERPOLATION),
}


def photo(size: int = 40) -> torch.Tensor:
    """A uint8 image with structure in it (gradients and a square), decoded from a JPEG."""
    x = torch.linspace(0, 1, size)
    img = torch.stack([x[None, :].expand(size, size), x[:, None].expand(size, size), (x[None, :] * x[:, None])])
    img = (img * 255).to(torch.uint8)
    img[:, size // 4 : size // 2, size // 3 : size // 2] = torch.tensor([200, 30, 90], dtype=torch.uint8)[:, None, None]
    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=95)
    return decode_image(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))


def ranges(name: str, size: int) -> dict[str, set]:
    """Each op's magnitudes the policy can draw (both signs where it draws a sign)."""
    policy = POLICIES[name]()
    out: dict[str, set] = {}
    if name == "autoaugment":
        wanted = [(op, idx) for pair in policy._policies for op, _, idx in pair]
        for op, idx in wanted:
            values, signed = policy._AUGMENTATION_SPACE[op]
            mags = values(10, size, size)
            m = float(mags[idx]) if mags is not None else 0.0
            out.setdefault(op, set()).update({m, -m} if signed and mags is not None else {m})
        return out
    for op, (values, signed) in policy._AUGMENTATION_SPACE.items():
        mags = values(MAGNITUDE_BINS, size, size)
        if mags is None:
            out[op] = {0.0}
            continue
        chosen = [float(mags[9])] if name == "randaugment" else [float(m) for m in mags]
        out[op] = set(chosen) | ({-m for m in chosen} if signed else set())
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_op_of_the_policy_is_reached_and_its_magnitudes_stay_in_range(name):
    size = 24
    augment = SampleAugment(name, 2, 9, 0.0, MEAN, size)
    allowed = ranges(name, size)
    seen: Counter = Counter()
    torch.manual_seed(0)
    for _ in range(3000):
        for op, magnitude in augment.draw().ops:
            seen[op] += 1
            assert op in allowed, op
            assert any(abs(magnitude - m) < 1e-6 for m in allowed[op]), (op, magnitude)
    assert set(seen) == set(allowed), sorted(set(allowed) - set(seen))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_ops_equal_torchvisions_own_transform_of_the_image_as_pil(name):
    """The reference's way: the v2 policy on a PIL image (each op: tests/data/decode/test_augment_ops.py)."""
    image, theirs = photo(), POLICIES[name]()
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    ours = SampleAugment(name, 2, 9, 0.0, MEAN, image.shape[-1])
    for seed in range(60):
        torch.manual_seed(seed)
        want, after = torch.from_numpy(np.array(theirs(pil))).permute(2, 0, 1), torch.rand(1)
        torch.manual_seed(seed)
        got = ours.apply(image, ours.draw())
        assert torch.equal(got, want), seed
        assert torch.rand(1) == after  # the same draws: the generator stands where theirs left it


def test_random_erasing_is_torchvisions_with_the_mean_colour():
    image = photo()
    fill = [round(255 * c) for c in MEAN]
    theirs, ours = v2.RandomErasing(p=0.5, value=fill), SampleAugment("none", 2, 9, 0.5, MEAN, image.shape[-1])
    erased = 0
    for seed in range(80):
        torch.manual_seed(seed)
        want = theirs(image)
        torch.manual_seed(seed)
        drawn = ours.draw()
        assert not drawn.ops
        got = ours.apply(image, drawn)
        assert torch.equal(got, want), seed
        if drawn.erase is not None:
            erased += 1
            i, j, h, w = drawn.erase
            assert got[:, i : i + h, j : j + w].flatten(1).unique(dim=1).tolist() == [[c] for c in fill]
    assert 20 < erased < 60  # about half


def test_a_samples_seed_is_its_own_and_the_draws_follow_from_it():
    seeds = {sample_draws(0, e, t) for e in range(3) for t in [*range(50), (0, 1, 2), (1, 0, 2)]}
    assert len(seeds) == 3 * 52 and all(0 <= s < 2**63 for s in seeds)
    assert sample_draws(0, 1, 7) == sample_draws(0, 1, 7) != sample_draws(1, 1, 7)


# ---------------------------------------------------------------- in the loader


@pytest.fixture
def photos(tmp_path):
    return str(write_tiny_shards(tmp_path / "p", [9, 7, 8, 6], size=40))


def config(**given) -> LoaderConfig:
    base = dict(batch_size=3, workers=0, mode="epoch", image_size=24, shuffle_buffer=5, seed=3)
    base |= dict(augment="trivialaugment", random_erase=0.5, with_keys=True)
    return LoaderConfig(**(base | given))


def by_position(batches) -> dict[tuple[int, int], tuple]:
    """(epoch, position) -> that sample's pixels, each once."""
    out: dict[tuple[int, int], tuple] = {}
    for b in batches:
        for epoch, pos, image in zip(b["id"][:, 0].tolist(), b["pos"].tolist(), b["image"], strict=True):
            assert (epoch, pos) not in out
            out[epoch, pos] = tuple(image.flatten().tolist())
    return out


def epochs(loader, n: int = 2) -> list[dict]:
    return [b for _ in range(n) for b in loader]


def test_a_samples_pixels_are_the_same_on_any_layout(photos):
    """Its draws come from its own seed (its epoch and position), whoever reads it."""
    one = by_position(epochs(Loader(photos, config(workers=2), rank=0, world=1)))
    two = {}
    for rank in range(2):
        two |= by_position(epochs(Loader(photos, config(), rank=rank, world=2)))
    shared = set(one) & set(two)
    assert len(shared) >= 2 * 30 and all(one[k] == two[k] for k in shared)
    # and not vacuous: a sample's draws differ from one epoch to the next
    again = [one[0, p] != one[1, p] for p in range(30) if (0, p) in one and (1, p) in one]
    assert len(again) == 30 and sum(again) >= 25


def test_a_resumed_loader_gives_the_uninterrupted_pixels_on_its_layout_and_on_another(photos):
    cfg = config(workers=2)
    straight = [epochs(Loader(photos, cfg, rank=r, world=2)) for r in range(2)]
    firsts, states = [], []
    for rank in range(2):
        loader = Loader(photos, cfg, rank=rank, world=2)
        it = iter(loader)
        firsts.append([next(it) for _ in range(3)])  # mid-epoch, mid-rotation
        states.append(loader.state_dict())
    state = every_rank(states)
    for rank in range(2):  # the same layout: batch for batch
        again = Loader(photos, cfg, rank=rank, world=2)
        again.load_state_dict(state)
        rest = firsts[rank] + epochs(again)
        assert len(rest) == len(straight[rank])
        for a, b in zip(rest, straight[rank], strict=True):
            assert torch.equal(a["image"], b["image"]) and a["pos"].tolist() == b["pos"].tolist()
    whole = by_position(b for run in straight for b in run)
    resized = {}
    for rank in range(3):  # three ranks of one worker: the epoch under way re-split, each sample its pixels
        again = Loader(photos, config(workers=1), rank=rank, world=3)
        again.load_state_dict(state)
        resized |= by_position(epochs(again, 2))  # the rest of epoch 0, then epoch 1 on this layout
    assert resized and all(whole[k] == resized[k] for k in resized if k in whole)
    assert sum(k in whole for k in resized) >= 12 + 30


def sizes_of(batches) -> list[int]:
    return [b["image"].shape[-1] for b in batches]


def test_repeat_mode_switches_size_at_the_planned_batch_on_every_rank_and_after_a_resume(photos):
    cfg = config(mode="repeat", workers=2, image_size=24, size_schedule=((0, 16), (5, 24)))
    want = [16] * 5 + [24] * 4
    for rank in range(2):
        loader = Loader(photos, cfg, rank=rank, world=2)
        it = iter(loader)
        assert sizes_of(next(it) for _ in range(9)) == want
    states = []
    for rank in range(2):
        loader = Loader(photos, cfg, rank=rank, world=2)
        it = iter(loader)
        assert sizes_of(next(it) for _ in range(3)) == want[:3]
        states.append(loader.state_dict())
    for rank in range(2):
        again = Loader(photos, cfg, rank=rank, world=2)
        again.load_state_dict(every_rank(states))
        it = iter(again)
        assert sizes_of(next(it) for _ in range(6)) == want[3:]


def test_epoch_mode_holds_a_size_for_whole_epochs_in_buffers_of_the_largest(photos):
    cfg = config(workers=2, image_size=24, size_schedule=((0, 16), (1, 24)))
    loader = Loader(photos, cfg, rank=0, world=1)
    first, second = list(loader), list(loader)
    assert set(sizes_of(first)) == {16} and set(sizes_of(second)) == {24}
    # the pixels of a 16-pixel batch from the shared buffers are its own, copied out whole
    plain = list(
        Loader(photos, config(workers=2, image_size=24, size_schedule=((0, 16), (1, 24)), reuse_buffers=False))
    )
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(first, plain, strict=True))


def test_evaluation_resizes_to_eval_resize_and_crops_eval_size(photos):
    """FixRes: evaluate at data.eval_size after resizing to data.eval_resize, whatever the training size."""
    cfg = config(eval_size=20, eval_resize=30, train=False, shuffle_buffer=0)
    batch = next(iter(EvalLoader(photos, cfg, rank=0, world=1)))
    assert tuple(batch["image"].shape[1:]) == (3, 20, 20)
    want = v2.Compose([v2.Resize(30, antialias=True), v2.CenterCrop(20)])
    jpegs = {}
    for shard in range(4):
        with tarfile.open(photos.replace("tiny.index.json", f"tiny-{shard:06d}.tar")) as tar:
            jpegs |= {m.name[: -len(".jpg")]: tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")}
    for row, key in enumerate(batch["key"]):
        image = decode_image(torch.frombuffer(bytearray(jpegs[key]), dtype=torch.uint8))
        assert torch.equal(batch["image"][row], want(image)), key


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(augment="randomaugment"), "augment=randomaugment: none, trivialaugment, randaugment, autoaugment"),
        (dict(random_erase=1.5), "random_erase=1.5: a probability between 0 and 1"),
        (dict(augment_m=31), "augment_m=31: a magnitude in 0..30"),
        (dict(size_schedule=((1, 16),)), "size_schedule=((1, 16),): ((from, size), ...): the first from 0"),
        (dict(size_schedule=((0, 16), (3, 20))), "image_size must be its largest size"),
        (dict(size_schedule=((0, 16), (3, 24)), mode="repeat", cross_shuffle=4), "needs each batch from one worker"),
        (dict(eval_size=20, eval_resize=10), "eval_resize=10: must be >= the evaluation's crop"),
    ],
)
def test_bad_recipe_options_are_refused_in_one_line_naming_them(given, message):
    with pytest.raises(UserError) as err:
        config(**given)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_augmentations_and_a_size_schedule_go_with_decode_gpu(monkeypatch):
    """decode=gpu makes the drawn augmentations and the scheduled size on the device
    (decode/gpu_augment.py), so gpu is taken beside them, and auto picks it on a GPU node with
    the [gpu] extra as it would without them."""
    from wdsdist.data import autos

    assert config(decode="gpu", random_erase=0.25, size_schedule=((0, 16), (2, 24)), image_size=24).decode == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    node = dict(pin_memory=True, cross_shuffle=0, decode_downscale=False, augment="none", random_erase=0.0)
    for change in (dict(), dict(augment="randaugment"), dict(random_erase=0.1)):
        assert autos.auto_decode(types.SimpleNamespace(**(node | change), size_schedule=()))[0] == "gpu"
    assert autos.auto_decode(types.SimpleNamespace(**node, size_schedule=((0, 16), (2, 24))))[0] == "gpu"
