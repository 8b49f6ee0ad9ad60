"""The orders an epoch is read in, as pure functions of the seed: each worker's shards, the epoch's
shard order (split=samples: global, or node by node), and where the shuffle buffer puts each
sample of a span. The worker stream reads in these orders; an elastic resume replays them to find
which samples a checkpoint had consumed."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import webdataset as wds

from wdsdist.data.plan import seeds
from wdsdist.data.plan.splits import rank_batches
from wdsdist.data.rules import ShardOrder
from wdsdist.errors import UserError

T = TypeVar("T")


def shard_order(shards: Sequence[T], seed: int, epoch: int, dsrepeat: int) -> list[T]:
    """A worker's shards for one epoch: ``dsrepeat`` passes, each shuffled; the same on every rank.
    (split=samples: all shards, one pass: the epoch's shard order.)"""
    rng = seeds.epoch_order(seed, epoch)
    order: list[T] = []
    for _ in range(dsrepeat):
        one = list(shards)
        rng.shuffle(one)
        order.extend(one)
    return order


def order_nodes(shard_order: str, world: int, node_ranks: int) -> int:
    """The nodes an epoch's shard order keeps blocks for (epoch_order): with
    loader.shard_order=node, ``world`` ranks on nodes of ``node_ranks`` (rank r is on node
    r // node_ranks, as torchrun numbers them); 1 with the global order."""
    if shard_order != ShardOrder.node:
        return 1
    if node_ranks < 1 or world % node_ranks:
        raise UserError(
            f"loader.shard_order=node: {world} ranks are not whole nodes of {node_ranks} ranks each "
            f"(the ranks per node): use a world size that is a multiple of it, or loader.shard_order=global"
        )
    return world // node_ranks


NodeOrder = tuple[int, int]  # (nodes, samples of each node's span): what node_parts cuts by
GLOBAL: NodeOrder = (1, 0)  # one block of every shard: the global order
Part = tuple[int, int, int]  # samples [first, stop) of the shard at this index of the loader's list


def node_order(shard_order: str, total: int, world: int, node_ranks: int, batch_size: int, remainder: str) -> NodeOrder:
    """What a layout's epoch order keeps its blocks by: its nodes, and the samples the equal rank
    spans give each node (its ranks' spans, contiguous: rank_batches x batch size x ranks per
    node). A loader state keeps it, so an epoch resumed on another layout is read in its order."""
    nodes = order_nodes(shard_order, world, node_ranks)
    if nodes == 1:
        return GLOBAL
    return nodes, rank_batches(total, world, batch_size, remainder) * batch_size * node_ranks


def node_shares(total: int, nodes: int) -> list[int]:
    """The samples each node keeps (loader.shard_order=node): equal shares of the data set, the
    first ``total % nodes`` nodes one more."""
    each, extra = divmod(total, nodes)
    return [each + (n < extra) for n in range(nodes)]


def node_parts(counts: Sequence[int], order: NodeOrder, seed: int) -> tuple[tuple[Part, ...], ...]:
    """The samples each node keeps across epochs (loader.shard_order=node), as parts of shards,
    sorted: one block of whole shards (every shard, whole) for the global order.

    The shards, in an order seeded by ``seed`` and the node count, are cut into one contiguous
    run per node at the nodes' equal shares (node_shares): each node keeps whole shards and, at
    each cut, one part of the shard the cut falls in, so at most ``nodes - 1`` shards are split
    in two, and each of their samples still belongs to one node. A node's share is within one
    sample of every other's and within a batch per rank of its ranks' spans: its ranks read its
    own samples only, their padding (pad) its own first samples again, and with drop its last
    ones are left over. The assignment depends on the counts, the node count and the seed only:
    a resume on another layout re-assigns once, the same on every rank, and every later epoch
    follows from it."""
    nodes, _ = order
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return (tuple((i, 0, n) for i, n in enumerate(counts)),)
    shards = list(range(len(counts)))
    seeds.node_blocks(seed, nodes).shuffle(shards)
    ends = list(itertools.accumulate(node_shares(sum(counts), nodes)))  # where each node's share ends
    parts: list[list[Part]] = [[] for _ in range(nodes)]
    node = before = 0
    for i in shards:
        first = 0
        while True:
            while node < nodes - 1 and before + first >= ends[node]:
                node += 1
            stop = min(counts[i], ends[node] - before)
            parts[node].append((i, first, stop))
            if stop >= counts[i]:
                break
            first = stop
        before += counts[i]
    return tuple(tuple(sorted(p)) for p in parts)


def epoch_order(blocks: Sequence[Sequence[Part]], seed: int, epoch: int) -> list[Part]:
    """split=samples: the epoch's order, the parts of shards the sample sequence reads in turn:
    each node's block (node_parts) shuffled (seed + epoch), the blocks in node order, so each
    node's samples are one stretch of the sequence. One block of every shard is the global
    order, shard_order(range(n), seed, epoch, 1), the same permutation."""
    rng = seeds.epoch_order(seed, epoch)
    order: list[Part] = []
    for block in blocks:
        one = list(block)
        rng.shuffle(one)
        order.extend(one)
    return order


def shuffled(items: Iterable[T], bufsize: int, rng: random.Random) -> Iterator[T]:
    """The sample shuffle, the one the loader uses everywhere: WebDataset's shuffle buffer of
    ``bufsize`` items (none: ``items`` as they come), drawing from ``rng`` (seeds.py). Its
    permutation depends on the generator and the number of items only, which is what lets a
    resume replay it over position numbers (``shuffled_offsets``)."""
    if bufsize <= 0:
        return iter(items)
    return wds.filters.shuffle(bufsize, min(bufsize, 100), rng=rng)(iter(items))


def shuffled_offsets(seed: int, shuffle_buffer: int, rank: int, worker: int, epoch: int, length: int) -> Iterator[int]:
    """split=samples: the span offset of each seq of a worker's stream of ``length`` samples, lazily
    (a resume needs them only up to the last seq consumed), by replaying its shuffle over the
    offsets. What an elastic resume maps a checkpoint's seq numbers with (resume.saved_progress)."""
    return shuffled(range(length), shuffle_buffer, seeds.sample_shuffle(seed, epoch, rank, worker))
