"""Resuming, through the public API: the three ways it broke (issue 35), each held by a test named
for the behaviour, and the saved state's format (a version, older states read, malformed ones
refused in one line). The randomized test against the model is tests/data/test_exactness.py."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from tests.conftest import write_tiny_shards
from wdsdist.data import Loader, LoaderConfig, Source, UserError
from wdsdist.data.plan.mix import epoch_total

COUNTS = [37, 41, 29, 50, 33, 44]  # 234 samples


def config(**kw) -> LoaderConfig:
    return LoaderConfig(**({"batch_size": 4, "mode": "epoch", "image_size": 8} | kw))


def every_rank(states: list[dict]) -> dict:
    """Every rank's entry in one state, as torch.distributed's gather would make it."""
    return states[0] | {"ranks": [s["ranks"][r] for r, s in enumerate(states)]}


def take(loader: Loader, count: int | None) -> list[list[int]]:
    return [b["pos"].tolist() for b in itertools.islice(iter(loader), count)]


def state_after(loader: Loader, count: int) -> dict:
    """The loader's state after ``count`` batches. The loader (its persistent workers) ends when
    this returns: a test frame that held it and an exception (pytest.raises) is a reference cycle,
    and a DataLoader iterator freed by the garbage collector does not stop its workers, which a
    later test's collection then waited 10 s for."""
    take(loader, count)
    return loader.state_dict()


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return str(write_tiny_shards(tmp_path_factory.mktemp("shards"), COUNTS))


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("mode", ["epoch", "repeat"])
def test_a_same_layout_resume_at_an_odd_step_goes_on_batch_for_batch_as_the_uninterrupted_run(index, workers, mode):
    """11 batches is no multiple of the worker count: the next batch is the next worker's, not
    worker 0's (the DataLoader takes them in turn), and every later one is the uninterrupted run's."""
    c = config(workers=workers, mode=mode, split="samples")
    straight = take(Loader(index, c, rank=0, world=2), 30)
    first = Loader(index, c, rank=0, world=2)
    assert take(first, 11) == straight[:11]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    resumed = Loader(index, c, rank=0, world=2)
    resumed.load_state_dict(state)
    assert take(resumed, 19) == straight[11:]
    # and once more, from the resumed run, at another odd step
    again = Loader(index, c, rank=0, world=2)
    resumed2 = Loader(index, c, rank=0, world=2)
    again.load_state_dict(state)
    assert take(again, 5) == straight[11:16]
    resumed2.load_state_dict(again.state_dict())
    assert take(resumed2, 14) == straight[16:]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Source]:
    root = tmp_path_factory.mktemp("mix")
    specs = {name: str(write_tiny_shards(root / name, counts, name)) for name, counts in
             (("a", [150, 170, 160]), ("b", [120, 130]), ("c", [90]))}  # fmt: skip
    return [
        Source("a", specs["a"], weight=0.6),
        Source("b", specs["b"], weight=0.3),
        Source("c", specs["c"], weight=0.1),
    ]


def test_padding_a_mix_delivered_before_an_elastic_resume_leaves_no_position_undelivered(sources):
    """Three sources at 0.6/0.3/0.1 of a 101-sample epoch (100 in epoch 0's windows), 2 ranks x 2
    workers whose shuffle buffer holds a worker's whole span, so padding rows come out early: a
    padding slot reads another position again (MixEpoch.padding), and the re-split on 3 ranks
    must count that position delivered, not the slot's number. Seed 8 lost 3 positions before."""
    c = config(batch_size=8, workers=2, epoch_samples=101, seed=8)
    before = [Loader(sources, c, rank=r, world=2) for r in range(2)]
    total = epoch_total(before[0].mix, 0)
    tags = [t for loader in before for batch in take(loader, 3) for t in batch]
    assert sum(t >= total for t in tags) > 0  # padding came out before the checkpoint
    state = every_rank([loader.state_dict() for loader in before])
    after = [Loader(sources, c, rank=r, world=3) for r in range(3)]
    for loader in after:
        loader.load_state_dict(state)
    rest = [take(loader, None) for loader in after]
    assert len({len(r) for r in rest}) == 1  # equal batches on the new layout
    tags += [t for r in rest for batch in r for t in batch]
    assert {t % total for t in tags} == set(range(total))  # none missing
    assert max(Counter(t for t in tags if t < total).values()) == 1  # none twice as itself
    resize = after[0].resize
    # what remained is what was not delivered in any form, and only the stated padding is added
    assert resize.remaining == total - len({t % total for t in tags[: 3 * 2 * 8]})
    assert sum(t >= total for t in tags[3 * 2 * 8 :]) == resize.delivered - resize.remaining


