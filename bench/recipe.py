#!/usr/bin/env python3
"""What the recipe's tools cost and what they do, on this machine (issue 57's report).

    ./run recipe.py                              # every part: the report's tables, as markdown
    ./run recipe.py --parts aug loader --rounds 5
    ./run recipe.py --parts digits --seeds 5     # runs already in --runs are taken as they are

Parts:
  aug      each augmentation's CPU time per sample in one worker's loop (the loader's own
           per-sample path, delivery/prep.py: region decode, crop, flip, the augmentation),
           on the bench's JPEGs (bench.py's noise set, 500 x 375), at 224 pixels
  loader   the training loader's samples/s with TrivialAugment off and on (all cores' workers)
  compile  the default job (./run train.py) eager and with trainer.compile=true: samples/s once
           running (the log's windows after the first), and the first step's time
  default  the default job (./run train.py) over --seeds seeds: val top-1 and samples/s (each
           sample's draws from its own seed since issue 57)
  digits   accuracy where data is small: scikit-learn's digits (10 classes, 120 training and 54
           held-out scans each), today's recipe against TrivialAugment, mixup/cutmix and EMA,
           each alone and together, over --seeds seeds; mean and spread (with EMA, the EMA's top-1)
Rounds of a part interleave their settings, so a slow minute of a shared machine lands on all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import cpu_model  # noqa: E402

AUGMENTS = {  # setting -> (data.augment, data.random_erase)
    "crop + flip (none)": ("none", 0.0),
    "+ trivialaugment": ("trivialaugment", 0.0),
    "+ randaugment (n 2, m 9)": ("randaugment", 0.0),
    "+ autoaugment": ("autoaugment", 0.0),
    "+ random erasing 0.25": ("none", 0.25),
    "+ trivialaugment + erasing 0.25": ("trivialaugment", 0.25),
}
DIGITS = {  # setting -> train.py overrides on top of today's recipe
    "today's recipe": [],
    "+ trivialaugment": ["data.augment=trivialaugment"],
    "+ mixup 0.2 / cutmix 1.0": ["trainer.mixup=0.2", "trainer.cutmix=1.0"],
    "+ EMA 0.99": ["trainer.ema.decay=0.99"],
    "+ all three": ["data.augment=trivialaugment", "trainer.mixup=0.2", "trainer.cutmix=1.0", "trainer.ema.decay=0.99"],
}
DIGIT_RUN = ["trainer.device=cpu", "trainer.workers=1", "trainer.batch_size=32", "trainer.steps=200"]
DIGIT_RUN += ["trainer.eval_every=0", "trainer.ckpt_every=0", "data.image_size=32", "data.crop_scale=[0.6,1.0]"]


def bench_data() -> dict:
    """bench.py's noise set (written once into data/bench/)."""
    import bench

    return bench.prepare(ROOT / "data" / "bench", 2000, "noise")


