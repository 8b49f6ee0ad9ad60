"""What the store sends each node per epoch, with and without a node cache (--shard-bytes,
--cache-size, --node-ranks, --shard-order): the loader's own plan of each node's reads
(plan/order.py, plan/sequence.py), priced in bytes, so a layout too big to run shows what
loader.shard_order=node saves.

A node is ``node_ranks`` consecutive ranks (torchrun numbers them so). Without a cache a node
fetches what its ranks read: with split=samples the samples of its ranks' spans, as their share
of each shard's bytes (a mid-shard start is a Range request); with split=shards its ranks' whole
shards, ``dsrepeat`` times. With a cache (loader.cache_dir) every shard a node touches is fetched
once, whole, or (shard_order=node) the node's part of a shard another node reads the rest of, as
one ranged read of that part's bytes; each is kept in a least-recently-used cache of
``cache_bytes``: a later epoch fetches only what the node has not kept. An entry larger than the
cache is read from the store each time, as the cache does. The nbatches cut is not modelled: it
reads less.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from wdsdist.data.plan.order import epoch_order, node_order, node_parts
from wdsdist.data.plan.sequence import EpochSequence, EpochShards
from wdsdist.data.plan.splits import rank_batches, split_by_rank
from wdsdist.errors import UserError
from wdsdist.simdist.simulate import Simulation, plural


@dataclass(frozen=True)
class Egress:
    """Bytes the store sends per [epoch][node]: ``direct`` without a cache, ``cached`` with one of
    ``cache_bytes`` per node (None: no cache asked for)."""

    node_ranks: int
    shard_order: str
    dataset: int  # bytes of all shards
    cache_bytes: int | None
    direct: tuple[tuple[int, ...], ...]
    cached: tuple[tuple[int, ...], ...] | None

    @property
    def nodes(self) -> int:
        return len(self.direct[0]) if self.direct else 0


Unit = tuple[int, int, int]  # what a cache entry holds: samples [first, stop) of a shard (all: the whole shard)


def node_reads(
    counts: Sequence[int], *, world: int, node_ranks: int, batch_size: int, epoch: int, seed: int, remainder: str,
    shard_order: str,
) -> list[list[tuple[tuple[int, int, int], Unit]]]:  # fmt: skip
    """split=samples: what each node's ranks read in ``epoch``, as the loader plans it: (piece,
    the cache entry it reads from) in reading order; a piece is samples [first, stop) of a shard."""
    total = sum(counts)
    order = node_order(shard_order, total, world, node_ranks, batch_size, remainder)
    shards = EpochShards(counts, epoch_order(node_parts(counts, order, seed), seed, epoch))
    sequence = EpochSequence.of(shards.total, order=order)
    length = rank_batches(total, world, batch_size, remainder) * batch_size * node_ranks
    out = []
    for node in range(world // node_ranks):  # the node's ranks hold consecutive spans
        _, (pieces,) = shards.reads(sequence.runs(node * length, (node + 1) * length))
        out.append([(p, (p[0], *(shards.part_of(p) or (0, counts[p[0]])))) for p in pieces])
    return out


class _Cache:
    """A node's cache as loader.cache_dir keeps it: entries of ``limit`` bytes at most, the least
    recently used evicted first; one larger than the limit is read from the store each time."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.entries = limit, 0, OrderedDict[Unit, int]()

    def fetch(self, touched: Sequence[Unit], size_of: Callable[[Unit], int]) -> int:
        """The bytes the store sends for ``touched`` (each entry once: two ranks' read is one
        download), what the cache holds being hits."""
        fetched = 0
        for unit in dict.fromkeys(touched):
            if unit in self.entries:
                self.entries.move_to_end(unit)
                continue
            size = size_of(unit)
            fetched += size
            if size > self.limit:
                continue  # over the limit: read from the store, never kept
            self.entries[unit] = size
            self.held += size
            while self.held > self.limit:
                self.held -= self.entries.popitem(last=False)[1]
        return fetched