def test_a_state_over_other_shards_is_refused_on_the_same_layout_too(index, tmp_path):
    c = config(workers=1)
    state = state_after(Loader(index, c, rank=0, world=1), 3)
    other = str(write_tiny_shards(tmp_path / "other", [40, 41, 29, 50, 33, 44], "other"))
    loader = Loader(other, c, rank=0, world=1)
    with pytest.raises(UserError) as exc:
        loader.load_state_dict(state, where="ckpt.pt")
    assert str(exc.value) == (
        "ckpt.pt was saved over other shards (234 samples in 6 shards then, 237 samples in 6 shards now): "
        "resume on the same shards"
    )
    recounted = str(write_tiny_shards(tmp_path / "recounted", [41, 37, 29, 50, 33, 44], "recounted"))
    with pytest.raises(UserError, match=r"\(other sample counts per shard\): resume on the same shards"):
        Loader(recounted, c, rank=0, world=1).load_state_dict(state, where="ckpt.pt")


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"seed": 1}, "was saved with seed=0, now 1: keep it"),
        ({"batch_size": 5}, "in the middle of epoch 0 with batch_size=4, now 5: keep it"),
        ({"shuffle_buffer": 10}, "in the middle of epoch 0 with shuffle_buffer=1000, now 10: keep it"),
        ({"remainder": "drop"}, "in the middle of epoch 0 with remainder=pad, now drop: keep it"),
        ({"mode": "repeat", "split": "samples"}, "in the middle of epoch 0 with mode=epoch, now repeat: keep it"),
        ({"split": "shards"}, "in the middle of epoch 0 with split=samples, now shards: keep it"),
        ({"cross_shuffle": 8}, "in the middle of epoch 0 with cross_shuffle=0, now 8: keep it"),
    ],
)
def test_an_option_that_changes_what_the_positions_mean_is_refused_naming_both_values(index, change, line):
    first = Loader(index, config(workers=0), rank=0, world=1)
    take(first, 2)
    with pytest.raises(UserError) as exc:
        Loader(index, config(workers=0, **change), rank=0, world=1).load_state_dict(first.state_dict(), "ckpt.pt")
    assert "\n" not in str(exc.value) and str(exc.value).startswith("ckpt.pt ") and line in str(exc.value)


def test_at_an_epochs_end_the_options_of_the_next_epoch_may_change(index):
    first = Loader(index, config(workers=0), rank=0, world=1)
    take(first, None)  # the whole epoch 0
    later = Loader(index, config(workers=0, shuffle_buffer=10, remainder="drop"), rank=0, world=1)
    later.load_state_dict(first.state_dict())
    assert later.epoch == 1 and len(take(later, None)) == sum(COUNTS) // 4


def test_the_state_has_a_version_and_an_older_ones_state_still_resumes_exactly(index):
    c = config(workers=2)
    straight = take(Loader(index, c, rank=0, world=1), None)
    first = Loader(index, c, rank=0, world=1)
    take(first, 7)
    state = first.state_dict()
    assert (state["format"], state["version"]) == ("wdsdist-loader", 3) and state["ranks"][0]["turn"] == 1
    # what version 1 wrote: no version, no turn, no mode/dsrepeat/cross_shuffle/shards
    v1 = {"format": "wdsdist-loader-v1", "steps": 7, "before_resume": 0, "ranks": [dict(state["ranks"][0])]}
    for key in ("version", "turn", "mode", "dsrepeat", "cross_shuffle", "shards"):
        del v1["ranks"][0][key]
    old = Loader(index, c, rank=0, world=1)
    old.load_state_dict(v1)
    assert take(old, None) == straight[7:]  # the turn an epoch's batches give, in epoch mode


@pytest.mark.parametrize(
    ("state", "line"),
    [
        ({"format": "wdsdist-loader", "version": 4, "ranks": [{}]}, "has loader state version 4; this version"),
        ({"format": "something", "ranks": [{}]}, "is not a wdsdist loader state (format 'something')"),
        ({"format": "wdsdist-loader", "version": 2, "ranks": [{"rank": 0}]}, "is not a readable wdsdist loader state"),
        ([{"rank": 0, "world": 1, "workers": 2, "point": {"epoch": "x"}}], "is not a readable wdsdist loader state"),
        ({"ranks": []}, "is not a wdsdist loader state (a dict with every rank's position)"),
        ({"format": "wdsdist-loader", "ranks": [None]}, "holds no rank's position"),
    ],
)
def test_a_malformed_state_or_one_of_a_newer_version_is_refused_in_one_line(index, state, line):
    loader = Loader(index, config(workers=2), rank=0, world=1)
    with pytest.raises(UserError) as exc:
        loader.load_state_dict(state, where="ckpt.pt")
    assert "\n" not in str(exc.value) and str(exc.value).startswith("ckpt.pt ") and line in str(exc.value)


def test_a_stream_reseeded_on_another_layout_goes_on_with_its_seed_when_resumed_on_that_layout(index):
    """split=shards, repeat mode: another layout starts a reseeded stream (seed + steps); a
    checkpoint of it resumed on its own layout goes on batch for batch (the stream's seed is
    saved apart from the caller's, which a resume still checks)."""
    one = config(workers=0, mode="repeat", split="shards")
    first = Loader(index, one, rank=0, world=1)
    take(first, 3)
    two = config(workers=2, mode="repeat", split="shards")
    reseeded = Loader(index, two, rank=0, world=1)
    reseeded.load_state_dict(first.state_dict())
    assert take(reseeded, 5)  # the fresh stream's first batches
    state = reseeded.state_dict()
    assert (state["ranks"][0]["seed"], state["ranks"][0]["stream_seed"]) == (0, 3)
    straight = Loader(index, two, rank=0, world=1)
    straight.load_state_dict(first.state_dict())
    expected = take(straight, 12)[5:]
    again = Loader(index, two, rank=0, world=1)
    again.load_state_dict(state)
    assert take(again, 7) == expected
