"""simdist --resize-at K --to-size S2 --to-nworkers W2: a checkpoint after K batches of an epoch
and an elastic resume on another layout (split=samples), planned or run for real.

The old layout's ranks each consumed K batches, their workers in the DataLoader's turns
(resume.round_robin_progress); the epoch's remaining positions (resume.remaining_after) are
re-split over the new layout by the loader's own rule (resume.virtual_to_real over
splits.sample_span), and the coverage over the whole epoch is counted on ranges of positions,
so 100,000 shards x 1,024 ranks stay arithmetic.

Real mode runs the training loader itself: every old rank's loader for K batches, its
``state_dict`` as a checkpoint holds it, then every new rank's loader resumed from all of them
(restore.restore, what the trainer does), and counts the keys delivered across the resize.
"""

from __future__ import annotations

import gc
import itertools
import re
import warnings
from collections import Counter
from dataclasses import dataclass, replace

from wdsdist.data.plan.resume import remaining_after, round_robin_progress
from wdsdist.data.plan.sequence import EpochSequence, merge_ranges, ranges_length
from wdsdist.data.plan.splits import Layout
from wdsdist.data.sources.shardspec import Access
from wdsdist.errors import UserError
from wdsdist.simdist.layouts import IMAGE_SIZE
from wdsdist.simdist.simulate import RankEpoch, Simulation, counted_shards, real_config
from wdsdist.simdist.text import percent, rank_lines


@dataclass(frozen=True)
class Resize:
    at: int  # batches every old rank consumed before the checkpoint
    size: int  # the new layout: ranks
    nworkers: int  # and workers per rank
    consumed: int  # samples the old layout delivered before the checkpoint
    remaining: int  # positions of the epoch left for the new layout
    ranges: int  # ranges the remaining positions make (the checkpoint's state is this small)
    after: list[RankEpoch]  # per new rank: the rest of the epoch
    total: int  # samples in the epoch
    delivered: int  # across the resize: old consumed + new delivered
    unique: int  # distinct positions of the epoch delivered

    @property
    def missing(self) -> int:
        return self.total - self.unique

    @property
    def duplicated(self) -> int:
        return self.delivered - self.unique


def _check(sim: Simulation, at: int) -> None:
    p = sim.plan
    if p.split != "samples":
        raise UserError("--resize-at re-splits an epoch's remaining samples: use it with --split samples")
    if sim.cut is not None:
        raise UserError("--resize-at with --nbatches: give one (a cut epoch has no remaining samples to re-split)")
    batches = p.ranks[0].batches
    if not 0 <= at <= batches:
        raise UserError(f"--resize-at {at}: every rank delivers {batches} batches per epoch; use 0..{batches}")


def simulate_resize(sim: Simulation, at: int, size: int, nworkers: int) -> Resize:
    _check(sim, at)
    settings, p = sim.settings, sim.plan
    bs, remainder, old_workers = settings.batch_size, settings.remainder, max(settings.nworkers, 1)
    workers = max(nworkers, 1)
    epoch = EpochSequence.of(p.total_samples)
    old = Layout(p.world, old_workers, bs, remainder)
    progress = [w for r in range(p.world) for w in round_robin_progress(epoch, old, r, at)]
    left = remaining_after(epoch, progress)
    m = left.length
    new = Layout(size, workers, bs, remainder)
    per_rank = left.batches(new)
    old_real = [run for w in progress for lo, hi in w.consumed() for run in epoch.real(lo, hi)]
    spans = [left.span(new, rank, worker) for rank in range(size) for worker in range(workers)]
    new_real = [run for lo, hi in spans for run in left.real(lo, hi)]
    unique = ranges_length(merge_ranges(old_real + new_real))
    consumed = sum(w.done - w.start for w in progress)
    return Resize(
        at=at,
        size=size,
        nworkers=workers,
        consumed=consumed,
        remaining=m,
        ranges=len(left.ranges),
        after=[RankEpoch({bs: per_rank} if per_rank else {}) for _ in range(size)],
        total=p.total_samples,
        delivered=consumed + size * per_rank * bs,
        unique=unique,
    )


