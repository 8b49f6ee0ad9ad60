"""The loader's public API (wdsdist.data): what a user's own loop relies on, in-process.

Multi-process behaviour (the gathered state, torchrun) is held by tests/repo/test_examples.py and
tests/lightning/test_lightning.py; the splitting and resume machinery underneath by their own tests.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.conftest import write_tiny_shards
from wdsdist.data import EvalLoader, Loader, LoaderConfig, UserError, dist_layout

COUNTS = [7, 5, 9, 5]  # 26 samples, uneven shards
N = sum(COUNTS)


def config(**given) -> LoaderConfig:
    return LoaderConfig(**({"batch_size": 4, "workers": 0, "image_size": 8, "shuffle_buffer": 8} | given))


@pytest.fixture
def index(tmp_path):
    return str(write_tiny_shards(tmp_path / "shards", COUNTS))


def positions(batches) -> list[list[int]]:
    return [b["pos"].tolist() for b in batches]


def test_len_is_what_every_rank_delivers_and_the_epoch_is_every_sample_once(index):
    cfg = config(mode="epoch")
    seen, lengths = [], []
    for rank in (0, 1):
        loader = Loader(index, cfg, rank=rank, world=2)
        batches = list(loader)
        lengths.append((len(loader), len(batches)))
        for b in batches:
            assert b["image"].dtype == torch.uint8 and tuple(b["image"].shape) == (4, 3, 8, 8)
            assert b["label"].dtype == torch.int64
        seen += [p for b in batches for p in b["pos"].tolist()]
    per_rank = -(-N // 8)  # 26 samples over 2 ranks x 4: 4 batches each, 6 of them padding
    assert lengths == [(per_rank, per_rank)] * 2
    assert sorted(p for p in seen if p < N) == list(range(N))
    assert len(seen) - N == 2 * per_rank * 4 - N == 6
    assert all(N <= p < 2 * N for p in seen if p >= N)  # padding is marked as such


def test_state_dict_resumes_exactly_on_the_same_layout_across_epochs(index):
    cfg = config(mode="epoch", workers=1)
    straight = Loader(index, cfg)
    whole = positions(straight) + positions(straight)  # two epochs
    first = Loader(index, cfg)
    it = iter(first)
    taken = [next(it)["pos"].tolist() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # small and JSON-friendly
    del it, first
    resumed = Loader(index, cfg)
    resumed.load_state_dict(state)
    assert (len(resumed), resumed.batches_done, resumed.epoch) == (len(straight), 3, 0)
    rest = positions(resumed) + positions(resumed)
    assert taken + rest[: len(whole) - 3] == whole
    assert resumed.epoch == 2 and resumed.steps == len(whole)


def test_repeat_mode_has_no_length_and_every_iter_goes_on_with_one_stream(index):
    loader = Loader(index, config(mode="repeat"))
    with pytest.raises(TypeError, match="no length"):
        len(loader)
    ids = []
    for _ in range(3):  # each a fresh iter(), as a loop that counts steps per "epoch" makes
        for _, batch in zip(range(5), loader, strict=False):
            ids += [tuple(row) for row in batch["id"].tolist()]
    assert len(ids) == 60 and len(set(ids)) == 60  # nothing replayed, nothing restarted
    epochs = Counter(e for e, _, _ in ids)
    assert epochs[0] == N and epochs[1] == N  # whole epochs, one after another


def test_mark_taken_leaves_a_fetched_but_untaken_batch_for_the_resume(index):
    cfg = config(mode="repeat")
    straight = [b["id"].tolist() for _, b in zip(range(6), Loader(index, cfg), strict=False)]
    ahead = Loader(index, cfg, mark_taken=True)
    it = iter(ahead)
    for _ in range(3):
        ahead.taken(next(it))
    next(it)  # fetched one ahead, as Lightning does for a loader without a length; never trained on
    state = ahead.state_dict()
    assert state["steps"] == 3
    resumed = Loader(index, cfg)
    resumed.load_state_dict(state)
    again = [b["id"].tolist() for _, b in zip(range(3), resumed, strict=False)]
    assert again == straight[3:6]


def test_the_transform_runs_on_each_training_image_after_its_crop(index):
    cfg = config(mode="epoch", seed=3)
    torch.manual_seed(0)  # the crops' draws (torch's generator, in this process without workers)
    plain = list(Loader(index, cfg))
    torch.manual_seed(0)
    inverted = list(Loader(index, cfg, transform=lambda image: 255 - image))
    assert [b["pos"].tolist() for b in plain] == [b["pos"].tolist() for b in inverted]
    for a, b in zip(plain, inverted, strict=True):
        assert torch.equal(b["image"], 255 - a["image"])
    wrong = Loader(index, cfg, transform=lambda image: image.float())
    with pytest.raises(
        TypeError, match=r"must return a uint8 tensor of shape \(3, 8, 8\); it returned a torch.float32"
    ):
        next(iter(wrong))


def test_rank_and_world_come_from_the_caller_or_default_to_one_process():
    assert dist_layout() == (0, 1)
    assert dist_layout(1, 2) == (1, 2)
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1"):
        dist_layout(2, 2)


def test_a_state_saved_without_a_process_group_names_its_rank_only(index):
    cfg = config(mode="epoch")
    one = Loader(index, cfg, rank=1, world=2)
    next(iter(one))
    state = one.state_dict()
    assert state["ranks"][0] is None and state["ranks"][1]["rank"] == 1
    Loader(index, cfg, rank=1, world=2).load_state_dict(state)  # its own rank: fine
    with pytest.raises(UserError, match="lacks rank 0's position"):
        Loader(index, cfg, rank=0, world=2).load_state_dict(state)
    with pytest.raises(UserError, match="one rank's position only"):
        Loader(index, cfg, rank=0, world=1).load_state_dict(state)


def test_load_state_dict_comes_before_iteration_and_refuses_foreign_states(index):
    loader = Loader(index, config(mode="epoch"))
    with pytest.raises(UserError, match="not a wdsdist loader state"):
        loader.load_state_dict({"format": "something-else", "ranks": [{}]})
    next(iter(loader))
    with pytest.raises(RuntimeError, match="before the loader's first iter"):
        loader.load_state_dict(loader.state_dict())


def test_the_eval_loader_gives_every_sample_exactly_once_over_the_ranks(index):
    cfg = config(with_keys=True, workers=1)
    keys = [k for rank in (0, 1, 2) for b in EvalLoader(index, cfg, rank=rank, world=3) for k in b["key"]]
    assert sorted(keys) == [f"s{n:07d}" for n in range(N)]


@pytest.mark.parametrize("seed", [0, 3])
def test_reads_names_the_shard_and_sample_of_every_position_each_worker_delivers(index, seed):
    """Loader.reads(): each worker's runs of positions with the shard and sample they read, in
    reading order, the padding left out (what predict.py files each result by): every delivered
    position lies in its worker's runs, and the key there is that shard's sample."""
    keys = [[f"s{sum(COUNTS[:i]) + j:07d}" for j in range(c)] for i, c in enumerate(COUNTS)]
    covered = []
    for rank in (0, 1, 2):
        loader = Loader(
            index,
            config(mode="epoch", split="samples", with_keys=True, shuffle_buffer=0, seed=seed),
            rank=rank,
            world=3,
        )
        reads = loader.reads()
        assert len(reads) == 1
        covered += [(shard, first + k) for a, b, shard, first in reads[0] for k in range(b - a)]
        for batch in loader:
            for pos, key in zip(batch["pos"].tolist(), batch["key"], strict=True):
                if pos >= N:
                    continue  # the padding: a sample of another position again
                [(a, shard, first)] = [(a, s, f) for a, b, s, f in reads[0] if a <= pos < b]
                assert keys[shard][first + pos - a] == key
    assert sorted(covered) == [(i, j) for i, c in enumerate(COUNTS) for j in range(c)]  # each sample once
