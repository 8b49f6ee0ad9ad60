"""An epoch's sample sequence as a layout reads it: the one map from a position of the epoch
(padding included) to the sample it reads, for one data set and several alike.

An epoch is a sequence of N positions (split=samples). A layout reads the positions still to
deliver, as sorted disjoint ranges of [0, N) (the whole epoch; fewer after an elastic resume),
one after another: M of them, "virtual" positions [0, M). Every rank delivers the same number of
batches (``Layout.batches``), so the virtual positions run on past M, up to k x world x B: that
is the padding, and ``EpochSequence.runs`` says which real position each of those reads again:
  - a whole epoch of one data set, or any epoch re-split on resume: the sequence's first
    positions again (virtual v is v mod M);
  - a whole epoch of one data set read node by node (loader.shard_order=node): each node's
    stretch of virtual positions (its ranks' spans) reads its own share of the sequence
    (order.node_parts), then that share's first positions again;
  - a whole epoch of several data sets: ``MixEpoch.padding``'s positions, which keep every
    padded batch's shares of the sources.
A delivered sample carries a tag (``batch["pos"]``): its real position, plus N where it is
padding. A position reads a sample through ``EpochShards.reads`` (one data set: the epoch's order
of parts of shards) or ``MixEpoch.reads`` (several: each source's stream). Everything here is
arithmetic on ranges and runs: nothing is O(samples) but a mix's padding (below world x batch size).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from wdsdist.data.plan.order import GLOBAL, NodeOrder, Part, node_shares
from wdsdist.data.plan.splits import Layout, span_pieces

Ranges = tuple[tuple[int, int], ...]
Run = tuple[int, int, int]  # real positions [start, stop), the tag of the first
Piece = tuple[int, int, int]  # samples [first, stop) of the shard at this index of the loader's list


def whole_epoch(total: int) -> Ranges:
    return ((0, total),) if total > 0 else ()


def ranges_length(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def ranges_cumulative(ranges: Ranges) -> list[int]:
    return list(itertools.accumulate((b - a for a, b in ranges), initial=0))


def virtual_to_real(
    ranges: Ranges, start: int, stop: int, cumulative: Sequence[int] | None = None
) -> Iterator[tuple[int, int, int]]:
    """The real positions of virtual positions [start, stop) of ``ranges`` read in order (from M
    on, wrapping to their start), as (real start, real stop, virtual start) pieces.
    ``cumulative``: the ranges' lengths cumulated (ranges_cumulative), when calling often."""
    if cumulative is None:
        cumulative = ranges_cumulative(ranges)
    for i, first, last, v in span_pieces(cumulative, start, stop):  # a range is a shard of samples
        yield ranges[i][0] + first, ranges[i][0] + last, v


