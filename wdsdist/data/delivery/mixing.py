"""Several data sets (``Source``) to what the rank loader reads: the config they need and one
list of every source's shards with the mix over it (plan/mix.py)."""

from __future__ import annotations

from collections.abc import Sequence

from wdsdist.data.autos import replaced
from wdsdist.data.delivery.pipeline import counted_shards, expand_shards
from wdsdist.data.options import LoaderConfig, Source
from wdsdist.data.plan.mix import Mix, MixSource, check
from wdsdist.data.rules import LoaderMode, ShardOrder, Split
from wdsdist.data.sources.shardspec import Shard
from wdsdist.errors import UserError


def mix_config(cfg: LoaderConfig) -> LoaderConfig:
    """The config several data sets are read with: split=samples (what keeps each source's
    promise exactly), refused in one line where another split or order is asked for."""
    if cfg.mode == LoaderMode.resampled:
        raise UserError("data.sources: loader.mode=resampled draws shards at random; use epoch or repeat")
    if cfg.split == Split.shards:
        raise UserError("data.sources needs loader.split=samples (each source's samples counted exactly)")
    if cfg.mix == "stratified" and cfg.cross_shuffle:
        raise UserError("loader.mix=stratified makes each batch in its worker: use loader.cross_shuffle=0")
    if cfg.shard_order == ShardOrder.node:
        raise UserError("data.sources: loader.shard_order=node is not supported with several data sets; use global")
    return replaced(cfg, split=Split.samples)


def resolve_sources(sources: Sequence[Source], cfg: LoaderConfig) -> tuple[list[Shard], Mix]:
    """Every source's shards, counted, in one list, and the mix that reads them (refused in one
    line naming the source where it cannot be read)."""
    shards: list[Shard] = []
    parts = []
    for source in sources:
        try:
            mine = counted_shards(expand_shards(source.shards, cfg), cfg.by_samples)
        except UserError as exc:
            raise UserError(f"source {source.name!r}: {exc}") from None
        index = tuple(range(len(shards), len(shards) + len(mine)))
        shards += mine
        counts = tuple(s.nsamples or 0 for s in mine)
        parts.append(MixSource(source.name, index, counts, source.weight, source.repeat, source.samples))
    mix = Mix(tuple(parts), cfg.epoch_samples)
    check(mix)
    return shards, mix
