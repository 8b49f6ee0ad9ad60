"""One rank's predictions filed by part, each part (or this rank's piece of it) written as soon
as every sample of it that this rank reads is accounted for.

A rank's reads are runs per worker, in each worker's order: positions [position, stop) are
samples first.. of unit ``unit`` (``Loader.reads``). A worker delivers its positions in order,
so once it delivers position p, every position of its runs before p is either delivered or was
skipped (a corrupt sample): those runs are settled. A part's piece is written when all of its
runs on this rank are; the rest when the rank's stream ends. A unit whose shard failed to read
is not written (counted, named in the summary): the next run of the job reads it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from wdsdist.predict import parts

log = logging.getLogger(__name__)

Run = tuple[int, int, int, int]  # positions [position, stop), unit, the unit's first sample there


@dataclass(frozen=True)
class Unit:
    """A part of the input: one shard, or a slice of a folder's sorted listing."""

    name: str
    source: str
    count: int


@dataclass
class Pending:
    """This rank's piece of a unit: its span, its runs still open, what came so far."""

    first: int
    stop: int
    open: int = 0
    rows: list[tuple[int, str]] = field(default_factory=list)
    features: list[tuple[int, np.ndarray]] = field(default_factory=list)


class Collector:
    """Files each sample's line (and features) into its unit (``locate``, then ``put``); writes each
    piece once settled, and calls ``on_part(unit)`` when that piece is the whole part.
    ``sample_name(unit, offset)``: how the manifest names a sample that was skipped."""

    def __init__(
        self,
        out_dir: str,
        units: Sequence[Unit],
        reads: Sequence[Sequence[Run]],
        features: bool,
        sample_name: Callable[[int, int], str],
        on_part: Callable[[int], None] = lambda unit: None,
    ):
        self.out_dir, self.units, self.reads, self.with_features = out_dir, units, reads, features
        self.sample_name, self.on_part = sample_name, on_part
        self.at = [0] * len(reads)  # per worker: its first run not yet settled
        self.pending: dict[int, Pending] = {}
        for runs in reads:
            for pos, stop, unit, first in runs:
                p = self.pending.setdefault(unit, Pending(first, first + stop - pos))
                p.first, p.stop = min(p.first, first), max(p.stop, first + stop - pos)
                p.open += 1
        self.failed: set[int] = set()  # units whose shard failed to read: not written
        self.damaged: dict[int, list[str]] = {}  # unit -> the keys of its samples that could not be decoded
        self.scored = self.skipped = self.written = 0

    def locate(self, worker: int, pos: int) -> tuple[int, int]:
        """(unit, sample in it) that ``worker`` read at ``pos``; the worker's runs before it settle."""
        runs, i = self.reads[worker], self.at[worker]
        while runs[i][1] <= pos:
            self._settle(runs[i])
            i += 1
        self.at[worker] = i
        start, _, unit, first = runs[i]
        return unit, first + pos - start

    def put(self, unit: int, offset: int, line: str, feature: np.ndarray | None) -> None:
        p = self.pending[unit]
        p.rows.append((offset, line))
        if feature is not None:
            p.features.append((offset, feature))
        self.scored += 1

    def fail(self, unit: int) -> None:
        self.failed.add(unit)

    def damage(self, unit: int, key: str) -> None:
        """A sample of ``unit`` that could not be decoded: the manifest names it by its key."""
        self.damaged.setdefault(unit, []).append(key)

    def finish(self) -> None:
        """The stream ended: every run still open is settled (its missing samples skipped)."""
        for worker, runs in enumerate(self.reads):
            for run in runs[self.at[worker] :]:
                self._settle(run)
            self.at[worker] = len(runs)

    def _settle(self, run: Run) -> None:
        p = self.pending[run[2]]
        p.open -= 1
        if p.open == 0:
            self._write(run[2], self.pending.pop(run[2]))

    def _write(self, index: int, p: Pending) -> None:
        unit = self.units[index]
        p.rows.sort()
        got = {offset for offset, _ in p.rows}
        missing = [o for o in range(p.first, p.stop) if o not in got]
        keys = self.damaged.pop(index, [])
        if len(keys) == len(missing):  # each one named by its key (a shard cut short names positions)
            skipped = [f"{unit.source}#{key}" for key in keys]
        else:
            skipped = [self.sample_name(index, o) for o in missing]
        self.skipped += len(skipped)
        if index in self.failed:
            log.warning("%s: not read whole; its part is left for the next run", unit.source)
            return
        feats = None
        if self.with_features:
            p.features.sort(key=lambda f: f[0])
            feats = np.stack([f for _, f in p.features]) if p.features else np.zeros((0, 0), np.float16)
        meta = {"source": unit.source, "scored": len(p.rows), "skipped": skipped}
        lines = [line for _, line in p.rows]
        parts.write_piece(self.out_dir, unit.name, (p.first, p.stop), unit.count, lines, feats, meta)
        self.written += 1
        if (p.first, p.stop) == (0, unit.count):  # the whole part: what comes after it (--write-shards)
            self.on_part(index)
