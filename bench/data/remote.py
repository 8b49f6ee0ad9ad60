#!/usr/bin/env python3
"""Shards from a far store: the benchmark's data set (bench/loader/bench.py's JPEGs, written once under
--data) served over HTTP from the store namespace of tests/helpers/cluster.py, behind a tbf rate
(--rate) and a relay adding --delay seconds each way; each contender reads it for --epochs
epochs in a node namespace, one after another. ``./run remote.py`` (root; see --help).

Contenders: ``ours-local`` (the Loader on the same shards read from the local disk: the figure a
cached epoch is held to), ``ours`` (the Loader, epoch mode, no cache), ``ours-cache`` (loader.cache_dir in a
fresh folder, loader.cache_ahead 2), ``wds`` (webdataset's WebDataset over the same URLs),
``wds-cache`` (its cache_dir), and the peers that read an object store: ``streaming`` (MosaicML
Streaming) and ``litdata`` (LitData), each its own format of the same images (bench/loader/peers.py's
conversion, once, cached under --data) from an S3 API server (moto) in the store's namespace,
behind the same link and a relay with the same delay, into its own cache in a fresh folder. They
run in .bench-venv (bench/loader/peervenv.py, made here if missing). Per epoch: samples/s, the first
batch's seconds, and the bytes the node received from the store (its link's counter: headers and
TCP included). Every contender: RandomResizedCrop(224) + flip, batches of --batch, --workers
DataLoader workers.
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

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

PEERS = ("streaming", "litdata")  # in .bench-venv, from the S3 API server
CONTENDERS = ("ours-local", "ours", "ours-cache", "wds", "wds-cache", *PEERS)
S3_PORT, S3_DELAY_PORT, BUCKET = 9000, 9001, "bench"
# Fake keys for the local S3 API server; the machine's own AWS configuration kept out.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def rx_bytes() -> int:
    """Bytes this namespace's link has received: everything the store sent it."""
    return int(Path("/sys/class/net/eth0/statistics/rx_bytes").read_text())


def loader(name: str, index: str, cache: str, batch: int, workers: int):
    if name in PEERS:  # index: the s3:// folder of the peer's format
        from bench.loader import peers  # in .bench-venv

        return peers.remote_loader(name, index, cache, workers, batch)
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
    p.add_argument("--upload", nargs="+", help=argparse.SUPPRESS)  # internal: ENDPOINT NAME=FOLDER...
    return p.parse_args()


def start_s3(args: argparse.Namespace, c, formats: dict[str, Path]) -> str:
    """An S3 API server (moto) in the store's namespace holding each peer's format under
    s3://BUCKET/NAME/, uploaded there on the store's own address (not over the link); the
    endpoint to read it through a relay with the shards' delay."""
    c.spawn("store", "s3", [sys.executable, "-m", "moto.server", "-H", c.addr("store"), "-p", str(S3_PORT)], S3_ENV)
    c.wait_listening("store", S3_PORT)
    direct = f"http://{c.addr('store')}:{S3_PORT}"
    pairs = [f"{name}={folder}" for name, folder in formats.items()]
    if c.spawn("store", "upload", [sys.executable, __file__, "--upload", direct, *pairs], S3_ENV).wait(1800) != 0:
        raise RuntimeError(f"the upload to the S3 API server failed:\n{c.log('upload')[-3000:]}")
    return c.delay(args.delay, S3_DELAY_PORT, target=S3_PORT)


