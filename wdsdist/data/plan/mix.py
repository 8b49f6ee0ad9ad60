"""Several data sets in one epoch (``Source``, data.sources): pure functions, no I/O.

Each source is read as an endless stream of passes, each pass its shards in a new order (seed,
source name, pass). An epoch takes a window of that stream from each source: ``repeat`` x its
samples, ``samples``, or its ``weight``'s share of ``epoch_samples``. Windows follow each other,
so with ``repeat: 0.5`` epochs 0 and 1 read one pass between them, each sample once, and with
``repeat: 3`` an epoch reads three whole passes.

The epoch's sample sequence interleaves the windows in stretches of a batch (``stripes``): each
holds every source's share of it, rounded down or up, so every batch of every rank does (in
the sequence's order; loader.mix=stratified keeps it through the shuffle). From there on the mix is
an ordinary epoch of split=samples: cut into equal spans per rank and worker, padded to equal
batches (with samples that keep the padded batches' shares too: MixEpoch.padding), resumed and
re-split on another layout by positions (splits.py, resume.py).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from wdsdist.data.plan import seeds
from wdsdist.data.plan.splits import span_pieces
from wdsdist.errors import UserError

# The most samples a mixed epoch may have: each worker holds the sequence's source and index of
# every position (6 bytes each), so a count from an index, which may be hostile, is bounded here.
MAX_SAMPLES = 200_000_000


@dataclass(frozen=True)
class MixSource:
    """A source as the plan sees it: its shards' indices in the loader's shard list, their sample
    counts, and its one setting (the others None)."""

    name: str
    shards: tuple[int, ...]
    counts: tuple[int, ...]
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None

    @property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def setting(self) -> str:
        for key in ("weight", "repeat", "samples"):
            if getattr(self, key) is not None:
                return f"{key}={getattr(self, key):g}"
        return "repeat=1"


@dataclass(frozen=True)
class Mix:
    """The sources of a mixed epoch and, with weights, the mixed epoch's size. ``origin`` and
    ``offsets``: the epoch from which these settings hold and where each source's stream stood
    then (a change of weights at an epoch boundary, ``carry_over``); ``previous``: the digest of
    the mix it continues."""

    sources: tuple[MixSource, ...]
    epoch_samples: int | None = None
    origin: int = 0
    offsets: tuple[int, ...] | None = None
    previous: str | None = None

    def digest(self) -> str:
        """What a checkpoint of this mix must match to resume it: names, settings, shards' counts."""
        text = json.dumps(
            [[s.name, s.setting, list(s.counts)] for s in self.sources]
            + [self.epoch_samples, self.origin, list(self.offsets or ())]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def spec(self) -> dict:
        """Everything ``carry_over`` needs of this mix in a checkpoint (its windows, without shards)."""
        return {
            "sources": [[s.name, s.weight, s.repeat, s.samples, s.size] for s in self.sources],
            "epoch_samples": self.epoch_samples,
            "origin": self.origin,
            "offsets": list(self.offsets) if self.offsets is not None else None,
        }

    def describe(self) -> list[list]:
        """Names, settings and sizes, for a checkpoint: what a refusal names when they change."""
        return [[s.name, s.setting, s.size] for s in self.sources]


def check(mix: Mix) -> None:
    """Refuse a mix that cannot be read, in one line naming the source."""
    names = [s.name for s in mix.sources]
    if not mix.sources:
        raise UserError("data.sources is empty: give at least one source")
    if len(names) > 32767:  # a position's source is an int16
        raise UserError(f"data.sources: {len(names)} sources are more than 32767")
    if len(set(names)) != len(names):
        raise UserError(f"data.sources: two sources are named {next(n for n in names if names.count(n) > 1)!r}")
    for s in mix.sources:
        given = [k for k in ("weight", "repeat", "samples") if getattr(s, k) is not None]
        if len(given) > 1:
            raise UserError(f"source {s.name!r}: give one of weight, repeat, samples (got {', '.join(given)})")
        if s.size <= 0:
            raise UserError(f"source {s.name!r} has no samples")
        value = getattr(s, given[0]) if given else 1
        if value <= 0:
            raise UserError(f"source {s.name!r}: {given[0]}={value} must be > 0")
    total = epoch_total(mix, 0) if not any(s.weight is not None for s in mix.sources) or mix.epoch_samples else 0
    if total > MAX_SAMPLES:
        raise UserError(
            f"data.sources: an epoch of {total} samples is more than a mix plans ({MAX_SAMPLES}: it holds a few "
            f"bytes per sample of the epoch in each worker); check the sources' sample counts (their index)"
        )
    weighted = [s for s in mix.sources if s.weight is not None]
    if weighted and mix.epoch_samples is None:
        raise UserError(f"source {weighted[0].name!r} has a weight: give data.epoch_samples (the mixed epoch's size)")
    if weighted and mix.epoch_samples is not None and _weighted_room(mix) <= 0:
        raise UserError(
            f"data.epoch_samples={mix.epoch_samples} leaves no room for the weighted sources after "
            f"the others' {mix.epoch_samples - _weighted_room(mix)} samples"
        )


def _weighted_room(mix: Mix) -> int:
    fixed = sum(per_epoch(s, mix) for s in mix.sources if s.weight is None)
    return int((mix.epoch_samples or 0) - fixed)


def per_epoch(source: MixSource, mix: Mix) -> Fraction:
    """Samples of ``source`` an epoch reads, exactly (a fraction: windows are cut at its multiples)."""
    if source.samples is not None:
        return Fraction(source.samples)
    if source.weight is None:
        return Fraction(str(source.repeat if source.repeat is not None else 1)) * source.size
    weights = sum(Fraction(str(s.weight)) for s in mix.sources if s.weight is not None)
    return Fraction(str(source.weight)) / weights * _weighted_room(mix)


def windows(mix: Mix, epoch: int) -> tuple[tuple[int, int], ...]:
    """(first, length) of each source's window in its stream for ``epoch``: [floor(e x R), floor((e+1) x R)),
    so consecutive epochs tile the stream and no sample comes twice before all came once."""
    out = []
    since = epoch - mix.origin
    for i, s in enumerate(mix.sources):
        rate = per_epoch(s, mix)
        first = (since * rate).__floor__()
        out.append(((mix.offsets[i] if mix.offsets else 0) + first, ((since + 1) * rate).__floor__() - first))
    return tuple(out)


def epoch_total(mix: Mix, epoch: int) -> int:
    """Samples in the mixed epoch's sequence (before the padding to equal batches)."""
    return sum(length for _, length in windows(mix, epoch))


def stripes(lengths: Sequence[int], size: int) -> np.ndarray:
    """Each source's samples in each stretch of ``size`` positions of the mixed sequence (the
    last stretch may be shorter): its share of ``size``, rounded down or up, the sources whose
    running count lags most behind their share rounded up, so that every count stays within a
    sample of its share from the start and the stretches sum to each source's length. A batch
    of a rank is such a stretch (rank spans start at multiples of the batch size)."""
    total, width = sum(lengths), len(lengths)
    full, last = divmod(total, size)
    out = np.zeros((full + (last > 0), width), dtype=np.int64)
    if total == 0:
        return out
    base = [size * n // total for n in lengths]
    given = [0] * width
    for j in range(full):
        # twice the lag of each source behind its share of the positions so far, in units of 1/total
        lag = [(j + 1) * size * n - (g + b) * total for n, g, b in zip(lengths, given, base, strict=True)]
        up = sorted(range(width), key=lambda s: (-lag[s], s))[: size - sum(base)]
        for s in range(width):
            count = min(base[s] + (s in up), lengths[s] - given[s])
            out[j, s] = count
            given[s] += count
        short = size - int(out[j].sum())
        for s in sorted(range(width), key=lambda s: (-lag[s], s)):  # a source that ran out: another's turn
            extra = min(short, lengths[s] - given[s])
            out[j, s] += extra
            given[s] += extra
            short -= extra
    if last:
        out[full] = [n - g for n, g in zip(lengths, given, strict=True)]
    return out


@functools.lru_cache(maxsize=4)
def _stripes(lengths: tuple[int, ...], size: int) -> np.ndarray:
    return stripes(lengths, size)


@functools.lru_cache(maxsize=4)
def interleave(lengths: tuple[int, ...], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, index in its window) of each position of the mixed sequence: stretch after
    stretch of ``size`` (``stripes``), each holding its sources' counts one source after another.
    The same arrays on every rank and worker: numbers only, no seed."""
    counts = _stripes(lengths, size)
    source_of = np.repeat(np.tile(np.arange(len(lengths), dtype=np.int16), len(counts)), counts.ravel())
    index_of = np.zeros(len(source_of), dtype=np.int32)  # a window holds at most MAX_SAMPLES
    for s, n in enumerate(lengths):
        index_of[source_of == s] = np.arange(n)
    return source_of, index_of


def pass_order(source: MixSource, seed: int, number: int) -> list[int]:
    """Pass ``number`` of the source's stream: its shards (indices into its list) in a new order."""
    order = list(range(len(source.shards)))
    seeds.source_pass(seed, source.name, number).shuffle(order)
    return order


def stream_pieces(source: MixSource, seed: int, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Samples [start, stop) of the source's stream as (shard index in the loader's list, first,
    stop) pieces of shards, pass after pass."""
    size = source.size
    u = start
    while u < stop:
        number, at = divmod(u, size)
        order = pass_order(source, seed, number)
        cumulative = list(itertools.accumulate((source.counts[i] for i in order), initial=0))
        take = min(size - at, stop - u)
        for slot, first, last, _ in span_pieces(cumulative, at, at + take):
            yield source.shards[order[slot]], first, last
        u += take


class MixEpoch:
    """One epoch of a mix: its windows, and where each position of its sequence reads from.

    Positions N on are the padding's slots (splits.plan_samples pads every epoch to equal
    batches). ``padding`` says which samples fill them: first those that complete the batch
    holding the sequence's last, short stretch to the shares, then the stretches of the
    sequence's start; each source gives its window's first samples again. A sample read as
    padding is tagged N + where it sits in the sequence (``batch["pos"]``, as with one data set)."""

    def __init__(self, mix: Mix, seed: int, epoch: int, batch_size: int):
        self.mix, self.seed, self.epoch, self.size = mix, seed, epoch, batch_size
        self.windows = windows(mix, epoch)
        self.lengths = tuple(n for _, n in self.windows)
        self.total = sum(self.lengths)
        self.source_of, self.index_of = interleave(self.lengths, batch_size)
        self._padding = np.zeros(0, dtype=np.int64)

    def sources(self, tags: np.ndarray) -> np.ndarray:
        """The source of each sample by its tag (``batch["pos"]``: N + p is position p again)."""
        return self.source_of[np.asarray(tags) % self.total]

    def slot_sources(self, positions: np.ndarray) -> np.ndarray:
        """The source of each position of the padded sequence (N on: the padding's slots)."""
        positions = np.asarray(positions)
        pad = positions >= self.total
        real = positions.copy()
        if pad.any():
            real[pad] = self.padding(int(positions.max()) - self.total + 1)[positions[pad] - self.total]
        return self.source_of[real]

    def counts(self, start: int, stop: int) -> list[int]:
        """Samples of each source at positions [start, stop) of the padded sequence."""
        picked = self.slot_sources(np.arange(start, stop))
        return np.bincount(picked, minlength=len(self.windows)).tolist()

    def padding(self, count: int) -> np.ndarray:
        """The positions read again for the first ``count`` padding slots (see the class)."""
        if len(self._padding) < count:
            self._padding = _padding(self.lengths, self.size, self.source_of, count)
        return self._padding[:count]

    def reads(self, runs: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, list[list[tuple[int, int, int]]]]:
        """What reading these runs of real positions in turn takes (sequence.EpochSequence.runs):
        the source of each position, and per source the shard pieces that give its samples in that
        same order (each source's part of a stretch is a run of its window)."""
        spots = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b, _ in runs] or [np.zeros(0, np.int64)])
        sources = self.source_of[spots]
        pieces: list[list[tuple[int, int, int]]] = []
        for s, source in enumerate(self.mix.sources):
            first = self.windows[s][0]
            index = self.index_of[spots[sources == s]]
            runs_of = _runs(index)
            pieces.append([p for a, b in runs_of for p in stream_pieces(source, self.seed, first + a, first + b)])
        return sources, pieces


