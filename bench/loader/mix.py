#!/usr/bin/env python3
"""What mixing several data sets costs (issue 30): ours with three sources (weights 0.6/0.3/0.1)
against ours on one source of the same images, and MosaicML Streaming's and LitData's own mixing
on the same images. Run with ``./run mix.py`` (see --help); the report: bench/results/*-mixing.md.

The images are bench.py's noise set (``prepare``: written once under data/bench/). Its shards are
split into three sources by shard (about 60/30/10 % of them): an index per source beside the
shards (mix-NAME.index.json) for ours, and a tree of links to the same JPEG files per source
(data/bench/mix/NAME/tree) from which bench/loader/peers.py's writers make each peer's own format once
(MDS for Streaming, litdata optimize for LitData). The single-source contenders read the whole set
(ours: its index; the peers: bench.py's conversions, data/bench/peers/).

Every contender does one epoch of --samples samples (default: the data set's size) in its own
subprocess: decode, RandomResizedCrop(224) + flip, uint8 batches of --batch, --workers DataLoader
workers. Rows: samples/s from the first batch to the epoch's end (start-up apart, given as "first
batch"), and each source's realised share of the samples. Contenders run in rounds, interleaved
(A B C ... A B C ...), so a busy minute of a shared machine lands on all of them; the table gives
each one's median round and the median over rounds of its ratio to ours-single in the same round.
"""
# Above the size guide on purpose: one script, every contender's loader beside the others with the
# same timing code.

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402
from bench.loader import peervenv  # noqa: E402

NAMES = ("a", "b", "c")
WEIGHTS = (0.6, 0.3, 0.1)
OURS = ("ours-single", "ours-mixed", "ours-stratified")
PEERS = ("streaming-single", "streaming-mixed", "litdata-single", "litdata-mixed")
CONTENDERS = OURS + PEERS
LABELS = {
    "ours-single": "ours, one source (the whole set)",
    "ours-mixed": "ours, 3 sources, mix=sample",
    "ours-stratified": "ours, 3 sources, mix=stratified",
    "streaming-single": "Streaming, one stream",
    "streaming-mixed": "Streaming, 3 streams (proportion)",
    "litdata-single": "LitData, one dataset",
    "litdata-mixed": "LitData, CombinedStreamingDataset(weights)",
}


# ---------------------------------------------------------------- the sources, once


def bench_info(data: Path, images: int) -> dict:
    from bench.loader import bench  # noqa: PLC0415  (bench/: its data set, written once)

    return bench.prepare(data, images, "noise")


def split_sources(info: dict) -> dict[str, dict]:
    """The set's shards in three sources by shard, about 60/30/10 % of them (at least one each):
    per source an index beside the shards and a tree of links to its images (for the peers)."""
    index_file = Path(info["index"])
    index = json.loads(index_file.read_text())
    shards = index["shardlist"]
    n = len(shards)
    first = max(1, round(n * WEIGHTS[0]))
    second = max(1, min(n - first - 1, round(n * WEIGHTS[1])))
    parts = dict(zip(NAMES, (shards[:first], shards[first : first + second], shards[first + second :]), strict=True))
    out: dict[str, dict] = {}
    for name, part in parts.items():
        spec = index_file.parent / f"mix-{name}.index.json"
        if not spec.exists() or json.loads(spec.read_text())["shardlist"] != part:
            spec.write_text(json.dumps(index | {"shardlist": part}, indent=1))
        tree = Path(info["tree"]).parent / "mix" / name / "tree"
        keys = []
        for shard in part:
            with tarfile.open(index_file.parent / shard["url"]) as tar:
                keys += sorted({m.name.split(".", 1)[0] for m in tar.getmembers() if m.name.endswith(".jpg")})
        links = {k: next(Path(info["tree"]).glob(f"class*/{k}.jpg")) for k in keys}
        ready = tree / "links.json"
        if not ready.exists() or json.loads(ready.read_text()) != sorted(links):
            for target in links.values():
                link = tree / target.parent.name / target.name
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.is_symlink():
                    link.symlink_to(target)
            ready.write_text(json.dumps(sorted(links)))
        out[name] = {"spec": str(spec), "tree": str(tree), "shards": len(part), "images": len(keys)}
    return out


