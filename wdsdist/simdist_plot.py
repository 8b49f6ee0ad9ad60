"""simdist's picture: ranks x workers with their shards, the batches per rank, and the cut."""

from __future__ import annotations

import os
from collections.abc import Sequence

from wdsdist.simdist_simulate import RankEpoch, Simulation
from wdsdist.simdist_text import describe_counts, verdict

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
        f"{p.nshards} shards ({describe_counts(sim.layout.counts)}), {s.size} ranks x {p.nworkers} workers, "
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
