"""Stand-ins: a row for each sample a worker cannot deliver, so its batches stay whole.

A sample that cannot be decoded, or a position whose shard cannot be read at all, still gets its
row: a good sample of the same epoch stands in for it, prepared with the draws of its own tag,
and the row counts the lost sample in ``bad``. So a worker makes as many rows as its span holds
whatever is damaged, every rank delivers the plan's batches, and no good sample is lost with a
short last batch (docs/reliability.md).

Which sample stands in is a pure function of where the loss is, never of the worker's history:
  - split=samples: the loss at position p of an epoch of N positions reads position
    q = sample_fill(seed, epoch, p) mod N, or the next ones after it (past a shard that failed
    in this worker), and the row's tag is N + q: padding, as ``batch["pos"]`` marks it. The same
    on any layout, so a resumed run (also on another world size) makes the same row.
  - split=shards (no positions): the worker's last good sample again, or, before its first, the
    first one that comes (its stand-ins follow it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from wdsdist.data.delivery.steps import POSITION
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan import seeds
from wdsdist.data.sources.shardspec import Shard
from wdsdist.data.sources.spanread import read_span
from wdsdist.data.tar.lateread import read_late
from wdsdist.errors import DataError

log = logging.getLogger(__name__)

TRIES = 64  # stand-ins tried for one loss before the worker gives up: the data is mostly gone then


def made(prepared: Any) -> Any:
    """The image and label of what prepare_sample returned: made now where it is a job."""
    return prepared() if callable(prepared) else prepared


def lost_name(sample: dict) -> str:
    """A lost sample as lines name it: its shard and key."""
    return f"{sample.get('__url__')} {sample.get('__key__')}"


class PositionStand:
    """split=samples: the stand-in for a loss at a position of one epoch (see the module).

    ``where``: the epoch's map from positions to shard pieces (sequence.EpochShards or
    mix.MixEpoch); ``prepare(sample, seq, pos)``: the worker's SamplePrep for this epoch."""

    def __init__(self, shards: Sequence[Shard], cfg: LoaderConfig, epoch: int, where: Any, prepare: Callable):
        self.shards, self.cfg, self.epoch, self.where, self.prepare = shards, cfg, epoch, where, prepare
        self.total = int(where.total)

    def shard_at(self, position: int) -> tuple[int, int]:
        """(shard index, sample number in it) of a real position."""
        _, pieces = self.where.reads([(position, position + 1, position)])
        return next((shard, first) for source in pieces for shard, first, _ in source)

    def __call__(self, seq: int, position: int, failed: set[str]) -> tuple[Any, dict]:
        """(what prepare returned, the sample) for the loss at ``position`` (its tag mod N)."""
        cfg, total = self.cfg, self.total
        q = seeds.sample_fill(cfg.seed, self.epoch, position) % total
        for _ in range(TRIES):
            index, first = self.shard_at(q)
            shard = self.shards[index]
            if shard.url in failed:  # the rest of that shard fails alike: past it
                q = (q + (shard.nsamples or first + 1) - first) % total
                continue
            try:
                sample = read_late(next(read_span(shard, first, first + 1, cfg.access, cfg.wanted_suffixes,
                                                  cfg.max_member_bytes)))  # fmt: skip
                sample[POSITION] = total + q
                return made(self.prepare(sample, seq=seq, pos=total + q)), sample
            except (DataError, StopIteration):
                q = (q + 1) % total
            except Exception as exc:  # noqa: BLE001 (a shard that cannot be read is passed, as the stream does)
                log.debug("stand-in: %s: %s", shard.url, exc)
                failed.add(shard.url)
        raise DataError(
            f"epoch {self.epoch}: no good sample found in {TRIES} tries to stand in for position {position}: "
            f"the data set is mostly damaged or unreadable"
        )


class LastGood:
    """split=shards: the worker's last good sample stands in (see the module); losses before the
    first wait for it."""

    def __init__(self, prepare: Callable):
        self.prepare = prepare
        self.last: dict | None = None
        self.waiting: list[int] = []  # seqs lost before any good sample came

    def good(self, sample: dict, seq: int) -> Iterator[tuple[Any, dict, int]]:
        """A good sample came: the stand-ins that waited for one."""
        self.last = sample
        waiting, self.waiting = self.waiting, []
        for lost in waiting:
            yield made(self.prepare(sample, seq=lost, pos=-1)), sample, lost

    def __call__(self, seq: int) -> Iterator[tuple[Any, dict, int]]:
        if self.last is None:
            self.waiting.append(seq)
            return
        yield made(self.prepare(self.last, seq=seq, pos=-1)), self.last, seq


class LossLimit:
    """A rank's losses per epoch against ``max_bad`` (none with ``strict``): ``add(batch)`` says,
    in one line naming the shards and samples, when an epoch's losses pass it; None until then.

    ``per_epoch``: the rank's samples in an epoch (None where the counts are unknown: then only
    ``strict`` is held). In repeat mode a rank's workers may stand in different epochs: each
    epoch is counted on its own."""

    SHOWN = 5  # names in the line

    def __init__(self, cfg: LoaderConfig, per_epoch: int | None):
        self.allowed = 0 if cfg.strict else None if per_epoch is None else int(cfg.max_bad * per_epoch)
        self.what = "data.strict" if cfg.strict else f"max_bad={cfg.max_bad:g} of its {per_epoch} samples"
        self.epochs: dict[int, tuple[int, list[str]]] = {}  # epoch -> (losses, names)

    def add(self, batch: dict) -> str | None:
        bad = batch.get("bad")
        if bad is None or not len(bad) or not int(bad[:, 0].sum()) and not batch.get("bad_shards"):
            return None
        epoch = int(batch["id"][0, 0])
        lost, names = self.epochs.get(epoch, (0, []))
        lost += int(bad[:, 0].sum())
        names += [f"shard {u} unreadable" for u in batch.get("bad_shards", ()) if f"shard {u} unreadable" not in names]
        names += batch.get("bad_errors", [])
        self.epochs = {e: v for e, v in self.epochs.items() if e >= epoch - 2} | {epoch: (lost, names)}
        if self.allowed is None or lost <= self.allowed:
            return None
        more = f" and {len(names) - self.SHOWN} more" if len(names) > self.SHOWN else ""
        return f"epoch {epoch}: {lost} samples lost, past {self.what}: {'; '.join(names[: self.SHOWN])}{more}"