# ---------------------------------------------------------------- one contender (in a subprocess)


def loader_for(name: str, info: dict, parts: dict[str, dict], args: argparse.Namespace):
    """An iterable over batches; ``(images, source ids or None)`` of a batch by ``unpack``."""
    if name in OURS:
        from wdsdist.data import Loader, LoaderConfig, Source

        cfg = LoaderConfig(
            mode="epoch",
            batch_size=args.batch,
            workers=args.workers,
            image_size=224,
            epoch_samples=args.samples if name != "ours-single" else None,
            mix="stratified" if name == "ours-stratified" else "sample",
        )
        if name == "ours-single":
            return Loader(info["index"], cfg, rank=0, world=1)
        sources = [Source(n, parts[n]["spec"], weight=w) for n, w in zip(NAMES, WEIGHTS, strict=True)]
        return Loader(sources, cfg, rank=0, world=1)
    from bench.loader import peers  # noqa: PLC0415  (bench/loader/peers.py, in .bench-venv)

    if name.startswith("streaming"):
        if name == "streaming-single":
            locals_ = [(str(peers.folder_of("streaming", info) / "data"), 1.0)]
        else:
            locals_ = [
                (str(peers.folder_of("streaming", parts[n]) / "data"), w) for n, w in zip(NAMES, WEIGHTS, strict=True)
            ]
        return _streaming(locals_, args)
    if name == "litdata-single":
        dirs = [str(peers.folder_of("litdata", info) / "data")]
        return _litdata(dirs, None, args)
    dirs = [str(peers.folder_of("litdata", parts[n]) / "data") for n in NAMES]
    return _litdata(dirs, list(WEIGHTS), args)


def _streaming(locals_: list[tuple[str, float]], args: argparse.Namespace):
    from streaming import Stream, StreamingDataLoader, StreamingDataset

    from bench.loader import peers  # noqa: PLC0415

    class Images(StreamingDataset):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.transform = peers.torch_transform()

        def __getitem__(self, i):
            sample = super().__getitem__(i)
            shard, _ = self.spanner[i]
            stream = int(self.stream_per_shard[shard])
            return peers.decode_crop(sample["jpg"], self.transform), sample["cls"], stream

    # Its documented mixing: streams with proportions, epoch_size the mixed epoch's samples.
    streams = [Stream(local=local, proportion=p) for local, p in locals_]
    ds = Images(streams=streams, epoch_size=args.samples, shuffle=True, batch_size=args.batch)
    return StreamingDataLoader(ds, batch_size=args.batch, num_workers=args.workers, drop_last=True)


def _litdata(dirs: list[str], weights: list[float] | None, args: argparse.Namespace):
    import litdata as ld

    from bench.loader import peers  # noqa: PLC0415

    transform = peers.torch_transform()

    class Images(ld.StreamingDataset):
        def __init__(self, input_dir, source):
            super().__init__(input_dir, shuffle=True, drop_last=True)
            self.source = source

        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return transform(sample["image"]), sample["cls"], self.source

    datasets = [Images(d, s) for s, d in enumerate(dirs)]
    if weights is None:
        ds = datasets[0]
    else:
        # Its documented weighted mix: iterate_over_all=False (weights are refused otherwise); an
        # epoch then ends when the first of its datasets runs out in a worker.
        ds = ld.CombinedStreamingDataset(datasets, weights=weights, iterate_over_all=False)
    return ld.StreamingDataLoader(ds, batch_size=args.batch, num_workers=args.workers, drop_last=True)


def unpack(batch) -> tuple:
    if isinstance(batch, dict):
        return batch["image"], batch.get("source")
    return batch[0], batch[2]


