"""Simulate ranks x workers: how many batches each rank delivers, why they differ, what fixes it.

Two ways to get the per-rank counts, printed in the same format:
  plan mode  the planner (``splits.plan``) on sample counts alone, no data read; batch sizes in
             delivery order follow the DataLoader's round-robin over its workers;
  real mode  for each simulated rank, the training loader itself (``pipeline.RankLoader``, rank
             and world passed in, real DataLoader worker processes) over real shards. simdist
             gives the loader no plan, so each pass runs until the rank's data end: the count is
             measured, not planned. simdist then applies the cut at N itself, as RankLoader does
             in training.

A rank's epoch, as simulated: ``repeat`` passes of its loader (each pass reads every shard of
the rank ``dsrepeat`` times inside its workers), cut at ``nbatches`` batches when a cut is
given. Splitting and planning are not reimplemented here: ranks and workers come from
``splits.plan``, advice from ``splits.suggest_dsrepeat`` and ``splits.nearest_divisible``.
"""

from __future__ import annotations

import gc
import math
import os
import random
import re
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from wdsdist.data import shardspec
from wdsdist.data.options import parse_nbatches
from wdsdist.data.shardspec import Access, Shard
from wdsdist.data.splits import Plan, RankPlan, nearest_divisible, plan, suggest_dsrepeat
from wdsdist.errors import UserError

DEFAULT_NSHARDS = 10
DEFAULT_SAMPLES = "100"
IMAGE_SIZE = 16  # pixels, written and loaded: the counts do not depend on it, the run time does
REAL_MODE_MAX_SAMPLES = 200_000  # real mode writes (for a described layout) and reads every sample
SHOWN_RANKS = 32  # more ranks than this: a summary plus the first and last few (--verbose: all)


# ---------------------------------------------------------------- settings and layouts


