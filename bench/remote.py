#!/usr/bin/env python3
"""Shards from a far store: the benchmark's data set (bench/bench.py's JPEGs, written once under
--data) served over HTTP from the store namespace of tests/helpers/cluster.py, behind a tbf rate
(--rate) and a relay adding --delay seconds each way; each contender reads it for --epochs
epochs in a node namespace, one after another. ``./run remote.py`` (root; see --help).

Contenders: ``ours-local`` (the Loader on the same shards read from the local disk: the figure a
cached epoch is held to), ``ours`` (the Loader, epoch mode, no cache), ``ours-cache`` (loader.cache_dir in a
fresh folder, loader.cache_ahead 2), ``wds`` (webdataset's WebDataset over the same URLs) and
``wds-cache`` (its cache_dir). Per epoch: samples/s, the first batch's seconds, and the bytes
the node received from the store (its link's counter: headers and TCP included). Every
contender: RandomResizedCrop(224) + flip, batches of --batch, --workers DataLoader workers.
Streaming and LitData (from an S3 API server) are not in this version.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONTENDERS = ("ours-local", "ours", "ours-cache", "wds", "wds-cache")


def rx_bytes() -> int:
    """Bytes this namespace's link has received: everything the store sent it."""
    return int(Path("/sys/class/net/eth0/statistics/rx_bytes").read_text())


def loader(name: str, index: str, cache: str, batch: int, workers: int):
    if name.startswith("ours"):
        from wdsdist.data import Loader, LoaderConfig

        extra = {"cache_dir": cache, "cache_ahead": 2} if name == "ours-cache" else {}
        cfg = LoaderConfig(mode="epoch", batch_size=batch, workers=workers, image_size=224, **extra)
        return Loader(index, cfg, rank=0, world=1)
    import webdataset as wds
    from torchvision import transforms as T

    from wdsdist.data import LoaderConfig, expand_shards

    urls = [s.url for s in expand_shards(index, LoaderConfig(batch_size=batch))]
    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
    kwargs = {"cache_dir": cache} if name == "wds-cache" else {}
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, **kwargs)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, lambda x: x)
        .batched(batch)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def run_one(args: argparse.Namespace) -> None:
    """In the node's namespace: --epochs epochs of one contender, a JSON line per epoch."""
    data = loader(args.run, args.index, args.cache, args.batch, args.workers)
    for epoch in range(args.epochs):
        before, start, first, samples = rx_bytes(), time.perf_counter(), None, 0
        for batch in data:
            if first is None:
                first = time.perf_counter() - start
            samples += len(batch["label"] if isinstance(batch, dict) else batch[1])
        seconds = time.perf_counter() - start
        row = {"contender": args.run, "epoch": epoch, "samples": samples, "samples_per_s": samples / seconds,
               "first_batch_s": first, "store_mb": (rx_bytes() - before) / 1e6}  # fmt: skip
        print(json.dumps(row), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="images in the data set (default: %(default)s)")
    p.add_argument("--data", default=str(ROOT / "data" / "bench"), help="bench.py's data folder (written once)")
    p.add_argument("--rate", default="200mbit", help="the store's link (tc tbf rate; default: %(default)s)")
    p.add_argument("--delay", type=float, default=0.02, help="seconds added each way (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--only", nargs="*", choices=CONTENDERS, help="run only these")
    p.add_argument("--json", type=Path, help="write the rows here too")
    p.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)  # internal: one contender
    p.add_argument("--index", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    return p.parse_args()


def run_contenders(args: argparse.Namespace, info: dict, cluster) -> list[dict]:
    """Each contender in the node's namespace, one after another, the store behind the link;
    their rows (an error naming the contender where one fails)."""
    shards, rows = Path(info["index"]).parent, []
    with (
        tempfile.TemporaryDirectory(prefix="wdsdist-remote-") as work,
        cluster.Cluster(1, Path(work) / "cluster", serve=shards) as c,
    ):
        url = c.delay(args.delay)
        c.shape("store", args.rate)
        remote = f"{url}/{Path(info['index']).name}"
        for name in args.only or CONTENDERS:
            index = info["index"] if name == "ours-local" else remote
            cache = Path(work) / f"cache-{name}"
            cache.mkdir()  # webdataset wants the folder made
            cmd = [sys.executable, str(Path(__file__).resolve()), "--run", name, "--index", index, "--cache"]
            cmd += [
                str(cache),
                "--epochs",
                str(args.epochs),
                "--batch",
                str(args.batch),
                "--workers",
                str(args.workers),
            ]
            if c.spawn("n0", name, cmd).wait(1800) != 0:
                raise RuntimeError(f"{name} failed:\n{c.log(name)[-3000:]}")
            got = [json.loads(line) for line in c.log(name).splitlines() if line.startswith("{")]
            rows += got
            for row in got:
                print(json.dumps(row), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    return rows


def print_table(rows: list[dict], info: dict, args: argparse.Namespace) -> None:
    shards = sorted(Path(info["index"]).parent.glob("*.tar"))
    data_mb = sum(p.stat().st_size for p in shards) / 1e6
    print(f"\n{info['images']} images, {data_mb:.0f} MB in {len(shards)} shards; store link "
          f"{args.rate}, +{args.delay * 1000:.0f} ms each way; {args.workers} workers, batch {args.batch}")  # fmt: skip
    print("| contender | epoch | samples/s | first batch s | from the store MB |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['epoch']} | {r['samples_per_s']:.0f} | {r['first_batch_s']:.2f} | "
              f"{r['store_mb']:.0f} |")  # fmt: skip


def main() -> int:
    args = parse_args()
    if args.run:
        run_one(args)
        return 0
    from tests.helpers import cluster

    why = cluster.unavailable()
    if why is not None:
        print(f"error: ./run remote.py {why}", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "bench" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    info = bench.prepare(Path(args.data), args.images)
    try:
        rows = run_contenders(args, info, cluster)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_table(rows, info, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
