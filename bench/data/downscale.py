#!/usr/bin/env python3
"""How far the downscaled region decode (loader.decode_downscale) moves a training crop's pixels,
and what it saves: for each JPEG under a folder, the same crop and flip (one seed) rendered by
the region decode at full scale (the reference: equal to torchvision's whole decode), with the
DCT-scaled decode as the loader does it (1/2, 1/4 or 1/8 where the region stays at least the
output size), and with a stricter rule that keeps the scaled region at least twice the output
size, so the final resize still shrinks it. Prints the mean absolute difference to the reference
in 8-bit levels (mean, 90th percentile, max over images) and the render time per image on one
thread (a rough figure: run it on a quiet machine).

    ./run downscale.py 'TREE/*/*.jpg' --size 32 --images 1000
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

import torch
from torchvision.transforms import v2

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from wdsdist.data.decode.jpegcrop import CropDecoder, crop_decoder  # noqa: E402


def at_least_twice(decoder: CropDecoder):
    """A scale rule for ``decoder`` that keeps the scaled region >= 2x the output in both sides."""

    def scale(height: int, width: int) -> int:
        out_h, out_w = decoder.crop.size
        return next((d for d in (8, 4, 2) if height // d >= 2 * out_h and width // d >= 2 * out_w), 1)

    return scale


def render_all(datas: list[bytes], size: int, rule: str, seed: int) -> tuple[list[torch.Tensor], float, int]:
    """Every image's crop under ``rule`` (off, loader, twice); seconds per image; crops scaled."""
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    decoder = crop_decoder(transform, downscale=rule != "off")
    if decoder is None:
        sys.exit("error: the region decoder did not load (a C compiler and libjpeg-turbo's headers are needed)")
    if rule == "twice":
        decoder.scale = at_least_twice(decoder)
    torch.manual_seed(seed)
    outs, seconds, scaled = [], 0.0, 0
    for data in datas:
        width, height = decoder.size(data)
        drawn = decoder.draw(width, height)
        scaled += decoder.scale(drawn[0]["height"], drawn[0]["width"]) > 1
        start = time.perf_counter()
        outs.append(decoder.render(data, width, height, drawn, None))
        seconds += time.perf_counter() - start
    return outs, seconds / len(datas), scaled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pattern", help="a glob of JPEG files (quote it)")
    parser.add_argument("--size", type=int, default=32, help="output size (data.image_size)")
    parser.add_argument("--images", type=int, default=1000, help="the first N files, sorted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = sorted(glob.glob(args.pattern))[: args.images]
    if not files:
        sys.exit(f"error: no file matches {args.pattern!r}")
    datas = [Path(f).read_bytes() for f in files]
    torch.set_num_threads(1)
    reference, ref_time, _ = render_all(datas, args.size, "off", args.seed)
    print(f"{len(datas)} images, {args.size} px; full-scale region decode: {1e3 * ref_time:.2f} ms per image")
    print("| rule | crops scaled | mean abs difference: mean / p90 / max | ms per image |")
    print("|---|---|---|---|")
    for rule in ("loader", "twice"):
        outs, took, scaled = render_all(datas, args.size, rule, args.seed)
        diff = torch.stack([(a.float() - b.float()).abs().mean() for a, b in zip(outs, reference, strict=True)])
        print(
            f"| {rule} | {scaled / len(datas):.1%} | {diff.mean():.2f} / {diff.quantile(0.9):.2f} / {diff.max():.2f} "
            f"| {1e3 * took:.2f} |"
        )


if __name__ == "__main__":
    main()
