"""The orders an epoch is read in, as pure functions of the seed: each worker's shards, the epoch's
shard order (split=samples: global, or node by node), and where the shuffle buffer puts each
sample of a span. The worker stream reads in these orders; an elastic resume replays them to find
which samples a checkpoint had consumed."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TypeVar

import webdataset as wds

from wdsdist.data.options import LoaderConfig, ShardOrder
from wdsdist.errors import UserError

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


def order_nodes(shard_order: str, world: int, node_ranks: int) -> int:
    """The number of blocks an epoch's shard order keeps shards in (epoch_order): the nodes with
    loader.shard_order=node (``world`` ranks, ``node_ranks`` of them on each node, so rank r is on
    node r // node_ranks, as torchrun numbers them), 1 with the global order."""
    if shard_order != ShardOrder.node:
        return 1
    if node_ranks < 1 or world % node_ranks:
        raise UserError(
            f"loader.shard_order=node: {world} ranks are not whole nodes of {node_ranks} ranks each "
            f"(the ranks per node): use a world size that is a multiple of it, or loader.shard_order=global"
        )
    return world // node_ranks


def node_blocks(counts: Sequence[int], nodes: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The shards each node keeps across epochs (loader.shard_order=node), as sorted indices.

    The shards, in an order seeded by ``seed`` and the node count, are cut into ``nodes``
    contiguous runs where their samples cross each node's share (a shard goes where its middle
    falls): every node holds its share of the samples give or take one shard's count, and every
    cut lies within half a shard of an even share's, so the equal rank spans cut from the
    epoch's sequence stay in their node's block but at its edges (and the padding). The
    assignment depends only on the counts, the node count and the seed: a resume on another node
    count re-assigns once, the same on every rank, and every later epoch follows from it."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return (tuple(range(len(counts))),)
    shards = list(range(len(counts)))
    random.Random(f"{seed}:nodes:{nodes}").shuffle(shards)
    total, before = sum(counts), 0
    blocks: list[list[int]] = [[] for _ in range(nodes)]
    for i in shards:
        middle2 = 2 * before + counts[i]  # twice the shard's middle, in samples
        node = min(nodes - 1, middle2 * nodes // (2 * total)) if total else 0
        blocks[node].append(i)
        before += counts[i]
    return tuple(tuple(sorted(b)) for b in blocks)


def epoch_order(blocks: Sequence[Sequence[int]], seed: int, epoch: int) -> list[int]:
    """split=samples: the epoch's shard order, the shards the sample sequence reads in turn: each
    block (node_blocks) shuffled (seed + epoch), the blocks in node order, so the equal rank spans
    cut from it fall in their node's block. One block of every shard is the global order,
    shard_order(range(n), seed, epoch, 1), the same permutation."""
    rng = random.Random(f"{seed}:{epoch}")
    order: list[int] = []
    for block in blocks:
        one = list(block)
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
