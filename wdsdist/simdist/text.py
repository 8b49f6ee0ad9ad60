"""simdist's report as text: the parameters, the splits, each rank's line, the verdict, the sample
balance, coverage and advice. Plan and real mode print the same lines."""
# A long module: every line simdist prints is written here, plan and real mode alike, so
# the two modes cannot drift apart (tests compare their lines).

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from wdsdist.data.plan.splits import nearest_divisible, suggest_dsrepeat
from wdsdist.simdist.simulate import (
    Coverage,
    RankEpoch,
    RealRun,
    Simulation,
    plural,
    sample_coverage,
    simulate_plan,
)

SHOWN_RANKS = 32  # more ranks than this: a summary plus the first and last few (--verbose: all)


def percent(n: int, total: int) -> str:
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


def ranks_word(ranks: Sequence[int]) -> str:
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
    for epoch, results in enumerate(epochs):
        where = f"epoch {epoch}: " if len(epochs) > 1 else ""
        refused = [i for i, r in enumerate(results) if r.refused]
        if refused:
            return False, f"FAILED: {where}the training loader refuses {ranks_word(refused)} (a worker with no shard)"
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(results):
            groups.setdefault(r.batches, []).append(i)
        if len(groups) > 1:
            parts = [
                f"{batches} ({ranks_word(ranks)})" for batches, ranks in sorted(groups.items(), key=lambda kv: -kv[0])
            ]
            if len(parts) > 4:
                parts = [f"{len(parts)} different counts from {parts[-1]} to {parts[0]}"]
            return False, f"FAILED: {where}ranks deliver different numbers of batches: " + ", ".join(parts)
        if not next(iter(groups)):
            return False, f"FAILED: {where}every rank delivers 0 batches"
    batches = epochs[0][0].batches
    return True, f"SUCCESS: same batches in all ranks ({batches} per rank per epoch)"


def sample_balance(sim: Simulation) -> tuple[int, int, int]:
    """(delivered, dropped, repeated) samples per epoch against one pass over the data set.

    Per rank: its share of the data (one pass, no dsrepeat) against what it delivers. With
    repetition, which samples repeat depends on the shuffle, so these are lower bounds; real
    mode counts keys.
    """
    if sim.plan.split == "samples":
        batches = 0 if sim.expected[0].refused else sim.expected[0].batches
        got, distinct = sample_coverage(sim.plan, batches)
        return got, sim.layout.total - distinct, got - distinct
    total = dropped = repeated = 0
    for rank, result in zip(sim.plan.ranks, sim.expected, strict=True):
        share = rank.samples // sim.settings.dsrepeat
        got = 0 if result.refused else result.samples
        total += got
        dropped += max(0, share - got)
        repeated += max(0, got - share)
    return total, dropped, repeated


def balance_line(sim: Simulation) -> str:
    got, dropped, repeated = sample_balance(sim)
    total = sim.layout.total
    bounds = sim.settings.dsrepeat > 1 or sim.settings.repeat > 1
    if sim.plan.split == "samples":
        p, cut = sim.plan, sim.cut
        nodes = sim.settings.size // sim.settings.node_ranks if sim.settings.shard_order == "node" else 1
        whose = "each node's own" if nodes > 1 else "the epoch's"
        how = (
            f"split=samples, remainder={p.remainder}: "
            + (
                f"pads {p.padded} ({whose} first samples again)"
                if p.remainder == "pad"
                else f"drops {p.dropped} ({whose} last samples)"
            )
            + f", under {p.world} ranks x batch {p.batch_size} = {p.world * p.batch_size}"
            + (f"; the cut at {cut} leaves out more" if cut is not None and cut < p.ranks[0].available else "")
        )
        return (
            f"samples per epoch: {got} delivered for {total} in the data set: drops {dropped} "
            f"({percent(dropped, total)}), repeats {repeated} ({percent(repeated, total)}) [{how}]"
        )
    return (
        f"samples per epoch: {got} delivered for {total} in the data set: drops {dropped} ({percent(dropped, total)}), "
        f"repeats {repeated} ({percent(repeated, total)})"
        + (" (at least: the shuffle decides which samples repeat)" if bounds else "")
    )