def upload(endpoint: str, pairs: list[str]) -> None:
    """In the store's namespace: each NAME=FOLDER's files to s3://BUCKET/NAME/."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    for pair in pairs:
        name, folder = pair.split("=", 1)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{name}/{path.relative_to(folder)}")


def run_contenders(args: argparse.Namespace, info: dict, cluster, formats: dict[str, Path]) -> list[dict]:
    """Each contender in the node's namespace, one after another, the store behind the link;
    their rows (an error naming the contender where one fails). ``formats``: each selected
    peer's converted data, served from the S3 API server."""
    import peervenv

    shards, rows = Path(info["index"]).parent, []
    with (
        tempfile.TemporaryDirectory(prefix="wdsdist-remote-") as work,
        cluster.Cluster(1, Path(work) / "cluster", serve=shards) as c,
    ):
        url = c.delay(args.delay)
        endpoint = start_s3(args, c, formats) if formats else None
        c.shape("store", args.rate)
        remote = f"{url}/{Path(info['index']).name}"
        for name in args.only or CONTENDERS:
            index = info["index"] if name == "ours-local" else remote
            python, env = sys.executable, None
            if name in PEERS:
                index, python = f"s3://{BUCKET}/{name}", str(peervenv.python())
                # Streaming reads S3_ENDPOINT_URL; LitData's boto3 and obstore, AWS_ENDPOINT_URL.
                env = S3_ENV | {"AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint}
            cache = Path(work) / f"cache-{name}"
            cache.mkdir()  # webdataset wants the folder made
            cmd = [python, str(Path(__file__).resolve()), "--run", name, "--index", index, "--cache", str(cache)]
            cmd += ["--epochs", str(args.epochs), "--batch", str(args.batch), "--workers", str(args.workers)]
            if c.spawn("n0", name, cmd, env).wait(1800) != 0:
                raise RuntimeError(f"{name} failed:\n{c.log(name)[-3000:]}")
            got = [json.loads(line) for line in c.log(name).splitlines() if line.startswith("{")]
            rows += got
            for row in got:
                print(json.dumps(row), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    return rows


def convert_peers(args: argparse.Namespace, info: dict, bench) -> dict[str, Path]:
    """Each selected peer's own format of the images, written once (bench.py's conversion, in
    .bench-venv, made here if missing); the folders to upload."""
    import peervenv

    from bench.loader import peers

    names = [n for n in args.only or CONTENDERS if n in PEERS]
    if not names:
        return {}
    peervenv.ensure()
    for name in names:
        print(f"{name}: converting the images (once) ...", file=sys.stderr, flush=True)
        done = bench.run_convert(name, "noise", argparse.Namespace(images=args.images, data=args.data))
        if "error" in done:
            raise RuntimeError(f"{name}'s conversion failed: {done['error']}")
    return {name: peers.folder_of(name, info) / "data" for name in names}


def print_table(rows: list[dict], info: dict, args: argparse.Namespace, formats: dict[str, Path]) -> None:
    shards = sorted(Path(info["index"]).parent.glob("*.tar"))
    data_mb = sum(p.stat().st_size for p in shards) / 1e6
    print(f"\n{info['images']} images, {data_mb:.0f} MB in {len(shards)} shards; store link "
          f"{args.rate}, +{args.delay * 1000:.0f} ms each way; {args.workers} workers, batch {args.batch}")  # fmt: skip
    for name, folder in formats.items():
        files = [f for f in folder.rglob("*") if f.is_file() and f.name != "index.json"]
        print(f"{name}: its own format, {sum(f.stat().st_size for f in files) / 1e6:.0f} MB in {len(files)} files")
    print("| contender | epoch | samples/s | first batch s | from the store MB |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['epoch']} | {r['samples_per_s']:.0f} | {r['first_batch_s']:.2f} | "
              f"{r['store_mb']:.0f} |")  # fmt: skip


def main() -> int:
    args = parse_args()
    if args.run:
        run_one(args)
        return 0
    if args.upload:
        upload(args.upload[0], args.upload[1:])
        return 0
    from tests.helpers import cluster

    why = cluster.unavailable()
    if why is not None:
        print(f"error: ./run remote.py {why}", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "bench" / "loader" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    info = bench.prepare(Path(args.data), args.images)
    try:
        formats = convert_peers(args, info, bench)
        rows = run_contenders(args, info, cluster, formats)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_table(rows, info, args, formats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
