"""--mix: several data sets in one epoch (the loader's ``Source`` list), per epoch and source: what
its window reads, in passes of the source, the padding that falls on it, what each rank's span
holds of it, and what a batch holds of it.

Every number comes from the loader's pure plan (``wdsdist.data.plan.mix``: windows, coverage,
MixEpoch over each rank's span; ``splits.rank_batches`` for the spans), so a layout too big to run
costs arithmetic on its sample counts. Real mode runs the loader itself (``wdsdist.data.Loader``
with the sources, one simulated rank after another) and counts the ``source`` of every row.

A source on the command line is ``NAME:DATA[:SETTING]``: DATA is ``SAMPLES[/SHARDS]`` (a described
source; real mode writes synthetic shards for it) or a shard spec (an index JSON, a brace pattern,
URLs: everything between the first colon and a trailing ``:repeat=``, ``:weight=`` or
``:samples=``); SETTING is one of those (none: repeat=1).
"""

from __future__ import annotations

import argparse
import gc
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wdsdist.data.plan.mix import Mix, MixEpoch, MixSource, check, coverage, windows
from wdsdist.data.plan.splits import rank_batches
from wdsdist.data.sources.shardspec import Access
from wdsdist.errors import UserError
from wdsdist.simdist.layouts import Layout, spec_layout, synthetic_layout
from wdsdist.simdist.simulate import Settings, plural, simulate_plan
from wdsdist.simdist.text import shown_ranks

SETTINGS = ("repeat", "weight", "samples")
DESCRIBED = "described"  # a Layout's source for SAMPLES[/SHARDS]
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SETTING = re.compile(r"^([A-Za-z_]+)=(.*)$")
_DESCRIBED = re.compile(r"^(\d+)(?:/(\d+))?$")


@dataclass(frozen=True)
class MixArg:
    """One ``--mix`` token: a source's name, its data (a description or a shard spec), its setting."""

    token: str
    name: str
    data: str
    key: str | None = None  # repeat, weight or samples; None: repeat=1
    value: float | None = None

    @property
    def described(self) -> tuple[int, int] | None:
        """(samples, shards) of a described source (SAMPLES[/SHARDS]), else None."""
        m = _DESCRIBED.match(self.data)
        return (int(m.group(1)), int(m.group(2) or 1)) if m else None


def parse_mix_source(token: str) -> MixArg:
    """``NAME:DATA[:SETTING]`` -> MixArg, or one line naming the token and what is wrong with it."""

    def bad(why: str) -> UserError:
        return UserError(f"--mix {token!r}: {why} (expected NAME:SAMPLES[/SHARDS][:SETTING] or NAME:SPEC[:SETTING])")

    name, colon, rest = token.partition(":")
    if not colon or not rest:
        raise bad("no data after the name")
    if not _NAME.match(name):
        raise bad(f"the name {name!r} must be letters, digits, '_', '.' or '-'")
    data, key, value = rest, None, None
    head, colon, last = rest.rpartition(":")
    m = _SETTING.match(last) if colon else _SETTING.match(rest)
    if m:
        if not colon or not head:
            raise bad("no data before the setting")
        data, key, text = head, m.group(1), m.group(2)
        if key not in SETTINGS:
            raise bad(f"unknown setting {key!r}: give repeat=, weight= or samples=")
        try:
            value = int(text) if key == "samples" else float(text)
        except ValueError:
            raise bad(f"{key}={text!r} is not a {'whole number' if key == 'samples' else 'number'}") from None
        if not value > 0:
            raise bad(f"{key}={text} must be > 0")
    described = _DESCRIBED.match(data)
    if described and (int(described.group(1)) < 1 or int(described.group(2) or 1) < 1):
        raise bad("a described source needs at least one sample and one shard")
    if described and int(described.group(2) or 1) > int(described.group(1)):
        raise bad(f"{described.group(2)} shards for {described.group(1)} samples: give fewer shards")
    return MixArg(token, name, data, key, value)


def mix_argument(token: str) -> MixArg:
    """parse_mix_source as an argparse type (argparse's one-line error, exit 2)."""
    try:
        return parse_mix_source(token)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--mix ")) from None  # argparse names --mix


def described_counts(samples: int, shards: int) -> tuple[int, ...]:
    """``samples`` over ``shards`` shards, as even as whole samples allow (the first ones one more)."""
    each, extra = divmod(samples, shards)
    return tuple(each + (i < extra) for i in range(shards))