def real_run_lines(sim: Simulation, real: RealRun) -> list[str]:
    """Real mode's coverage per epoch, and a warning where the loader did other than the plan."""
    out = [coverage_line(epoch, coverage, sim) for epoch, coverage in enumerate(real.coverage)]
    differ = [rank for results in real.epochs for rank, result in enumerate(results) if result != sim.expected[rank]]
    if differ:
        out.append(f"warning: the loader delivered other counts than the plan for {ranks_word(sorted(set(differ)))}")
    return out


def advice(sim: Simulation) -> list[str]:
    """Why the layout cannot be equal, with the numbers, and the nearest fixes."""
    no_shard = _no_shard_tip(sim)
    if no_shard:
        return [no_shard]
    reach = sim.reach
    lo, hi = min(reach), max(reach)
    if not hi:
        return [_no_batch_tip(sim)]
    tips = _shard_count_tips(sim)
    if sim.cut is not None and sim.cut > lo:
        tips.append(_cut_too_high_tip(sim, sim.cut, lo))
    elif sim.cut is None and lo != hi:
        tips += _cut_or_repeat_tips(sim, lo, hi)
    return tips


def _no_shard_tip(sim: Simulation) -> str | None:
    """A rank with fewer shards than workers: some worker gets none, and the loader refuses it."""
    plan = sim.plan
    fewest = min(len(r.shards) for r in plan.ranks)
    if fewest >= plan.nworkers:
        return None
    slots = sim.settings.size * plan.nworkers
    rank = next(r for r in plan.ranks if len(r.shards) == fewest)
    fix = f"--nworkers {fewest}" if fewest else f"--size {plan.nshards}"
    return (
        f"rank {rank.rank} gets {plural(fewest, 'shard')} for {plural(plan.nworkers, 'worker')}, "
        f"so a worker gets no shard "
        f"(the training loader refuses that): use {fix}, or at least {slots} shards "
        f"({nearest_divisible(max(plan.nshards, slots), slots)} divide evenly)"
    )


def _no_batch_tip(sim: Simulation) -> str:
    smallest = min(w.samples for r in sim.plan.ranks for w in r.workers)
    return (
        f"every rank delivers 0 batches: a worker holds as few as {smallest} samples per epoch, "
        f"less than --batch-size {sim.settings.batch_size}; use a smaller --batch-size, --partial, or --dsrepeat"
    )


def _shard_count_tips(sim: Simulation) -> list[str]:
    """Why ranks differ before any cut: shards that do not divide evenly, or shards of unequal size."""
    plan, size, counts = sim.plan, sim.settings.size, sim.layout.counts
    slots = size * plan.nworkers
    if plan.nshards % slots:
        return [
            f"{plan.nshards} shards do not divide evenly into {plural(size, 'rank')} x "
            f"{plural(plan.nworkers, 'worker')} = {slots} slots, so ranks get different numbers of shards: "
            f"{nearest_divisible(plan.nshards, slots)} shards of equal size would divide evenly"
        ]
    if len(set(counts)) > 1:
        return [
            f"{plan.nshards} shards divide evenly into {slots} slots, but shards hold {min(counts)}.."
            f"{max(counts)} samples, so ranks still differ: cut them (--nbatches)"
        ]
    return []


def _cut_too_high_tip(sim: Simulation, cut: int, lo: int) -> str:
    """--nbatches ``cut`` above what the shortest rank reaches (``lo``): a lower cut, or more passes."""
    settings, plan = sim.settings, sim.plan
    short = [i for i, n in enumerate(sim.reach) if n < cut]
    dsrepeat = suggest_dsrepeat(plan, math.ceil(cut / settings.repeat))
    fixes = [f"--nbatches {lo} or less (every rank reaches {lo})"]
    if dsrepeat:
        fixes.append(f"--dsrepeat {dsrepeat} (each worker reads its shards {dsrepeat} times)")
    if lo:
        fixes.append(f"--repeat {math.ceil(cut / min(r.available for r in plan.ranks))} (loader-level passes)")
    return (
        f"--nbatches {cut} is more than {ranks_word(short)} can deliver "
        f"(as few as {lo} batches with --dsrepeat {settings.dsrepeat}): use " + ", or ".join(fixes)
    )


