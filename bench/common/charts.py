#!/usr/bin/env python3
"""Charts of the dated reports, drawn from the reports' own tables, kept beside them.

    ./run charts.py            # every chart: bench/results/NAME.png beside bench/results/NAME.md
    ./run charts.py --check    # exit 1 naming each report whose chart is missing or older

Three kinds of report have a chart, told by the file name: the peers benchmark (``*-peers.md``:
samples/s, first batch and memory (PSS, else peak RSS) of each loader, per data set), the mixing reports
(``*-mixing*.md``: samples/s and CPU per sample of each contender) and the remote reports
(``*-remote*.md``: samples/s, first batch and bytes from the store per contender and epoch). A
report added of one of these kinds gets its chart when this runs again; tests/repo/test_docs.py holds
that every such report has one, no older than the report, naming it (in its title, and in the
PNG's ``Source`` text chunk).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of a report: (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def number(cell: str) -> float | None:
    """The first number of a cell (``1021 (948-1095)`` is 1021, ``4.34 s`` 4.34); None for ``-``."""
    found = NUMBER.search(cell.replace(",", ""))
    return float(found.group()) if found else None


def column(header: list[str], *names: str) -> int | None:
    """The first column whose heading starts with one of ``names``."""
    return next((i for i, h in enumerate(header) if any(h.lower().startswith(n) for n in names)), None)


def bars(ax, labels: list[str], values: list[float | None], title: str, unit: str, ours: Callable[[str], bool]):  # noqa: ANN001, ANN201
    shown = [(label, v) for label, v in zip(labels, values, strict=True) if v is not None]
    colours = ["#1f6fb4" if ours(label) else "#9aa5b1" for label, _ in shown]
    ax.barh([label for label, _ in shown], [v for _, v in shown], color=colours)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(unit, fontsize=9)
    ax.tick_params(labelsize=8)
    for y, (_, v) in enumerate(shown):
        ax.text(v, y, f" {v:g}", va="center", fontsize=7)


def peers(report: Path, plt) -> object:  # noqa: ANN001
    """Per data set: samples/s, first batch and memory of each loader (ours in blue): PSS, which
    counts the pages a loader's processes share once, where the table has it, else peak RSS."""
    sets = [(h, rows) for h, rows in tables(report.read_text()) if column(h, "samples/s") is not None]
    fig, axes = plt.subplots(len(sets), 3, figsize=(13, 2.2 + 1.9 * len(sets)), squeeze=False)
    for (header, rows), row in zip(sets, axes, strict=True):
        keep = [r for r in rows if number(r[column(header, "first batch")] or "-") is not None]
        labels = [re.sub(r"^\(\w+'?\) ", "", r[0]) for r in keep]
        name = header[0]
        for ax, (col, title, unit) in zip(
            row,
            [("samples/s", f"{name}: samples/s", "samples/s (more is better)"),
             ("first batch", "first batch", "seconds (less is better)"),
             ("pss", "memory (PSS)", "MB (less is better)") if column(header, "pss") is not None
             else ("peak rss", "peak memory (RSS)", "MB (less is better)")],
            strict=True,
        ):  # fmt: skip
            i = column(header, col)
            bars(ax, labels, [number(r[i]) if i is not None else None for r in keep], title, unit, _ours)
    return fig


def mixing(report: Path, plt) -> object:  # noqa: ANN001
    """The first table: samples/s and CPU per sample of each contender."""
    header, rows = tables(report.read_text())[0]
    labels = [r[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.45 * len(rows)))
    bars(axes[0], labels, [number(r[column(header, "samples/s")]) for r in rows], "samples/s", "samples/s", _ours)
    cpu = column(header, "cpu ms/sample")
    if cpu is not None:
        bars(axes[1], labels, [number(r[cpu]) for r in rows], "CPU per sample", "ms (less is better)", _ours)
    else:
        first = column(header, "first batch")
        bars(axes[1], labels, [number(r[first]) for r in rows], "first batch", "seconds (less is better)", _ours)
    return fig


def remote(report: Path, plt) -> object:  # noqa: ANN001
    """Per contender and epoch: samples/s, first batch, MB from the store."""
    header, rows = next((h, r) for h, r in tables(report.read_text()) if column(h, "epoch") is not None)
    labels = [f"{r[0]}, epoch {r[column(header, 'epoch')]}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 1.2 + 0.35 * len(rows)), sharey=True)
    for ax, (col, title, unit) in zip(
        axes,
        [("samples/s", "samples/s", "samples/s (more is better)"),
         ("first batch", "first batch", "seconds (less is better)"),
         ("from the store", "from the store", "MB (less is better)")],
        strict=True,
    ):  # fmt: skip
        bars(ax, labels, [number(r[column(header, col)]) for r in rows], title, unit, _ours)
    return fig


def _ours(label: str) -> bool:
    return label.lower().startswith("ours")


KINDS: dict[str, Callable] = {"-remote": remote, "-mixing": mixing, "-peers.md": peers}  # the first that fits


def charted(report: Path) -> Callable | None:
    """The chart a report gets, by its name (None: none)."""
    return next((draw for key, draw in KINDS.items() if key in report.name), None)


def chart_of(report: Path) -> Path:
    return report.with_suffix(".png")


def draw(report: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = charted(report)(report, plt)  # type: ignore[misc]
    fig.suptitle(f"drawn from bench/results/{report.name}", fontsize=9, color="#555555", x=0.01, ha="left")
    fig.tight_layout()
    out = chart_of(report)
    fig.savefig(out, dpi=80, metadata={"Title": report.stem, "Source": report.name})
    plt.close(fig)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say which charts are missing or older than their report")
    args = p.parse_args()
    reports = [r for r in sorted(RESULTS.glob("*.md")) if charted(r)]
    if args.check:
        stale = [r.name for r in reports if not chart_of(r).exists() or chart_of(r).stat().st_mtime < r.stat().st_mtime]
        for name in stale:
            print(f"charts: {name} has no chart, or an older one: ./run charts.py", file=sys.stderr)
        return 1 if stale else 0
    for report in reports:
        print(f"{draw(report).relative_to(RESULTS.parent.parent)}  <- {report.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
