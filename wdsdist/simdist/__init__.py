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

This package's ``__init__`` is simdist's public face: every name a caller needs, and ``report``,
which prints the whole report. The pieces are its modules, each importing only those before it:
  layouts   the data: per-shard counts, described or from a spec; synthetic shards
  simulate  the job's settings; what each rank delivers, planned or run for real
  text      the report's lines: parameters, splits, ranks, verdict, coverage, advice
  plot      the picture
  resize    --resize-at: a checkpoint and an elastic resume on another layout, planned or run
  egress    --shard-bytes: what the store sends each node per epoch, with and without a cache
  mix       --mix: several data sets, per epoch, source and rank, from the loader's mix plan
Of wdsdist it imports ``wdsdist.data``, ``wdsdist.errors``, and (to write synthetic shards for
real mode) ``wdsdist.tools.shards`` and ``wdsdist.tools.synthetic``; nothing of ``wdsdist.train``.
"""

from __future__ import annotations

import sys
from typing import TextIO

from wdsdist.data.sources.shardspec import Access
from wdsdist.simdist.egress import Egress, egress_lines, node_egress, simulate_egress
from wdsdist.simdist.layouts import (
    DEFAULT_NSHARDS,
    DEFAULT_SAMPLES,
    IMAGE_SIZE,
    REAL_MODE_MAX_SAMPLES,
    Layout,
    described_counts,
    described_layout,
    parse_spread,
    spec_layout,
    synthetic_layout,
    write_synthetic_shards,
)
from wdsdist.simdist.mix import (
    MixArg,
    MixEpochCounts,
    MixRun,
    mix_argument,
    mix_layouts,
    mix_of,
    mix_report,
    parse_mix_source,
    plan_mix_epoch,
    run_mix,
)
from wdsdist.simdist.plot import plot
from wdsdist.simdist.resize import Resize, resize_lines, resize_verdict, simulate_resize, simulate_resize_real
from wdsdist.simdist.simulate import (
    Coverage,
    RankEpoch,
    RealRun,
    Settings,
    Simulation,
    delivered,
    pass_sizes,
    refusal,
    simulate_plan,
    simulate_real,
)
from wdsdist.simdist.text import (
    SHOWN_RANKS,
    advice,
    balance_line,
    coverage_line,
    parameter_lines,
    rank_line,
    rank_lines,
    real_run_lines,
    sample_balance,
    shown_ranks,
    split_lines,
    verdict,
)

__all__ = [
    "DEFAULT_NSHARDS",
    "DEFAULT_SAMPLES",
    "IMAGE_SIZE",
    "REAL_MODE_MAX_SAMPLES",
    "SHOWN_RANKS",
    "Access",
    "Coverage",
    "Egress",
    "Layout",
    "MixArg",
    "MixEpochCounts",
    "MixRun",
    "RankEpoch",
    "RealRun",
    "Resize",
    "Settings",
    "Simulation",
    "advice",
    "balance_line",
    "coverage_line",
    "delivered",
    "described_counts",
    "described_layout",
    "egress_lines",
    "mix_argument",
    "mix_layouts",
    "mix_of",
    "mix_report",
    "node_egress",
    "parameter_lines",
    "parse_mix_source",
    "parse_spread",
    "pass_sizes",
    "plan_mix_epoch",
    "plot",
    "rank_line",
    "rank_lines",
    "real_run_lines",
    "refusal",
    "report",
    "resize_lines",
    "resize_verdict",
    "run_mix",
    "sample_balance",
    "shown_ranks",
    "simulate_egress",
    "simulate_plan",
    "simulate_real",
    "simulate_resize",
    "simulate_resize_real",
    "spec_layout",
    "split_lines",
    "synthetic_layout",
    "verdict",
    "write_synthetic_shards",
]


def report(
    sim: Simulation,
    *,
    real: RealRun | None = None,
    showsplits: bool = False,
    verbose: bool = False,
    plot_to: str | None = None,
    out: TextIO | None = None,
    resize: Resize | None = None,
    egress: Egress | None = None,
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
    for epoch, results in enumerate(epochs):
        if len(epochs) > 1:
            say(f"epoch {epoch}:")
        say(*rank_lines(results, verbose))
    say("", balance_line(sim))
    if real:
        say(*real_run_lines(sim, real))
    ok, line = verdict(epochs)
    if ok and resize is not None:
        say("", *resize_lines(sim, resize, verbose))
        ok, line = resize_verdict(sim, resize)
    if not ok:
        tips = advice(sim)
        if tips:
            say("", "advice:", *(f"  - {tip}" for tip in tips))
    if egress is not None:
        say("", *egress_lines(egress, verbose))
    if plot_to:
        say(f"plot: {plot(sim, epochs[-1], plot_to)}")
    say("", line)
    return 0 if ok else 1