def mix_layouts(args: Sequence[MixArg], *, plan: bool, cache: str, access: Access | None = None) -> list[Layout]:
    """Each source's layout: described (real mode: synthetic shards, written once) or from its spec."""
    layouts = []
    for a in args:
        described = a.described
        if described is None:
            try:
                layouts.append(
                    spec_layout(a.data, count_local=True, count_remote=not plan, need_files=not plan, access=access)
                )
            except UserError as exc:
                raise UserError(f"--mix source {a.name!r}: {exc}") from None
            continue
        samples, shards = described
        layout = Layout(described_counts(samples, shards), DESCRIBED)
        layouts.append(layout if plan else synthetic_layout(layout, cache, f"mix-{samples}-in-{shards}"))
    return layouts


def mix_of(args: Sequence[MixArg], layouts: Sequence[Layout], epoch_samples: int | None) -> Mix:
    """The plan's Mix of the sources, as the loader builds it: shards numbered in one list, in the
    sources' order; refused in one line (plan.mix.check) where the loader would refuse it."""
    parts, first = [], 0
    for a, layout in zip(args, layouts, strict=True):
        index = tuple(range(first, first + len(layout.counts)))
        first += len(layout.counts)
        parts.append(MixSource(a.name, index, layout.counts, **({a.key: a.value} if a.key else {})))
    mix = Mix(tuple(parts), epoch_samples)
    check(mix)
    return mix


@dataclass(frozen=True)
class MixEpochCounts:
    """One epoch of a mix on ``world`` ranks: the plan's numbers, per source in the sources' order."""

    epoch: int
    total: int  # positions of the epoch's sequence
    batches: int  # per rank
    batch_size: int
    world: int
    padded: int
    dropped: int
    first: tuple[int, ...]  # where each source's window starts in its stream
    samples: tuple[int, ...]  # each source's window
    passes: tuple[float, ...]
    padding: tuple[int, ...]  # of the padded positions, each source's
    dropped_by_source: tuple[int, ...]  # remainder=drop: the sequence's last positions, each source's
    ranks: tuple[tuple[int, ...], ...]  # [rank][source]: samples in the rank's span
    per_batch: tuple[tuple[int, int], ...]  # [source]: (fewest, most) in a batch of any rank

    @property
    def delivered(self) -> int:
        return self.world * self.batches * self.batch_size


def plan_mix_epoch(mix: Mix, settings: Settings, epoch: int) -> MixEpochCounts:
    """The plan for one epoch: the split=samples layout of the mixed sequence (refused where the
    loader refuses it), its windows and coverage, and MixEpoch.counts over every rank's span."""
    world, size = settings.size, settings.batch_size
    spans = windows(mix, epoch)
    total = sum(n for _, n in spans)
    # The loader's own check of a split=samples layout (a worker with no batch is refused).
    simulate_plan(Layout((total,), "mix"), settings)
    k = rank_batches(total, world, size, settings.remainder)
    span = k * size
    padded, dropped = max(0, world * span - total), max(0, total - world * span)
    rows = coverage(mix, epoch, padded, size)
    m = MixEpoch(mix, settings.seed, epoch, size)
    n = len(mix.sources)
    ranks = tuple(tuple(m.counts(r * span, (r + 1) * span)) for r in range(world))
    drop = tuple(m.counts(world * span, total)) if dropped else (0,) * n
    # Every batch of every rank is a stretch of ``size`` positions (spans start at multiples of it).
    per_batch: list[tuple[int, int]] = []
    if span:
        of = m.slot_sources(np.arange(world * span)).reshape(-1, size)
        for s in range(n):
            c = (of == s).sum(axis=1)
            per_batch.append((int(c.min()), int(c.max())))
    else:
        per_batch = [(0, 0)] * n
    return MixEpochCounts(
        epoch=epoch,
        total=total,
        batches=k,
        batch_size=size,
        world=world,
        padded=padded,
        dropped=dropped,
        first=tuple(a for a, _ in spans),
        samples=tuple(r["samples"] for r in rows),
        passes=tuple(r["passes"] for r in rows),
        padding=tuple(r["padding"] for r in rows),
        dropped_by_source=drop,
        ranks=ranks,
        per_batch=tuple(per_batch),
    )


@dataclass(frozen=True)
class MixRun:
    """What the loader delivered per epoch: [epoch][rank][source] samples, and per epoch and source
    (fewest, most) in a batch."""

    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    per_batch: tuple[tuple[tuple[int, int], ...], ...]
    batches: tuple[tuple[int, ...], ...]  # [epoch][rank]


