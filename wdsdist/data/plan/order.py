"""The orders an epoch is read in, as pure functions of the seed: each worker's shards, and where
the shuffle buffer puts each sample of a span (split=samples). The worker stream reads in these
orders; an elastic resume replays them to find which samples a checkpoint had consumed."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TypeVar

import webdataset as wds

from wdsdist.data.options import LoaderConfig

T = TypeVar("T")


def shard_order(shards: Sequence[T], seed: int, epoch: int, dsrepeat: int) -> list[T]:
    """A worker's shards for one epoch: ``dsrepeat`` passes, each shuffled; the same on every rank.
    (split=samples: all shards, one pass: the epoch's shard order.)"""
    rng = random.Random(f"{seed}:{epoch}")
    order: list[T] = []
    for _ in range(dsrepeat):
        one = list(shards)
        rng.shuffle(one)
        order.extend(one)
    return order


def shuffled_offsets(cfg: LoaderConfig, rank: int, worker: int, epoch: int, length: int) -> list[int]:
    """split=samples: the span offset of each seq of a worker's stream of ``length`` samples, by
    replaying its shuffle buffer over the offsets (its permutation depends on the seed and the
    length only). What an elastic resume maps a checkpoint's seq numbers with (resume.saved_progress)."""
    return list(iter_shuffled_offsets(cfg, rank, worker, epoch, length))


def iter_shuffled_offsets(cfg: LoaderConfig, rank: int, worker: int, epoch: int, length: int) -> Iterator[int]:
    """shuffled_offsets, lazily: a resume needs them only up to the last seq consumed."""
    if cfg.shuffle_buffer <= 0:
        return iter(range(length))
    rng = random.Random(f"{cfg.seed}:{epoch}:{rank}:{worker}:0:samples")
    return wds.filters.shuffle(cfg.shuffle_buffer, min(cfg.shuffle_buffer, 100), rng=rng)(iter(range(length)))
