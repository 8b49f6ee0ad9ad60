"""This rank's batches, and what the ranks agree on before each step."""

from __future__ import annotations

import time
from typing import Any, NoReturn

from omegaconf import DictConfig

from wdsdist.cluster import distributed, faults
from wdsdist.cluster.distributed import Dist
from wdsdist.data import Loader
from wdsdist.errors import DataError
from wdsdist.train.config import LoaderMode
from wdsdist.train.report import Reporter


class Feed:
    """This rank's batches, and what every rank must agree on before each step: whether any rank
    was asked to stop, and (epoch mode) whether any rank ran out of this epoch's batches."""

    def __init__(self, cfg: DictConfig, dist: Dist, loader: Loader, stop: faults.StopRequest, report: Reporter):
        self.dist, self.loader, self.stop, self.report = dist, loader, stop, report
        self.mode, self.batch_size = cfg.loader.mode, cfg.trainer.batch_size
        self.batches: Any = None  # the loader's iterator, started at the first batch
        self.pending: distributed.Agreement | None = None  # repeat and resampled modes: the stop flags in flight
        self.some_have = False  # epoch mode, as of the last agreement: some rank has a batch
        self.ended_without_step = False  # the last epoch ended before this rank trained a step of it
        self.past_limit: str | None = None  # this rank's loader lost more than loader.max_bad (its line)

    def next(self) -> tuple[dict | None, float]:
        """The next batch (None: this rank's epoch is over, in epoch mode) and the seconds waited for it."""
        if self.batches is None:
            self.batches = iter(self.loader)
        t0 = time.perf_counter()
        batch = next(self.batches, None)
        if batch is None and self.mode != LoaderMode.epoch:  # a pass that gave not one batch: this rank alone restarts
            self.batches = iter(self.loader)
            batch = next(self.batches, None)
            if batch is None:
                raise DataError(
                    f"rank {self.dist.rank} delivers not one batch of {self.batch_size} "
                    f"(loader.mode={self.mode.value}): its shards lost too many samples; see the warnings"
                )
        return batch, time.perf_counter() - t0

    def agree(self, batch: dict | None, step: int) -> tuple[bool, bool]:
        """(stop, ran out), the same on every rank. Where some rank's loader lost more than
        loader.max_bad, every rank stops here, at one step (``past_limit``)."""
        if batch is not None and "past_limit" in batch:
            self.past_limit = self.past_limit or batch["past_limit"]
        past = self.past_limit is not None
        if self.mode == LoaderMode.epoch:
            # One small all-reduce: every rank delivers the plan's batches (losses are filled),
            # and one that still runs out ends the epoch for all instead of leaving them waiting.
            flags = [self.stop.requested, batch is None, batch is not None, past]
            stop_all, out_any, have_any, past_any = distributed.agree_max(flags)
            if past_any:
                self.stop_past_limit(step)
            self.some_have = bool(have_any)
            if not out_any:
                self.ended_without_step = False
            return bool(stop_all), bool(out_any)
        # No rank runs out here, so only the stop flags are agreed on, and that all-reduce runs
        # while the step trains: every rank reads the one started a step ago, the same value
        # everywhere, so all still stop at one step (one step after the signal).
        stop_all, past_any = self.pending.result() if self.pending is not None else (0, 0)
        if past_any:
            self.stop_past_limit(step)
        self.pending = distributed.Agreement([int(self.stop.requested), int(past)])
        return bool(stop_all), False

    def stop_past_limit(self, step: int) -> NoReturn:
        """Collective: some rank lost more than loader.max_bad; every rank stops at this step, and
        rank 0 says so in one line naming what each such rank lost."""
        lines = [line for line in distributed.all_gather_object(self.past_limit) if line]
        if not self.dist.is_main:
            raise SystemExit(2)
        raise DataError(f"{' | '.join(lines)}; every rank stops at step {step} (data.max_bad, data.strict)")

    def end_epoch_together(self, step: int, batch: dict | None) -> None:
        """Some rank ran out: every rank ends this epoch at this step. An epoch in which no rank
        trained a step is an error: its shards lost too many samples."""
        if self.ended_without_step:
            # Every rank agreed on this: rank 0 says it once, the others leave quietly.
            if not self.dist.is_main:
                raise SystemExit(2)
            raise DataError(
                f"epoch {self.loader.epoch}: a rank delivers not one batch of {self.batch_size} "
                f"(its shards lost too many samples; see the warnings)"
            )
        if self.some_have:
            out = [r for r, none in enumerate(distributed.all_gather_object(batch is None)) if none]
            self.report.line(
                f"epoch {self.loader.epoch} ends early at step {step} on every rank: "
                f"rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} ran out of data before the plan's "
                f"{len(self.loader)} batches (bad samples or shards skipped; see the warnings)"
            )
        self.loader.end_epoch()
        self.batches = iter(self.loader)
        self.ended_without_step = True

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()  # the last flags in flight: read, so nothing is left on the control group
