#!/usr/bin/env python3
"""How far decode=gpu's augmented pixels are from the CPU path's, per op, for the same draws.

    ./run gpuaugment.py --shards INDEX [--size 224] [--batches 16] [--augment trivialaugment]

Both paths load the same shards with the same seed, the augmentation and random erasing on;
decode=gpu runs on CPU tensors (its device pointed at the CPU, as the suite runs it), so no GPU
is needed: the ops are the same torch code on either device. Each row's difference is counted
under its op, or for a chain of ops (RandAugment, AutoAugment) under the one with the loosest
stated tolerance; an erased box's pixels under ``Erase``. Prints a markdown table and a JSON
line: per op, the pixels, the 99th percentile, the mean and the largest absolute difference in
uint8 steps, beside the tolerance decode/gpu_augment.py states.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from tests.helpers.gpu_augment import op_differences, recorded_draws, stats  # noqa: E402
from wdsdist.data import Loader, LoaderConfig  # noqa: E402
from wdsdist.data.decode import gpu  # noqa: E402
from wdsdist.data.decode.gpu_augment import TOLERANCE  # noqa: E402


def batches(args: argparse.Namespace, decode: str) -> list[dict]:
    cfg = LoaderConfig(
        batch_size=32, workers=2, image_size=args.size, mode="repeat", decode=decode, augment=args.augment,
        random_erase=0.25, with_keys=True, gpu_decode_threads=1, seed=args.seed,
    )  # fmt: skip
    loader = Loader(args.shards, cfg, rank=0, world=1)
    torch.manual_seed(0)
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == args.batches:
            return out
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", required=True, help="a shard spec (an index JSON, a folder)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=16, help="batches of 32")
    parser.add_argument("--augment", default="trivialaugment")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gpu.device = lambda: torch.device("cpu")  # decode=gpu's functions on CPU tensors
    cpu = batches(args, "cpu")
    with recorded_draws() as draws:
        on_device = batches(args, "gpu")
    table = stats(op_differences(cpu, on_device, draws))
    print(f"{len(cpu)} batches of 32 at {args.size} px, {args.augment}, random erasing 0.25, seed {args.seed}\n")
    print("| op | pixels | 99th percentile | mean | max | stated: 99th, mean |")
    print("|---|---|---|---|---|---|")
    for op, s in table.items():
        near, mean = TOLERANCE.get(op, ("-", "-"))
        print(f"| {op} | {s['pixels']} | {s['q99']:g} | {s['mean']:.3f} | {s['max']:g} | {near}, {mean} |")
    print(json.dumps({"size": args.size, "augment": args.augment, "batches": len(cpu), "ops": table}))


if __name__ == "__main__":
    main()
