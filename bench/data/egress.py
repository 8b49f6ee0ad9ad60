#!/usr/bin/env python3
"""What the store sends a cluster with a cache on each node, measured against simdist's plan:
N nodes x R ranks as N torchrun agents on this machine (``--nnodes N --nproc_per_node R``, a
static rendezvous on 127.0.0.1), each node with its own cache folder (loader.cache_dir) and its
own http store (a Range-honouring server of the same shards, on a port of its own, so the bytes
each node received are counted apart), reading --shards uneven shards for 3 epochs in epoch mode
with loader.split=samples (--rate: each store paced to that many bytes/s per connection).
``./run egress.py`` (see --help).

Each rank runs the public Loader (no training) and records every key it delivered, its batches
per epoch, each epoch's seconds and what its cache did. Per layout and shard order (node, and
global beside it): the bytes each store sent, simdist's plan for them (node_egress, the node's
parts priced by the index's offsets), the ratio to the data set, the first epoch's seconds, and
whether every epoch delivered every sample once plus each node's padding with equal batches.
Then, for the first layout: a warm rerun (the same caches), and a node killed with SIGKILL (its
agent's whole process tree) while its ranks download from a slowed store, then the whole job
run again on the caches it left.

The shards are noise JPEGs (--side pixels, quality 90), --min to --max samples each, with a
makeshards.py index (sample offsets every 16 samples, the default).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402
from tests.helpers import cluster  # noqa: E402
from tests.helpers.servers import CountingStore, Servers  # noqa: E402
from tests.helpers.training import free_port  # noqa: E402

LAYOUTS = ((2, 2), (4, 2), (3, 1))  # (nodes, ranks per node)
EPOCHS = 3


def make_data(folder: Path, shards: int, low: int, high: int, side: int, seed: int) -> tuple[Path, list[int]]:
    """Uneven shards of noise JPEGs and their index (makeshards.py --index); key s{shard}-{j}."""
    import numpy as np
    from PIL import Image

    from wdsdist.tools.makeshards import index_only

    index = folder / "u.index.json"
    rng = random.Random(seed)
    counts = [rng.randint(low, high) for _ in range(shards)]
    if index.exists():
        return index, json.loads((folder / "counts.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed)
    for i, n in enumerate(counts):
        with tarfile.open(folder / f"u-{i:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(n):
                out = io.BytesIO()
                Image.fromarray(pixels.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
                for suffix, data in (("jpg", out.getvalue()), ("cls", str(j % 10).encode())):
                    info = tarfile.TarInfo(f"s{i:03d}-{j:04d}.{suffix}")
                    info.size, info.mtime = len(data), 1
                    tar.addfile(info, io.BytesIO(data))
    index_only(str(folder / "u-*.tar"), str(index))
    (folder / "counts.json").write_text(json.dumps(counts))
    return index, counts


# ---------------------------------------------------------------- one rank (inside torchrun)


def rank_job(args: argparse.Namespace) -> None:
    from wdsdist.data import CACHE_COUNTS, Loader, LoaderConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = LoaderConfig(
        batch_size=args.batch, workers=args.workers, mode="epoch", split="samples", shard_order=args.order,
        node_ranks=int(os.environ["LOCAL_WORLD_SIZE"]), cache_dir=args.cache, image_size=32, with_keys=True,
        seed=args.seed,
    )  # fmt: skip
    loader = Loader(args.spec, cfg, rank=rank, world=world)
    epochs, cache = [], Counter()
    for _ in range(EPOCHS):
        started, keys, batches = time.monotonic(), [], 0
        for batch in loader:
            keys += batch["key"]
            batches += 1
            cache.update(dict(zip(CACHE_COUNTS, batch["cache"].tolist(), strict=True)))
        epochs.append({"keys": keys, "batches": batches, "seconds": time.monotonic() - started})
    (Path(args.out) / f"rank-{rank}.json").write_text(json.dumps({"epochs": epochs, "cache": cache}))


# ---------------------------------------------------------------- the cluster


def store_class(rate: int) -> type:
    """A CountingStore class with its own counts; ``rate`` (bytes/s, 0: as fast as it goes)."""
    sent: dict[str, int] = {}

    class Store(CountingStore):
        def end_headers(self) -> None:
            super().end_headers()
            if rate:
                self.wfile = _Paced(self.wfile, rate)

    Store.sent = sent
    return Store


class _Paced:
    """A file whose writes go out at ``rate`` bytes/s, 64 KiB at a time."""

    def __init__(self, raw, rate: int) -> None:
        self.raw, self.rate = raw, rate

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for at in range(0, len(view), 1 << 16):
            self.raw.write(view[at : at + (1 << 16)])
            self.raw.flush()
            time.sleep((1 << 16) / self.rate)
        return len(data)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def tar_bytes(sent: dict[str, int]) -> int:
    return sum(n for path, n in sent.items() if path.endswith(".tar"))


def launch(nodes: int, per_node: int, bases: list[str], caches: list[Path], out: Path, args, order: str) -> list:
    """The job's N torchrun agents, started (node n reads ``bases[n]`` through ``caches[n]``)."""
    port, agents = free_port(), []
    for node in range(nodes):
        argv = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={per_node}",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--rank-job",
            "--spec", f"{bases[node]}/u.index.json", "--cache", str(caches[node]), "--out", str(out),
            "--order", order, "--batch", str(args.batch), "--workers", str(args.workers), "--seed", str(args.seed),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        agents.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return agents