@dataclass(frozen=True)
class Settings:
    """What the simulated job looks like; validated, so bad values fail with one line."""

    size: int = 3
    nworkers: int = 3
    batch_size: int = 10
    partial: bool = False
    nbatches: int | str | None = None  # None: no cut; an int; or "auto"
    dsrepeat: int = 1
    repeat: int = 1
    nepochs: int = 1
    cross_shuffle: int = 0  # samples shuffled across workers before re-batching; 0: off
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("size", "batch_size", "dsrepeat", "repeat", "nepochs"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("nworkers", "cross_shuffle"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        try:
            object.__setattr__(self, "nbatches", parse_nbatches(self.nbatches))  # frozen: set once, here
        except ValueError as exc:
            raise UserError(f"--nbatches {exc}") from None


@dataclass(frozen=True)
class Layout:
    """Per-shard sample counts, and the shards themselves when there are files to read."""

    counts: tuple[int, ...]
    source: str  # how the layout was given, for the report
    shards: tuple[Shard, ...] | None = None

    @property
    def total(self) -> int:
        return sum(self.counts)


_SPREAD = re.compile(r"^\s*(\d+)\s*(?:(?:\+-|\+/-|±)\s*(\d+))?\s*$")


def parse_spread(text: str) -> tuple[int, int]:
    """'1000' -> (1000, 0); '1000+-50' -> (1000, 50): samples per shard and the spread around it."""
    m = _SPREAD.match(str(text))
    if not m:
        raise UserError(f"--samples-per-shard {text!r}: expected N or N+-D, such as 1000 or 1000+-50")
    base, spread = int(m.group(1)), int(m.group(2) or 0)
    if base < 1:
        raise UserError(f"--samples-per-shard must be >= 1, got {base}")
    if spread >= base:
        raise UserError(f"--samples-per-shard {text!r}: the spread {spread} must be less than {base}")
    return base, spread


def described_counts(nshards: int, samples: str, seed: int) -> list[int]:
    """Counts of a described layout: uniform integers in [N-D, N+D], seeded."""
    if nshards < 1:
        raise UserError(f"--nshards must be >= 1, got {nshards}")
    base, spread = parse_spread(samples)
    if not spread:
        return [base] * nshards
    rng = random.Random(seed)
    return [rng.randint(base - spread, base + spread) for _ in range(nshards)]


def described_layout(nshards: int, samples: str, seed: int) -> Layout:
    counts = described_counts(nshards, samples, seed)
    base, spread = parse_spread(samples)
    source = f"--nshards {nshards} --samples-per-shard {base}" + (f"+-{spread} (seed {seed})" if spread else "")
    return Layout(tuple(counts), source)


def spec_layout(
    spec: str, *, count_local: bool, count_remote: bool, need_files: bool = False, access: Access | None = None
) -> Layout:
    """A layout from a shard spec: counts from its index, else counted from tar headers if allowed.

    ``need_files``: real mode reads the shards, so local ones an index lists must exist.
    ``access``: what the spec's index may name, and whether pipe: shards may be opened.
    """
    access = access or Access()
    shards = shardspec.expand(spec, access=access)
    if need_files:
        absent = [s.url for s in shards if not shardspec.is_remote(s.url) and not os.path.exists(s.url)]
        if absent:
            raise UserError(
                f"{len(absent)} of {len(shards)} shards of {spec} do not exist, first {absent[0]}; "
                f"--plan plans from the index alone"
            )
    counts = shardspec.sample_counts(shards)
    if counts is None:
        unknown = [s for s in shards if s.nsamples is None]
        remote = [s for s in unknown if shardspec.is_remote(s.url)]
        if (remote and not count_remote) or (unknown and not count_local):
            first = (remote or unknown)[0].url
            raise UserError(
                f"--plan needs sample counts and {first} has none: give an index JSON "
                f"(makeshards.py --index), or describe the layout with --nshards and --samples-per-shard"
            )
        shardspec.refuse_pipes(unknown, access)
        from wdsdist.data.index import count_samples  # imports torch: only when counting

        try:
            counts = [s.nsamples if s.nsamples is not None else count_samples(s.url) for s in shards]
        except UserError as exc:
            raise UserError(" ".join(str(exc).split())) from None  # tarfile's reasons span lines
    if need_files:
        shardspec.refuse_pipes(shards, access)
    return Layout(tuple(counts), spec, tuple(shards))


def synthetic_layout(layout: Layout, cache: str, name: str, seed: int = 0) -> Layout:
    """Write (once) synthetic shards with exactly the layout's counts; reuse them afterwards."""
    if layout.total > REAL_MODE_MAX_SAMPLES:
        raise UserError(
            f"real mode would write and read {layout.total} samples (more than {REAL_MODE_MAX_SAMPLES}): "
            f"use --plan for a layout this big"
        )
    from wdsdist.data.index import index_path

    outdir = os.path.join(cache, name)
    index = index_path(outdir, "simdist")
    if os.path.exists(index):
        try:
            shards = shardspec.read_index_shards(index)
        except UserError:
            shards = []
        if tuple(s.nsamples for s in shards) == layout.counts and all(os.path.exists(s.url) for s in shards):
            return Layout(layout.counts, f"{layout.source} -> {index}", tuple(shards))
    print(f"writing {len(layout.counts)} synthetic shards, {layout.total} samples, to {outdir} (once)", file=sys.stderr)
    write_synthetic_shards(list(layout.counts), outdir, "simdist", seed=seed)
    return Layout(layout.counts, f"{layout.source} -> {index}", tuple(shardspec.read_index_shards(index)))


def write_synthetic_shards(counts: Sequence[int], outdir: str, prefix: str, *, seed: int = 0) -> str:
    """Shards of exactly ``counts`` synthetic samples (tiny images, unique keys), and their index."""
    from wdsdist.data.index import index_path
    from wdsdist.tools import synthetic
    from wdsdist.tools.shards import Sample, ShardSink

    with ShardSink(outdir, prefix, maxcount=max(counts), maxsize=1 << 40) as sink:
        i = 0
        for count in counts:
            for _ in range(count):
                image, label = synthetic.draw(i, size=IMAGE_SIZE, seed=seed)
                sink.write(Sample(f"sample-{i:08d}", "jpg", synthetic.jpeg_bytes(image, 90), label, {}))
                i += 1
            sink.end_shard()
        sink.commit(classes=list(synthetic.CLASSES), synthetic={"seed": seed})
    return index_path(outdir, prefix)


# ---------------------------------------------------------------- what each rank delivers


@dataclass(frozen=True)
class RankEpoch:
    """What one rank delivered (or would deliver) in one epoch."""

    sizes: dict[int, int]  # batch size -> number of batches
    refused: str | None = None  # why the training loader refuses to run this rank

    @property
    def batches(self) -> int:
        return sum(self.sizes.values())

    @property
    def samples(self) -> int:
        return sum(size * n for size, n in self.sizes.items())


@dataclass
class Simulation:
    """The planned side of a simulation: the plan of one loader pass, the cut, and per-rank counts."""

    layout: Layout
    settings: Settings
    plan: Plan  # one loader pass, no cut (the cut spans ``repeat`` passes)
    cut: int | None
    expected: list[RankEpoch]  # per rank, every epoch

    @property
    def reach(self) -> list[int]:
        """Batches each rank can deliver per epoch before any cut: ``repeat`` passes of its loader."""
        return [self.settings.repeat * r.available for r in self.plan.ranks]


def refusal(rank: RankPlan) -> str | None:
    """The training loader refuses a rank with a worker that has no shard (it would hang DDP)."""
    empty = [w.worker for w in rank.workers if not w.shards]
    if not empty:
        return None
    if not rank.shards:
        return "refused: this rank gets no shard"
    return f"refused: worker {empty[0]} gets no shard ({_n(len(rank.shards), 'shard')} for {len(rank.workers)} workers)"


def pass_sizes(rank: RankPlan, batch_size: int, partial: bool, rebatch: bool) -> tuple[int, list[tuple[int, int]]]:
    """One loader pass of a rank: (full batches, [(position, size)] of its short batches).

    Without re-batching, the DataLoader takes batches from its workers in turn (worker 0, 1,
    2, 0, ...), skipping workers that have run out; each worker's short batch is its last.
    """
    if rebatch and partial:
        full, rest = divmod(rank.samples, batch_size)
        return full, [(full, rest)] if rest else []
    per_worker = []
    for w in rank.workers:
        full, rest = divmod(w.samples, batch_size)
        per_worker.append((full, rest if partial else 0))
    counts = [f + (1 if r else 0) for f, r in per_worker]
    shorts = []
    for w, (_, rest) in enumerate(per_worker):
        if rest:
            last_round = counts[w] - 1
            before = sum(min(c, last_round) for c in counts) + sum(1 for v in range(w) if counts[v] >= counts[w])
            shorts.append((before, rest))
    return sum(f for f, _ in per_worker), sorted(shorts)


def delivered(rank: RankPlan, s: Settings, cut: int | None) -> RankEpoch:
    """Batch sizes one rank delivers per epoch: ``repeat`` passes, cut at ``cut`` batches."""
    why = refusal(rank)
    if why:
        return RankEpoch({}, why)
    full, shorts = pass_sizes(rank, s.batch_size, s.partial, s.cross_shuffle > 0)
    per_pass = full + len(shorts)
    if cut is None or not per_pass:
        whole, rest = s.repeat, 0
    else:
        whole, rest = divmod(cut, per_pass)
        if whole >= s.repeat:
            whole, rest = s.repeat, 0
    sizes: Counter[int] = Counter()
    for m in [per_pass] * whole + ([rest] if rest else []):
        taken = [size for pos, size in shorts if pos < m]
        sizes[s.batch_size] += m - len(taken)
        sizes.update(taken)
    return RankEpoch({k: v for k, v in sizes.items() if v})


def simulate_plan(layout: Layout, s: Settings) -> Simulation:
    """Per-rank counts from sample counts alone."""
    try:
        p = plan(
            layout.counts,
            s.size,
            s.nworkers,
            s.batch_size,
            partial=s.partial,
            dsrepeat=s.dsrepeat,
            rebatch=s.cross_shuffle > 0,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    reach = [s.repeat * r.available for r in p.ranks]
    cut: int | None
    if s.nbatches == "auto":
        cut = min(reach)
    else:
        cut = s.nbatches  # type: ignore[assignment]
    return Simulation(layout, s, p, cut, [delivered(r, s, cut) for r in p.ranks])


# ---------------------------------------------------------------- real mode


@dataclass
class Coverage:
    """Sample keys over all ranks in one epoch, against the data set."""

    total: int  # samples in the data set
    delivered: int
    unique: int

    @property
    def duplicated(self) -> int:
        return self.delivered - self.unique

    @property
    def missing(self) -> int:
        return self.total - self.unique


@dataclass
class RealRun:
    epochs: list[list[RankEpoch]]  # [epoch][rank]
    coverage: list[Coverage]  # per epoch


def simulate_real(
    sim: Simulation, *, showopen: bool = False, image_size: int = IMAGE_SIZE, access: Access | None = None
) -> RealRun:
    """Run every simulated rank's training loader (real DataLoader workers), one rank after another."""
    access = access or Access()
    from wdsdist.data.options import LoaderConfig
    from wdsdist.data.pipeline import RankLoader
    from wdsdist.errors import DataError

    s, shards = sim.settings, sim.layout.shards
    if shards is None:
        raise UserError("real mode needs shards: give --shards, or let simdist write synthetic ones")
    cfg = LoaderConfig(
        batch_size=s.batch_size,
        workers=s.nworkers,
        mode="epoch",
        image_size=image_size,
        seed=s.seed,
        cross_shuffle=s.cross_shuffle,
        partial=s.partial,
        nbatches=sim.cut if sim.cut else None,
        dsrepeat=s.dsrepeat,
        with_keys=True,
        trace=showopen,
        strict=True,  # a simulator reports bad data at once: skipping it would change the counts
        allow_pipe=access.allow_pipe,
        trust_index=access.trust_index,
    )
    epochs: list[list[RankEpoch]] = [[] for _ in range(s.nepochs)]
    keys: list[Counter[str]] = [Counter() for _ in range(s.nepochs)]
    with warnings.catch_warnings():
        # Simulating more workers than this machine has cores is the point, not a mistake.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for rank, rank_plan in enumerate(sim.plan.ranks):
            why = refusal(rank_plan)
            if why:
                for e in range(s.nepochs):
                    epochs[e].append(RankEpoch({}, why))
                continue
            loader = RankLoader(list(shards), rank, s.size, cfg, None, None)  # no plan: run to the end of the data
            try:
                for e in range(s.nepochs):
                    epochs[e].append(_run_epoch(loader, s.repeat, sim.cut, keys[e]))
            except DataError as exc:
                # Raised in a worker, it arrives with the worker's traceback: keep its last line.
                raise UserError(re.sub(r"^[\w.]*DataError: ", "", str(exc).strip().splitlines()[-1])) from None
            finally:
                del loader
            gc.collect()  # shut this rank's persistent workers down before the next rank starts its own
    coverage = [Coverage(sim.layout.total, sum(k.values()), len(k)) for k in keys]
    return RealRun(epochs, coverage)


def _run_epoch(loader, repeat: int, cut: int | None, keys: Counter[str]) -> RankEpoch:
    """One simulated epoch of one rank: ``repeat`` passes of its loader, stopped at ``cut`` batches."""
    sizes: Counter[int] = Counter()
    n = 0
    for _ in range(repeat):
        if cut is not None and n >= cut:
            break
        for batch in loader:
            sizes[len(batch["key"])] += 1
            keys.update(batch["key"])
            n += 1
            if cut is not None and n >= cut:
                break
    return RankEpoch(dict(sizes))


# ---------------------------------------------------------------- report


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def _ranges(ranks: Sequence[int], limit: int = 6) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (at most ``limit`` pieces)."""
    pieces: list[str] = []
    start = prev = None
    for r in list(ranks) + [None]:
        if start is not None and (r is None or r != prev + 1):
            pieces.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    more = len(pieces) - limit
    return ", ".join(pieces[:limit]) + (f", ... (+{more} more)" if more > 0 else "")


def _ranks_word(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def rank_line(rank: int, result: RankEpoch, width: int = 1) -> str:
    """One rank's line, the same in plan and real mode: batches, sizes, samples."""
    head = f"rank {rank:>{width}}:"
    if result.refused:
        return f"{head} {result.refused}"
    if not result.batches:
        return f"{head} 0 batches"
    sizes = sorted(result.sizes.items(), reverse=True)
    if len(sizes) == 1:
        size, n = sizes[0]
        return f"{head} {n} batches of {size} ({result.samples} samples)"
    parts = ", ".join(f"{n} of {size}" for size, n in sizes)
    return f"{head} {result.batches} batches: {parts} ({result.samples} samples)"


def shown_ranks(results: Sequence[RankEpoch], verbose: bool) -> list[int]:
    """All ranks, or for big worlds the first and last few plus the shortest and the longest."""
    n = len(results)
    if verbose or n <= SHOWN_RANKS:
        return list(range(n))
    counts = [r.batches for r in results]
    keep = set(range(4)) | set(range(n - 4, n))
    keep.add(counts.index(min(counts)))
    keep.add(counts.index(max(counts)))
    return sorted(keep)


def rank_lines(results: Sequence[RankEpoch], verbose: bool = False) -> list[str]:
    width = len(str(len(results) - 1))
    out: list[str] = []
    shown = shown_ranks(results, verbose)
    if len(shown) < len(results):
        counts = Counter(r.batches for r in results)
        lo, hi = min(counts), max(counts)
        if lo == hi:
            out.append(f"batches per rank: {lo} on every one of {len(results)} ranks")
        else:
            out.append(f"batches per rank: {lo}..{hi}, {len(counts)} distinct counts over {len(results)} ranks")
            for batches, nranks in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5]:
                out.append(f"  {batches} batches: {nranks} ranks")
            if len(counts) > 5:
                out.append(f"  ... {len(counts) - 5} more counts")
    last = -1
    for r in shown:
        if r > last + 1:
            out.append(f"  ... {r - last - 1} ranks not shown (--verbose shows all)")
        out.append(rank_line(r, results[r], width))
        last = r
    return out


def verdict(epochs: Sequence[Sequence[RankEpoch]]) -> tuple[bool, str]:
    """SUCCESS when every rank delivers the same number of batches (> 0) in every epoch."""
    for e, results in enumerate(epochs):
        where = f"epoch {e}: " if len(epochs) > 1 else ""
        refused = [i for i, r in enumerate(results) if r.refused]
        if refused:
            return False, f"FAILED: {where}the training loader refuses {_ranks_word(refused)} (a worker with no shard)"
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(results):
            groups.setdefault(r.batches, []).append(i)
        if len(groups) > 1:
            parts = [f"{b} ({_ranks_word(rs)})" for b, rs in sorted(groups.items(), key=lambda kv: -kv[0])]
            if len(parts) > 4:
                parts = [f"{len(parts)} different counts from {parts[-1]} to {parts[0]}"]
            return False, f"FAILED: {where}ranks deliver different numbers of batches: " + ", ".join(parts)
        if not next(iter(groups)):
            return False, f"FAILED: {where}every rank delivers 0 batches"
    n = epochs[0][0].batches
    return True, f"SUCCESS: same batches in all ranks ({n} per rank per epoch)"


def sample_balance(sim: Simulation) -> tuple[int, int, int]:
    """(delivered, dropped, repeated) samples per epoch against one pass over the data set.

    Per rank: its share of the data (one pass, no dsrepeat) against what it delivers. With
    repetition, which samples repeat depends on the shuffle, so these are lower bounds; real
    mode counts keys.
    """
    out = dropped = repeated = 0
    for rank, result in zip(sim.plan.ranks, sim.expected, strict=True):
        share = rank.samples // sim.settings.dsrepeat
        got = 0 if result.refused else result.samples
        out += got
        dropped += max(0, share - got)
        repeated += max(0, got - share)
    return out, dropped, repeated


def advice(sim: Simulation) -> list[str]:
    """Why the layout cannot be equal, with the numbers, and the nearest fixes."""
    s, p = sim.settings, sim.plan
    out: list[str] = []
    slots = s.size * p.nworkers
    divisible = p.nshards % slots == 0
    fewest = min(len(r.shards) for r in p.ranks)
    if fewest < p.nworkers:
        rank = next(r for r in p.ranks if len(r.shards) == fewest)
        fix = f"--nworkers {fewest}" if fewest else f"--size {p.nshards}"
        out.append(
            f"rank {rank.rank} gets {_n(fewest, 'shard')} for {p.nworkers} workers, so a worker gets no shard "
            f"(the training loader refuses that): use {fix}, or at least {slots} shards "
            f"({nearest_divisible(max(p.nshards, slots), slots)} divide evenly)"
        )
        return out
    reach = sim.reach
    lo, hi = min(reach), max(reach)
    if not hi:
        smallest = min(w.samples for r in p.ranks for w in r.workers)
        out.append(
            f"every rank delivers 0 batches: a worker holds as few as {smallest} samples per epoch, "
            f"less than --batch-size {s.batch_size}; use a smaller --batch-size, --partial, or --dsrepeat"
        )
        return out
    if not divisible:
        out.append(
            f"{p.nshards} shards do not divide evenly into {s.size} ranks x {p.nworkers} workers = {slots} "
            f"slots, so ranks get different numbers of shards: {nearest_divisible(p.nshards, slots)} shards "
            f"of equal size would divide evenly"
        )
    elif len(set(sim.layout.counts)) > 1:
        out.append(
            f"{p.nshards} shards divide evenly into {slots} slots, but shards hold {min(sim.layout.counts)}.."
            f"{max(sim.layout.counts)} samples, so ranks still differ: cut them (--nbatches)"
        )
    if sim.cut is not None and sim.cut > lo:
        short = [i for i, n in enumerate(reach) if n < sim.cut]
        k = suggest_dsrepeat(p, math.ceil(sim.cut / s.repeat))
        fixes = [f"--nbatches {lo} or less (every rank reaches {lo})"]
        if k:
            fixes.append(f"--dsrepeat {k} (each worker reads its shards {k} times)")
        if lo:
            fixes.append(f"--repeat {math.ceil(sim.cut / min(r.available for r in p.ranks))} (loader-level passes)")
        out.append(
            f"--nbatches {sim.cut} is more than {_ranks_word(short)} can deliver "
            f"(as few as {lo} batches with --dsrepeat {s.dsrepeat}): use " + ", or ".join(fixes)
        )
    elif sim.cut is None and lo != hi:
        cut_sim = simulate_plan(sim.layout, replace(s, nbatches=lo))
        got, dropped, _ = sample_balance(cut_sim)
        out.append(
            f"ranks reach {lo}..{hi} batches per epoch and DDP needs the same number on every rank: cut every "
            f"rank with --nbatches {lo} (or --nbatches auto), which delivers {got} of {sim.layout.total} samples "
            f"per epoch (drops {dropped}, {_pct(dropped, sim.layout.total)})"
        )
        k = suggest_dsrepeat(p, math.ceil(hi / s.repeat))
        if k:
            more = simulate_plan(sim.layout, replace(s, nbatches=hi, dsrepeat=k))
            got, dropped, repeated = sample_balance(more)
            out.append(
                f"or lose no rank's data: with --nbatches {hi} --dsrepeat {k} every worker reads its shards {k} times, "
                f"so the short ranks reach {hi} too (delivers {got} samples per epoch, repeats at least {repeated}, "
                f"{_pct(repeated, sim.layout.total)})"
            )
    return out


def _describe_counts(counts: Sequence[int]) -> str:
    lo, hi = min(counts), max(counts)
    if lo == hi:
        return f"{lo} per shard"
    return f"{lo}..{hi} per shard, mean {sum(counts) / len(counts):.1f}"


def parameter_lines(sim: Simulation, real: bool) -> list[str]:
    s, lay = sim.settings, sim.layout
    nw = "0 (loading in the main process: one worker)" if s.nworkers == 0 else str(s.nworkers)
    if s.nbatches == "auto":
        cut = f"auto -> {sim.cut} (the most every rank reaches)"
    else:
        cut = "none (every rank runs to the end of its data)" if sim.cut is None else str(sim.cut)
    mode = (
        "real: every simulated rank runs the training loader (RankLoader) with its own DataLoader workers"
        if real
        else "plan: counts from the planner and sample counts alone, no data read"
    )
    return [
        f"simdist ({mode})",
        "parameters:",
        f"  shards        {sim.plan.nshards} ({lay.source})",
        f"  samples       {lay.total} ({_describe_counts(lay.counts)})",
        f"  size          {s.size} ranks",
        f"  nworkers      {nw} per rank",
        f"  batch-size    {s.batch_size}",
        f"  partial       {'yes (short batches kept)' if s.partial else 'no (short batches dropped)'}",
        f"  nbatches      {cut}",
        f"  dsrepeat      {s.dsrepeat} (passes over the shards inside each worker)",
        f"  repeat        {s.repeat} (loader passes per epoch)",
        f"  cross-shuffle {s.cross_shuffle}" + (" (re-batch across workers)" if s.cross_shuffle else ""),
        f"  nepochs       {s.nepochs}",
    ]


def split_lines(sim: Simulation, verbose: bool) -> list[str]:
    """Which shards each rank and each worker got (indices into the expanded shard list)."""

    def listing(indices: Sequence[int]) -> str:
        head = ", ".join(map(str, indices[:8]))
        return f"[{head}{', ...' if len(indices) > 8 else ''}]"

    p, s = sim.plan, sim.settings
    out = ["splits (shard i is the i-th of the shard list; worker samples and batches per loader pass):"]
    if sim.layout.shards:
        out.append(f"  shard 0 = {sim.layout.shards[0].url}, shard {p.nshards - 1} = {sim.layout.shards[-1].url}")
    shown = shown_ranks(sim.expected, verbose)
    for r in shown:
        rank = p.ranks[r]
        out.append(
            f"rank {r}: {_n(len(rank.shards), 'shard')} {listing(rank.shards)}, {rank.samples // s.dsrepeat} samples"
        )
        for w in rank.workers:
            x = f" x {s.dsrepeat}" if s.dsrepeat > 1 else ""
            out.append(
                f"  worker {w.worker}: {_n(len(w.shards), 'shard')} {listing(w.shards)}, "
                f"{w.samples // s.dsrepeat}{x} samples, {w.batches} batches"
            )
    if len(shown) < len(p.ranks):
        out.append(f"  ({len(p.ranks) - len(shown)} ranks not shown; --verbose shows all)")
    return out


def coverage_line(epoch: int, c: Coverage, sim: Simulation) -> str:
    s, cut, reach = sim.settings, sim.cut, sim.reach
    short_dropped = not s.partial and any(w.samples % s.batch_size for r in sim.plan.ranks for w in r.workers)
    line = (
        f"coverage epoch {epoch}: {c.delivered} samples delivered, {c.unique} distinct of {c.total}; "
        f"duplicated {c.duplicated} ({_pct(c.duplicated, c.total)}), missing {c.missing} ({_pct(c.missing, c.total)})"
    )
    why = []
    if c.missing:
        if cut is not None and cut < max(reach):
            why.append("the cut at --nbatches drops the rest of longer ranks")
        if short_dropped:
            why.append("short batches are dropped (--no-partial)")
        if s.dsrepeat > 1 or s.repeat > 1:
            why.append("repeated samples take the place of others")
    if c.duplicated:
        if s.dsrepeat > 1 or s.repeat > 1:
            why.append("--dsrepeat/--repeat read data more than once")
        else:
            why.append("UNEXPECTED: no repetition was asked for (are keys unique in the data set?)")
    return line + (f" [{'; '.join(why)}]" if why else "")


def report(
    sim: Simulation,
    *,
    real: RealRun | None = None,
    showsplits: bool = False,
    verbose: bool = False,
    plot_to: str | None = None,
    out: TextIO | None = None,
) -> int:
    """Print the whole report (and draw it to ``plot_to``); return the exit code (0 SUCCESS, 1 FAILED)."""
    out = out or sys.stdout

    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=out)

    say(*parameter_lines(sim, real is not None), "")
    if showsplits:
        say(*split_lines(sim, verbose), "")
    epochs = real.epochs if real else [sim.expected]
    for e, results in enumerate(epochs):
        if len(epochs) > 1:
            say(f"epoch {e}:")
        say(*rank_lines(results, verbose))
    say("")
    got, dropped, repeated = sample_balance(sim)
    total = sim.layout.total
    bounds = sim.settings.dsrepeat > 1 or sim.settings.repeat > 1
    say(
        f"samples per epoch: {got} delivered for {total} in the data set: drops {dropped} ({_pct(dropped, total)}), "
        f"repeats {repeated} ({_pct(repeated, total)})"
        + (" (at least: the shuffle decides which samples repeat)" if bounds else "")
    )
    if real:
        for e, c in enumerate(real.coverage):
            say(coverage_line(e, c, sim))
        differ = [r for results in real.epochs for r, x in enumerate(results) if x != sim.expected[r]]
        if differ:
            say(f"warning: the loader delivered other counts than the plan for {_ranks_word(sorted(set(differ)))}")
    ok, line = verdict(epochs)
    if not ok:
        tips = advice(sim)
        if tips:
            say("", "advice:", *(f"  - {t}" for t in tips))
    if plot_to:
        say(f"plot: {plot(sim, epochs[-1], plot_to)}")
    say("", line)
    return 0 if ok else 1


# ---------------------------------------------------------------- picture

PLOT_MAX_WORKERS = 16  # worker rows drawn per rank
PLOT_EDGE_RANKS = 3  # big worlds: the first and last few ranks, plus the shortest and the longest
ROW_INCHES = 0.24


def plot(sim: Simulation, results: Sequence[RankEpoch], path: str) -> str:
    """Draw ranks x workers with their shards, the batches per rank, and the cut line at N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    s, p = sim.settings, sim.plan
    counts, reach = [r.batches for r in results], sim.reach
    ranks = list(range(len(results)))
    if len(ranks) > 2 * PLOT_EDGE_RANKS + 2:
        keep = set(ranks[:PLOT_EDGE_RANKS]) | set(ranks[-PLOT_EDGE_RANKS:])
        keep |= {reach.index(min(reach)), reach.index(max(reach))}
        ranks = sorted(keep)
    nw = min(p.nworkers, PLOT_MAX_WORKERS)
    rows: list[tuple[int, int, float]] = []  # (rank, worker, y)
    centers: dict[int, tuple[float, float]] = {}  # rank -> (y of its middle, rows)
    y = 0.0
    for r in ranks:
        top = y
        for w in range(nw):
            rows.append((r, w, y))
            y += 1
        centers[r] = ((top + y - 1) / 2, y - top)
        y += 0.7
    height = 2.3 + ROW_INCHES * y
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(14, height), sharey=True, gridspec_kw={"width_ratios": [3, 2], "wspace": 0.04}
    )

    # Left: each worker's shards as boxes, one pass after another when dsrepeat > 1.
    cmap = plt.get_cmap("tab20")
    xmax = max((w.samples for rk in p.ranks for w in rk.workers), default=1) or 1
    nboxes = sum(len(p.ranks[r].workers[w].shards) * s.dsrepeat for r, w, _ in rows)
    for r, w, yy in rows:
        worker = p.ranks[r].workers[w]
        if not worker.shards:
            left.text(0, yy, " no shard: the loader refuses this rank", va="center", color="crimson", fontsize=8)
            continue
        x = 0
        for rep in range(s.dsrepeat):
            spans = []
            for shard in worker.shards:
                width = sim.layout.counts[shard]
                spans.append((x, width))
                if nboxes <= 300 and width / xmax > 0.035:
                    left.text(x + width / 2, yy, str(shard), ha="center", va="center", fontsize=8)
                x += width
            left.broken_barh(
                spans,
                (yy - 0.4, 0.8),
                facecolors=[cmap(i % 20) for i in worker.shards],
                edgecolors="white",
                linewidth=0.6,
                alpha=1.0 if rep == 0 else 0.45,
                hatch=None if rep == 0 else "//",
            )
    left.set_xlim(0, xmax * 1.02)
    left.set_ylim(y - 0.7 + 0.5, -0.6)  # top to bottom: rank 0 first
    hatched = "; hatched: dsrepeat passes" if s.dsrepeat > 1 else ""
    more_workers = f"; first {nw} of {p.nworkers} workers" if nw < p.nworkers else ""
    left.set_xlabel(f"samples per worker per loader pass (boxes: shards by index{hatched}{more_workers})")
    labels = [f"rank {r}  w{w}" if w == 0 else f"w{w}" for r, w, _ in rows]
    left.set_yticks([yy for _, _, yy in rows], labels, fontsize=8)
    left.set_title("shards per worker: rank r gets shards r::size, its worker w those w::nworkers", fontsize=10)
    trans = blended_transform_factory(left.transAxes, left.transData)
    for a, b in zip(ranks, ranks[1:], strict=False):
        if b > a + 1:
            gap = centers[a][0] + centers[a][1] / 2 + 0.1
            left.text(-0.01, gap, f"... {b - a - 1} ranks ...", transform=trans, ha="right", va="center", fontsize=8)

    # Right: batches per rank. Up to the target every rank is fine; red beyond it is what only some
    # ranks have (DDP would hang there); a red outline short of it is what a rank is missing.
    equal = verdict([results])[0]
    target = sim.cut if sim.cut is not None else min(counts)
    base_colour = "seagreen" if equal else "steelblue"
    for r in ranks:
        yc, n = centers[r]
        res, bar = results[r], n * 0.85
        right.barh(yc, reach[r], height=bar, color="0.9", edgecolor="0.75")
        right.barh(yc, min(res.batches, target), height=bar, color=base_colour)
        if res.batches > target:
            right.barh(yc, res.batches - target, left=target, height=bar, color="crimson")
        elif res.batches < target:
            right.barh(
                yc, target - res.batches, left=res.batches, height=bar, fill=False, edgecolor="crimson", hatch="xx"
            )
        text = "refused" if res.refused else f"{res.batches}"
        if not res.refused and reach[r] != res.batches:
            text += f" of {reach[r]}"
        right.text(max(res.batches, reach[r], target), yc, f"  {text}", va="center", fontsize=9)
    upto = " (up to the shortest rank)" if sim.cut is None else " (up to the cut)"
    handles = [
        Patch(facecolor="0.9", edgecolor="0.75", label="what the rank can reach"),
        Patch(color=base_colour, label="delivered" + ("" if equal else upto)),
    ]
    if not equal:
        handles.append(Patch(color="crimson", label="only some ranks: DDP would hang"))
        if sim.cut is not None:
            handles.append(Patch(fill=False, edgecolor="crimson", hatch="xx", label="short of the cut"))
    if sim.cut is not None:
        right.axvline(sim.cut, color="navy", linestyle="--", linewidth=1.5)
        handles.append(Line2D([], [], color="navy", linestyle="--", label=f"cut: --nbatches {sim.cut}"))
    right.set_xlim(0, max(max(reach), max(counts), sim.cut or 0, 1) * 1.3)
    right.set_xlabel("batches per rank per epoch")
    right.set_title("batches per rank", fontsize=10)
    right.tick_params(left=False)

    ok, line = verdict([results])
    cut = "none" if sim.cut is None else str(sim.cut)
    fig.suptitle(
        f"{p.nshards} shards ({_describe_counts(sim.layout.counts)}), {s.size} ranks x {p.nworkers} workers, "
        f"batch {s.batch_size}, nbatches {cut}, dsrepeat {s.dsrepeat}, repeat {s.repeat}\n{line}",
        color="darkgreen" if ok else "darkred",
        fontsize=11,
        y=1 - 0.1 / height,
        va="top",
    )
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.1 / height), ncol=len(handles), fontsize=8)
    fig.subplots_adjust(left=0.09, right=0.98, top=1 - 0.95 / height, bottom=1.05 / height)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
