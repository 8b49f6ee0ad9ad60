"""Exactness guards of the public Loader: a recipe changed in the middle of an epoch is refused on
resume (at an epoch's end it is taken, and said); ``reads()`` names what the workers read, from
the stream's own split; a folder is a spec."""

from __future__ import annotations

import itertools
import logging
import shutil

import pytest

from tests.conftest import write_tiny_shards
from wdsdist.data import Loader, LoaderConfig, UserError

COUNTS = [7, 13, 5, 11, 9]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_tiny_shards(tmp_path_factory.mktemp("guards"), COUNTS, size=16)


def cfg(**kw) -> LoaderConfig:
    return LoaderConfig(**({"batch_size": 4, "workers": 0, "mode": "epoch", "image_size": 16, "seed": 3} | kw))


@pytest.mark.parametrize(
    "change",
    [
        {"augment": "trivialaugment"},
        {"random_erase": 0.5},
        {"image_size": 24, "size_schedule": ((0, 16), (1, 24))},
        {"image_size": 24},
    ],
)
def test_a_recipe_changed_in_the_middle_of_an_epoch_is_refused_in_one_line(index, change):
    loader = Loader(str(index), cfg(), rank=0, world=1)
    list(itertools.islice(iter(loader), 3))
    state = loader.state_dict()
    resumed = Loader(str(index), cfg(**change), rank=0, world=1)
    with pytest.raises(UserError) as refused:
        resumed.load_state_dict(state, where="ckpt.pt")
    message = str(refused.value)
    assert "\n" not in message and "ckpt.pt was saved in the middle of epoch 0" in message
    key = next(iter(change))
    assert f"{key} " in message and "resume from a checkpoint at an epoch's end" in message


def test_a_recipe_changed_at_an_epochs_end_is_taken_and_said(index, caplog):
    loader = Loader(str(index), cfg(), rank=0, world=1)
    assert len(list(loader)) == len(loader)  # the whole epoch
    state = loader.state_dict()
    resumed = Loader(str(index), cfg(augment="trivialaugment"), rank=0, world=1)
    with caplog.at_level(logging.INFO):
        resumed.load_state_dict(state)
    assert "the recipe changes from epoch 1 on: augment none -> trivialaugment" in caplog.text
    assert resumed.epoch == 1 and len(list(resumed)) == len(resumed)


def test_reads_names_what_each_worker_reads(index):
    keys = list(itertools.accumulate(COUNTS, initial=0))
    for world, workers in [(1, 2), (2, 2), (3, 1)]:
        for rank in range(world):
            config = cfg(workers=workers, with_keys=True, shuffle_buffer=5)
            loader = Loader(str(index), config, rank=rank, world=world)
            reads = loader.reads()
            named = {}  # (worker, position) -> the key reads() says it holds
            for worker, runs in enumerate(reads):
                for pos, stop, shard, first in runs:
                    named |= {(worker, p): f"s{keys[shard] + first + p - pos:07d}" for p in range(pos, stop)}
            got = {}
            for batch in loader:
                rows = zip(batch["key"], batch["pos"].tolist(), batch["id"][:, 1].tolist(), strict=True)
                for key, pos, worker in rows:
                    if pos < sum(COUNTS):
                        got[(worker, pos)] = key
            assert got == named, (world, workers, rank)


def test_a_folder_is_its_one_index_or_its_tars_and_two_indexes_are_refused(index, tmp_path):
    folder = index.parent
    assert len(Loader(str(folder), cfg(), rank=0, world=1).shards) == len(COUNTS)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    next(bare.glob("*.index.json")).unlink()
    assert len(Loader(str(bare), cfg(mode="repeat", split="shards"), rank=0, world=1).shards) == len(COUNTS)
    two = tmp_path / "two"
    shutil.copytree(folder, two)
    write_tiny_shards(two, [3], prefix="val")
    with pytest.raises(UserError, match=r"holds 2 indexes \(tiny\.index\.json, val\.index\.json\): name the one"):
        Loader(str(two), cfg(), rank=0, world=1)