def finish(agents: list, timeout: float = 900) -> None:
    for agent in agents:
        _, err = agent.communicate(timeout=timeout)
        if agent.returncode:
            raise RuntimeError(f"a torchrun agent failed (exit {agent.returncode}): {err.decode()[-2000:]}")


def expected(counts: list[int], nodes: int, per_node: int, order: str, epoch: int, args) -> Counter:
    """Every key a whole epoch delivers: each node's share of the sequence, padded with its own
    first keys (node order), or the sequence padded with its first keys (global)."""
    from wdsdist.data.plan.order import epoch_order, node_order, node_parts, node_shares
    from wdsdist.data.plan.splits import rank_batches

    world, total = nodes * per_node, sum(counts)
    key = node_order(order, total, world, per_node, args.batch, "pad")
    parts = epoch_order(node_parts(counts, key, args.seed), args.seed, epoch)
    sequence = [f"s{i:03d}-{j:04d}" for i, a, b in parts for j in range(a, b)]
    slots = rank_batches(total, world, args.batch, "pad") * args.batch * world
    if key[0] == 1:
        return Counter(sequence[i % total] for i in range(slots))
    out, start = Counter(), 0
    for own in node_shares(total, key[0]):
        share = sequence[start : start + own]
        out.update(share[i % own] for i in range(slots // key[0]))
        start += own
    return out


def plan(index: Path, counts: list[int], nodes: int, per_node: int, order: str, args) -> list[int]:
    """simdist's plan of the bytes each node's cache fetches over the epochs."""
    from wdsdist.data.sources import shardspec
    from wdsdist.data.sources.spanread import part_span
    from wdsdist.simdist import node_egress

    shards = shardspec.expand(str(index))
    sizes = [os.path.getsize(s.url) for s in shards]

    def part_bytes(i: int, first: int, stop: int) -> int:
        lo, hi = part_span(shards[i], (first, stop))  # type: ignore[misc]
        return (sizes[i] if hi is None else hi) - lo

    e = node_egress(
        counts, sizes, world=nodes * per_node, node_ranks=per_node, batch_size=args.batch, nepochs=EPOCHS,
        seed=args.seed, shard_order=order, cache_bytes=1 << 50, part_bytes=part_bytes,
    )  # fmt: skip
    return [sum(row[n] for row in e.cached) for n in range(nodes)]  # type: ignore[union-attr]


def run(index, counts, nodes, per_node, order, caches, servers_of, args, work: Path) -> dict:
    """One job; what it delivered, what each store sent, and the plan."""
    out = Path(tempfile.mkdtemp(dir=work))
    bases, stores = servers_of(nodes)
    before = [tar_bytes(s.sent) for s in stores]
    started = time.monotonic()
    finish(launch(nodes, per_node, bases, caches, out, args, order))
    wall = time.monotonic() - started
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nodes * per_node)]
    sent = [tar_bytes(s.sent) - b for s, b in zip(stores, before, strict=True)]
    exact = all(
        Counter(k for r in ranks for k in r["epochs"][e]["keys"]) == expected(counts, nodes, per_node, order, e, args)
        for e in range(EPOCHS)
    )
    batches = {r["epochs"][e]["batches"] for r in ranks for e in range(EPOCHS)}
    first = max(r["epochs"][0]["seconds"] for r in ranks)
    later = max(r["epochs"][e]["seconds"] for r in ranks for e in range(1, EPOCHS))
    cache = sum((Counter(r["cache"]) for r in ranks), Counter())
    return {
        "nodes": nodes, "per_node": per_node, "order": order, "sent": sent, "wall_s": round(wall, 1),
        "exact": exact, "equal": len(batches) == 1, "first_epoch_s": round(first, 2), "later_epoch_s": round(later, 2),
        "corrupt": cache["corrupt"], "misses": cache["misses"], "hits": cache["hits"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--order", default="node", help=argparse.SUPPRESS)
    p.add_argument("--data", default="data/bench-egress", help="where the shards are written once")
    p.add_argument("--shards", type=int, default=16, help="shards (default: 16)")
    p.add_argument("--min", type=int, default=93, help="fewest samples in a shard (default: 93)")
    p.add_argument("--max", type=int, default=107, help="most samples in a shard (default: 107)")
    p.add_argument("--side", type=int, default=160, help="image side in pixels (default: 160)")
    p.add_argument("--batch", type=int, default=16, help="batch size per rank (default: 16)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="2x2,4x2,3x1", help="NODESxRANKS, comma-separated (default: 2x2,4x2,3x1)")
    p.add_argument("--rate", type=int, default=0, help="bytes/s each store sends a connection (0: as fast as it goes)")
    p.add_argument("--kill-rate", type=int, default=1 << 20, help="bytes/s of the slowed store for the kill")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args)
        return 0
    index, counts = make_data(ROOT / args.data, args.shards, args.min, args.max, args.side, args.seed)
    dataset = sum(os.path.getsize(ROOT / args.data / f"u-{i:06d}.tar") for i in range(args.shards))
    print(f"data: {args.shards} shards, {min(counts)}-{max(counts)} samples ({sum(counts)}), {dataset} bytes")
    print(f"machine: {cpu_model()} ({platform.machine()}), {os.cpu_count()} cores, python {platform.python_version()}")
    layouts = [tuple(int(n) for n in item.split("x")) for item in args.layouts.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="egress-") as tmp, Servers() as servers:
        work = Path(tmp)
        pool: dict[int, list] = {}

        def servers_of(nodes: int, rate: int = args.rate):
            key = (nodes, rate)
            if key not in pool:
                classes = [store_class(rate) for _ in range(nodes)]
                bases = [servers.start(lambda *a, c=c: c(*a, directory=str(ROOT / args.data))) for c in classes]
                pool[key] = [bases, classes]
            return pool[key]

        for nodes, per_node in layouts:
            for order in ("node", "global"):
                caches = [work / f"cache-{nodes}x{per_node}-{order}-{n}" for n in range(nodes)]
                r = run(index, counts, nodes, per_node, order, caches, servers_of, args, work)
                r["plan"] = plan(index, counts, nodes, per_node, order, args)
                r["ratio"] = round(sum(r["sent"]) / dataset, 3)
                r["plan_ratio"] = round(sum(r["plan"]) / dataset, 3)
                results.append(r)
                print(json.dumps(r), flush=True)
                if (nodes, per_node) == layouts[0] and order == "node":
                    warm = run(index, counts, nodes, per_node, order, caches, servers_of, args, work)
                    results.append({**warm, "warm": True})
                    print(json.dumps(results[-1]), flush=True)
        results.append(kill(index, counts, layouts[0], servers_of, args, work))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"dataset": dataset, "counts": counts, "results": results}, indent=1))
    return 0