def node_egress(
    counts: Sequence[int],
    shard_bytes: Sequence[int],
    *,
    world: int,
    node_ranks: int,
    batch_size: int,
    nepochs: int,
    seed: int = 0,
    split: str = "samples",
    remainder: str = "pad",
    shard_order: str = "global",
    dsrepeat: int = 1,
    cache_bytes: int | None = None,
    part_bytes: Callable[[int, int, int], int] | None = None,
) -> Egress:
    """The bytes each node fetches from the store in each epoch, without and with a node cache.
    ``part_bytes(shard, first, stop)``: the bytes of the cache's entry of that part of a shard,
    its ranged read (spanread.part_span, from the index's offsets); None: its share of the
    shard's bytes."""
    if node_ranks < 1 or world % node_ranks:
        raise UserError(f"--size {world} is not whole nodes of --node-ranks {node_ranks}: give a multiple of it")
    nodes = world // node_ranks
    caches = [_Cache(cache_bytes or 0) for _ in range(nodes)]

    def share(shard: int, first: int, stop: int) -> int:
        return shard_bytes[shard] * (stop - first) // max(counts[shard], 1)

    def bytes_of(unit: Unit) -> int:
        whole = unit[1:] == (0, counts[unit[0]])
        return shard_bytes[unit[0]] if whole else (part_bytes or share)(*unit)

    direct, cached = [], []
    for epoch in range(nepochs):
        direct.append([0] * nodes)
        cached.append([0] * nodes)
        if split == "samples":
            reads = node_reads(
                counts, world=world, node_ranks=node_ranks, batch_size=batch_size, epoch=epoch, seed=seed,
                remainder=remainder, shard_order=shard_order,
            )  # fmt: skip
        for node in range(nodes):
            if split == "samples":
                direct[epoch][node] = sum(share(*piece) for piece, _ in reads[node])
                touched = [unit for _, unit in reads[node]]
            else:
                ranks = range(node * node_ranks, (node + 1) * node_ranks)
                shards = sorted(s for r in ranks for s in split_by_rank(range(len(counts)), r, world))
                direct[epoch][node] = dsrepeat * sum(shard_bytes[s] for s in shards)
                touched = [(s, 0, counts[s]) for s in shards]
            if cache_bytes is not None:
                cached[epoch][node] = caches[node].fetch(touched, bytes_of)
    return Egress(
        node_ranks=node_ranks,
        shard_order=shard_order,
        dataset=sum(shard_bytes),
        cache_bytes=cache_bytes,
        direct=tuple(map(tuple, direct)),
        cached=tuple(map(tuple, cached)) if cache_bytes is not None else None,
    )


def simulate_egress(sim: Simulation, shard_bytes: int, cache_bytes: int | None) -> Egress:
    """node_egress for a simulation's layout and settings, every shard ``shard_bytes`` long."""
    st = sim.settings
    return node_egress(
        sim.layout.counts,
        [shard_bytes] * len(sim.layout.counts),
        world=st.size,
        node_ranks=st.node_ranks,
        batch_size=st.batch_size,
        nepochs=st.nepochs,
        seed=st.seed,
        split=st.split,
        remainder=st.remainder,
        shard_order=st.shard_order,
        dsrepeat=st.dsrepeat,
        cache_bytes=cache_bytes,
    )


def size_text(n: float) -> str:
    """Bytes in decimal units, three figures: 4.00 GB, 128 GB, 512 B."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n} PB"  # unreachable: TB takes the rest


def egress_lines(e: Egress, verbose: bool = False, shown: int = 6) -> list[str]:
    """The report's lines: per node and epoch, without a cache / with it, and the totals."""
    nodes, nepochs = e.nodes, len(e.direct)
    cache = f"a cache of {size_text(e.cache_bytes)} per node (LRU)" if e.cache_bytes is not None else "no cache"
    head = (
        f"store egress (shard-order {e.shard_order}; {plural(nodes, 'node')} of {plural(e.node_ranks, 'rank')}; "
        f"data set {size_text(e.dataset)}; {cache}):"
    )
    lines = [head, "  each cell: bytes from the store without a cache" + (" / with it" if e.cached else "")]

    def cell(epoch: int | None, node: int | None) -> str:
        def pick(table):
            rows = table if epoch is None else [table[epoch]]
            return sum(row[n] for row in rows for n in (range(nodes) if node is None else [node]))

        return size_text(pick(e.direct)) + (f" / {size_text(pick(e.cached))}" if e.cached else "")

    names = [f"epoch {i}" for i in range(nepochs)] + ["in all"]
    rows = list(range(nodes))
    if not verbose and nodes > shown:
        rows = rows[: shown // 2] + [None] + rows[-(shown // 2) :]
    table = [["node", *names]]
    for node in rows:
        if node is None:
            table.append(["...", *["" for _ in names]])
            continue
        table.append([str(node), *(cell(i, node) for i in range(nepochs)), cell(None, node)])
    table.append(["all", *(cell(i, None) for i in range(nepochs)), cell(None, None)])
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in table]
    dataset = e.dataset or 1
    summary = (
        f"  over {plural(nepochs, 'epoch')}: {sum(map(sum, e.direct)) / dataset:.2f} x the data set without a cache"
    )
    if e.cached:
        summary += f", {sum(map(sum, e.cached)) / dataset:.2f} x with it"
    return [*lines, summary]
