"""Several data sets in one epoch (Source, plan/mix.py): each source read exactly as its setting
says across epochs, equal batches on every rank, stratified batches, and a mid-epoch resume on
another world size that keeps every source's count.

Samples are named by (source, key): each source's shards have their own keys, and a batch's
``source`` says which source a row came from."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from wdsdist.data import Loader, LoaderConfig, Source, UserError
from wdsdist.data.plan.mix import Mix, MixEpoch, MixSource, check, coverage, interleave, windows
from wdsdist.data.plan.splits import rank_batches

# Uneven shards, three sources of different sizes.
SHARDS = {"big": [13, 7, 10, 5], "small": [4, 5], "tiny": [3]}
BS = 4


def cfg(**kw):
    base = dict(batch_size=BS, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=12, seed=5)
    return LoaderConfig(**(base | kw))


@pytest.fixture
def specs(tiny_shards):
    return {name: str(tiny_shards(counts, prefix=name)) for name, counts in SHARDS.items()}


def sources(specs, **settings):
    return [Source(name, specs[name], **settings.get(name, {})) for name in SHARDS]


def keys_of(name):
    return [f"s{i:07d}" for i in range(sum(SHARDS[name]))]


def epoch_samples(loaders, window=None):
    """Every rank's batches of one epoch: (per-rank (batches, len()), Counter of (source name, key),
    Counter of positions). ``window``: count only positions below it (the padding left out)."""
    names = list(SHARDS)
    lengths, got, positions = [], Counter(), Counter()
    for loader in loaders:
        batches = list(loader)
        lengths.append((len(batches), len(loader)))
        for b in batches:
            rows = zip(b["source"].tolist(), b["key"], b["pos"].tolist(), strict=True)
            got.update((names[s], k) for s, k, p in rows if window is None or p < window)
            positions.update(b["pos"].tolist())
    return lengths, got, positions


def per_source(got, name):
    return Counter({k: n for (s, k), n in got.items() if s == name})


# ---------------------------------------------------------------- the plan


def test_windows_tile_each_sources_stream_so_half_a_repeat_reads_one_pass_over_two_epochs():
    mix = Mix((MixSource("a", (0,), (11,), repeat=0.5), MixSource("b", (1,), (4,), repeat=3)))
    assert [windows(mix, e) for e in range(3)] == [((0, 5), (0, 12)), ((5, 6), (12, 12)), ((11, 5), (24, 12))]


@pytest.mark.parametrize("lengths", [(11, 24, 4), (1, 99), (50, 50, 50), (7, 3, 1, 200), (3, 1000)])
@pytest.mark.parametrize("size", [1, 4, 16, 64])
def test_every_batch_of_the_sequence_holds_each_share_rounded_and_every_sample_once(lengths, size):
    source_of, index_of = interleave(lengths, size)
    total = sum(lengths)
    for s, n in enumerate(lengths):  # each source's samples in order, each once
        assert index_of[source_of == s].tolist() == list(range(n))
    for start in range(0, total - size + 1, size):  # every whole batch: the share rounded
        counts = np.bincount(source_of[start : start + size], minlength=len(lengths))
        for s, n in enumerate(lengths):
            share = n * size / total
            assert np.floor(share) <= counts[s] <= np.ceil(share), (start, s, counts)


@pytest.mark.parametrize(
    ("counts", "world", "size"), [((100, 37, 9), 2, 8), ((35, 9, 3), 2, 4), ((7, 5), 3, 4), ((1000, 11), 4, 16)]
)
def test_every_batch_of_the_padded_sequence_holds_each_share_rounded(counts, world, size):
    """The batch holding the sequence's last, short stretch is completed to the shares by its
    padding, and the padding reads each source's first samples again, in order."""
    mix = Mix(tuple(MixSource(f"s{i}", (i,), (n,)) for i, n in enumerate(counts)))
    mixed = MixEpoch(mix, 0, 0, size)
    k = rank_batches(mixed.total, world, size, "pad")
    padded = world * k * size - mixed.total
    batches = mixed.slot_sources(np.arange(world * k * size)).reshape(-1, size)
    for row in batches:
        got = np.bincount(row, minlength=len(counts))
        for s, n in enumerate(counts):
            share = n * size / mixed.total
            assert np.floor(share) <= got[s] <= np.ceil(share), (row, counts)
    again = mixed.padding(padded)
    for s in range(len(counts)):
        mine = again[mixed.source_of[again] == s]
        assert mixed.index_of[mine].tolist() == list(range(len(mine)))  # its first samples, in order


def test_a_source_given_two_settings_or_a_weight_without_an_epoch_size_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"source 'a': give one of weight, repeat, samples \(got weight, repeat\)"):
        check(Mix((MixSource("a", (0,), (5,), weight=1, repeat=2),)))
    with pytest.raises(UserError, match=r"source 'a' has a weight: give data.epoch_samples"):
        check(Mix((MixSource("a", (0,), (5,), weight=1),)))
    with pytest.raises(UserError, match=r"two sources are named 'a'"):
        check(Mix((MixSource("a", (0,), (5,)), MixSource("a", (1,), (5,)))))