def kill(index, counts, layout, servers_of, args, work: Path) -> dict:
    """Node 1 of ``layout`` killed (SIGKILL, its agent's whole tree) while its ranks download from a
    slowed store; what its cache folder held then; the whole job again on the caches left."""
    nodes, per_node = layout
    caches = [work / f"cache-kill-{n}" for n in range(nodes)]
    out = Path(tempfile.mkdtemp(dir=work))
    bases, _ = servers_of(nodes, args.kill_rate)
    agents = launch(nodes, per_node, bases, caches, out, args, "node")
    deadline = time.monotonic() + 300
    while not list(caches[1].glob("*.part-*")):
        if time.monotonic() > deadline:
            raise TimeoutError("no download in flight on node 1")
        time.sleep(0.05)
    cluster.kill_tree(agents[1].pid)
    agents[1].wait()
    parts = [p.name for p in caches[1].glob("*.part-*")]
    for agent in agents[:1]:
        cluster.kill_tree(agent.pid)  # node 0 alone cannot finish the job: ended too
        agent.wait()
    again = run(index, counts, nodes, per_node, "node", caches, servers_of, args, work)
    left = [p.name for c in caches for p in c.glob("*.part-*")]
    return {"kill": True, "parts_after_kill": len(parts), "parts_after_rerun": len(left), **again}


if __name__ == "__main__":
    raise SystemExit(main())