def simulate_resize_real(
    sim: Simulation, at: int, size: int, nworkers: int, *, access: Access | None = None, image_size: int = IMAGE_SIZE
) -> Resize:
    """The resize with the training loader: old ranks' loaders for ``at`` batches, then the new
    layout's loaders resumed from their states, one rank after another; coverage by keys."""
    from wdsdist.data.delivery.pipeline import RankLoader, check_layout, resumed
    from wdsdist.data.plan.state import LoaderState
    from wdsdist.errors import DataError

    _check(sim, at)
    counted = counted_shards(sim)
    config = real_config(sim, image_size=image_size, access=access)
    keys: Counter[str] = Counter()
    states = []
    new_config = replace(config, workers=nworkers)
    new_plan = check_layout(counted, size, new_config)  # a new layout too small for its workers is refused
    after, ranges, remaining = [], 0, 0
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            for rank in range(sim.settings.size):
                loader = RankLoader(counted, rank, sim.settings.size, config, None, sim.plan)
                keys.update(k for batch in itertools.islice(iter(loader), at) for k in batch["key"])
                states.append(loader.state())
                del loader
                gc.collect()  # this rank's workers end before the next rank's start
            consumed = sum(keys.values())
            saved = LoaderState(tuple(states))
            for rank in range(size):
                restored = resumed(saved, counted, rank, size, new_config)
                loader = RankLoader(counted, rank, size, new_config, restored, new_plan)
                resize = loader.resize
                if resize is None or resize.start != 0:  # the epoch's end: nothing of it remains
                    after.append(RankEpoch({}))
                    continue
                ranges = len(loader.elastic.get(0, ((0, sim.layout.total),)))
                remaining = resize.remaining if resize.epochs else sim.layout.total
                sizes: Counter[int] = Counter()
                for batch in loader:
                    keys.update(batch["key"])
                    sizes[len(batch["key"])] += 1
                after.append(RankEpoch(dict(sizes)))
                del loader
                gc.collect()
    except DataError as exc:
        raise UserError(re.sub(r"^[\w.]*DataError: ", "", str(exc).strip().splitlines()[-1])) from None
    return Resize(
        at=at,
        size=size,
        nworkers=max(nworkers, 1),
        consumed=consumed,
        remaining=remaining,
        ranges=ranges,
        after=after,
        total=sim.layout.total,
        delivered=sum(keys.values()),
        unique=len(keys),
    )


def resize_lines(sim: Simulation, r: Resize, verbose: bool = False) -> list[str]:
    s = sim.settings
    bs = s.batch_size
    head = (
        f"resize after {r.at} batches per rank: {s.size} ranks x {max(s.nworkers, 1)} workers delivered {r.consumed} "
        f"samples; the epoch's other {r.remaining} positions ({r.ranges} ranges in the checkpoint) re-split over "
        f"{r.size} ranks x {r.nworkers} workers:"
    )
    out = [head]
    if r.remaining == 0:
        out.append("  nothing remains of the epoch: the new layout starts with the next one")
    else:
        out += ["  " + line for line in rank_lines(r.after, verbose)]
        per_rank = r.after[0].batches
        extra = r.size * per_rank * bs - r.remaining
        if extra > 0:
            out.append(f"  pads {extra} (the remaining positions' first ones again; below {r.size} x {bs})")
        elif extra < 0:
            out.append(f"  drops {-extra} (the remaining positions' last ones; below {r.size} x {bs})")
        if per_rank < r.nworkers:
            out.append(f"  {r.nworkers - per_rank} of each rank's {r.nworkers} workers have no batch left and end")
    before = r.consumed - (r.total - r.remaining)  # padding positions the old layout had delivered
    why = []
    if before:
        why.append(f"the old layout's padding delivered before the checkpoint: {before}")
    if r.duplicated - before:
        why.append(f"the new layout's padding: {r.duplicated - before}")
    if r.missing:
        why.append(f"remainder=drop leaves out {r.missing}")
    out.append(
        f"coverage epoch 0 across the resize: {r.delivered} samples delivered, {r.unique} distinct of {r.total}; "
        f"duplicated {r.duplicated} ({percent(r.duplicated, r.total)}), missing {r.missing} "
        f"({percent(r.missing, r.total)})" + (f" [{'; '.join(why)}]" if why else "")
    )
    return out


def resize_verdict(sim: Simulation, r: Resize) -> tuple[bool, str]:
    """SUCCESS when the new ranks deliver equal batches and the epoch's coverage keeps the rule:
    pad misses nothing and repeats less than the two layouts' padding; drop repeats nothing and
    misses less than the new layout's world x batch size."""
    bs = sim.settings.batch_size
    if len({e.batches for e in r.after}) > 1:
        return False, "FAILED: after the resize, ranks deliver different numbers of batches"
    if sim.settings.remainder == "pad":
        ok = r.missing == 0 and r.duplicated < (sim.settings.size + r.size) * bs
    else:
        ok = r.duplicated == 0 and r.missing < r.size * bs
    if not ok:
        return False, f"FAILED: across the resize {r.missing} missing and {r.duplicated} duplicated"
    per_rank = r.after[0].batches
    if r.remaining == 0:
        return True, (
            f"SUCCESS: same batches in all ranks ({sim.plan.ranks[0].batches} per rank per epoch); the resize "
            f"falls at the epoch's end"
        )
    return True, (
        f"SUCCESS: same batches in all ranks before ({sim.plan.ranks[0].batches} per rank per epoch) and after "
        f"the resize ({per_rank} per rank for the rest of the epoch)"
    )
