"""Conversion to shards, side by side (``./run bench.py --conversion``): an ImageFolder tree of the
photos set (bench/loader/photos.py) written as shards by ours (wds-makeshards --source with 1 and 2
workers; also 2 workers with --verify header, the check the others do not make), webdataset's
``ShardWriter`` in one process (its documented loop: read each file, write it), and LitData's
``optimize`` with the same workers (in .bench-venv, bench/loader/peervenv.py). Each row is a fresh
subprocess writing into a fresh folder; rows run in rounds (--repeat), interleaved, and the table
gives each one's median round: images/s and MB/s (of the source's bytes), and ours' ratio.

``python bench/loader/conversion.py --writer NAME --tree TREE --out DIR --workers N`` is one peer's row (run
by ``measure``, LitData's in .bench-venv's Python; its time is taken from outside).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (row, writer, workers, extra makeshards options)
ROWS = (
    ("ours, 1 worker", "ours", 1, ()),
    ("ours, 2 workers", "ours", 2, ()),
    ("ours, 2 workers, --verify header", "ours", 2, ("--verify", "header")),
    ("webdataset ShardWriter, 1 process", "shardwriter", 1, ()),
    ("LitData optimize, 1 worker", "litdata", 1, ()),
    ("LitData optimize, 2 workers", "litdata", 2, ()),
)
MAXCOUNT = 200  # samples per shard for every writer: 10 shards of the default 2000, work for 2 workers
CHUNK_BYTES = 64 << 20  # LitData's chunks, as bench/loader/peers.py writes them


def tree_samples(tree: Path) -> list[tuple[str, int]]:
    """The tree's images with their labels, classes in sorted order (ImageFolder's)."""
    classes = sorted(p.name for p in tree.iterdir() if p.is_dir())
    return [(str(f), c) for c, name in enumerate(classes) for f in sorted((tree / name).iterdir()) if f.is_file()]


def _shardwriter(tree: Path, out: Path) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=MAXCOUNT, verbose=0) as sink:
        for i, (path, label) in enumerate(tree_samples(tree)):
            sink.write({"__key__": f"{i:08d}", "jpg": Path(path).read_bytes(), "cls": str(label)})


def _litdata_sample(item: tuple[str, int]) -> dict:
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "cls": label}


def _litdata(tree: Path, out: Path, workers: int) -> None:
    import litdata as ld

    # LitData's documented image path (as bench/loader/peers.py): PIL images from the function, stored as
    # their JPEG bytes; the same number of worker processes as ours.
    ld.optimize(
        fn=_litdata_sample, inputs=tree_samples(tree), output_dir=str(out), chunk_bytes=CHUNK_BYTES, num_workers=workers
    )


def run_row(writer: str, tree: Path, out: Path, workers: int, extra: tuple[str, ...]) -> float:
    """One row's seconds, in a fresh subprocess (ours: the command itself)."""
    shutil.rmtree(out, ignore_errors=True)
    if writer == "ours":
        cmd = [sys.executable, str(ROOT / "makeshards.py"), "--source", str(tree), "--shards", str(out)]
        cmd += ["--workers", str(workers), "--maxcount", str(MAXCOUNT), "--prefix", "photos", *extra]
    else:
        import peervenv

        python = str(peervenv.python()) if writer == "litdata" else sys.executable
        cmd = [python, __file__, "--writer", writer, "--tree", str(tree), "--out", str(out), "--workers", str(workers)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{writer}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def measure(tree: Path, scratch: Path, repeat: int, only: list[str] | None = None) -> dict[str, dict]:
    """Every row ``repeat`` times, interleaved; each row's median round."""
    nbytes = sum(os.path.getsize(p) for p, _ in tree_samples(tree))
    n = len(tree_samples(tree))
    rows = [r for r in ROWS if not only or r[1] in only]
    times: dict[str, list[float]] = {r[0]: [] for r in rows}
    errors: dict[str, str] = {}
    for _ in range(repeat):
        for label, writer, workers, extra in rows:
            if label in errors:
                continue
            try:
                times[label].append(run_row(writer, tree, scratch / "out", workers, extra))
            except (RuntimeError, OSError) as exc:
                errors[label] = str(exc)
    results = {}
    for label, secs in times.items():
        if label in errors:
            results[label] = {"error": errors[label]}
            continue
        median = sorted(secs)[(len(secs) - 1) // 2]
        results[label] = {"seconds": median, "images_per_s": n / median, "mb_per_s": nbytes / median / 1e6}
        results[label] |= {"rounds_s": secs, "images": n, "source_mb": nbytes / 1e6}
    return results


def print_table(results: dict[str, dict], info: str) -> None:
    print(f"\nconversion to shards: {info}; median of the rounds")
    header = f"{'writer':36} {'images/s':>9} {'MB/s':>7} {'seconds':>8} {'x ours 1':>8}"
    print(header)
    print("-" * len(header))
    base = results.get(ROWS[0][0], {}).get("images_per_s")
    for label, r in results.items():
        if "error" in r:
            print(f"{label:36} failed: {r['error']}")
            continue
        x = f"{r['images_per_s'] / base:.2f}" if base else "-"
        print(f"{label:36} {r['images_per_s']:9.1f} {r['mb_per_s']:7.1f} {r['seconds']:8.2f} {x:>8}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writer", choices=["shardwriter", "litdata"], required=True)
    p.add_argument("--tree", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    if args.writer == "shardwriter":
        _shardwriter(Path(args.tree), Path(args.out))
    else:
        _litdata(Path(args.tree), Path(args.out), args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
