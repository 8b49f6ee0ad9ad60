"""decode=gpu's augmentations and size schedule (decode/gpu_augment.py) without a GPU: the device
is the CPU (as in tests/data/decode/test_gpu_decode.py). Each op on the same crop gives the CPU path's
pixels exactly; through the loader, with TrivialAugment, random erasing and a size schedule, the
batches hold the CPU path's samples, labels, sizes and resume state, and each op's pixels are
within its stated tolerance (gpu_augment.TOLERANCE) of the CPU path's for the same draws."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import webdataset as wds

from tests.helpers.augment import POLICIES, crop, magnitudes
from tests.helpers.gpu_augment import op_differences, recorded_draws, stats
from tests.helpers.jpegs import encode
from tests.helpers.loading import taken
from wdsdist.data import Loader, LoaderConfig
from wdsdist.data.decode import gpu, gpu_augment
from wdsdist.data.decode.augment import Drawn, SampleAugment
from wdsdist.data.decode.gpu_augment import TOLERANCE, BatchAugment
from wdsdist.data.sources.index import index_path, write_index

MEAN = (0.485, 0.456, 0.406)
SCHEDULE = ((0, 24), (3, 40))  # repeat mode: batches 0-2 at 24 px, then 40 px


@pytest.fixture
def on_cpu(monkeypatch):
    """decode=gpu's device is the CPU: the same functions, on CPU tensors."""
    monkeypatch.setattr(gpu, "device", lambda: torch.device("cpu"))


def photos(root: Path) -> str:
    """Two shards of 24 photo-like JPEGs of several sizes and shapes."""
    root.mkdir()
    sizes = [(120, 90), (90, 120), (150, 100), (64, 64)]
    for k in range(2):
        with wds.TarWriter(str(root / f"p-{k:06d}.tar")) as w:
            for i in range(24):
                width, height = sizes[i % 4]
                w.write({"__key__": f"p{k}{i:03d}", "jpg": encode(width, height, seed=100 * k + i), "cls": str(i % 10)})
    index = index_path(str(root), "p")
    write_index(index, [(str(p), 24) for p in sorted(root.glob("*.tar"))], name="p")
    return index


def batches(index: str, decode: str, n: int, state: dict | None = None) -> tuple[list[dict], dict]:
    cfg = LoaderConfig(
        batch_size=8, workers=2, image_size=40, mode="repeat", size_schedule=SCHEDULE, decode=decode,
        augment="trivialaugment", random_erase=0.5, mean=MEAN, with_keys=True, gpu_decode_threads=1,
    )  # fmt: skip
    return taken(index, cfg, n, state)


def assert_within(diffs: dict[str, torch.Tensor]) -> None:
    for op, s in stats(diffs).items():
        near, mean = TOLERANCE[op]
        assert s["q99"] <= near and s["mean"] <= mean, (op, s)


def assert_same_samples(cpu: list[dict], gpu_: list[dict]) -> None:
    assert len(cpu) == len(gpu_)
    for a, b in zip(cpu, gpu_, strict=True):
        for name in ("id", "pos", "label", "bad"):
            assert torch.equal(a[name], b[name]), name
        assert a["key"] == b["key"]
        assert b["image"].dtype == torch.uint8 and b["image"].shape == a["image"].shape


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_op_on_the_device_equals_the_cpu_paths_on_the_same_crop(name):
    policy, size = POLICIES[name](), 40
    images = torch.stack(
        [crop(size, size, seed=s) for s in range(3)] + [torch.full((3, size, size), 77, dtype=torch.uint8)]
    )
    images[2] = images[2] // 8 + 100  # a narrow range: autocontrast and equalize stretch it
    worker = SampleAugment(name, 2, 9, 0.0, MEAN, size)
    device = BatchAugment(MEAN)
    for op in policy._AUGMENTATION_SPACE:
        mags = magnitudes(policy, op, size, size)
        # every magnitude at once, a row each: the op runs once on the group, a magnitude per row
        rows = torch.cat([images] * len(mags))
        drawn = [Drawn(((op, m),), None) for m in mags for _ in images]
        want = torch.stack([worker.apply(row.clone(), d) for row, d in zip(rows, drawn, strict=True)])
        got = device(rows.clone(), drawn)
        assert torch.equal(got, want), (op, (got.int() - want.int()).abs().max())
    assert set(device.counts) == set(policy._AUGMENTATION_SPACE)


def test_a_chain_of_ops_and_erasing_on_the_device_equal_the_cpu_paths():
    """RandAugment's slots (rows drawing different ops in each) and erased boxes, on one batch."""
    images = torch.stack([crop(32, 32, seed=s) for s in range(4)])
    drawn = [
        Drawn((("Rotate", 90.0), ("Color", 0.3)), (2, 3, 10, 12)),
        Drawn((("Color", -0.5), ("Rotate", -27.0)), None),
        Drawn((("Posterize", 5.0), ("ShearY", -0.2)), (0, 0, 32, 5)),
        None,  # a row its worker decoded and augmented itself
    ]
    worker = SampleAugment("randaugment", 2, 9, 0.5, MEAN, 32)
    want = torch.stack([worker.apply(im.clone(), d) if d else im for im, d in zip(images, drawn, strict=True)])
    device = BatchAugment(MEAN)
    assert torch.equal(device(images.clone(), drawn), want)
    assert device.counts == {"Rotate": 2, "Color": 2, "Posterize": 1, "ShearY": 1, "Erase": 2}


