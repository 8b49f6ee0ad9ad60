#!/usr/bin/env python3
"""What PyTorch Lightning costs on our loader: the same shards read by 2 ranks through
``wdsdist.lightning.WdsDataModule`` under ``Trainer(strategy="ddp")``, and by the raw ``Loader``
in a plain torchrun loop, in alternating rounds of one run. ``./run lightning.py`` (see --help).

The model is trivial on purpose (manual optimisation, a training step that only touches the
batch: no backward, so no gradient all-reduce), so the loader is the bottleneck and what differs is Lightning's own
loop: its fetcher, hooks and batch transfer. Each contender reads --epochs epochs of
``mode=epoch`` (equal batches on every rank); the clock runs on rank 0 from the --warmup-th
batch to the end of the last epoch, epoch boundaries included. samples/s counts every rank's
batches. The table gives each contender's median round and the ratio Lightning / raw, and
the CPU time of the ranks' main processes per batch in that window (the loop's own cost,
workers excluded: less sensitive to a busy machine than throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)
from bench.common.machine import cpu_model  # noqa: E402

CONTENDERS = ("raw", "lightning")


def loader_config(args: argparse.Namespace):
    from wdsdist.data import LoaderConfig

    return LoaderConfig(mode="epoch", batch_size=args.batch, image_size=args.image_size, workers=args.workers)


def run_raw(args: argparse.Namespace) -> dict:
    """Under torchrun: the loader in a plain loop."""
    import torch
    import torch.distributed as dist

    from wdsdist.data import Loader

    dist.init_process_group("gloo")
    loader = Loader(args.shards, loader_config(args))
    touched, batches, start = 0, 0, (0.0, 0.0)
    synced = torch.zeros(1)
    for _ in range(args.epochs):
        for batch in loader:
            touched += int(batch["image"][0, 0, 0, 0])  # the step: touch the batch
            # Every DDP step synchronises the ranks once (its gradients' all-reduce); Lightning's
            # step does too (a broadcast of its stop flag), so the raw loop takes its smallest form.
            dist.all_reduce(synced)
            batches += 1
            if batches == args.warmup:
                start = (time.perf_counter(), time.process_time())
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "batches": batches, "seconds": wall, "main_cpu_seconds": cpu}


def run_lightning(args: argparse.Namespace) -> dict:
    """Lightning starts the second rank itself (it runs this script again, with --run lightning)."""
    import pytorch_lightning as pl
    import torch

    from wdsdist.lightning import WdsDataModule

    class Touch(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)  # DDP wants a parameter; it never gets a gradient
            self.automatic_optimization = False  # DDP may not skip steps otherwise; this loop takes none
            self.touched = self.batches = 0
            self.start, self.wall, self.cpu_s = (0.0, 0.0), 0.0, 0.0

        def training_step(self, batch: dict, batch_idx: int) -> None:
            self.touched += int(batch["image"][0, 0, 0, 0])
            self.batches += 1
            if self.batches == args.warmup:
                self.start = (time.perf_counter(), time.process_time())
            return None  # no backward, no optimizer step, no all-reduce

        def on_train_end(self) -> None:
            self.wall, self.cpu_s = time.perf_counter() - self.start[0], time.process_time() - self.start[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module = Touch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.ranks,
        strategy="ddp",
        use_distributed_sampler=False,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=WdsDataModule(args.shards, loader_config(args)))
    return {
        "rank": trainer.global_rank,
        "batches": module.batches,
        "seconds": module.wall,
        "main_cpu_seconds": module.cpu_s,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One contender's round in fresh processes: every rank's batches over the slowest rank's time."""
    mine = [
        "--contender",
        name,
        "--result-file",
        str(out),
        *("--shards", args.shards, "--epochs", str(args.epochs), "--batch", str(args.batch)),
        *("--image-size", str(args.image_size), "--workers", str(args.workers), "--warmup", str(args.warmup)),
        *("--ranks", str(args.ranks)),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if name == "raw":
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), f"--nproc_per_node={args.ranks}", "--master_addr=127.0.0.1"]
        cmd += [f"--master_port={free_port()}", __file__, *mine]
    else:
        cmd = [sys.executable, __file__, *mine]
    files = [out.with_suffix(f".{r}.json") for r in range(args.ranks)]
    for f in files:
        f.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not all(f.exists() for f in files):
        sys.exit(f"error: {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    ranks = [json.loads(f.read_text()) for f in files]
    timed = sum(r["batches"] - args.warmup for r in ranks)
    seconds = max(r["seconds"] for r in ranks)
    return {
        "ranks": ranks,
        "timed_samples": timed * args.batch,
        "seconds": seconds,
        "samples_per_s": timed * args.batch / seconds,
        "main_cpu_ms_per_batch": 1000 * sum(r["main_cpu_seconds"] for r in ranks) / timed,
    }


def ensure_shards(args: argparse.Namespace) -> None:
    if args.shards is not None:
        return
    folder = ROOT / "data" / "bench-lightning"
    index = folder / f"lightning-{args.images}-{args.size}.index.json"
    if not index.exists():
        print(f"writing {args.images} synthetic {args.size} px images to {folder}/ (once)", flush=True)
        subprocess.run(
            [sys.executable, str(ROOT / "makeshards.py"), "--synthetic", str(args.images), "--size", str(args.size)]
            + ["--shards", str(folder), "--prefix", index.name.removesuffix(".index.json"), "--maxcount", "250"],
            check=True,
        )
    args.shards = str(index)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="shards to read (default: synthetic ones, written once under data/)")
    p.add_argument("--images", type=int, default=4000, help="synthetic images (default: %(default)s)")
    p.add_argument("--size", type=int, default=160, help="synthetic image size in px (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="the training crop (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="loader workers per rank (default: %(default)s)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5, help="batches per rank before the clock starts")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default: %(default)s)")
    p.add_argument("--json", default=str(ROOT / "outputs" / "bench" / "lightning.json"), help="JSON output")
    p.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)  # internal: one contender
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.contender is not None:
        result = run_raw(args) if args.contender == "raw" else run_lightning(args)
        Path(args.result_file).with_suffix(f".{result['rank']}.json").write_text(json.dumps(result))
        return

    ensure_shards(args)
    scratch = Path(args.json).parent
    scratch.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for i in range(args.rounds):
        order = CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]  # alternate who goes first
        for name in order:
            rounds[name].append(launch(name, args, scratch / f"lightning-{name}.json"))
            print(f"round {i + 1} {name:9s} {rounds[name][-1]['samples_per_s']:8.0f} samples/s", flush=True)
    median = {name: statistics.median(r["samples_per_s"] for r in rounds[name]) for name in CONTENDERS}
    cpu = {name: statistics.median(r["main_cpu_ms_per_batch"] for r in rounds[name]) for name in CONTENDERS}
    ratio = median["lightning"] / median["raw"]
    info = {
        "command": " ".join(["./run lightning.py", *sys.argv[1:]]),
        "nproc_machine": os.cpu_count(),
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "shards": args.shards,
        "ranks": args.ranks,
        "workers_per_rank": args.workers,
        "batch": args.batch,
        "image_size": args.image_size,
        "epochs": args.epochs,
    }
    print()
    print(f"| contender | samples/s (median of {args.rounds}) | each round | vs raw | main process CPU ms/batch |")
    print("|---|---|---|---|---|")
    for name in CONTENDERS:
        each = ", ".join(f"{r['samples_per_s']:.0f}" for r in rounds[name])
        print(f"| {name} | {median[name]:.0f} | {each} | {median[name] / median['raw']:.3f} | {cpu[name]:.2f} |")
    print(f"\nLightning / raw: {ratio:.3f} (target >= 0.95)")
    report = {
        "info": info,
        "rounds": rounds,
        "median_samples_per_s": median,
        "median_main_cpu_ms_per_batch": cpu,
        "ratio_lightning_over_raw": ratio,
    }
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_samples_per_s": median, "main_cpu_ms_per_batch": cpu, "ratio": round(ratio, 4)}))


if __name__ == "__main__":
    main()
