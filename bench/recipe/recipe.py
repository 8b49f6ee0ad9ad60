#!/usr/bin/env python3
"""What the recipe's tools cost and what they do, on this machine (issue 57's report).

    ./run recipe.py                              # every part: the report's tables, as markdown
    ./run recipe.py --parts aug loader --rounds 5
    ./run recipe.py --parts digits --seeds 5     # runs already in --runs are taken as they are
    ./run recipe.py --ops                        # each policy op's cost: PIL, tensor, ours
    ./run recipe.py --parts digits --settings trivialaugment --runs DIR   # one setting, fresh runs

Parts:
  ops      each op of the policies at 224 pixels, one thread: torchvision's functional op on a PIL
           image, the same on the uint8 tensor, and ours (decode/augment_ops.py, on the tensor the
           crop is, back to a tensor): the fastest of --rounds means of 5 calls; then each whole
           policy and random erasing the same three ways, over the draws of --samples seeds: the
           mean of each draw's fastest of --rounds calls
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

# A long module: one part per question of the recipe's report (ops, a worker's added cost, the
# loader, the digits' accuracy), sharing the data and the timing helpers.

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402

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
# ops: each op at a middling magnitude of TrivialAugmentWide's range (no right angle: PIL transposes those)
OP_MAGNITUDES = {
    "ShearX": 0.3, "ShearY": 0.3, "TranslateX": 16.0, "TranslateY": 16.0, "Rotate": 20.0,
    "Brightness": 0.5, "Color": 0.5, "Contrast": 0.5, "Sharpness": 0.5, "Posterize": 4.0,
    "Solarize": 0.5, "AutoContrast": 0.0, "Equalize": 0.0, "Invert": 0.0,
}  # fmt: skip
POLICY_ROWS = {  # ops: the whole policies' rows -> (data.augment, data.random_erase)
    "trivialaugment": ("trivialaugment", 0.0),
    "randaugment (n 2, m 9)": ("randaugment", 0.0),
    "autoaugment": ("autoaugment", 0.0),
    "random erasing 0.25": ("none", 0.25),
}
DIGIT_RUN = ["trainer.device=cpu", "trainer.workers=1", "trainer.batch_size=32", "trainer.steps=200"]
DIGIT_RUN += ["trainer.eval_every=0", "trainer.ckpt_every=0", "data.image_size=32", "data.crop_scale=[0.6,1.0]"]


def bench_data() -> dict:
    """bench.py's noise set (written once into data/bench/)."""
    from bench.loader import bench

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


def _timed(fn, calls: int, rounds: int) -> float:
    """ms per call: the fastest round's mean (a shared machine's slow moments are the noise)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1000 * best


def _mean_of_fastest(fn, items, rounds: int) -> float:
    """ms: the mean over ``items`` of each one's fastest of ``rounds`` calls (a policy's ops differ
    in cost; a busy machine's slow moments land on some calls, not on every one's fastest)."""
    best = [float("inf")] * len(items)
    for _ in range(rounds):
        for k, item in enumerate(items):
            start = time.perf_counter()
            fn(item)
            best[k] = min(best[k], time.perf_counter() - start)
    return 1000 * sum(best) / len(best)


def op_image(size: int = 224):
    """A uint8 CHW crop laid out as the loader's are (HWC in memory), from a bench JPEG."""
    import torch
    from torchvision.io import decode_image
    from torchvision.transforms.v2 import functional as F

    jpeg = bench_photo()
    image = decode_image(torch.frombuffer(bytearray(jpeg), dtype=torch.uint8))
    return F.resize(image.permute(1, 2, 0).contiguous().permute(2, 0, 1), [size, size], antialias=True)


def bench_photo() -> bytes:
    from bench.loader import bench

    return bench.photo(0)


def ops_part(args: argparse.Namespace) -> dict:
    """ms per op at 224 px, one thread: PIL, tensor, ours; then each whole policy and erasing."""
    import torch
    from PIL import Image
    from torchvision.transforms import v2

    from wdsdist.data.decode import augment_ops

    torch.set_num_threads(1)
    image = op_image()
    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    policy, lib = v2.TrivialAugmentWide(interpolation=augment_ops.InterpolationMode.BILINEAR), augment_ops.library()
    out: dict = {"ops": {}, "policies": policy_times(image, pil, args), "library": lib is not None}
    for op, magnitude in OP_MAGNITUDES.items():

        def theirs(img, op=op, magnitude=magnitude):
            return policy._apply_image_or_video_transform(
                img, op, magnitude, interpolation=policy.interpolation, fill=policy._fill
            )

        def ours(op=op, magnitude=magnitude):
            crop = augment_ops.Crop(image)
            augment_ops.apply_op(policy, crop, op, magnitude, lib)
            return crop.tensor()

        out["ops"][f"{op} {magnitude:g}"] = {
            "pil": _timed(functools.partial(theirs, pil), 5, args.rounds),
            "tensor": _timed(functools.partial(theirs, image), 5, args.rounds),
            "ours": _timed(ours, 5, args.rounds),
            "how": augment_ops.HOW[op],
        }
    return out