# ---------------------------------------------------------------- the loader


SETTINGS = {
    "repeat 0.5 / 1 / 3": {"big": {"repeat": 0.5}, "small": {}, "tiny": {"repeat": 3}},
    "weights": {"big": {"weight": 0.6}, "small": {"weight": 0.3}, "tiny": {"weight": 0.1}},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_two_epochs_on_two_ranks_of_two_workers_deliver_each_source_as_promised(specs, setting):
    c = cfg(workers=2, epoch_samples=40)
    world = 2
    loaders = [Loader(sources(specs, **SETTINGS[setting]), c, rank=r, world=world) for r in range(world)]
    mix = loaders[0].mix
    read = Counter()  # (source, key) over both epochs, padding left out
    for epoch in range(2):
        total = sum(n for _, n in windows(mix, epoch))
        lengths, got, positions = epoch_samples(loaders, window=total)
        k = rank_batches(total, world, BS, "pad")
        assert lengths == [(k, k)] * world  # equal batches, as len() says
        # every position of the epoch's sequence once, and the padding the plan states, once
        padding = k * world * BS - total
        again = MixEpoch(mix, 5, epoch, BS).padding(padding)  # the positions the padding reads again
        assert positions == Counter(range(total)) + Counter((again + total).tolist())
        for row, (_, n) in zip(coverage(mix, epoch, padding, BS), windows(mix, epoch), strict=True):
            assert sum(per_source(got, row["name"]).values()) == row["samples"] == n
        assert sum(row["padding"] for row in coverage(mix, epoch, padding, BS)) == padding
        read += got
    for name in SHARDS:  # no sample twice before every sample once, over the epochs
        mine = per_source(read, name)
        counts = [mine[k] for k in keys_of(name)]
        assert sum(counts) == sum(
            n for e in range(2) for (_, n), s in zip(windows(mix, e), SHARDS, strict=True) if s == name
        )
        assert max(counts) - min(counts) <= 1, (name, counts)
    if setting != "weights":  # half a pass per epoch: once in two; one: twice; three: six times
        assert {n: set(per_source(read, n).values()) for n in SHARDS} == {"big": {1}, "small": {2}, "tiny": {6}}
    else:  # 24, 12 and 4 of every 40: each source's share of the mixed epoch
        assert [n for _, n in windows(mix, 0)] == [24, 12, 4]


def test_stratified_batches_hold_the_sources_of_their_stretch_of_the_sequence_on_every_rank(specs):
    setting = sources(specs, big={"repeat": 1}, small={"repeat": 2}, tiny={"repeat": 2})
    world = 2
    plain = [Loader(setting, cfg(shuffle_buffer=0), rank=r, world=world) for r in range(world)]
    strat = [Loader(setting, cfg(mix="stratified", workers=2), rank=r, world=world) for r in range(world)]
    mixed = MixEpoch(plain[0].mix, 5, 0, BS)
    shares = [n / mixed.total for _, n in mixed.windows]
    for p, s in zip(plain, strat, strict=True):
        want = [Counter(b["source"].tolist()) for b in p]
        got = [Counter(b["source"].tolist()) for b in s]
        # with workers=2 a rank's batches alternate between its workers' spans
        assert sorted(map(sorted_items, got)) == sorted(map(sorted_items, want))
        for batch in got:
            for source, share in enumerate(shares):
                assert np.floor(share * BS) <= batch[source] <= np.ceil(share * BS)
    # the padded batch too: a layout whose sequence ends in a short stretch (35 of 4s, padded by 5)
    assert mixed.total % BS and rank_batches(mixed.total, world, BS, "pad") * world * BS > mixed.total
    # the shuffle did move samples across the batches (what stratifying must undo)
    loose = [Counter(b["source"].tolist()) for b in Loader(setting, cfg(workers=2), rank=0, world=world)]
    assert loose != [Counter(b["source"].tolist()) for b in plain[0]]


def sorted_items(counter):
    return tuple(sorted(counter.items()))


def test_a_mid_epoch_resume_on_another_world_size_keeps_every_sources_count(specs):
    setting = sources(specs, big={"repeat": 0.5}, tiny={"repeat": 3})
    c = cfg(workers=1)
    straight = Loader(setting, c)  # the epoch's window, one rank: what every layout must deliver
    total = sum(n for _, n in windows(straight.mix, 0))
    window = epoch_samples([straight], window=total)[1]
    before = [Loader(setting, c, rank=r, world=2) for r in range(2)]
    # the positions delivered: a padding row (pos >= total) delivers the position it reads again
    got, delivered = Counter(), set()
    names = list(SHARDS)
    for loader in before:
        for b in itertools.islice(iter(loader), 2):
            got.update((names[s], k) for s, k in zip(b["source"].tolist(), b["key"], strict=True))
            delivered.update((b["pos"] % total).tolist())
    states = json.loads(json.dumps([loader.state_dict()["ranks"][r] for r, loader in enumerate(before)]))
    after = [Loader(setting, c, rank=r, world=3) for r in range(3)]
    for loader in after:
        loader.load_state_dict(states)
    lengths, rest, _ = epoch_samples(after)
    assert len(set(lengths)) == 1  # equal batches on the new layout
    got += rest
    resize = after[0].resize
    assert resize.remaining == total - len(delivered)  # what was delivered, as itself or as padding, is done
    assert not window - got  # missing: none, of any source
    # extra: positions delivered twice before the resume, and the new layout's stated padding
    assert sum((got - window).values()) == (2 * 2 * BS - len(delivered)) + (resize.delivered - resize.remaining)


def test_other_sources_on_resume_are_refused_in_one_line_naming_the_change(specs):
    first = Loader(sources(specs, tiny={"repeat": 3}), cfg())
    next(iter(first))
    state = first.state_dict()
    again = Loader(sources(specs, tiny={"repeat": 2}), cfg())
    with pytest.raises(UserError, match=r"other data.sources \(tiny: \['repeat=3', 3\] then, \['repeat=2', 3\] now\)"):
        again.load_state_dict(state)
        next(iter(again))


def test_several_data_sets_need_the_sample_split(specs):
    with pytest.raises(UserError, match=r"data.sources needs loader.split=samples"):
        Loader(sources(specs), cfg(split="shards"))
    with pytest.raises(UserError, match=r"loader.mix=stratified makes each batch in its worker: use loader.cross_"):
        Loader(sources(specs), cfg(mix="stratified", cross_shuffle=8))
    repeat = Loader(sources(specs), cfg(mode="repeat"))  # the epochless default takes the sample split
    assert repeat.config.by_samples and "source" in next(iter(repeat))


def test_new_weights_at_an_epoch_end_carry_each_sources_coverage_over_and_are_refused_mid_epoch(specs, capsys):
    c = cfg(epoch_samples=24, remainder="drop")
    first = sources(specs, big={"weight": 0.5}, small={"weight": 0.25}, tiny={"weight": 0.25})
    loader = Loader(first, c)
    seen = per_source(epoch_samples([loader])[1], "big")  # epoch 0: 12 of big's 35
    state = loader.state_dict()  # at the end of epoch 0
    later = sources(specs, big={"weight": 0.75}, small={"weight": 0.125}, tiny={"weight": 0.125})
    resumed = Loader(later, c)
    resumed.load_state_dict(state)
    assert "data.sources: new weights from epoch 1 (a curriculum): big 0.5 -> 0.75, small 0.25 -> 0.125" in (
        capsys.readouterr().err
    )
    assert [n for _, n in windows(resumed.mix, 1)] == [18, 3, 3]
    assert windows(resumed.mix, 1)[0][0] == 12  # big goes on where epoch 0 left its stream
    seen += per_source(epoch_samples([resumed])[1], "big")
    assert sum(seen.values()) <= 30 and max(seen.values()) == 1  # 12 + up to 18: none twice before all once
    mid = Loader(first, c)
    next(iter(mid))
    with pytest.raises(UserError, match=r"in the middle of epoch 0 with other weights"):
        Loader(later, c).load_state_dict(mid.state_dict())


def test_after_an_elastic_resume_stratified_batches_hold_each_share_within_a_sample(tiny_shards):
    """The re-split epoch's remaining positions are cut into new batches, not the sequence's
    stretches: each still holds every source's share to within one sample either way (a shuffled
    mix=sample batch of 12 does not: this test fails with it)."""
    counts = {"a": [30, 30, 30], "b": [20, 25], "c": [15]}
    setting = [Source(name, str(tiny_shards(n, prefix=f"e{name}"))) for name, n in counts.items()]
    c = cfg(workers=1, mix="stratified", batch_size=12, shuffle_buffer=60)
    before = [Loader(setting, c, rank=r, world=2) for r in range(2)]
    for loader in before:
        next(iter(loader))
    states = [loader.state_dict()["ranks"][r] for r, loader in enumerate(before)]
    after = [Loader(setting, c, rank=r, world=3) for r in range(3)]
    mixed = MixEpoch(after[0].mix, 5, 0, 12)
    shares = [n * 12 / mixed.total for n in mixed.lengths]
    rows = []
    for loader in after:
        loader.load_state_dict(states)
        rows += [np.bincount(b["source"].numpy(), minlength=len(shares)) for b in loader]
    assert after[0].resize is not None and after[0].resize.epochs and len(rows) == 12
    for got in rows:
        for count, share in zip(got, shares, strict=True):
            assert np.floor(share) - 1 <= count <= np.ceil(share) + 1, (got, shares)


def test_an_index_claiming_more_samples_than_a_mix_plans_is_refused_in_one_line():
    """Counts come from an index, which may be hostile: the per-position arrays stay bounded."""
    from wdsdist.data.plan.mix import MAX_SAMPLES

    huge = Mix((MixSource("a", (0,), (MAX_SAMPLES,)), MixSource("b", (1,), (5,))))
    with pytest.raises(UserError, match=rf"an epoch of {MAX_SAMPLES + 5} samples is more than a mix plans"):
        check(huge)
