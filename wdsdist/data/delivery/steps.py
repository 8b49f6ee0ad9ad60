"""A worker stream's small steps, in the order a sample meets them (stream.py): its first row
made while the DataLoader waits (``primed``), its shard opened (``opening``), passed over where a
resumed worker had delivered it (``wanted``), checked and drawn (``prepared``), and a skipped one
kept as a run for the tracker (``skip``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from wdsdist.data.tar.lateread import read_late
from wdsdist.errors import DataError

T = TypeVar("T")
POSITION = "__pos__"  # a raw sample's position in the epoch's sample sequence (split=samples)
# split=samples: a position of the span that no sample came for (its shard failed or came short).
# It keeps its place in the worker's stream, so the stream's length and its shuffle stay the ones a
# resume replays (order.shuffled_offsets); it is never decoded, and counts as skipped.
FAILED = "__failed__"


def primed(rows: Iterator[T]) -> Iterator[T]:
    """``rows`` with its first row made now. A DataLoader worker calls ``iter()`` as soon as it
    starts, then waits until every other worker has started and it is asked for a batch: the
    first row (its shard opened, the shuffle buffer's first fill read, one sample decoded) is
    made in that wait instead of after it. An error it meets is raised when the first batch is
    asked for, as before: the DataLoader catches one raised by ``iter()`` only when a worker
    starts, not when a persistent worker begins its next epoch."""
    try:
        first = next(rows)
    except StopIteration:
        return iter(())
    except Exception as exc:  # noqa: BLE001 (raised again, unchanged, at the first batch)
        return raise_later(exc)
    return itertools.chain((first,), rows)


def opening(samples: Iterator[T], opened: Callable[[], None]) -> Iterator[T]:
    """``samples``, calling ``opened()`` once the first has come, or the read has ended or failed."""
    try:
        first = next(samples)
    except StopIteration:
        return
    finally:
        opened()
    yield first
    yield from samples


def raise_later(exc: Exception) -> Iterator:
    raise exc
    yield  # a generator: the raise waits for the first next()


def wanted(samples: Iterable[dict], start: int, skip: frozenset, passed: list) -> Iterator[tuple[int, dict]]:
    """(seq, sample) of an epoch's stream, less those a resumed worker had delivered: seqs below
    ``start``, in ``skip``, or in a run of ``passed`` (consumed runs still ahead, the next one last)."""
    for seq, sample in enumerate(samples):
        while passed and passed[-1][1] <= seq:
            passed.pop()
        if seq < start or seq in skip or passed and passed[-1][0] <= seq:
            continue
        yield seq, sample


def prepared(wanted: Iterable[tuple[int, dict]], prepare: Callable) -> Iterator[tuple]:
    """(seq, sample, prepared): what prepare_sample returned or the DataError it raised, in the
    stream's order (it makes the random draws: prep.SamplePrep); FAILED for a placeholder. The
    sample comes with its late members read (a stand-in may be made of it: fill.LastGood)."""
    for seq, sample in wanted:
        if FAILED in sample:
            yield seq, sample, FAILED
            continue
        try:
            yield seq, sample, prepare(read_late(sample), seq=seq, pos=sample.get(POSITION, -1))
        except DataError as error:
            yield seq, sample, error


def skip(skipped: list[list[int]], epoch: int, seq: int) -> None:
    """Add a skipped seq to the [epoch, first, stop] runs skipped since the last row: every seq
    between it and the last run's end of the same epoch was passed over (consumed already)."""
    if skipped and skipped[-1][0] == epoch:
        skipped[-1][2] = seq + 1
    else:
        skipped.append([epoch, seq, seq + 1])
