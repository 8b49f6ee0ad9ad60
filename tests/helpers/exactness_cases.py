"""The randomized exactness test's cases: what a case is and the Hypothesis strategy that draws one.

A case (``Case``) is a data set (or up to three, mixed, each a ``Data``), loader options and a
chain of up to three layouts, each given as (ranks, workers). ``cases()`` draws them within the
bounds the driver can run (tests/helpers/exactness.py's ``check_case``): most cases fit every
layout, a few are meant to be refused at start. tests/data/test_exactness.py draws from it in the
suite and keeps the cases it found; ``./run fuzz`` (tests/helpers/fuzz.py) draws new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from hypothesis import strategies as st

from wdsdist.data import LoaderConfig


@dataclass(frozen=True)
class Data:
    """One data set: its shards' sample counts and, among several, how much an epoch reads."""

    counts: tuple[int, ...]
    setting: str | None = None  # weight, repeat or samples
    value: float | None = None


@dataclass(frozen=True)
class Case:
    data: tuple[Data, ...]
    batch: int
    buffer: int
    remainder: str
    mode: str
    split: str
    mix: str
    seed: int
    epoch_samples: int | None
    layouts: tuple[tuple[int, int], ...]  # (ranks, workers) of each part of the run
    augment: str = "none"  # data.augment
    erase: float = 0.0  # data.random_erase
    sizes: tuple[tuple[int, int], ...] = ()  # loader.size_schedule: (from, size), from epochs or batches
    # lost samples (split=samples): sample ids (labels) whose image cannot be decoded, and shards
    # (their index in the loader's shard list: the sources' in order) that cannot be read at all
    damaged: tuple[int, ...] = ()
    unreadable: tuple[int, ...] = ()

    def config(self, workers: int) -> LoaderConfig:
        # max_bad: every loss is filled, however many (the limit is tests/data/test_damaged.py's)
        return LoaderConfig(
            batch_size=self.batch, workers=workers, mode=self.mode, split=self.split, remainder=self.remainder,
            shuffle_buffer=self.buffer, seed=self.seed, image_size=self.size_at(0, 10**9), mix=self.mix,
            epoch_samples=self.epoch_samples, augment=self.augment, random_erase=self.erase, size_schedule=self.sizes,
            max_bad=1.0,
        )  # fmt: skip

    def size_at(self, epoch: int, batch: int) -> int:
        """The size of a rank's batch: by its epoch in epoch mode, else by its number since the run
        began (the largest size where ``batch`` is huge: the config's image_size)."""
        if not self.sizes:
            return 8
        at = epoch if self.mode == "epoch" else batch
        return max(size for _, size in self.sizes) if batch >= 10**9 else [s for f, s in self.sizes if f <= at][-1]


