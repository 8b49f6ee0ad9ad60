"""The run's classes: their number and names, from the config or the training index, checked
against each other, and written to the run directory (classes.json)."""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from wdsdist.data import LoaderConfig, UserError, index_classes
from wdsdist.tools.outfolder import write_text


def from_index(cfg: DictConfig, loader_cfg: LoaderConfig) -> tuple[str, list[str]] | None:
    """(key, names) of the training data's index: data.train_shards', or with data.sources the
    first source's whose index names classes (every other that names some must agree)."""
    d = cfg.data
    specs = [("data.train_shards", d.train_shards)] if d.sources is None else []
    specs += [(f"data.sources[{s.name}]", s.shards) for s in d.sources or ()]
    found: tuple[str, list[str]] | None = None
    for key, spec in specs:
        try:
            names = index_classes(str(spec), loader_cfg) if spec else None
        except UserError as exc:
            raise UserError(f"{key}: {exc}") from None
        if names is None:
            continue
        if found is not None and names != found[1]:
            raise UserError(
                f"{key}: its index names {len(names)} classes ({preview(names)}), {found[0]}'s "
                f"{len(found[1])} ({preview(found[1])}): one model needs one set of labels"
            )
        found = found or (key, names)
    return found


def preview(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def resolve(cfg: DictConfig, loader_cfg: LoaderConfig) -> list[str]:
    """data.num_classes and data.classes as the run uses them, set in ``cfg``: given, or read from
    the training index; a given count or list that disagrees with the index stops the run in one
    line naming both."""
    d = cfg.data
    given = list(d.classes) if d.classes is not None else None
    indexed = from_index(cfg, loader_cfg)
    if given is None and indexed is not None:
        given = indexed[1]
        if d.num_classes is not None and d.num_classes != len(given):
            raise UserError(
                f"data.num_classes={d.num_classes}: {indexed[0]}'s index names {len(given)} classes "
                f"({preview(given)}); leave data.num_classes out to take the index's"
            )
    if given is None:
        if d.num_classes is None:
            where = "data.train_shards" if d.sources is None else "data.sources"
            raise UserError(
                f"data.num_classes: not given, and {where} is no shard index naming its classes "
                "(makeshards.py writes them into DIR/NAME.index.json); give data.num_classes=N"
            )
        given = [str(i) for i in range(d.num_classes)]
    if d.num_classes is not None and d.num_classes != len(given):
        raise UserError(f"data.num_classes={d.num_classes}: data.classes names {len(given)} classes")
    if len(given) < 2:
        raise UserError(f"data.num_classes={len(given)}: a classifier needs at least 2 classes")
    d.num_classes, d.classes = len(given), given
    return given


def write(run_dir: str, names: list[str]) -> None:
    """classes.json in the run directory: label i's name at position i."""
    write_text(os.path.join(run_dir, "classes.json"), json.dumps(names, indent=1, ensure_ascii=False) + "\n")
