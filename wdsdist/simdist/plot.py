"""simdist's picture: ranks x workers with their shards, the batches per rank, and the cut."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wdsdist.data.plan.splits import Plan, span_pieces
from wdsdist.simdist.simulate import RankEpoch, Simulation
from wdsdist.simdist.text import describe_counts, verdict

PLOT_MAX_WORKERS = 16  # worker rows drawn per rank
PLOT_EDGE_RANKS = 3  # big worlds: the first and last few ranks, plus the shortest and the longest
ROW_INCHES = 0.24


@dataclass(frozen=True)
class _Rows:
    """Which ranks and workers get a row, top to bottom, and where (y grows downwards)."""

    ranks: list[int]  # the ranks drawn
    nworkers: int  # worker rows per rank
    rows: list[tuple[int, int, float]]  # (rank, worker, y)
    centers: dict[int, tuple[float, float]]  # rank -> (y of its middle, its number of rows)
    bottom: float  # y below the last rank


def plot(sim: Simulation, results: Sequence[RankEpoch], path: str) -> str:
    """Draw ranks x workers with their shards, the batches per rank, and the cut line at N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(sim, results)
    height = 2.3 + ROW_INCHES * rows.bottom
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(14, height), sharey=True, gridspec_kw={"width_ratios": [3, 2], "wspace": 0.04}
    )
    _draw_shards(left, sim, rows, plt.get_cmap("tab20"))
    _label_shards(left, sim, rows)
    handles = _draw_batches(right, sim, results, rows)
    _title_and_legend(fig, sim, results, handles, height)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rows(sim: Simulation, results: Sequence[RankEpoch]) -> _Rows:
    """Every rank, or for big worlds the first and last few plus the shortest and the longest."""
    reach = sim.reach
    ranks = list(range(len(results)))
    if len(ranks) > 2 * PLOT_EDGE_RANKS + 2:
        keep = set(ranks[:PLOT_EDGE_RANKS]) | set(ranks[-PLOT_EDGE_RANKS:])
        keep |= {reach.index(min(reach)), reach.index(max(reach))}
        ranks = sorted(keep)
    nworkers = min(sim.plan.nworkers, PLOT_MAX_WORKERS)
    rows: list[tuple[int, int, float]] = []
    centers: dict[int, tuple[float, float]] = {}
    y = 0.0
    for rank in ranks:
        top = y
        for worker in range(nworkers):
            rows.append((rank, worker, y))
            y += 1
        centers[rank] = ((top + y - 1) / 2, y - top)
        y += 0.7
    return _Rows(ranks, nworkers, rows, centers, y)


def _widest_worker(plan: Plan) -> int:
    """Samples of the fullest worker per loader pass: the shard panel's x range."""
    return max((w.samples for rank in plan.ranks for w in rank.workers), default=1) or 1


def worker_boxes(sim: Simulation, rank: int, worker: int, cumulative: Sequence[int]) -> list[tuple[int, int]]:
    """(shard, samples) a worker's row draws: its whole shards, or under split=samples the part
    of each shard slot its span reads (a span past the epoch's end wraps to its first samples,
    the padding). ``cumulative``: the shards' counts cumulated from 0."""
    row = sim.plan.ranks[rank].workers[worker]
    if row.span is None:
        return [(shard, sim.layout.counts[shard]) for shard in row.shards]
    return [(slot, stop - first) for slot, first, stop, _ in span_pieces(cumulative, *row.span)]


def _draw_shards(ax: Any, sim: Simulation, rows: _Rows, cmap: Any) -> None:
    """Each worker's shards as boxes, one pass after another when dsrepeat > 1; under
    split=samples, the part of each shard slot its span reads."""
    plan, dsrepeat = sim.plan, sim.settings.dsrepeat
    xmax = _widest_worker(plan)
    nboxes = sum(len(plan.ranks[rank].workers[worker].shards) * dsrepeat for rank, worker, _ in rows.rows)
    cumulative = list(itertools.accumulate(sim.layout.counts, initial=0))
    for rank, worker_index, y in rows.rows:
        worker = plan.ranks[rank].workers[worker_index]
        if not worker.shards:
            ax.text(0, y, " no shard: the loader refuses this rank", va="center", color="crimson", fontsize=8)
            continue
        pieces = worker_boxes(sim, rank, worker_index, cumulative)
        x = 0
        for repetition in range(dsrepeat):
            spans = []
            for shard, width in pieces:
                spans.append((x, width))
                if nboxes <= 300 and width / xmax > 0.035:
                    ax.text(x + width / 2, y, str(shard), ha="center", va="center", fontsize=8)
                x += width
            ax.broken_barh(
                spans,
                (y - 0.4, 0.8),
                facecolors=[cmap(i % 20) for i, _ in pieces],
                edgecolors="white",
                linewidth=0.6,
                alpha=1.0 if repetition == 0 else 0.45,
                hatch=None if repetition == 0 else "//",
            )