def test_decode_gpu_with_trivialaugment_erasing_and_a_schedule_gives_the_cpu_paths_batches(tmp_path, on_cpu):
    index = photos(tmp_path / "p")
    cpu, cpu_state = batches(index, "cpu", 10)
    with recorded_draws() as draws:
        gpu_, gpu_state = batches(index, "gpu", 10)
    assert_same_samples(cpu, gpu_)
    assert cpu_state == gpu_state
    assert [b["image"].shape[-1] for b in gpu_] == [24] * 3 + [40] * 7  # the schedule's sizes, by batch
    diffs = op_differences(cpu, gpu_, draws)
    assert set(diffs) == set(POLICIES["trivialaugment"]()._AUGMENTATION_SPACE) | {"Erase"}  # each op at least once
    assert_within(diffs)


def test_decode_gpu_with_the_recipe_resumes_as_the_cpu_path_does(tmp_path, on_cpu):
    index = photos(tmp_path / "p")
    first, state = batches(index, "gpu", 2)
    _, cpu_state = batches(index, "cpu", 2)
    assert state == cpu_state  # the same position, whichever path made the batches
    with recorded_draws() as draws:
        rest, _ = batches(index, "gpu", 4, state)
    cpu_rest, _ = batches(index, "cpu", 4, state)
    assert_same_samples(cpu_rest, rest)
    assert [b["image"].shape[-1] for b in rest] == [24, 40, 40, 40]  # batch 2 of the run, then the next size
    whole, _ = batches(index, "gpu", 6)
    for a, b in zip(whole, first + rest, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["label"], b["label"])
    assert_within(op_differences(cpu_rest, rest, draws))


def test_evaluation_and_the_defaults_make_no_batch_augment():
    assert not gpu_augment.wanted("trivialaugment", 0.25, train=False)
    assert not gpu_augment.wanted("none", 0.0, train=True)
    assert gpu_augment.wanted("none", 0.1, train=True) and gpu_augment.wanted("randaugment", 0.0, train=True)


def elastic(index: str, decode: str, world: int, at: int | None, state: dict | None) -> tuple[list, dict]:
    """Every rank of ``world`` (epoch mode, split=samples, TrivialAugment and erasing), resumed
    from ``state`` where given: ``at`` batches of each (None: the rest of the epoch), and the
    ranks' state after them, gathered as a job's is."""
    cfg = LoaderConfig(
        batch_size=4, workers=2, image_size=32, mode="epoch", split="samples", decode=decode,
        augment="trivialaugment", random_erase=0.5, mean=MEAN, with_keys=True, gpu_decode_threads=1,
    )  # fmt: skip
    out, saved = [], []
    for rank in range(world):
        loader = Loader(index, cfg, rank=rank, world=world)
        if state is not None:
            loader.load_state_dict(state)
        torch.manual_seed(0)
        batches = list(itertools.islice(iter(loader), at))
        out.append(batches)
        saved.append(loader.state_dict())
    return out, saved[0] | {"ranks": [s["ranks"][r] for r, s in enumerate(saved)]}  # every rank's, gathered


def test_decode_gpu_stopped_on_2_ranks_and_resumed_on_3_replays_the_cpu_paths_draws(tmp_path, on_cpu):
    """The draws come from each sample's own seed, so an elastic resume on the GPU path makes
    the CPU path's samples with the CPU path's draws (pixels within the stated tolerance), and
    the epoch's every sample once (the loader's exactness on the CPU path: the fuzz)."""
    index = photos(tmp_path / "p")
    before, states = elastic(index, "gpu", 2, 2, None)
    _, cpu_states = elastic(index, "cpu", 2, 2, None)
    assert states == cpu_states
    with recorded_draws() as draws:
        after, _ = elastic(index, "gpu", 3, None, states)
    cpu_after, _ = elastic(index, "cpu", 3, None, states)
    for gpu_rank, cpu_rank in zip(after, cpu_after, strict=True):
        assert_same_samples(cpu_rank, gpu_rank)
    assert len({len(r) for r in after}) == 1  # every rank the same batches
    real = [k for r in before + after for b in r for k, p in zip(b["key"], b["pos"].tolist(), strict=True) if p < 48]
    assert sorted(real) == sorted(f"p{k}{i:03d}" for k in range(2) for i in range(24))  # each once
    diffs = op_differences([b for r in cpu_after for b in r], [b for r in after for b in r], draws)
    assert len(diffs) >= 6 and "Erase" in diffs  # the resumed samples drew many ops, and boxes
    assert_within(diffs)