def run_one(name: str, info: dict, parts: dict[str, dict], args: argparse.Namespace) -> dict:
    """One epoch of ``args.samples`` samples (whole batches). LitData's weighted epoch ends at its
    first exhausted dataset, shorter than that: its next epochs follow, started as a user's loop
    would, until the samples are in."""
    from memory import TreeMemory  # noqa: PLC0415  (bench/: the CPU time of a process tree, this one and its workers)

    tree = TreeMemory()
    start, cpu_start = time.perf_counter(), tree.cpu()
    loader = loader_for(name, info, parts, args)
    want = args.samples // args.batch
    n, first, shares, epochs, shape = 0, None, Counter(), 0, None
    while n < want:
        epochs += 1
        got_any = False
        for batch in loader:
            images, source = unpack(batch)
            got_any = True
            if first is None:
                first, cpu_first, shape = (
                    time.perf_counter(),
                    tree.cpu(),
                    "x".join(map(str, images.shape)) + f" {images.dtype}",
                )
            n += 1
            if source is not None:
                shares.update(source.tolist())
            if n == want:
                break
        if not got_any:
            raise RuntimeError(f"{name}: an epoch without batches")
    end, cpu_end = time.perf_counter(), tree.cpu()
    total = sum(shares.values())
    return {
        "samples_per_s": (n - 1) * args.batch / (end - first),
        "first_batch_s": first - start,
        "with_start_samples_per_s": n * args.batch / (end - start),
        # CPU time of the process and its workers per sample: what a busy machine's load does not
        # stretch, as it stretches wall time (memory.TreeMemory.cpu)
        "cpu_ms_per_sample": (cpu_end - cpu_first) * 1000 / ((n - 1) * args.batch),
        "cpu_ms_per_sample_with_start": (cpu_end - cpu_start) * 1000 / (n * args.batch),
        "batches": n,
        "epochs": epochs,
        "batch": shape,
        "shares": {NAMES[s]: c / total for s, c in sorted(shares.items())} if total and "single" not in name else {},
    }


# ---------------------------------------------------------------- rounds and the table


def subprocess_run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    last = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
    if out.returncode == 0 and last and last[0].startswith("{"):
        return json.loads(last[0])
    print(out.stderr, file=sys.stderr)
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
    return {"error": lines[-1] if lines else f"exit status {out.returncode}"}


def common(args: argparse.Namespace) -> list[str]:
    return ["--images", str(args.images), "--samples", str(args.samples), "--batch", str(args.batch)] + [
        "--workers",
        str(args.workers),
        "--data",
        args.data,
    ]


def convert(name: str, parts: dict[str, dict], info: dict) -> dict:
    """Each peer's format (peers.convert) for the whole set and for each source, once."""
    from bench.loader import peers  # noqa: PLC0415

    done = {"all": peers.convert(name, info)}
    for part, source in parts.items():
        done[part] = peers.convert(name, source)
    return done