def _label_shards(ax: Any, sim: Simulation, rows: _Rows) -> None:
    """The shard panel's axes: a row per worker, and a note where ranks are left out."""
    from matplotlib.transforms import blended_transform_factory

    nworkers = sim.plan.nworkers
    ax.set_xlim(0, _widest_worker(sim.plan) * 1.02)
    ax.set_ylim(rows.bottom - 0.7 + 0.5, -0.6)  # top to bottom: rank 0 first
    hatched = "; hatched: dsrepeat passes" if sim.settings.dsrepeat > 1 else ""
    more_workers = f"; first {rows.nworkers} of {nworkers} workers" if rows.nworkers < nworkers else ""
    boxes = "the part of each shard slot a span reads" if sim.plan.split == "samples" else "shards by index"
    ax.set_xlabel(f"samples per worker per loader pass (boxes: {boxes}{hatched}{more_workers})")
    labels = [f"rank {rank}  w{worker}" if worker == 0 else f"w{worker}" for rank, worker, _ in rows.rows]
    ax.set_yticks([y for _, _, y in rows.rows], labels, fontsize=8)
    if sim.plan.split == "samples":
        title = "each worker's span of the epoch's samples, contiguous and of whole batches"
    else:
        title = "shards per worker: rank r gets shards r::size, its worker w those w::nworkers"
    ax.set_title(title, fontsize=10)
    trans = blended_transform_factory(ax.transAxes, ax.transData)
    for above, below in zip(rows.ranks, rows.ranks[1:], strict=False):
        if below > above + 1:
            gap = rows.centers[above][0] + rows.centers[above][1] / 2 + 0.1
            ax.text(
                -0.01, gap, f"... {below - above - 1} ranks ...", transform=trans, ha="right", va="center", fontsize=8
            )


def _draw_batches(ax: Any, sim: Simulation, results: Sequence[RankEpoch], rows: _Rows) -> list[Any]:
    """Batches per rank, and the legend's handles for them.

    Up to the target every rank is fine; red beyond it is what only some ranks have (DDP would
    hang there); a red outline short of it is what a rank is missing.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    counts, reach = [r.batches for r in results], sim.reach
    equal = verdict([results])[0]
    target = sim.cut if sim.cut is not None else min(counts)
    colour = "seagreen" if equal else "steelblue"
    for rank in rows.ranks:
        _draw_rank_bar(ax, results[rank], reach[rank], target, rows.centers[rank], colour)
    upto = " (up to the shortest rank)" if sim.cut is None else " (up to the cut)"
    handles = [
        Patch(facecolor="0.9", edgecolor="0.75", label="what the rank can reach"),
        Patch(color=colour, label="delivered" + ("" if equal else upto)),
    ]
    if not equal:
        handles.append(Patch(color="crimson", label="only some ranks: DDP would hang"))
        if sim.cut is not None:
            handles.append(Patch(fill=False, edgecolor="crimson", hatch="xx", label="short of the cut"))
    if sim.cut is not None:
        ax.axvline(sim.cut, color="navy", linestyle="--", linewidth=1.5)
        handles.append(Line2D([], [], color="navy", linestyle="--", label=f"cut: --nbatches {sim.cut}"))
    ax.set_xlim(0, max(max(reach), max(counts), sim.cut or 0, 1) * 1.3)
    ax.set_xlabel("batches per rank per epoch")
    ax.set_title("batches per rank", fontsize=10)
    ax.tick_params(left=False)
    return handles


def _draw_rank_bar(
    ax: Any, result: RankEpoch, reach: int, target: int, center: tuple[float, float], colour: str
) -> None:
    """One rank's bar: what it can reach (grey), delivers (colour), has too many or too few (red)."""
    y, nrows = center
    thickness = nrows * 0.85
    ax.barh(y, reach, height=thickness, color="0.9", edgecolor="0.75")
    ax.barh(y, min(result.batches, target), height=thickness, color=colour)
    if result.batches > target:
        ax.barh(y, result.batches - target, left=target, height=thickness, color="crimson")
    elif result.batches < target:
        ax.barh(
            y,
            target - result.batches,
            left=result.batches,
            height=thickness,
            fill=False,
            edgecolor="crimson",
            hatch="xx",
        )
    text = "refused" if result.refused else f"{result.batches}"
    if not result.refused and reach != result.batches:
        text += f" of {reach}"
    ax.text(max(result.batches, reach, target), y, f"  {text}", va="center", fontsize=9)


def _title_and_legend(
    fig: Any, sim: Simulation, results: Sequence[RankEpoch], handles: list[Any], height: float
) -> None:
    """The verdict as the title (green or red), the legend below, margins fixed in inches."""
    settings, plan = sim.settings, sim.plan
    ok, line = verdict([results])
    cut = "none" if sim.cut is None else str(sim.cut)
    fig.suptitle(
        f"{plan.nshards} shards ({describe_counts(sim.layout.counts)}), {settings.size} ranks x {plan.nworkers} "
        f"workers, batch {settings.batch_size}, nbatches {cut}, dsrepeat {settings.dsrepeat}, "
        f"repeat {settings.repeat}\n{line}",
        color="darkgreen" if ok else "darkred",
        fontsize=11,
        y=1 - 0.1 / height,
        va="top",
    )
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.1 / height), ncol=len(handles), fontsize=8)
    fig.subplots_adjust(left=0.09, right=0.98, top=1 - 0.95 / height, bottom=1.05 / height)
