"""The loader's saved position: one typed, versioned value, and the one reader of older ones.

``Loader.state_dict()`` is ``LoaderState.to_dict()``: small (a few numbers per worker, ranges
where an epoch was re-split), picklable and JSON-friendly, as torchdata's StatefulDataLoader
protocol expects. ``LoaderState.from_dict`` reads it back, and reads the states older versions
wrote (format ``wdsdist-loader-v1``), here and nowhere else; a value that is not a loader state,
or one of a newer version, is refused in one line (UserError). What a state may be resumed
with is restore.py's business: this module only reads and writes it.

A state, as ``to_dict`` writes it::

    format          "wdsdist-loader"
    version         3 (this module reads 1 to 3)
    steps           batches the run had taken in all (the trainer's step)
    before_resume   batches of the epoch under way delivered before an elastic resume (len() counts them)
    ranks           one entry per rank, in rank order (None for a rank that was not gathered)

Each rank's entry (``RankState``):

    rank, world, workers    the layout it was saved on
    point                   where each worker stands (resume.ResumePoint.state: per worker and
                            epoch, the consumed prefix of its stream, the seqs and runs beyond it)
    batches                 batches of point's epoch this rank delivered
    turn                    the worker whose batch comes next (the DataLoader takes them in turn)
    mode, split, batch_size, remainder, shuffle_buffer, seed, dsrepeat, cross_shuffle
                            the options the positions were read with
    stream_seed             a stream reseeded on another layout (split=shards): the seed it runs
                            with, which a resume on its layout goes on with
    shards, samples, counts the data: shard count, sample total, a digest of the per-shard counts
    order, orders           split=samples: the nodes this layout's order keeps blocks for, and
                            those of the epochs in flight read in another layout's order
                            (loader.shard_order=node; versions 1 and 2 cut the nodes otherwise:
                            their states in the middle of a node-ordered epoch are refused)
    elastic                 epochs re-split on an earlier resume: their remaining positions as
                            [a, b) ranges (rank 0 holds them; the other ranks say "as rank 0")
    mix, sources, mix_spec  several data sets: the mix's digest, its sources (name, setting,
                            size) and its windows (plan/mix.py: Mix.digest, describe, spec)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from wdsdist.data.plan.order import GLOBAL, NodeOrder
from wdsdist.data.plan.resume import ResumePoint
from wdsdist.data.plan.sequence import Ranges
from wdsdist.errors import UserError

FORMAT = "wdsdist-loader"
VERSION = 3
READS = (1, 2, 3)  # the versions from_dict reads
NODE_SAMPLES = 3  # the first version whose node order keeps each node's samples (order.node_parts)
OLD_FORMATS = {"wdsdist-loader-v1": 1}  # the outer format string of each older version
SHARED = "as rank 0"  # a rank's elastic ranges, saved once in rank 0's entry


def counts_digest(counts: Sequence[int]) -> str:
    """A short fingerprint of the shards' sample counts, in order: an epoch's sample sequence is
    defined by them (and the seed), so a resume onto other shards is refused, not misread."""
    return hashlib.sha1(",".join(map(str, counts)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MixState:
    """Several data sets: what a resume checks and carries of the mix (plan/mix.py)."""

    digest: str  # Mix.digest: names, settings, counts, origin
    sources: list  # Mix.describe: names, settings and sizes, for a refusal's line
    spec: dict | None  # Mix.spec: its windows, for a change of weights (mix.carry_over)


@dataclass(frozen=True)
class RankState:
    """One rank's saved position and what it means (the fields: this module's docstring).
    A field that an older version did not write is None: not checked, or refused where needed."""

    rank: int
    world: int
    workers: int
    point: ResumePoint
    batches: int = 0
    turn: int | None = None
    mode: str | None = None
    split: str | None = None
    batch_size: int | None = None
    remainder: str | None = None
    shuffle_buffer: int | None = None
    seed: int | None = None
    stream_seed: int | None = None
    dsrepeat: int | None = None
    cross_shuffle: int | None = None
    recipe: str | None = None  # the options a training sample's pixels are drawn with (restore.recipe_of)
    shards: int | None = None
    samples: int | None = None
    counts: str | None = None
    order: NodeOrder = GLOBAL
    orders: dict[int, NodeOrder] = field(default_factory=dict)
    elastic: dict[int, Ranges] = field(default_factory=dict)
    mix: MixState | None = None

    @property
    def in_flight(self) -> bool:
        """An epoch is under way: a worker delivered some of it, or it was re-split."""
        return bool(self.point.workers or self.batches or self.elastic)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"version": VERSION, "rank": self.rank, "world": self.world, "workers": self.workers}
        out |= {"point": self.point.state(), "batches": self.batches, "turn": self.turn}
        for key in ("mode", "split", "batch_size", "remainder", "shuffle_buffer", "seed", "dsrepeat", "cross_shuffle"):
            out[key] = getattr(self, key)
        for key in ("shards", "samples", "counts", "stream_seed", "recipe"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.split == "samples":
            out["order"] = list(self.order)
        if self.orders:
            out["orders"] = {str(e): list(o) for e, o in self.orders.items()}
        if self.elastic:
            # The same on every rank, and as long as the shuffle buffers' pending items: one copy
            # per checkpoint, rank 0's (from_dict puts it back in the others').
            out["elastic"] = SHARED if self.rank else {str(e): [list(r) for r in rs] for e, rs in self.elastic.items()}
        if self.mix is not None:
            out |= {"mix": self.mix.digest, "sources": self.mix.sources, "mix_spec": self.mix.spec}
        return out

    @classmethod
    def from_dict(cls, d: dict, elastic: dict[int, Ranges] | None = None) -> RankState:
        """A rank's entry, of a version in READS; ``elastic``: rank 0's ranges, for an entry that
        says "as rank 0". Raises KeyError, TypeError or ValueError on a malformed entry."""
        version = d.get("version", 1)
        if version not in READS:
            raise ValueError(f"rank {d.get('rank')}'s entry has version {version!r}")
        options = {k: d.get(k) for k in ("mode", "split", "remainder", "counts", "recipe")}
        numbers = ("turn", "batch_size", "shuffle_buffer", "seed", "stream_seed", "dsrepeat", "cross_shuffle")
        numbers += ("shards", "samples")
        options |= {k: None if d.get(k) is None else int(d[k]) for k in numbers}
        saved = d.get("elastic")
        if saved == SHARED:
            if elastic is None:
                raise ValueError(f"rank {d['rank']}'s re-split epochs are in rank 0's entry, which is missing")
            ranges = elastic
        else:
            ranges = {int(e): tuple((int(a), int(b)) for a, b in rs) for e, rs in (saved or {}).items()}
        mix = None
        if d.get("mix") is not None:
            mix = MixState(str(d["mix"]), list(d.get("sources") or []), d.get("mix_spec"))
        return cls(
            rank=int(d["rank"]),
            world=int(d["world"]),
            workers=int(d["workers"]),
            point=ResumePoint.from_state(d["point"]),
            batches=int(d.get("batches", 0)),
            order=_order(d.get("order", GLOBAL)),
            orders={int(e): _order(o) for e, o in (d.get("orders") or {}).items()},
            elastic=ranges,
            mix=mix,
            **options,
        )


def _order(value: Any) -> NodeOrder:
    nodes, span = (int(n) for n in value)
    return nodes, span


@dataclass(frozen=True)
class LoaderState:
    """Every rank's position (``ranks``, in rank order; None where a rank was not gathered), the
    run's step count and the batches of the epoch under way delivered before an elastic resume."""

    ranks: tuple[RankState | None, ...]
    steps: int = 0
    before_resume: int = 0

    @property
    def first(self) -> RankState:
        """The first rank's entry there is (every entry holds the same options)."""
        return next(r for r in self.ranks if r is not None)

    @property
    def in_flight(self) -> bool:
        return any(r is not None and r.in_flight for r in self.ranks)

    def to_dict(self) -> dict:
        ranks = [None if r is None else r.to_dict() for r in self.ranks]
        return gathered(ranks, self.steps, self.before_resume)

    @classmethod
    def from_dict(cls, state: Any, where: str = "the loader state") -> LoaderState:
        """Read a state ``to_dict`` wrote, or an older version's; a list is every rank's entries, and
        one rank's entry alone is that rank's position only (a resume of it on the same layout).
        Refuses (UserError, one line naming ``where``) anything else."""
        if isinstance(state, dict) and "ranks" not in state and "point" in state and "world" in state:
            entries: list = [None] * int(state["world"])
            entries[int(state["rank"])] = state
            state = entries
        if isinstance(state, list):
            state = {"ranks": state}
        if not isinstance(state, dict) or not isinstance(state.get("ranks"), list) or not state["ranks"]:
            raise UserError(f"{where} is not a wdsdist loader state (a dict with every rank's position)")
        fmt, version = state.get("format", FORMAT), state.get("version")
        if fmt in OLD_FORMATS:
            version = OLD_FORMATS[fmt]
        elif fmt != FORMAT:
            raise UserError(f"{where} is not a wdsdist loader state (format {fmt!r})")
        if version is not None and version not in READS:
            raise UserError(
                f"{where} has loader state version {version!r}; this version of wds-distributed reads 1 to {VERSION}"
            )
        entries = state["ranks"]
        try:
            zero = RankState.from_dict(entries[0]) if entries[0] is not None else None
            ranks = tuple(
                None if d is None else zero if i == 0 else RankState.from_dict(d, zero and zero.elastic)
                for i, d in enumerate(entries)
            )
            steps, before = int(state.get("steps", 0)), int(state.get("before_resume", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise UserError(f"{where} is not a readable wdsdist loader state: {what}") from None
        if all(r is None for r in ranks):
            raise UserError(f"{where} holds no rank's position")
        saved = cls(ranks, steps, before)
        if version is None:  # a list of entries: the oldest of them
            version = min((d or {}).get("version", 1) for d in entries)
        old = version < NODE_SAMPLES
        if old and saved.in_flight and any(o[0] > 1 for r in ranks if r for o in (r.order, *r.orders.values())):
            raise UserError(
                f"{where} was saved in the middle of epoch {saved.first.point.epoch} with loader.shard_order=node by "
                f"an earlier version, whose nodes read other samples: resume from a checkpoint at an epoch's end"
            )
        return saved


def gathered(ranks: list[dict | None], steps: int, before_resume: int) -> dict:
    """The state of every rank's entries (``RankState.to_dict``, as gathered over the ranks)."""
    return {"format": FORMAT, "version": VERSION, "steps": steps, "before_resume": before_resume, "ranks": ranks}
