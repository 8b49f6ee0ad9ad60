"""The loader: WebDataset shards (local, http(s), s3://, gs://) to equal batches on every rank.

The public API is what ``__all__`` names; the other modules of this package are its inside and
may change. The shortest correct loop on it is examples/ddp_loop.py; PyTorch Lightning's
DataModule is ``wdsdist.lightning``. This package imports nothing from ``train`` or ``tools``.

The names load on first use (PEP 562), so importing a light module of the package (its options,
shard specs) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, its name there)
_EXPORTS = {
    "CACHE_COUNTS": ("wdsdist.data.sources.cache", "CACHE_COUNTS"),
    "DataError": ("wdsdist.errors", "DataError"),
    "EvalLoader": ("wdsdist.data.loader", "EvalLoader"),
    "Loader": ("wdsdist.data.loader", "Loader"),
    "LoaderConfig": ("wdsdist.data.options", "LoaderConfig"),
    "LoaderMode": ("wdsdist.data.rules", "LoaderMode"),
    "Plan": ("wdsdist.data.plan.splits", "Plan"),
    "Remainder": ("wdsdist.data.rules", "Remainder"),
    "SampleOptions": ("wdsdist.data.options", "SampleOptions"),
    "Shard": ("wdsdist.data.sources.shard", "Shard"),
    "ShardSpec": ("wdsdist.data.loader", "ShardSpec"),
    "Source": ("wdsdist.data.options", "Source"),
    "Split": ("wdsdist.data.rules", "Split"),
    "StreamOptions": ("wdsdist.data.options", "StreamOptions"),
    "Transform": ("wdsdist.data.loader", "Transform"),
    "UserError": ("wdsdist.errors", "UserError"),
    "dist_layout": ("wdsdist.data.loader", "dist_layout"),
    "decode_eval": ("wdsdist.data.delivery.pipeline", "decode_eval"),
    "expand_shards": ("wdsdist.data.delivery.pipeline", "expand_shards"),
    "index_classes": ("wdsdist.data.delivery.pipeline", "index_classes"),
    "option_problems": ("wdsdist.data.rules", "option_problems"),
    "pin_spec": ("wdsdist.data.sources.resolve", "pin_spec"),
    "shard_samples": ("wdsdist.data.delivery.raw", "shard_samples"),
    "write_index": ("wdsdist.data.sources.index", "write_index"),
}
__all__ = [
    "CACHE_COUNTS",
    "DataError",
    "EvalLoader",
    "Loader",
    "LoaderConfig",
    "LoaderMode",
    "Plan",
    "Remainder",
    "SampleOptions",
    "Shard",
    "ShardSpec",
    "Source",
    "Split",
    "StreamOptions",
    "Transform",
    "UserError",
    "decode_eval",
    "dist_layout",
    "expand_shards",
    "index_classes",
    "option_problems",
    "pin_spec",
    "shard_samples",
    "write_index",
]

if TYPE_CHECKING:
    from wdsdist.data.delivery.pipeline import decode_eval, expand_shards, index_classes
    from wdsdist.data.delivery.raw import shard_samples
    from wdsdist.data.loader import EvalLoader, Loader, ShardSpec, Transform, dist_layout
    from wdsdist.data.options import LoaderConfig, SampleOptions, Source, StreamOptions
    from wdsdist.data.plan.splits import Plan
    from wdsdist.data.rules import LoaderMode, Remainder, Split, option_problems
    from wdsdist.data.sources.cache import CACHE_COUNTS
    from wdsdist.data.sources.index import write_index
    from wdsdist.data.sources.resolve import pin_spec
    from wdsdist.data.sources.shard import Shard
    from wdsdist.errors import DataError, UserError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wdsdist.data' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
