"""wdsdist.lightning under PyTorch Lightning's DDP (2 CPU processes, gloo), through
examples/lightning_train.py: every sample of an epoch once (plus the stated padding), equal
batches, an exact resume from a mid-epoch Lightning checkpoint, on the same and on another
number of devices, and Lightning's three traps (rank 0 writes the checkpoint, the one-ahead
fetch of a loader without a length, issue 20550's early train_dataloader())."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_script, write_tiny_shards
from tests.helpers.training import free_port
from wdsdist.data import Loader, LoaderConfig

pytestmark = pytest.mark.slow  # real training processes

pytest.importorskip("pytorch_lightning")

COUNTS = [7, 5, 9, 5, 4]  # 30 samples: 2 ranks x batch 4 -> 4 batches per rank, 2 of them padding
# A checkpoint at step 1 of 2 workers: the resumed epoch's next batch is worker 1's, then worker 0's
# (the DataLoader takes them in turn), so a resume that started again at worker 0 would swap them.
N, BATCH, RANKS, STOP, WORKERS = sum(COUNTS), 4, 2, 1, 2
PER_RANK = -(-N // (RANKS * BATCH))


def lightning(tmp: Path, index: Path, name: str, *extra: str, devices: int = RANKS) -> dict[int, list[dict]]:
    """Run the example; each rank's batches as it traced them (epoch, len, pos, id). Its output
    goes to TMP/NAME.out. Its ranks are forked from the preloaded Python with torchrun's
    environment, which Lightning takes as torchrun's launch (tests/preloaded.py); the example's
    own launch, Lightning starting the other ranks, is tests/repo/test_examples.py's. That Python has
    Lightning imported too (1.6 s of CPU a rank otherwise; the rank its import reads from the
    environment, the Trainer sets again as it is made, before it prints). The example's ResNet-18 is
    a one-convolution net here (tests/helpers/small_model.py): the data's order is what is checked
    (bench/results/2026-11-28-examples-tests.md)."""
    tmp.mkdir(parents=True, exist_ok=True)
    result = run_script(
        str(ROOT / "tests" / "helpers" / "small_model.py"),
        str(ROOT / "examples" / "lightning_train.py"),
        str(index),
        "--accelerator=cpu",
        f"--devices={devices}",
        f"--batch-size={BATCH}",
        "--image-size=16",
        f"--workers={WORKERS}",
        "--schedule=constant",
        f"--ckpt-dir={tmp / 'ckpt'}",
        f"--trace={tmp / name}",
        *extra,
        cwd=tmp,
        env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
        ranks=devices if devices > 1 else None,  # one device: a plain process, as before
        preload=("pytorch_lightning",),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp / f"{name}.out").write_text(result.stdout)
    return {r: json.loads((tmp / f"{name}.{r}.json").read_text()) for r in range(devices)}


# "len" is len(loader) at each training step: at an epoch's last step the loader has delivered
# the epoch (Lightning fetched its last batch), so it says the next epoch's length there.


def positions(trace: list[dict], epoch: int) -> list[int]:
    return [p for e in trace if e["epoch"] == epoch for p in e["pos"]]


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    return write_tiny_shards(tmp_path_factory.mktemp("shards"), COUNTS, size=16)


@pytest.fixture(scope="module")
def val_index(tmp_path_factory) -> Path:
    return write_tiny_shards(tmp_path_factory.mktemp("val"), [6, 5], prefix="val", size=16)


@pytest.fixture(scope="module")
def straight_dir(index, val_index, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    lightning(tmp, index, "straight", "--epochs=2", f"--val={val_index}")
    return tmp


@pytest.fixture(scope="module")
def straight(straight_dir) -> dict[int, list[dict]]:
    return {r: json.loads((straight_dir / f"straight.{r}.json").read_text()) for r in range(RANKS)}


@pytest.fixture(scope="module")
def interrupted(index, tmp_path_factory) -> tuple[Path, dict[int, list[dict]]]:
    """A run stopped at step STOP of epoch 0, with Lightning's checkpoint of that step."""
    tmp = tmp_path_factory.mktemp("interrupted")
    trace = lightning(tmp, index, "first", f"--max-steps={STOP}", f"--save-every={STOP}")
    assert (tmp / "ckpt" / "last.ckpt").exists()
    return tmp / "ckpt" / "last.ckpt", trace


