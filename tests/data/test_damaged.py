"""Damaged data costs only itself: the public Loader on 1,437 digits in 10 shards, 5 samples in 5
shards damaged (one of them the epoch's first position, so padding reads it again). Every rank
delivers the clean run's len() batches, every good sample comes (once each with split=samples),
no damaged one does, and the loss count is exact; an unreadable shard is filled up to
loader.max_bad and stops the rank past it (docs/reliability.md)."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.damaged import (
    DAMAGED,
    PER_SHARD,
    TOTAL,
    damage,
    one_epoch,
    positions,
    unreadable,
    write_digits,
)
from wdsdist.data import DataError, Loader, LoaderConfig

SEED = 0


def first_position_sample() -> tuple[int, int]:
    """(shard, sample) at epoch 0's position 0."""
    n = next(n for n, p in positions(SEED, 0).items() if p == 0)
    return n // PER_SHARD, n % PER_SHARD


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    index, _ = write_digits(root / "clean")
    shutil.copytree(root / "clean", root / "bad")
    first = first_position_sample()
    chosen = tuple(d for d in DAMAGED if d[0] != first[0])[:4] + (first,)
    lost = damage(root / "bad", chosen)
    return {"clean": index, "bad": str(root / "bad" / "digits.index.json"), "lost": lost, "root": root}


def config(split: str, workers: int, batch: int, **extra) -> LoaderConfig:
    nbatches = "auto" if split == "shards" else None
    return LoaderConfig(
        batch_size=batch, workers=workers, mode="epoch", split=split, image_size=16, nbatches=nbatches,
        with_keys=True, seed=SEED, **extra,
    )  # fmt: skip


SAMPLE_LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]


@pytest.mark.parametrize("batch", [10, 16])
def test_split_samples_every_good_sample_once_and_len_batches_on_every_layout(digits, batch):
    lost = digits["lost"]
    first = first_position_sample()
    padded_a_loss = False
    for world, workers in SAMPLE_LAYOUTS:
        got = one_epoch(digits["bad"], world, config("samples", workers, batch))
        where = f"{world} x {workers}, batch {batch}"
        assert got["batches"] == got["lens"], where  # exactly len() on every rank
        assert len(set(got["lens"])) == 1, where
        assert sorted(got["real"]) == sorted(set(range(TOTAL)) - lost), where  # every good sample once
        assert not lost & set(got["padding"]), where  # no damaged sample stands in
        assert got["lost"] == len(lost), where  # each counted once, a padding re-read not again
        assert sorted(int(name.split()[-1]) for name in got["names"]) == sorted(lost), where
        padded_a_loss |= first[0] * PER_SHARD + first[1] in lost and len(got["padding"]) > len(lost)
    assert padded_a_loss  # some layout's padding read the damaged first position again


@pytest.mark.parametrize("batch", [10, 16])
def test_split_shards_every_sample_the_clean_run_delivers_but_the_damaged(digits, batch):
    lost = digits["lost"]
    for world, workers in [(2, 2), (3, 1)]:
        cfg = config("shards", workers, batch)
        clean, bad = one_epoch(digits["clean"], world, cfg), one_epoch(digits["bad"], world, cfg)
        where = f"{world} x {workers}, batch {batch}"
        assert bad["batches"] == clean["batches"] == bad["lens"], where
        reached = lost & set(clean["real"])
        assert sorted(bad["real"]) == sorted(set(clean["real"]) - lost), where
        assert bad["lost"] == len(reached) and not lost & set(bad["padding"]), where


def test_an_unreadable_shard_is_filled_within_max_bad_and_stops_the_rank_past_it(digits, tmp_path):
    shutil.copytree(digits["root"] / "clean", tmp_path / "gone")
    gone = unreadable(tmp_path / "gone", 3)
    spec = str(tmp_path / "gone" / "digits.index.json")
    got = one_epoch(spec, 2, config("samples", 2, 10, max_bad=0.25))
    assert got["batches"] == got["lens"] and len(set(got["lens"])) == 1
    assert sorted(got["real"]) == sorted(set(range(TOTAL)) - gone)  # every other sample once
    assert got["lost"] == len(gone) and not gone & set(got["padding"])
    # past the default (1 % of a rank's epoch): the rank that holds the shard raises, naming it
    with pytest.raises(DataError, match=r"digits-000003\.tar unreadable"):
        one_epoch(spec, 2, config("samples", 1, 10))
    # data.strict: the first loss stops the rank, naming the sample
    with pytest.raises(DataError, match=r"past data\.strict: .*digits-\d+\.tar: sample '\d{6}': cannot decode image"):
        one_epoch(digits["bad"], 1, config("samples", 1, 10, strict=True))


def test_a_resume_mid_epoch_from_2_ranks_to_3_delivers_every_good_sample_once(digits):
    lost, cfg = digits["lost"], config("samples", 1, 10)
    delivered, states = [], []
    for rank in range(2):
        loader = Loader(digits["bad"], cfg, rank=rank, world=2)
        for i, batch in enumerate(loader):
            delivered += batch["pos"][batch["pos"] < TOTAL].tolist()
            if i == 29:  # 30 of 72 batches
                break
        states.append(loader.state_dict())
    state = states[0] | {"ranks": [s["ranks"][r] for r, s in enumerate(states)]}
    resumed = []
    for rank in range(3):
        loader = Loader(digits["bad"], cfg, rank=rank, world=3)
        loader.load_state_dict(state)
        n = 0
        for batch in loader:
            n += 1
            delivered += batch["pos"][batch["pos"] < TOTAL].tolist()
        resumed.append((n, len(loader)))
    assert len(set(resumed)) == 1  # the same batches on every rank, and the same len()
    at = positions(SEED, 0)
    assert sorted(delivered) == sorted(at[n] for n in range(TOTAL) if n not in lost)