def _completion(lengths: Sequence[int], size: int, last: np.ndarray) -> np.ndarray:
    """Each source's samples of padding that make the sequence's last, short stretch (``last``,
    per source) a batch holding every share rounded down or up: the rounding up goes to the
    sources furthest behind their share, as in ``stripes``."""
    total = sum(lengths)
    full = total // size
    lo = np.array([size * n // total for n in lengths])
    hi = lo + np.array([(size * n) % total > 0 for n in lengths])
    want = np.maximum(last, lo)
    alive = np.array([n > 0 for n in lengths])

    def lag(s: int) -> int:  # how far source s would lag its share after this batch (in 1/total)
        given = lengths[s] - last[s]
        return (full + 1) * size * lengths[s] - (given + want[s]) * total

    while want.sum() < size:
        pick = [s for s in range(len(lengths)) if alive[s] and want[s] < hi[s]] or [
            s for s in range(len(lengths)) if alive[s]
        ]
        want[max(pick, key=lambda s: (lag(s), -s))] += 1
    while want.sum() > size:
        pick = [s for s in range(len(lengths)) if want[s] > max(last[s], lo[s])] or [
            s for s in range(len(lengths)) if want[s] > last[s]
        ]
        want[min(pick, key=lambda s: (lag(s), s))] -= 1
    return want - last


def _padding(lengths: tuple[int, ...], size: int, source_of: np.ndarray, count: int) -> np.ndarray:
    """MixEpoch.padding: the positions the first ``count`` padding slots read."""
    rows = _stripes(lengths, size)
    total = sum(lengths)
    full = total // size
    width = len(lengths)
    parts = []
    if total % size:
        parts.append(_completion(lengths, size, rows[-1]))
    cycle = list(rows[:full]) or [parts[0] + rows[-1]]  # the whole batches of the sequence's start
    filled = sum(int(p.sum()) for p in parts)
    for row in itertools.cycle(cycle):
        if filled >= count:
            break
        parts.append(np.asarray(row))
        filled += int(row.sum())
    slots = np.concatenate([np.repeat(np.arange(width), part) for part in parts])[:count]
    real = np.zeros(len(slots), dtype=np.int64)
    for s, n in enumerate(lengths):
        mine = slots == s
        if n and mine.any():
            real[mine] = np.flatnonzero(source_of == s)[np.arange(int(mine.sum())) % n]
    return real


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of a sequence of integers, in order."""
    if len(index) == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(index)]))
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def coverage(mix: Mix, epoch: int, padded: int, batch_size: int) -> list[dict]:
    """Per source, for the epoch line and simdist: the samples its window reads, what they are in
    passes of it, and how many of the ``padded`` positions (the sequence's first) are its."""
    total = epoch_total(mix, epoch)
    mixed = MixEpoch(mix, 0, epoch, batch_size)
    pad = mixed.counts(total, total + padded) if padded else [0] * len(mix.sources)
    return [
        {"name": s.name, "setting": s.setting, "samples": n, "passes": n / s.size, "padding": p}
        for s, (_, n), p in zip(mix.sources, windows(mix, epoch), pad, strict=True)
    ]


def from_spec(spec: dict) -> Mix:
    """A mix's windows from its ``Mix.spec`` (sources of one shard each: their sizes only)."""
    sources = tuple(MixSource(n, (0,), (size,), w, r, s) for n, w, r, s, size in spec["sources"])
    offsets = tuple(spec["offsets"]) if spec.get("offsets") is not None else None
    return Mix(sources, spec.get("epoch_samples"), int(spec.get("origin", 0)), offsets)


def carry_over(
    saved: dict, digest: str | None, mix: Mix, epoch: int, boundary: bool, where: str
) -> tuple[Mix, str | None]:
    """The mix a resume reads with: ``mix`` (the config's) continuing the checkpoint's (``saved``,
    its Mix.spec, and ``digest``, its Mix.digest) from ``epoch``; and a line saying what changed,
    or None. The same settings keep the checkpoint's origin. Other weights (or data.epoch_samples) at an epoch boundary
    (``boundary``) are a curriculum: from ``epoch`` on the new shares hold, each source's stream
    going on from where the old windows left it, so its coverage carries over. Anything else
    is refused in one line naming the difference."""
    old = from_spec(saved)
    shape = [[s.name, s.size, s.weight is None, s.repeat, s.samples] for s in old.sources]
    if shape != [[s.name, s.size, s.weight is None, s.repeat, s.samples] for s in mix.sources]:
        changed = differences(old.describe(), mix.describe()) or "their order"
        raise UserError(
            f"{where} was saved with other data.sources ({changed}): give the same sources "
            f"(only weights may change, at an epoch's end)"
        )
    weights = [s.weight for s in old.sources], [s.weight for s in mix.sources]
    kept = Mix(mix.sources, mix.epoch_samples, old.origin, old.offsets)
    if weights[0] == weights[1] and old.epoch_samples == mix.epoch_samples:
        return kept, None
    if not boundary:
        raise UserError(
            f"{where} was saved in the middle of epoch {epoch} with other weights: change data.sources' weights "
            f"only when resuming from a checkpoint at an epoch's end"
        )
    offsets = tuple(first for first, _ in windows(old, epoch))
    moved = Mix(mix.sources, mix.epoch_samples, epoch, offsets, previous=digest)
    changes = ", ".join(
        f"{s.name} {a:g} -> {b:g}" for s, a, b in zip(mix.sources, *weights, strict=True) if a is not None and a != b
    )
    if old.epoch_samples != mix.epoch_samples:
        changes += f"{', ' if changes else ''}epoch_samples {old.epoch_samples} -> {mix.epoch_samples}"
    return moved, f"data.sources: new weights from epoch {epoch} (a curriculum): {changes}"


def differences(before: Sequence[Sequence], now: Sequence[Sequence]) -> str:
    """What changed between two ``Mix.describe``s, source by source, for a refusal's line."""
    old = {name: [setting, size] for name, setting, size in before}
    new = {name: [setting, size] for name, setting, size in now}
    return "; ".join(
        f"{n}: {old.get(n, 'absent')} then, {new.get(n, 'absent')} now"
        for n in {**old, **new}
        if old.get(n) != new.get(n)
    )