def _fixed(data: Data) -> int:
    """Samples an epoch reads of a source that has no weight (at most)."""
    size = sum(data.counts)
    if data.setting == "samples":
        return int(data.value)  # type: ignore[arg-type]
    rate = Fraction(str(data.value)) if data.setting == "repeat" else Fraction(1)
    return -(-rate * size // 1)


@st.composite
def cases(draw: Callable, lossy: bool = True) -> Case:
    """Layouts of 1-5 ranks x 0-4 workers, batch 1-17, uneven shards (1-sample ones too), shuffle
    buffers up to twice a worker's span, pad and drop, epoch and repeat mode, 1-3 sources with a
    weight, repeat or samples, mix=sample or stratified, split=shards in repeat mode too, the
    recipe's augmentations and size schedule, and with ``lossy`` lost samples (``damage``)."""
    several = draw(st.integers(1, 3))
    data = []
    for _ in range(several):
        counts = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=5)))
        if several == 1:
            data.append(Data(counts))
            continue
        setting = draw(st.sampled_from([None, "weight", "repeat", "samples"]))
        value = {
            None: st.none(),
            "weight": st.sampled_from([0.1, 0.25, 0.5, 1.0, 3.0]),
            "repeat": st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
            "samples": st.integers(1, 50),
        }[setting]
        data.append(Data(counts, setting, draw(value)))
    epoch_samples = None
    if any(d.setting == "weight" for d in data):
        epoch_samples = sum(_fixed(d) for d in data if d.setting != "weight") + draw(st.integers(1, 120))
    mode = draw(st.sampled_from(["epoch", "repeat"]))
    split = "samples" if mode == "epoch" or several > 1 else draw(st.sampled_from(["samples", "shards"]))
    batch = draw(st.integers(1, 17))
    # Most cases fit every layout (a layout too small for its workers is refused at start, as
    # the model says): the batch and the later layouts are drawn within the data's size.
    fit = draw(st.sampled_from([True, True, True, False]))
    total = (epoch_samples or sum(_fixed(d) for d in data)) - several  # epoch 0's length, at least
    if split == "shards":
        total = len(data[0].counts) * batch  # a worker needs a shard, whatever the batch
    parts = draw(st.integers(1, 3))
    layouts = [(draw(st.integers(1, 5)), draw(st.integers(0, 4)))]
    if fit:
        batch = max(1, min(batch, total // (layouts[0][0] * max(layouts[0][1], 1))))
    for _ in range(parts - 1):
        if draw(st.booleans()):
            layouts.append(layouts[-1])
            continue
        world = draw(st.integers(1, 5 if not fit else max(1, min(5, total // batch))))
        workers = draw(st.integers(0, 4 if not fit else max(0, min(4, total // (batch * world)))))
        layouts.append((world, workers))
    span = max(1, sum(sum(d.counts) for d in data) // (layouts[0][0] * max(layouts[0][1], 1)))
    buffer = draw(st.one_of(st.just(0), st.integers(1, 2 * span)))
    remainder = draw(st.sampled_from(["pad", "drop"]))  # drawn in this order since the first cases
    mix = draw(st.sampled_from(["sample", "stratified"])) if several > 1 else "sample"
    return Case(
        data=tuple(data),
        batch=batch,
        buffer=buffer,
        remainder=remainder,
        mode=mode,
        split=split,
        mix=mix,
        seed=draw(st.integers(0, 999)),
        epoch_samples=epoch_samples,
        layouts=tuple(layouts),
        **(draw(recipe(mode, mix)) | draw(damage(split, tuple(data), lossy))),  # losses last: the draws before stay
    )


@st.composite
def recipe(draw: Callable, mode: str, mix: str) -> dict:
    """The recipe's options a case draws: an augmentation policy, random erasing, and a size
    schedule (two sizes; in repeat mode only where each batch comes from one worker)."""
    sizes: tuple[tuple[int, int], ...] = ()
    if draw(st.booleans()) and (mode == "epoch" or mix == "sample"):
        sizes = ((0, 8), (draw(st.integers(1, 2 if mode == "epoch" else 12)), 12))
    return {
        "augment": draw(st.sampled_from(["none", "none", "trivialaugment", "randaugment", "autoaugment"])),
        "erase": draw(st.sampled_from([0.0, 0.0, 0.5])),
        "sizes": sizes,
    }


@st.composite
def damage(draw: Callable, split: str, data: tuple[Data, ...], lossy: bool = True) -> dict:
    """Lost samples, drawn for half of the split=samples cases (split=shards cases stay whole):
    up to 3 damaged samples, at most a quarter of their data set's, and in half of these cases one
    shard that cannot be read, in a data set of two shards or more, holding at most half of it.
    Every epoch keeps good samples to stand in (a loss is filled from its own epoch, and the
    search for a good one gives up after fill.TRIES tries): in a mix, the damage spares a source
    that every epoch reads (one with no setting, or a number of samples); a mix without one stays
    whole. Of 1,000 cases drawn, about one in six lost samples and one in twelve a shard (fewer
    in ./run fuzz, whose rounds begin with their simplest cases). Without ``lossy``, none."""
    if not lossy or split != "samples" or not draw(st.booleans()):
        return {}
    spared = next((s for s, d in enumerate(data) if d.setting in (None, "samples")), None)
    if len(data) > 1 and spared is None:
        return {}
    shards, first = [], 0  # (source, shard index, its first sample id, its count)
    for s, d in enumerate(data):
        for count in d.counts:
            shards.append((s, len(shards), first, count))
            first += count
    hurt = [x for x in shards if len(data) == 1 or x[0] != spared]
    size = [sum(d.counts) for d in data]
    whole = [x for x in hurt if len(data[x[0]].counts) > 1 and 2 * x[3] <= size[x[0]]]
    unreadable = draw(st.sampled_from(whole)) if whole and draw(st.booleans()) else None
    ids = [(s, i) for s, shard, a, n in hurt if unreadable is None or shard != unreadable[1] for i in range(a, a + n)]
    room = [n // 4 for n in size]
    damaged = []
    for s, i in draw(st.lists(st.sampled_from(ids), max_size=3, unique=True)) if ids else []:
        if room[s] > 0:
            room[s] -= 1
            damaged.append(i)
    return {"damaged": tuple(sorted(damaged)), "unreadable": () if unreadable is None else (unreadable[1],)}