def policy_times(image, pil, args: argparse.Namespace) -> dict:
    """ms per image of each whole policy (and erasing) over --samples seeds' draws: the v2
    transform on the PIL image and on the tensor, and ours (SampleAugment.draw, then apply), each
    from the same seed."""
    import torch
    from torchvision.transforms import v2

    from wdsdist.data.decode.augment import SampleAugment

    mean, out = (0.485, 0.456, 0.406), {}
    for name, (augment, erase) in POLICY_ROWS.items():
        ours = SampleAugment(augment, 2, 9, erase, mean, 224)
        theirs = ours.policy or v2.RandomErasing(p=erase, value=[round(255 * c) for c in mean])

        # The CPU generator's own seed, as the loader seeds a sample's: torch.manual_seed also
        # queues one for each accelerator, which costs more than a policy's ops here.
        def theirs_of(img, seed, theirs=theirs):
            torch.default_generator.manual_seed(seed)
            return theirs(img)

        def ours_of(seed, ours=ours):  # the same draws as theirs, made apart, then applied
            torch.default_generator.manual_seed(seed)
            return ours.apply(image, ours.draw())

        seeds = range(args.samples)
        out[name] = {
            "pil": None if ours.policy is None else _mean_of_fastest(lambda i: theirs_of(pil, i), seeds, args.rounds),
            "tensor": _mean_of_fastest(lambda i: theirs_of(image, i), seeds, args.rounds),
            "ours": _mean_of_fastest(ours_of, seeds, args.rounds),
        }
    return out


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


def tag_of(setting: str) -> str:
    """A digits setting's name in its runs' folders and in --settings: "+ trivialaugment" -> trivialaugment."""
    return re.sub(r"[^a-z0-9]+", "-", setting.lower()).strip("-")


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
    chosen = {name: extra for name, extra in DIGITS.items() if not args.settings or tag_of(name) in args.settings}
    top1: dict[str, list[float]] = {name: [] for name in chosen}
    for seed in range(args.seeds):
        for name, extra in chosen.items():
            tag = tag_of(name)
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


def ops_markdown(r: dict) -> list[str]:
    lines = ["| op at 224 px, one thread | PIL, ms | tensor, ms | ours, ms | ours is |", "|---|---|---|---|---|"]
    for name, t in r["ops"].items():
        lines.append(f"| {name} | {t['pil']:.3f} | {t['tensor']:.3f} | {t['ours']:.3f} | {t['how']} |")
    lines += ["", "| whole policy, per image (224 px) | PIL, ms | tensor, ms | ours, ms |", "|---|---|---|---|"]
    for name, t in r["policies"].items():
        pil = "-" if t["pil"] is None else f"{t['pil']:.3f}"
        lines.append(f"| {name} | {pil} | {t['tensor']:.3f} | {t['ours']:.3f} |")
    return [*lines, ""]


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [f"machine: {cpu_model()}, {os.cpu_count()} cores; command: `./run recipe.py {' '.join(sys.argv[1:])}`", ""]
    if "ops" in results:
        lines += ops_markdown(results["ops"])
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
    p.add_argument("--parts", nargs="*", choices=("ops", "aug", "loader", "compile", "default", "digits"), default=None)
    p.add_argument("--ops", action="store_true", help="the ops part alone (--parts ops)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=200, help="aug: samples per setting and round")
    p.add_argument("--warmup", type=int, default=5, help="loader: batches before the clock starts")
    p.add_argument("--batches", type=int, default=30, help="loader: batches timed")
    p.add_argument("--seeds", type=int, default=5, help="digits: seeds per setting")
    p.add_argument(
        "--settings", nargs="*", help="digits: only these settings, by their tags (today-s-recipe, trivialaugment, ...)"
    )
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "recipe-bench", help="where the runs go")
    p.add_argument("--json", type=Path, default=ROOT / "outputs" / "recipe-bench" / "recipe.json")
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    parts = ["ops"] if args.ops else args.parts or ["ops", "aug", "loader", "compile", "default", "digits"]
    results = {}
    for part in parts:
        parts_ = {"ops": ops_part, "aug": aug_part, "loader": loader_part, "compile": compile_part}
        results[part] = (parts_ | {"default": default_part, "digits": digits_part})[part](args)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
