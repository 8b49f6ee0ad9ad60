"""What a training run delivered, from its ranks' traces (faults.trace_for_test: per step, the
epoch and the sample positions of the batch, in DIR/start-G/rank-R.txt)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path


def traced(where: Path, before: int | None = None) -> dict[int, list[tuple[int, list[int]]]]:
    """rank -> [(epoch, positions)] per step it trained (those before step ``before``), in order,
    from one start's folder."""
    out = {}
    for path in sorted(where.glob("rank-*.txt")):
        rows = [line.split() for line in path.read_text().splitlines()]
        out[int(path.stem[5:])] = [
            (int(e), [int(p) for p in pos.split(",")]) for step, e, pos in rows if before is None or int(step) < before
        ]
    return out


def kept(root: Path) -> dict[int, list[int]]:
    """epoch -> every position the run's final trajectory trained, over all its starts: of each
    start, the steps the next start resumed from (its first traced step - 1) kept."""
    starts = sorted((int(p.name.split("-")[1]), p) for p in root.glob("start-*"))
    rows_of = []
    for _, folder in starts:
        rows = [
            (int(step), int(e), [int(p) for p in pos.split(",")])
            for path in folder.glob("rank-*.txt")
            for step, e, pos in (line.split() for line in path.read_text().splitlines())
        ]
        rows_of.append(rows)
    epochs: dict[int, list[int]] = {}
    for i, rows in enumerate(rows_of):
        later = [min(step for step, _, _ in r) - 1 for r in rows_of[i + 1 :] if r]
        upto = min(later) if later else None  # a later start resumed after this step
        for step, epoch, positions in rows:
            if upto is None or step <= upto:
                epochs.setdefault(epoch, []).extend(positions)
    return epochs


@dataclass(frozen=True)
class Delivery:
    """One epoch of ``n`` samples as delivered: positions >= n are padding copies."""

    missing: int  # samples never delivered
    duplicated: int  # deliveries beyond one per sample
    padding: int  # padding positions delivered (copies, as stated in the plan)

    @property
    def exact(self) -> bool:
        """Every sample once, and nothing twice but the padding."""
        return self.missing == 0 and self.duplicated == self.padding


def delivery(positions: list[int], n: int) -> Delivery:
    real = Counter(p % n for p in positions)
    padding = sum(p >= n for p in positions)
    assert all(p < 2 * n for p in positions), "a padding position copies a sample of the epoch"
    return Delivery(n - len(real), len(positions) - len(real), padding)