def _cut_or_repeat_tips(sim: Simulation, lo: int, hi: int) -> list[str]:
    """No cut and ranks reach ``lo``..``hi``: cut at lo and drop data, or repeat the short ranks' data."""
    settings, total = sim.settings, sim.layout.total
    got, dropped, _ = sample_balance(simulate_plan(sim.layout, replace(settings, nbatches=lo)))
    tips = [
        f"ranks reach {lo}..{hi} batches per epoch and DDP needs the same number on every rank: cut every "
        f"rank with --nbatches {lo} (or --nbatches auto), which delivers {got} of {total} samples "
        f"per epoch (drops {dropped}, {percent(dropped, total)})"
    ]
    dsrepeat = suggest_dsrepeat(sim.plan, math.ceil(hi / settings.repeat))
    if dsrepeat:
        longer = simulate_plan(sim.layout, replace(settings, nbatches=hi, dsrepeat=dsrepeat))
        got, dropped, repeated = sample_balance(longer)
        tips.append(
            f"or lose no rank's data: with --nbatches {hi} --dsrepeat {dsrepeat} every worker reads its shards "
            f"{dsrepeat} times, so the short ranks reach {hi} too (delivers {got} samples per epoch, repeats at "
            f"least {repeated}, {percent(repeated, total)})"
        )
    return tips


def describe_counts(counts: Sequence[int]) -> str:
    lo, hi = min(counts), max(counts)
    if lo == hi:
        return f"{lo} per shard"
    return f"{lo}..{hi} per shard, mean {sum(counts) / len(counts):.1f}"


def parameter_lines(sim: Simulation, real: bool) -> list[str]:
    settings, layout = sim.settings, sim.layout
    nworkers = "0 (loading in the main process: one worker)" if settings.nworkers == 0 else str(settings.nworkers)
    if settings.nbatches == "auto":
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
        f"  shards        {sim.plan.nshards} ({layout.source})",
        f"  samples       {layout.total} ({describe_counts(layout.counts)})",
        f"  size          {settings.size} ranks",
        f"  nworkers      {nworkers} per rank",
        f"  batch-size    {settings.batch_size}",
        f"  partial       {'yes (short batches kept)' if settings.partial else 'no (short batches dropped)'}",
        f"  nbatches      {cut}",
        f"  dsrepeat      {settings.dsrepeat} (passes over the shards inside each worker)",
        f"  repeat        {settings.repeat} (loader passes per epoch)",
        f"  cross-shuffle {settings.cross_shuffle}" + (" (re-batch across workers)" if settings.cross_shuffle else ""),
        f"  split         {settings.split}"
        + (
            " (whole shards per rank and worker)"
            if settings.split == "shards"
            else f" (equal spans of the epoch's sample sequence), remainder {settings.remainder}"
        ),
        f"  nepochs       {settings.nepochs}",
    ] + (
        [f"  shard-order   {settings.shard_order}, {plural(settings.node_ranks, 'rank')} per node"]
        if (settings.shard_order, settings.node_ranks) != ("global", 1)
        else []
    )


