"""simdist's simulation: the job's settings, and the batches each simulated rank delivers, from the
planner (plan mode) or from the training loader itself over real shards (real mode)."""

from __future__ import annotations

import gc
import re
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from wdsdist.data.plan.order import order_nodes
from wdsdist.data.plan.splits import REMAINDERS, Plan, RankPlan, plan, plan_samples
from wdsdist.data.rules import SHARD_ORDERS, parse_nbatches
from wdsdist.data.sources.shardspec import Access
from wdsdist.errors import UserError
from wdsdist.simdist.layouts import IMAGE_SIZE, Layout

if TYPE_CHECKING:
    from wdsdist.data.options import LoaderConfig
    from wdsdist.data.sources.shardspec import Shard


@dataclass(frozen=True)
class Settings:
    """What the simulated job looks like; validated, so bad values fail with one line."""

    size: int = 3
    nworkers: int = 3
    batch_size: int = 10
    partial: bool = False
    nbatches: int | str | None = None  # None: no cut; an int; or "auto"
    dsrepeat: int = 1
    repeat: int = 1
    nepochs: int = 1
    cross_shuffle: int = 0  # samples shuffled across workers before re-batching; 0: off
    seed: int = 0
    split: str = "shards"  # shards: whole shards per rank and worker; samples: equal spans of the epoch's samples
    remainder: str = "pad"  # split=samples: pad or drop
    shard_order: str = "global"  # split=samples: global, or node (each node keeps its samples: order.py)
    node_ranks: int = 1  # ranks per node (that share its cache)

    def __post_init__(self) -> None:
        if self.split not in ("shards", "samples"):
            raise UserError(f"--split {self.split}: must be shards or samples")
        if self.remainder not in REMAINDERS:
            raise UserError(f"--remainder {self.remainder}: must be pad or drop")
        if self.split == "samples" and self.dsrepeat > 1:
            raise UserError("--dsrepeat applies to --split shards (split=samples needs no repetition)")
        if self.shard_order not in SHARD_ORDERS:
            raise UserError(f"--shard-order {self.shard_order}: must be global or node")
        if self.shard_order == "node" and self.split != "samples":
            raise UserError("--shard-order node applies to --split samples (the order of the epoch's sample sequence)")
        for name in ("size", "batch_size", "dsrepeat", "repeat", "nepochs", "node_ranks"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("nworkers", "cross_shuffle"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        try:
            object.__setattr__(self, "nbatches", parse_nbatches(self.nbatches))  # frozen: set once, here
        except ValueError as exc:
            raise UserError(f"--nbatches {exc}") from None


@dataclass(frozen=True)
class RankEpoch:
    """What one rank delivered (or would deliver) in one epoch."""

    sizes: dict[int, int]  # batch size -> number of batches
    refused: str | None = None  # why the training loader refuses to run this rank

    @property
    def batches(self) -> int:
        return sum(self.sizes.values())

    @property
    def samples(self) -> int:
        return sum(size * n for size, n in self.sizes.items())


@dataclass
class Simulation:
    """The planned side of a simulation: the plan of one loader pass, the cut, and per-rank counts."""

    layout: Layout
    settings: Settings
    plan: Plan  # one loader pass, no cut (the cut spans ``repeat`` passes)
    cut: int | None
    expected: list[RankEpoch]  # per rank, every epoch

    @property
    def reach(self) -> list[int]:
        """Batches each rank can deliver per epoch before any cut: ``repeat`` passes of its loader."""
        return [self.settings.repeat * r.available for r in self.plan.ranks]


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def refusal(rank: RankPlan) -> str | None:
    """The training loader refuses a rank with a worker that has no shard (it would hang DDP)."""
    empty = [w.worker for w in rank.workers if not w.shards]
    if not empty:
        return None
    if not rank.shards:
        return "refused: this rank gets no shard"
    shards = plural(len(rank.shards), "shard")
    return f"refused: worker {empty[0]} gets no shard ({shards} for {len(rank.workers)} workers)"


def pass_sizes(rank: RankPlan, batch_size: int, partial: bool, rebatch: bool) -> tuple[int, list[tuple[int, int]]]:
    """One loader pass of a rank: (full batches, [(position, size)] of its short batches).

    Without re-batching, the DataLoader takes batches from its workers in turn (worker 0, 1,
    2, 0, ...), skipping workers that have run out; each worker's short batch is its last.
    """
    if rebatch and partial:
        full, rest = divmod(rank.samples, batch_size)
        return full, [(full, rest)] if rest else []
    per_worker = []  # (full batches, samples of the short batch) per worker
    for worker in rank.workers:
        full, rest = divmod(worker.samples, batch_size)
        per_worker.append((full, rest if partial else 0))
    counts = [full + (1 if rest else 0) for full, rest in per_worker]
    shorts = []
    for worker, (_, rest) in enumerate(per_worker):
        if rest:
            last_round = counts[worker] - 1
            before = sum(min(count, last_round) for count in counts)
            before += sum(1 for other in range(worker) if counts[other] >= counts[worker])
            shorts.append((before, rest))
    return sum(full for full, _ in per_worker), sorted(shorts)


def delivered(rank: RankPlan, settings: Settings, cut: int | None) -> RankEpoch:
    """Batch sizes one rank delivers per epoch: ``repeat`` passes, cut at ``cut`` batches."""
    why = refusal(rank)
    if why:
        return RankEpoch({}, why)
    full, shorts = pass_sizes(rank, settings.batch_size, settings.partial, settings.cross_shuffle > 0)
    per_pass = full + len(shorts)
    if cut is None or not per_pass:
        whole, rest = settings.repeat, 0
    else:
        whole, rest = divmod(cut, per_pass)
        if whole >= settings.repeat:
            whole, rest = settings.repeat, 0
    sizes: Counter[int] = Counter()
    for batches in [per_pass] * whole + ([rest] if rest else []):
        taken = [size for position, size in shorts if position < batches]
        sizes[settings.batch_size] += batches - len(taken)
        sizes.update(taken)
    return RankEpoch({k: v for k, v in sizes.items() if v})


def simulate_plan(layout: Layout, settings: Settings) -> Simulation:
    """Per-rank counts from sample counts alone."""
    if settings.split == "samples":
        return _simulate_sample_plan(layout, settings)
    try:
        one_pass = plan(
            layout.counts,
            settings.size,
            settings.nworkers,
            settings.batch_size,
            partial=settings.partial,
            dsrepeat=settings.dsrepeat,
            rebatch=settings.cross_shuffle > 0,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    reach = [settings.repeat * r.available for r in one_pass.ranks]
    cut: int | None
    if settings.nbatches == "auto":
        cut = min(reach)
    else:
        cut = settings.nbatches  # type: ignore[assignment]
    return Simulation(layout, settings, one_pass, cut, [delivered(r, settings, cut) for r in one_pass.ranks])


def _simulate_sample_plan(layout: Layout, settings: Settings) -> Simulation:
    """split=samples: the loader's own plan (equal spans); a layout it refuses is refused here too."""
    order_nodes(settings.shard_order, settings.size, settings.node_ranks)  # whole nodes, as the loader asks
    try:
        one_pass = plan_samples(
            layout.counts,
            settings.size,
            settings.nworkers,
            settings.batch_size,
            remainder=settings.remainder,
            rebatch=settings.cross_shuffle > 0,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    problems = one_pass.problems()
    if problems:
        raise UserError(f"the training loader refuses this layout: {problems[0]}")
    per_epoch = settings.repeat * one_pass.ranks[0].available
    cut = per_epoch if settings.nbatches == "auto" else settings.nbatches
    return Simulation(layout, settings, one_pass, cut, [delivered(r, settings, cut) for r in one_pass.ranks])  # type: ignore[arg-type]


def sample_coverage(p: Plan, batches: int) -> tuple[int, int]:
    """split=samples: (delivered, distinct) samples of one epoch when every rank delivers
    ``batches`` batches of its span: intervals of the epoch's sequence, positions past its end
    being its first samples again. Arithmetic on O(ranks) intervals, no per-sample lists."""
    total, size = p.total_samples, p.batch_size
    spans = [(r.span[0], min(r.span[1], r.span[0] + batches * size)) for r in p.ranks if r.span]
    inside = [(a, min(b, total)) for a, b in spans if a < total]
    wrapped = [(max(a, total) - total, b - total) for a, b in spans if b > total]
    merged: list[list[int]] = []
    for a, b in sorted(inside + wrapped):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif a < b:
            merged.append([a, b])
    return sum(b - a for a, b in spans), sum(b - a for a, b in merged)


# ---------------------------------------------------------------- real mode


@dataclass
class Coverage:
    """Sample keys over all ranks in one epoch, against the data set."""

    total: int  # samples in the data set
    delivered: int
    unique: int

    @property
    def duplicated(self) -> int:
        return self.delivered - self.unique

    @property
    def missing(self) -> int:
        return self.total - self.unique


@dataclass
class RealRun:
    epochs: list[list[RankEpoch]]  # [epoch][rank]
    coverage: list[Coverage]  # per epoch


def real_config(
    sim: Simulation, *, showopen: bool = False, image_size: int = IMAGE_SIZE, access: Access | None = None
) -> LoaderConfig:
    """The training loader's config for real mode (a LoaderConfig), keys carried for the coverage."""
    from wdsdist.data.options import LoaderConfig

    settings, access = sim.settings, access or Access()
    return LoaderConfig(
        batch_size=settings.batch_size,
        workers=settings.nworkers,
        mode="epoch",
        image_size=image_size,
        seed=settings.seed,
        cross_shuffle=settings.cross_shuffle,
        partial=settings.partial,
        nbatches=sim.cut if sim.cut else None,
        dsrepeat=settings.dsrepeat,
        split=settings.split,
        remainder=settings.remainder,
        shard_order=settings.shard_order,
        node_ranks=settings.node_ranks,
        with_keys=True,
        trace=showopen,
        strict=True,  # a simulator reports bad data at once: skipping it would change the counts
        allow_pipe=access.allow_pipe,
        trust_index=access.trust_index,
    )


def counted_shards(sim: Simulation) -> list[Shard]:
    """The layout's shards with their sample counts (real mode needs shards)."""
    shards = sim.layout.shards
    if shards is None:
        raise UserError("real mode needs shards: give --shards, or let simdist write synthetic ones")
    return [
        s if s.nsamples is not None else replace(s, nsamples=n) for s, n in zip(shards, sim.layout.counts, strict=True)
    ]


def simulate_real(
    sim: Simulation, *, showopen: bool = False, image_size: int = IMAGE_SIZE, access: Access | None = None
) -> RealRun:
    """Run every simulated rank's training loader (real DataLoader workers), one rank after another."""
    from wdsdist.data.delivery.pipeline import RankLoader
    from wdsdist.errors import DataError

    settings = sim.settings
    counted = counted_shards(sim)
    config = real_config(sim, showopen=showopen, image_size=image_size, access=access)
    epochs: list[list[RankEpoch]] = [[] for _ in range(settings.nepochs)]
    keys: list[Counter[str]] = [Counter() for _ in range(settings.nepochs)]
    with warnings.catch_warnings():
        # Simulating more workers than this machine has cores is the point, not a mistake.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for rank, rank_plan in enumerate(sim.plan.ranks):
            why = refusal(rank_plan)
            if why:
                for results in epochs:
                    results.append(RankEpoch({}, why))
                continue
            # No plan: each pass runs to the data's end (split=samples: the end of the rank's span).
            loader = RankLoader(counted, rank, settings.size, config, None, None)
            try:
                for results, epoch_keys in zip(epochs, keys, strict=True):
                    results.append(_run_epoch(loader, settings.repeat, sim.cut, epoch_keys))
            except DataError as exc:
                # Raised in a worker, it arrives with the worker's traceback: keep its last line.
                raise UserError(re.sub(r"^[\w.]*DataError: ", "", str(exc).strip().splitlines()[-1])) from None
            finally:
                del loader
            gc.collect()  # shut this rank's persistent workers down before the next rank starts its own
    coverage = [Coverage(sim.layout.total, sum(epoch_keys.values()), len(epoch_keys)) for epoch_keys in keys]
    return RealRun(epochs, coverage)


def _run_epoch(loader, repeat: int, cut: int | None, keys: Counter[str]) -> RankEpoch:
    """One simulated epoch of one rank: ``repeat`` passes of its loader, stopped at ``cut`` batches."""
    sizes: Counter[int] = Counter()
    batches = 0
    for _ in range(repeat):
        if cut is not None and batches >= cut:
            break
        for batch in loader:
            sizes[len(batch["key"])] += 1
            keys.update(batch["key"])
            batches += 1
            if cut is not None and batches >= cut:
                break
    return RankEpoch(dict(sizes))
