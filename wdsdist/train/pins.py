"""A run reads one set of bytes: each data spec pinned once, on rank 0, to what it names when the
run begins (an hf:// revision to its commit: sources/schemes/hub.py), that pin shared with every
rank, written to the run directory (pins.json) and into every checkpoint, and taken again on a
resume, which says in one line when a branch has moved since. Specs of other schemes pin to
themselves and are left out of the record."""

from __future__ import annotations

import json
import logging
import os

from omegaconf import DictConfig

from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import Dist
from wdsdist.data import LoaderConfig, pin_spec
from wdsdist.errors import UserError
from wdsdist.tools.outfolder import write_text

log = logging.getLogger(__name__)

PINS_FILE = "pins.json"


def data_specs(cfg: DictConfig) -> list[tuple[str, str]]:
    """(config key, spec) of every shard spec the run reads."""
    d = cfg.data
    specs = [("data.train_shards", d.train_shards), ("data.val_shards", d.val_shards)]
    for key in ("sources", "val_sources"):
        specs += [(f"data.{key}[{s.name}]", s.shards) for s in d[key] or ()]
    return [(k, str(s)) for k, s in specs if s]


def _pin_all(cfg: DictConfig, loader_cfg: LoaderConfig, recorded: dict[str, str]) -> dict[str, str]:
    """{part: pinned part} of every spec's ``::`` parts that pin to something else."""
    pins: dict[str, str] = {}
    for key, spec in data_specs(cfg):
        for part in (p.strip() for p in spec.split("::")):
            if part and part not in pins:
                pinned_part = _pin_one(key, part, recorded.get(part), loader_cfg)
                if pinned_part != part:
                    pins[part] = pinned_part
                    log.info("%s: %s read as %s", key, part, pinned_part)
    return pins


def _pin_one(key: str, part: str, before: str | None, loader_cfg: LoaderConfig) -> str:
    """What ``part`` pins to now; a part pinned before (``before``, a resumed run's) keeps its pin,
    with a line if its revision has moved since, or if the Hub cannot say (the run can go on from
    the node cache)."""
    try:
        now = pin_spec(part, loader_cfg.access)
    except UserError as exc:
        if before is None:
            raise UserError(f"{key}: {exc}") from None
        log.warning("%s: %s; reading %s, as the run began", key, exc, before)
        return before
    if before is not None and before != now:
        moved = "%s: %s has moved since this run began (now %s); reading %s, as the run began"
        log.warning(moved, key, part, now, before)
    return before or now


def pin_data(cfg: DictConfig, dist: Dist, loader_cfg: LoaderConfig, ckpt: dict | None, run_dir: str) -> dict[str, str]:
    """Collective: the run's pins, made on rank 0 (one look at each data set, and every rank reads
    what rank 0 saw), recorded in the run directory."""
    recorded = dict(ckpt.get("pins") or {}) if ckpt is not None else {}

    def on_main() -> dict[str, str] | None:
        if not dist.is_main:
            return None
        pins = _pin_all(cfg, loader_cfg, recorded)
        if pins:
            write_text(os.path.join(run_dir, PINS_FILE), json.dumps(pins, indent=1) + "\n")
        return pins

    return distributed.broadcast_object(distributed.on_all_ranks(on_main))


def pinned(spec: str | None, pins: dict[str, str]) -> str | None:
    """``spec`` with each of its ``::`` parts read as pinned."""
    if not spec or not pins:
        return spec
    return "::".join(pins.get(p.strip(), p) for p in spec.split("::"))