def merge_ranges(pieces: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, disjoint, non-empty ranges covering the union of ``pieces``."""
    out: list[list[int]] = []
    for a, b in sorted(p for p in pieces if p[1] > p[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def subtract_ranges(ranges: Ranges, taken: Ranges) -> Ranges:
    """``ranges`` minus ``taken`` (both sorted and disjoint)."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in ranges:
        while j < len(taken) and taken[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(taken) and taken[k][0] < b:
            if taken[k][0] > cur:
                out.append((cur, taken[k][0]))
            cur = max(cur, taken[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return tuple(out)


def consecutive(values: Iterable[int]) -> list[tuple[int, int]]:
    """Runs [a, b) of consecutive integers, in the order given."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1][1] += 1
        else:
            out.append([v, v + 1])
    return [(a, b) for a, b in out]


@dataclass(frozen=True)
class EpochSequence:
    """An epoch's N positions and the ones a layout reads of it (see the module).

    ``padding``: for a whole epoch of several data sets, the real position each padding slot
    reads (``MixEpoch.padding``: count -> positions); None: the sequence's first positions again.
    ``order``: for a whole epoch read node by node, its nodes and the span of each (order.NodeOrder)."""

    total: int
    ranges: Ranges
    padding: Callable[[int], Sequence[int]] | None = field(default=None, compare=False)
    order: NodeOrder = GLOBAL

    @classmethod
    def of(
        cls,
        total: int,
        resplit: Ranges | None = None,
        padding: Callable[[int], Sequence[int]] | None = None,
        order: NodeOrder = GLOBAL,
    ) -> EpochSequence:
        """A whole epoch of ``total`` positions (read node by node where ``order`` has several),
        or (``resplit``) the ones a resume left of it."""
        if resplit is not None:
            return cls(total, tuple(resplit))
        return cls(total, whole_epoch(total), padding, order)

    @cached_property
    def length(self) -> int:
        """M: the positions to deliver, before the padding."""
        return ranges_length(self.ranges)

    @cached_property
    def _cumulative(self) -> list[int]:
        return ranges_cumulative(self.ranges)

    def batches(self, layout: Layout) -> int:
        return layout.batches(self.length)

    def span(self, layout: Layout, rank: int, worker: int) -> tuple[int, int]:
        """A worker's virtual positions [start, stop) on ``layout``."""
        return layout.span(rank, worker, self.batches(layout))

    def runs(self, start: int, stop: int) -> list[Run]:
        """Virtual positions [start, stop) as runs of real positions, in reading order, each with
        the tag of its first sample (real, or N + real for the padding)."""
        if self.order[0] > 1:
            return self._node_runs(start, stop)
        m, out = self.length, []
        if m <= 0:
            return out
        for a, b, _ in virtual_to_real(self.ranges, start, min(stop, m), self._cumulative):
            out.append((a, b, a))
        lo = max(start, m)
        if stop <= lo:
            return out
        if self.padding is None:
            pad = [(a, b) for a, b, _ in virtual_to_real(self.ranges, lo, stop, self._cumulative)]
        else:
            pad = consecutive(int(p) for p in self.padding(stop - m)[lo - m :])
        return out + [(a, b, a + self.total) for a, b in pad]

    def _node_runs(self, start: int, stop: int) -> list[Run]:
        """``runs`` node by node: node n's virtual positions [n x span, (n + 1) x span) read its
        share of the sequence, then (pad) its share's first positions again; with drop its share's
        last positions are left over."""
        nodes, span = self.order
        out: list[Run] = []
        base = 0
        for node, own in enumerate(node_shares(self.total, nodes)):
            u0, u1 = max(start - node * span, 0), min(stop - node * span, span)
            if u0 < u1 and own <= 0:
                raise ValueError(f"node {node} holds no sample of {self.total} to read ({nodes} nodes)")
            if u0 < min(u1, own):
                out.append((base + u0, base + min(u1, own), base + u0))
            u = max(u0, own)
            while u < u1:  # the padding: the node's own first positions again
                at = (u - own) % own
                take = min(own - at, u1 - u)
                out.append((base + at, base + at + take, self.total + base + at))
                u += take
            base += own
        return out

    def real(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The real positions virtual positions [start, stop) read, as (start, stop) runs."""
        return [(a, b) for a, b, _ in self.runs(start, stop)]

    def without(self, taken: Iterable[tuple[int, int]]) -> EpochSequence:
        """What remains of this sequence once the real positions ``taken`` were delivered: a
        re-split's sequence (its padding is its first positions again)."""
        return EpochSequence(self.total, subtract_ranges(self.ranges, merge_ranges(taken)))


class EpochShards:
    """One data set's epoch: its parts of shards (order.Part; a shard index: the whole shard) in
    the epoch's order (order.epoch_order), read as one sequence; position p is sample
    p - cumulative[slot] of the part at that slot, counted from the part's first sample."""

    def __init__(self, counts: Sequence[int], order: Sequence[int | Part]):
        self.order: list[Part] = [(i, 0, counts[i]) if isinstance(i, int) else tuple(i) for i in order]  # type: ignore[misc]
        self.cumulative = list(itertools.accumulate((b - a for _, a, b in self.order), initial=0))
        self.total = self.cumulative[-1]
        # shard -> the parts of it that are not the whole shard (a node's share, cut at its edge)
        self.partial: dict[int, list[tuple[int, int]]] = {}
        for i, a, b in self.order:
            if (a, b) != (0, counts[i]):
                self.partial.setdefault(i, []).append((a, b))

    def reads(self, runs: Sequence[Run]) -> tuple[None, list[list[Piece]]]:
        """What reading these runs takes: one source (None: no per-position sources), its shard
        pieces in the runs' order (a piece never crosses from one part into another)."""
        pieces = [
            (self.order[slot][0], self.order[slot][1] + first, self.order[slot][1] + last)
            for a, b, _ in runs
            for slot, first, last, _ in span_pieces(self.cumulative, a, b)
        ]
        return None, [pieces]

    def part_of(self, piece: Piece) -> tuple[int, int] | None:
        """The part of its shard a piece reads in, where that is not the whole shard (None)."""
        index, first, _ = piece
        return next(((a, b) for a, b in self.partial.get(index, ()) if a <= first < b), None)


def tags(runs: Iterable[Run]) -> Iterator[int]:
    """Each sample's tag, in reading order."""
    for a, b, tag in runs:
        yield from range(tag, tag + b - a)