def median(rs: list[dict]) -> dict:
    return sorted(rs, key=lambda r: r["samples_per_s"])[(len(rs) - 1) // 2]


def ratio_of(rs: list[dict], base: list[dict]) -> str:
    """The median over rounds of each round's ratio (rounds minutes apart, not a whole run)."""
    ratios = sorted(
        r["samples_per_s"] / b["samples_per_s"]
        for r, b in zip(rs, base, strict=False)
        if "samples_per_s" in r and "samples_per_s" in b
    )
    return f"{ratios[(len(ratios) - 1) // 2]:.3f}" if ratios else "-"


def table(rounds: dict[str, list[dict]], args: argparse.Namespace, info: dict, parts: dict) -> str:
    base = rounds.get("ours-single", [])
    lines = [
        f"{args.images} JPEGs ({info['mean_kb']} KB mean), sources "
        + ", ".join(
            f"{n}: {p['shards']} shards / {p['images']} images, weight {w}"
            for (n, p), w in zip(parts.items(), WEIGHTS, strict=True)
        )
        + f"; one epoch of {args.samples} samples, batch {args.batch}, {args.workers} workers, "
        f"{os.cpu_count()} cores, {cpu_model()}; median of {args.repeat} rounds",
        "",
        "| contender | samples/s (median, range) | ratio to ours-single | ratio to its own single | "
        "CPU ms/sample (median) | first batch | per-source shares realised (a/b/c) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in rounds.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            err = next((r["error"] for r in rs), "not run")
            lines.append(f"| {LABELS[name]} | failed: {err} | | | | | |")
            continue
        m = median(good)
        rates = [r["samples_per_s"] for r in good]
        cpus = sorted(r["cpu_ms_per_sample"] for r in good if "cpu_ms_per_sample" in r)
        cpu = f"{cpus[(len(cpus) - 1) // 2]:.2f}" if cpus else "-"
        ratio = ratio_of(rs, base)
        own = ratio_of(rs, rounds.get(name.split("-")[0] + "-single", []))
        shares = "/".join(f"{m['shares'].get(n, 0):.3f}" for n in NAMES) if m["shares"] else "-"
        extra = f" ({m['epochs']} epochs)" if m["epochs"] > 1 else ""
        lines.append(
            f"| {LABELS[name]} | {m['samples_per_s']:.0f} ({min(rates):.0f}-{max(rates):.0f}) | {ratio} | {own} | "
            f"{cpu} | {m['first_batch_s']:.2f} s | {shares}{extra} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000, help="images in bench.py's data set (default: %(default)s)")
    p.add_argument("--samples", type=int, default=None, help="samples in the epoch (default: --images)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5, help="rounds over all contenders (default: %(default)s)")
    p.add_argument("--only", nargs="*", choices=CONTENDERS, help="run only these contenders")
    p.add_argument("--no-peers", action="store_true", help="ours only (no .bench-venv needed)")
    p.add_argument("--data", default=str(ROOT / "data" / "bench"))
    p.add_argument("--json", default=str(ROOT / "outputs" / "bench" / "mixing.json"))
    p.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)  # internal: one contender
    p.add_argument("--convert", choices=("streaming", "litdata"), help=argparse.SUPPRESS)  # internal
    args = p.parse_args()
    args.samples = args.samples or args.images
    return args


def main() -> int:
    args = parse_args()
    info = bench_info(Path(args.data), args.images)
    parts = split_sources(info)
    if args.convert:
        print(json.dumps(convert(args.convert, parts, info)))
        return 0
    if args.run:
        print(json.dumps(run_one(args.run, info, parts, args)))
        return 0
    names = args.only or list(OURS if args.no_peers else CONTENDERS)
    extra: dict = {"sources": parts}
    if any(n in PEERS for n in names):
        extra["bench_venv"] = peervenv.ensure()
        for peer in sorted({n.split("-")[0] for n in names if n in PEERS}):
            print(f"{peer}: converting (once) ...", file=sys.stderr, flush=True)
            extra.setdefault("conversions", {})[peer] = subprocess_run(
                [str(peervenv.python()), __file__, "--convert", peer] + common(args)
            )
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    load = []
    for round_ in range(args.repeat):
        for name in names:
            python = str(peervenv.python()) if name in PEERS else sys.executable
            load.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{args.repeat}: {LABELS[name]} ...", file=sys.stderr, flush=True)
            rounds[name].append(subprocess_run([python, __file__, "--run", name] + common(args)))
    text = table(rounds, args, info, parts)
    text += f"\n\nload average (1 min) before each run: {min(load):.2f}-{max(load):.2f}"
    print("\n" + text)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    report = {
        "config": vars(args) | {"cores": os.cpu_count(), "cpu": cpu_model()},
        "data": info,
        "rounds": rounds,
        "load": load,
    } | extra
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