def test_every_rank_gets_len_batches_and_every_sample_once_per_epoch(straight):
    for epoch in (0, 1):
        for r in range(RANKS):
            mine = [e for e in straight[r] if e["epoch"] == epoch]
            assert len(mine) == PER_RANK  # equal on every rank
            assert {(e["len"], e["lightning_len"]) for e in mine} == {(PER_RANK, PER_RANK)}
        seen = [p for r in range(RANKS) for p in positions(straight[r], epoch)]
        assert sorted(p for p in seen if p < N) == list(range(N))
        assert sorted(p for p in seen if p >= N) == list(range(N, PER_RANK * RANKS * BATCH))  # the padding
    assert positions(straight[0], 0) != positions(straight[0], 1)  # a new order every epoch


def test_validation_counts_every_sample_once_with_one_all_reduce(straight_dir):
    # Ranks validate on shares of different sizes; the printed count is the all-reduced sum.
    out = (straight_dir / "straight.out").read_text()
    for epoch in (0, 1):
        assert re.search(rf"epoch {epoch}: top-1 [0-9.]+ on 11 samples\n", out), out[-2000:]


def test_a_mid_epoch_checkpoint_resumes_where_the_straight_run_went_on(index, straight, interrupted, tmp_path):
    ckpt, first = interrupted
    for r in range(RANKS):
        assert [e["pos"] for e in first[r]] == [e["pos"] for e in straight[r][:STOP]]
    resumed = lightning(tmp_path, index, "resumed", "--epochs=2", f"--resume={ckpt}")
    for r in range(RANKS):
        # the rest of epoch 0 in the straight run's order, then the same epoch 1
        assert [e["pos"] for e in resumed[r]] == [e["pos"] for e in straight[r][STOP:]]
        assert {(e["len"], e["lightning_len"]) for e in resumed[r]} == {(PER_RANK, PER_RANK)}
    both = [p for t in (first, resumed) for r in range(RANKS) for p in positions(t[r], 0)]
    assert sorted(p for p in both if p < N) == list(range(N))