def run_mix(
    args: Sequence[MixArg],
    layouts: Sequence[Layout],
    settings: Settings,
    *,
    epoch_samples: int | None,
    mix_batches: str,
    image_size: int,
    access: Access | None = None,
) -> MixRun:
    """Real mode: the loader itself with the sources, each simulated rank in turn, every epoch."""
    from wdsdist.data import Loader, LoaderConfig, Source

    access = access or Access()
    config = LoaderConfig(
        batch_size=settings.batch_size,
        workers=settings.nworkers,
        mode="epoch",
        image_size=image_size,
        seed=settings.seed,
        cross_shuffle=settings.cross_shuffle,
        split="samples",
        remainder=settings.remainder,
        epoch_samples=epoch_samples,
        mix=mix_batches,
        strict=True,
        allow_pipe=access.allow_pipe,
        trust_index=access.trust_index,
    )
    sources = [
        Source(a.name, list(layout.shards or ()), **({a.key: a.value} if a.key else {}))
        for a, layout in zip(args, layouts, strict=True)
    ]
    n, nepochs = len(sources), settings.nepochs
    ranks = [[(0,) * n] * settings.size for _ in range(nepochs)]
    batches = [[0] * settings.size for _ in range(nepochs)]
    lo = [[None] * n for _ in range(nepochs)]
    hi = [[None] * n for _ in range(nepochs)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for rank in range(settings.size):
            loader = Loader(sources, config, rank=rank, world=settings.size)
            try:
                for epoch in range(nepochs):
                    total = np.zeros(n, dtype=np.int64)
                    for batch in loader:
                        counts = np.bincount(batch["source"].numpy(), minlength=n)
                        total += counts
                        batches[epoch][rank] += 1
                        for s in range(n):
                            c = int(counts[s])
                            lo[epoch][s] = c if lo[epoch][s] is None else min(lo[epoch][s], c)
                            hi[epoch][s] = c if hi[epoch][s] is None else max(hi[epoch][s], c)
                    ranks[epoch][rank] = tuple(int(x) for x in total)
            finally:
                del loader
            gc.collect()  # this rank's workers end before the next rank's start
    per_batch = tuple(tuple((a or 0, b or 0) for a, b in zip(lo[e], hi[e], strict=True)) for e in range(nepochs))
    return MixRun(tuple(map(tuple, ranks)), per_batch, tuple(map(tuple, batches)))


# ---------------------------------------------------------------- the report


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    width = max(map(len, rows))
    rows = [list(r) + [""] * (width - len(r)) for r in rows]
    widths = [max(len(r[c]) for r in rows) for c in range(width)]
    return [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


def mix_parameter_lines(
    mix: Mix, layouts: Sequence[Layout], settings: Settings, *, real: bool, mix_batches: str
) -> list[str]:
    mode = (
        "real: every simulated rank runs the loader (Loader with the sources) with its own DataLoader workers"
        if real
        else "plan: counts from the loader's mix plan and sample counts alone, no data read"
    )
    rows = [
        [s.name, s.setting, f"{s.size} samples", plural(len(s.counts), "shard")]
        + ([] if layout.source == DESCRIBED else [f"({layout.source})"])
        for s, layout in zip(mix.sources, layouts, strict=True)
    ]
    sources = _table(rows, indent="")
    how = {
        "sample": "sample (each worker's shuffle buffer mixes its rows: a batch holds the shares in expectation)",
        "stratified": "stratified (every batch holds its stretch's count of each source: the share, rounded)",
    }[mix_batches]
    out = [f"simdist --mix ({mode})", "parameters:"]
    out += [f"  {'sources' if i == 0 else ''.ljust(7)}       {line}" for i, line in enumerate(sources)]
    if mix.epoch_samples is not None:
        out.append(f"  epoch-samples {mix.epoch_samples}")
    nworkers = "0 (loading in the main process: one worker)" if settings.nworkers == 0 else str(settings.nworkers)
    out += [
        f"  size          {settings.size} ranks",
        f"  nworkers      {nworkers} per rank",
        f"  batch-size    {settings.batch_size}",
        f"  split         samples (several data sets need it), remainder {settings.remainder}",
        f"  mix           {how}",
        f"  nepochs       {settings.nepochs}",
    ]
    return out


def mix_epoch_lines(
    mix: Mix, e: MixEpochCounts, verbose: bool = False, run: MixRun | None = None, stratified: bool = False
) -> list[str]:
    """One epoch: the sequence and its padding, a row per source, a line per (shown) rank."""
    names = [s.name for s in mix.sources]
    cut = (
        f"{e.padded} padded (samples read again: the last short batch made whole, then the sequence's start)"
        if e.padded
        else (f"{e.dropped} dropped (its last positions)" if e.dropped else "nothing padded")
    )
    out = [
        f"epoch {e.epoch}: {e.total} samples in the sequence; {e.world} ranks x {e.batches} batches of "
        f"{e.batch_size} = {e.delivered}: {cut}"
    ]
    rows = [["source", "setting", "samples", "passes", "stream (passes)", "padding", "per batch", "per rank"]]
    if e.dropped:
        rows[0][5] = "dropped"
    for s, source in enumerate(mix.sources):
        first = e.first[s] / source.size
        per_rank = [r[s] for r in e.ranks]
        rows.append(
            [
                source.name,
                source.setting,
                str(e.samples[s]),
                f"{e.passes[s]:.3f}",
                f"{first:.3f}..{first + e.passes[s]:.3f}",
                str(e.dropped_by_source[s] if e.dropped else e.padding[s]),
                _range(*e.per_batch[s]),
                _range(min(per_rank), max(per_rank)),
            ]
        )
    out += _table(rows)
    width = len(str(e.world - 1))
    shown = shown_ranks([_Batches(sum(r)) for r in e.ranks], verbose)
    last = -1
    for r in shown:
        if r > last + 1:
            out.append(f"  ... {r - last - 1} ranks not shown (--verbose shows all)")
        parts = ", ".join(f"{name} {n}" for name, n in zip(names, e.ranks[r], strict=True))
        out.append(f"  rank {r:>{width}}: {parts} ({e.batches} batches, {sum(e.ranks[r])} samples)")
        last = r
    if run is not None:
        got = run.ranks[e.epoch]
        differ = [r for r in range(e.world) if got[r] != e.ranks[r] or run.batches[e.epoch][r] != e.batches]
        if stratified and run.per_batch[e.epoch] != e.per_batch:
            plan = ", ".join(f"{n} {_range(*b)}" for n, b in zip(names, e.per_batch, strict=True))
            batch = ", ".join(f"{n} {_range(*b)}" for n, b in zip(names, run.per_batch[e.epoch], strict=True))
            out.append(f"  warning: mix=stratified batches held {batch}, the plan's stretches {plan}")
        if differ:
            r = differ[0]
            out.append(
                f"  warning: the loader delivered other counts than the plan on {plural(len(differ), 'rank')}, "
                f"first rank {r}: {', '.join(map(str, got[r]))} in {run.batches[e.epoch][r]} batches"
            )
        else:
            batch = ", ".join(f"{n} {_range(*b)}" for n, b in zip(names, run.per_batch[e.epoch], strict=True))
            out.append(f"  the loader delivered the plan's counts on every rank; per batch it held {batch}")
    return out


@dataclass(frozen=True)
class _Batches:
    """shown_ranks picks ranks by their ``batches``: here a rank's samples stand in (all are equal)."""

    batches: int


def mix_report(
    mix: Mix,
    layouts: Sequence[Layout],
    settings: Settings,
    epochs: Sequence[MixEpochCounts],
    *,
    mix_batches: str = "sample",
    run: MixRun | None = None,
    verbose: bool = False,
) -> tuple[int, list[str]]:
    """The whole --mix report and its exit code (0: equal batches, and in real mode the plan's counts)."""
    out = mix_parameter_lines(mix, layouts, settings, real=run is not None, mix_batches=mix_batches)
    for e in epochs:
        out += ["", *mix_epoch_lines(mix, e, verbose, run, stratified=mix_batches == "stratified")]
    out += [
        "",
        "samples: each source's window of its stream (passes: each a new shard order); padding: "
        "its samples among the padded positions",
        "per batch: a stretch of the sequence, which mix=stratified batches hold"
        + ("; mix=sample batches hold it in expectation" if mix_batches == "sample" else ""),
    ]
    if run is not None and any(
        run.ranks[e.epoch][r] != e.ranks[r]
        or run.batches[e.epoch][r] != e.batches
        or (mix_batches == "stratified" and run.per_batch[e.epoch] != e.per_batch)
        for e in epochs
        for r in range(e.world)
    ):
        return 1, [*out, "", "FAILED: the loader delivered other per-source counts than its plan"]
    batches = sorted({e.batches for e in epochs})
    if batches == [0]:
        return 1, [*out, "", "FAILED: every rank delivers 0 batches"]
    each = (
        f"{batches[0]} per rank per epoch"
        if len(batches) == 1
        else f"{', '.join(str(e.batches) for e in epochs)} per rank in epochs 0-{len(epochs) - 1}"
    )
    return 0, [*out, "", f"SUCCESS: same batches in all ranks ({each})"]