def aug_part(args: argparse.Namespace) -> dict:
    """ms of CPU per sample in one process, each setting's median over rounds."""
    import torch
    import webdataset as wds

    from wdsdist.data.delivery.prep import SamplePrep
    from wdsdist.data.options import LoaderConfig
    from wdsdist.data.sources import shardspec

    torch.set_num_threads(1)  # as in a DataLoader worker
    urls = [s.url for s in shardspec.expand(bench_data()["index"])]
    samples = list(wds.WebDataset(urls[:1], shardshuffle=False, empty_check=False))[: args.samples]
    preps = {
        name: SamplePrep(LoaderConfig(batch_size=64, augment=a, random_erase=e), 0, 0, 1, 0, in_worker=True)
        for name, (a, e) in AUGMENTS.items()
    }
    rounds: dict[str, list[float]] = {name: [] for name in preps}
    for r in range(args.rounds):
        for name, prep in preps.items():
            prep(dict(samples[0]), epoch=99, worker=0, seq=0, pos=-1)()  # its first: classes made, caches warm
            start = time.process_time()
            for i, sample in enumerate(samples):
                prep(dict(sample), epoch=r, worker=0, seq=i, pos=i)()
            rounds[name].append(1000 * (time.process_time() - start) / len(samples))
        print(f"aug: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    base = statistics.median(rounds["crop + flip (none)"])
    return {
        name: {"ms": statistics.median(ms), "spread": [min(ms), max(ms)], "added_ms": statistics.median(ms) - base}
        for name, ms in rounds.items()
    }


def loader_part(args: argparse.Namespace) -> dict:
    """samples/s of the training loader with TrivialAugment off and on, median over rounds."""
    import gc

    from wdsdist.data import Loader, LoaderConfig

    index, workers = bench_data()["index"], os.cpu_count() or 1
    rates: dict[str, list[float]] = {"none": [], "trivialaugment": []}
    for r in range(args.rounds):
        for augment in rates:
            cfg = LoaderConfig(batch_size=64, workers=workers, augment=augment, seed=r)
            loader = Loader(index, cfg, rank=0, world=1)
            batches = iter(loader)
            for _ in range(args.warmup):
                next(batches)
            start = time.perf_counter()
            for _ in range(args.batches):
                next(batches)
            rates[augment].append(64 * args.batches / (time.perf_counter() - start))
            del batches, loader
            gc.collect()
        print(f"loader: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    return {
        name: {"samples_per_s": statistics.median(v), "spread": [min(v), max(v)], "workers": workers}
        for name, v in rates.items()
    }


def train(run_dir: Path, *overrides: str) -> tuple[dict, str]:
    """train.py with these overrides; its summary and log."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"run_dir={run_dir}", *overrides],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"error: train.py {' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text()), (run_dir / "train.log").read_text()


def compile_part(args: argparse.Namespace) -> dict:
    """The default job eager and compiled: steady samples/s (the windows after the first log
    line's) and the first step's seconds."""
    out = {}
    for setting in ("false", "true"):
        summary, log = train(args.runs / f"compile-{setting}", f"trainer.compile={setting}")
        windows = [float(m) for m in re.findall(r"step \d+/\d+ .* (\d+) samples/s", log)][1:]
        first = float(re.search(r"the first step is done in ([\d.]+)s", log).group(1))
        out[setting] = {
            "steady_samples_per_s": statistics.median(windows),
            "first_step_s": first,
            "run_s": summary["seconds"],
            "val_top1": summary["val_top1"],
        }
        print(f"compile={setting}: {out[setting]}", file=sys.stderr, flush=True)
    return out


def default_part(args: argparse.Namespace) -> dict:
    """The default job's val top-1 and samples/s over the seeds."""
    runs = []
    for seed in range(args.seeds):
        summary, _ = train(args.runs / f"default-{seed}", f"seed={seed}")
        runs.append({"seed": seed, "val_top1": 100 * summary["val_top1"], "samples_per_s": summary["samples_per_s"]})
        print(f"default: {runs[-1]}", file=sys.stderr, flush=True)
    return {"runs": runs}


def digits_part(args: argparse.Namespace) -> dict:
    """val top-1 on the held-out digits of each setting over the seeds."""
    from tests.helpers.digits import digits_tree

    root = args.runs / "digits"
    if not (root / "shards" / "digits-val.index.json").exists():
        digits_tree(root, list(range(10)), train=120, val=54)
        for split in ("train", "val"):
            subprocess.run(
                [sys.executable, str(ROOT / "makeshards.py"), "--source", str(root / split), "--shards",
                 str(root / "shards"), "--prefix", f"digits-{split}"],
                check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
    data = ["data=shards", f"data.train_shards={root}/shards/digits-train.index.json"]
    data += [f"data.val_shards={root}/shards/digits-val.index.json"]
    top1: dict[str, list[float]] = {name: [] for name in DIGITS}
    for seed in range(args.seeds):
        for name, extra in DIGITS.items():
            tag = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
            run_dir = root / f"run-{tag}-{seed}"
            done = run_dir / "summary.json"  # a run of an earlier, interrupted study is taken as it is
            summary = json.loads(done.read_text()) if done.exists() else None
            if summary is None:
                summary, _ = train(run_dir, *data, *DIGIT_RUN, f"seed={seed}", *extra)
            # with trainer.ema, the EMA's: what the run ships (model.safetensors)
            top1[name].append(100 * (summary.get("val_top1_ema") or summary["val_top1"]))
            print(f"digits: seed {seed} {name}: {top1[name][-1]:.2f}", file=sys.stderr, flush=True)
    return {
        name: {"top1": v, "mean": statistics.mean(v), "stdev": statistics.stdev(v) if len(v) > 1 else 0.0}
        for name, v in top1.items()
    }


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [f"machine: {cpu_model()}, {os.cpu_count()} cores; command: `./run recipe.py {' '.join(sys.argv[1:])}`", ""]
    if "aug" in results:
        lines += ["| per sample, one worker (224 px) | ms CPU | added | spread |", "|---|---|---|---|"]
        for name, r in results["aug"].items():
            lines.append(
                f"| {name} | {r['ms']:.2f} | {r['added_ms']:+.2f} | {r['spread'][0]:.2f}-{r['spread'][1]:.2f} |"
            )
        lines.append("")
    if "loader" in results:
        lines += ["| loader, 224 px, batch 64 | samples/s | spread |", "|---|---|---|"]
        for name, r in results["loader"].items():
            lines.append(f"| augment={name}, {r['workers']} workers | {r['samples_per_s']:.0f} | "
                         f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f} |")  # fmt: skip
        lines.append("")
    if "compile" in results:
        lines += [
            "| default job | steady samples/s | first step, s | whole run, s | val top-1 |",
            "|---|---|---|---|---|",
        ]
        for name, r in results["compile"].items():
            lines.append(f"| trainer.compile={name} | {r['steady_samples_per_s']:.0f} | {r['first_step_s']:.1f} | "
                         f"{r['run_s']:.0f} | {100 * r['val_top1']:.2f} % |")  # fmt: skip
        lines.append("")
    if "default" in results:
        lines += ["| default job, seed | val top-1 | samples/s |", "|---|---|---|"]
        lines += [
            f"| {r['seed']} | {r['val_top1']:.2f} % | {r['samples_per_s']:.0f} |" for r in results["default"]["runs"]
        ]
        lines.append("")
    if "digits" in results:
        lines += ["| digits, val top-1 | mean | stdev | seeds |", "|---|---|---|---|"]
        for name, r in results["digits"].items():
            each = ", ".join(f"{v:.1f}" for v in r["top1"])
            lines.append(f"| {name} | {r['mean']:.2f} % | {r['stdev']:.2f} | {each} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="*", choices=("aug", "loader", "compile", "default", "digits"), default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=200, help="aug: samples per setting and round")
    p.add_argument("--warmup", type=int, default=5, help="loader: batches before the clock starts")
    p.add_argument("--batches", type=int, default=30, help="loader: batches timed")
    p.add_argument("--seeds", type=int, default=5, help="digits: seeds per setting")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "recipe-bench", help="where the runs go")
    p.add_argument("--json", type=Path, default=ROOT / "outputs" / "recipe-bench" / "recipe.json")
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    parts = args.parts or ["aug", "loader", "compile", "default", "digits"]
    results = {}
    for part in parts:
        parts_ = {"aug": aug_part, "loader": loader_part, "compile": compile_part, "default": default_part}
        results[part] = (parts_ | {"digits": digits_part})[part](args)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