def test_resumed_on_one_device_the_interrupted_epoch_is_still_every_sample_once(index, interrupted, tmp_path):
    ckpt, first = interrupted
    resumed = lightning(tmp_path, index, "elastic", "--epochs=2", f"--resume={ckpt}", devices=1)[0]
    before = [p for r in range(RANKS) for p in positions(first[r], 0)]
    after = positions(resumed, 0)
    # Padding is an earlier position again (p % N); the first run's padding counts as seen.
    left = set(range(N)) - {p % N for p in before}
    assert set(p % N for p in after) == left  # the rest, nothing seen before
    assert 0 <= len(after) - len(left) < BATCH  # each once, but the padding of the re-split on 1 rank
    # the resumed epoch's len() counts from its start (the old layout's batches included), and
    # Lightning reads it: the epoch ends after the re-split rest; the next is whole on 1 device
    rest = len(after) // BATCH
    assert len(after) % BATCH == 0 and {e["lightning_len"] for e in resumed if e["epoch"] == 0} == {STOP + rest}
    assert next(e["len"] for e in resumed if e["epoch"] == 0) == STOP + rest
    whole = -(-N // BATCH)
    epoch1 = [e for e in resumed if e["epoch"] == 1]
    assert len(epoch1) == whole and {e["lightning_len"] for e in epoch1} == {whole} and epoch1[0]["len"] == whole
    assert sorted(positions(resumed, 1)) == list(range(whole * BATCH))  # 2 of them padding


def test_the_checkpoint_rank_0_writes_holds_every_ranks_position(interrupted):
    ckpt, _ = interrupted
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    loop_states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    for state in (loop_states[0], saved["WdsDataModule"]["loader"]):
        assert [r["rank"] for r in state["ranks"]] == list(range(RANKS))
        assert [r["batches"] for r in state["ranks"]] == [STOP] * RANKS
        assert state["steps"] == STOP


def test_three_workers_resumed_mid_rotation_go_on_as_the_straight_run(index, tmp_path):
    # 4 batches per rank on 3 workers (2, 1 and 1 of them): after step 1, workers 1, 2 and 0 in turn
    three = ("--workers=3", "--epochs=1")
    straight = lightning(tmp_path / "a", index, "straight", *three)
    first = lightning(tmp_path / "b", index, "first", *three, f"--max-steps={STOP}", f"--save-every={STOP}")
    resumed = lightning(tmp_path / "b", index, "resumed", *three, f"--resume={tmp_path / 'b/ckpt/last.ckpt'}")
    for r in range(RANKS):
        assert [e["pos"] for e in first[r] + resumed[r]] == [e["pos"] for e in straight[r]]
        assert len(first[r]) == STOP and len(resumed[r]) == PER_RANK - STOP


def test_repeat_mode_resumed_neither_skips_nor_repeats_a_batch(index, tmp_path):
    # No length: Lightning fetches a batch ahead of the step it trains; the checkpoint must not count it.
    repeat = ("--mode=repeat", "--save-every=3")
    straight = lightning(tmp_path / "a", index, "straight", *repeat, "--max-steps=6")
    first = lightning(tmp_path / "b", index, "first", *repeat, "--max-steps=3")
    resumed = lightning(
        tmp_path / "b", index, "resumed", *repeat, "--max-steps=6", f"--resume={tmp_path / 'b/ckpt/last.ckpt'}"
    )
    for r in range(RANKS):
        assert [e["id"] for e in straight[r]] == [e["id"] for e in first[r] + resumed[r]]
        assert len(first[r]) == 3 and len(resumed[r]) == 3


def test_estimated_stepping_batches_read_first_still_resumes_exactly(index, straight, interrupted, tmp_path):
    # --schedule=cosine reads trainer.estimated_stepping_batches in configure_optimizers: Lightning
    # then builds the train loader before it has restored the loop's loader state (its issue 20550).
    ckpt, _ = interrupted
    resumed = lightning(tmp_path, index, "resumed", "--epochs=2", f"--resume={ckpt}", "--schedule=cosine")
    for r in range(RANKS):
        assert [e["pos"] for e in resumed[r]] == [e["pos"] for e in straight[r][STOP:]]


def test_lightnings_call_order_on_the_loader_keeps_its_position(index):
    """Lightning reads len(), then loads the state the DataModule loaded already, then iterates;
    and it stops after len() batches without asking for the epoch's end."""
    cfg = LoaderConfig(mode="epoch", batch_size=BATCH, image_size=16, workers=0)
    whole = [[b["pos"].tolist() for b in Loader(str(index), cfg, rank=r, world=RANKS)] for r in range(RANKS)]
    state = {"format": "wdsdist-loader-v1", "ranks": [], "steps": STOP}
    for r in range(RANKS):
        first = Loader(str(index), cfg, rank=r, world=RANKS)
        it = iter(first)
        for _ in range(STOP):
            next(it)
        state["ranks"].append(first.state_dict()["ranks"][r])
    for r in range(RANKS):
        loader = Loader(str(index), cfg, rank=r, world=RANKS)
        loader.load_state_dict(state)
        assert len(loader) == PER_RANK
        loader.load_state_dict(state)  # the fit loop's load of the same state: harmless before iter()
        rest = [b["pos"].tolist() for b in loader]
        assert rest == whole[r][STOP:]
    # elastic: one rank takes the rest; after exactly len() batches (no StopIteration asked for)
    # the next epoch's len() is a whole epoch's
    one = Loader(str(index), cfg, rank=0, world=1)
    one.load_state_dict(state)
    first_len = len(one)
    batches = iter(one)
    for _ in range(first_len - one.batches_done):
        next(batches)
    next(iter(one))
    assert (len(one), one.batches_done, one.state_dict()["before_resume"]) == (one.batches_per_epoch, 1, 0)


def test_importing_the_loader_does_not_import_lightning():
    code = "import sys, wdsdist.data; wdsdist.data.Loader; assert 'pytorch_lightning' not in sys.modules, 'imported'"
    result = run_script("-c", code)
    assert result.returncode == 0, result.stderr


def test_the_data_module_reads_several_data_sets_with_each_batch_naming_its_sources(tmp_path):
    from wdsdist.data import Source
    from wdsdist.lightning import WdsDataModule

    a = write_tiny_shards(tmp_path / "a", [6, 5], "a")
    b = write_tiny_shards(tmp_path / "b", [4], "b")
    cfg = LoaderConfig(batch_size=3, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=0)
    module = WdsDataModule([Source("a", str(a)), Source("b", str(b), repeat=2)], cfg)
    batches = list(module.train_dataloader())
    got = Counter((s, k) for batch in batches for s, k in zip(batch["source"].tolist(), batch["key"], strict=True))
    # a once and b twice, plus the padding to equal batches (11 + 8 = 19 samples, 7 batches of 3)
    assert len(batches) == len(module.loader) == 7 and sum(got.values()) == 21
    assert all(got[(0, f"s{i:07d}")] >= 1 for i in range(11)) and all(got[(1, f"s{i:07d}")] >= 2 for i in range(4))