def split_lines(sim: Simulation, verbose: bool) -> list[str]:
    """Which shards each rank and each worker got (indices into the expanded shard list)."""

    def listing(indices: Sequence[int]) -> str:
        head = ", ".join(map(str, indices[:8]))
        return f"[{head}{', ...' if len(indices) > 8 else ''}]"

    plan, settings = sim.plan, sim.settings
    if plan.split == "samples":
        return _span_lines(sim, verbose)
    out = ["splits (shard i is the i-th of the shard list; worker samples and batches per loader pass):"]
    if sim.layout.shards:
        out.append(f"  shard 0 = {sim.layout.shards[0].url}, shard {plan.nshards - 1} = {sim.layout.shards[-1].url}")
    shown = shown_ranks(sim.expected, verbose)
    for index in shown:
        rank = plan.ranks[index]
        out.append(
            f"rank {index}: {plural(len(rank.shards), 'shard')} {listing(rank.shards)}, "
            f"{rank.samples // settings.dsrepeat} samples"
        )
        for worker in rank.workers:
            times = f" x {settings.dsrepeat}" if settings.dsrepeat > 1 else ""
            out.append(
                f"  worker {worker.worker}: {plural(len(worker.shards), 'shard')} {listing(worker.shards)}, "
                f"{worker.samples // settings.dsrepeat}{times} samples, {worker.batches} batches"
            )
    if len(shown) < len(plan.ranks):
        out.append(f"  ({len(plan.ranks) - len(shown)} ranks not shown; --verbose shows all)")
    return out


def _span_lines(sim: Simulation, verbose: bool) -> list[str]:
    """split=samples: each rank's and worker's span of the epoch's sample sequence."""
    plan = sim.plan
    out = [
        f"splits (split=samples: spans of the epoch's sequence of {plan.total_samples} samples, shards in an "
        f"order new every epoch; positions from {plan.total_samples} on are the sequence's first samples again):"
    ]
    shown = shown_ranks(sim.expected, verbose)
    for index in shown:
        rank = plan.ranks[index]
        a, b = rank.span or (0, 0)
        out.append(f"rank {index}: positions {a}..{b - 1}, {rank.samples} samples, {rank.available} batches")
        for worker in rank.workers:
            a, b = worker.span or (0, 0)
            out.append(
                f"  worker {worker.worker}: positions {a}..{b - 1}, {worker.samples} samples, {worker.batches} batches"
            )
    if len(shown) < len(plan.ranks):
        out.append(f"  ({len(plan.ranks) - len(shown)} ranks not shown; --verbose shows all)")
    return out


def coverage_line(epoch: int, coverage: Coverage, sim: Simulation) -> str:
    settings, cut, reach = sim.settings, sim.cut, sim.reach
    short_dropped = not settings.partial and any(
        w.samples % settings.batch_size for r in sim.plan.ranks for w in r.workers
    )
    line = (
        f"coverage epoch {epoch}: {coverage.delivered} samples delivered, "
        f"{coverage.unique} distinct of {coverage.total}; "
        f"duplicated {coverage.duplicated} ({percent(coverage.duplicated, coverage.total)}), "
        f"missing {coverage.missing} ({percent(coverage.missing, coverage.total)})"
    )
    why = []
    if sim.plan.split == "samples":
        if coverage.missing and sim.plan.dropped:
            why.append(f"remainder=drop leaves out the epoch's last {sim.plan.dropped}")
        if coverage.missing and cut is not None and cut < max(reach):
            why.append("the cut at --nbatches drops the rest of every rank's span")
        if coverage.duplicated:
            why.append(f"remainder=pad delivers the epoch's first {sim.plan.padded} samples twice")
        return line + (f" [{'; '.join(why)}]" if why else "")
    if coverage.missing:
        if cut is not None and cut < max(reach):
            why.append("the cut at --nbatches drops the rest of longer ranks")
        if short_dropped:
            why.append("short batches are dropped (--no-partial)")
        if settings.dsrepeat > 1 or settings.repeat > 1:
            why.append("repeated samples take the place of others")
    if coverage.duplicated:
        if settings.dsrepeat > 1 or settings.repeat > 1:
            why.append("--dsrepeat/--repeat read data more than once")
        else:
            why.append("UNEXPECTED: no repetition was asked for (are keys unique in the data set?)")
    return line + (f" [{'; '.join(why)}]" if why else "")
