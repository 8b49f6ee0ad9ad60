"""gpu-check's data and loader parts: the JPEG sets as shards, (d) the loader alone, (e) the
pixels of GPU decode against CPU decode.

The photo-like set is bench.py's (``photo``: a colour field, texture and grain at 500x375,
quality 90), so its rates compare with the loader reports'; the noise set is uniform noise, the
hardest case for a decoder and the one where two decoders' rounding shows most.
"""

from __future__ import annotations

import gc
import io
import itertools
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

NCLASSES = 10
PIXEL_BATCH = 32


def photo_sample(i: int) -> bytes:
    from bench.loader.bench import photo  # bench/loader/bench.py: the bench's photo-like JPEG

    return photo(i)


def noise_sample(i: int, w: int = 500, h: int = 375) -> bytes:
    from PIL import Image

    arr = np.random.default_rng((7, i)).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_set(folder: Path, prefix: str, make: Callable[[int], bytes], n: int, shards: int) -> dict:
    """n JPEGs made on every core, written as shards with their index; a table row."""
    from wdsdist.tools.shards import Sample, ShardSink

    t0 = time.perf_counter()
    total = 0
    with (
        multiprocessing.Pool(os.cpu_count()) as pool,
        ShardSink(str(folder), prefix, math.ceil(n / shards), 1 << 30) as sink,
    ):
        for i, jpg in enumerate(pool.imap(make, range(n), chunksize=max(1, n // (8 * (os.cpu_count() or 1))))):
            total += len(jpg)
            sink.write(Sample(f"{prefix}{i:06d}", "jpg", jpg, i % NCLASSES, {}))
        sink.commit()
    return {
        "set": prefix,
        "images": n,
        "shards": shards,
        "mean_kb": total / n / 1e3,
        "seconds": time.perf_counter() - t0,
    }


def index_of(check: Any, prefix: str) -> str:
    return str(check.work / prefix / f"{prefix}.index.json")


def write_sets(work: Path, sizes: Any, say: Callable[[str], None]) -> list[dict]:
    """The ImageNet-size set of (c) and (d), and the two small sets of (e)."""
    rows = []
    for prefix, make, n, shards in (
        ("photos", photo_sample, sizes.photos, sizes.photo_shards),
        ("pixels-photos", photo_sample, sizes.pixel_images, 2),
        ("pixels-noise", noise_sample, sizes.pixel_images, 2),
    ):
        rows.append(write_set(work / prefix, prefix, make, n, shards))
        say(f"  {n} JPEGs ({prefix}, {rows[-1]['mean_kb']:.0f} kB mean) in {rows[-1]['seconds']:.1f} s")
    return rows


# ---------------------------------------------------------------- (d) the loader alone


def steady_rate(
    next_batch: Callable[[], int], window_s: float, most_s: float, clock: Callable[[], float] = time.perf_counter
) -> dict:
    """Samples/s of ``next_batch()`` (which returns a batch's sample count), timed in windows of
    ``window_s`` until the last three agree within 5 % (steady), or ``most_s`` has passed: a
    node's many workers take seconds to reach their rate, and a fixed stretch timed them before
    they had (2026-11-27-gpu-check.md: 15 workers at 5,586/s there, 9,639/s under training). The
    rate is the last three windows' samples over their time."""
    windows: list[tuple[int, float]] = []
    start = clock()
    while True:
        t0, n = clock(), 0
        while clock() - t0 < window_s:
            n += next_batch()
        windows.append((n, clock() - t0))
        last = windows[-3:]
        rates = [k / t for k, t in last]
        steady = len(last) == 3 and max(rates) - min(rates) <= 0.05 * max(rates)
        if steady or clock() - start >= most_s:
            return {
                "samples_per_s": sum(k for k, _ in last) / sum(t for _, t in last),
                "steady": steady,
                "windows": [round(k / t, 1) for k, t in windows],
                "timed_s": round(clock() - start, 2),
            }


def loader_rate(index: str, config: Any, window_s: float, most_s: float, cuda: bool) -> dict:
    """Samples/s the Loader delivers once steady (steady_rate), after the batches its workers
    made ahead are drained."""
    import torch

    from wdsdist.data import Loader

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t_start = time.perf_counter()
    loader = Loader(index, config, rank=0, world=1)
    batches = iter(loader)
    # At the start each worker has made its prefetch ahead while the others started: drained
    # here, or the timed stretch would count batches made before it.
    for _ in range(max(2, config.workers * (config.prefetch + 1))):
        next(batches)
    first = time.perf_counter() - t_start
    sync()
    count = [0]

    def next_batch() -> int:
        count[0] += 1
        return len(next(batches)["label"])

    rate = steady_rate(next_batch, window_s, most_s)
    sync()
    batches = loader = None  # the workers end before the next row starts its own
    gc.collect()
    return rate | {"batches": count[0], "warmup_s": first, "status": "ok"}


def gpu_rows(sizes: Any) -> list[tuple[str, int, dict]]:
    """(c), (d): each GPU decode row's label, workers and loader options."""
    rows = []
    for w in sizes.gpu_workers:
        for t in sizes.decode_threads:
            for share in sizes.decode_shares:
                for d in sizes.gpu_decoders:
                    how = [f"{t} threads"] * (t > 1) + [f"{share * 100:g}% on the GPU"] * (share < 1)
                    label = f"gpu/{d}" + (f" ({', '.join(how)})" if how else "")
                    options = {"decode": "gpu", "gpu_decoder": d, "gpu_decode_threads": t, "gpu_decode_share": share}
                    rows.append((label, w, options))
    return rows


def on_cpu_tensors() -> None:
    """The rehearsal's decode=gpu: its functions on CPU tensors (decode/gpu.py's device pointed at
    the CPU), in this process only, for the rest of the rehearsal."""
    import torch

    from wdsdist.data.decode import gpu

    gpu.device = lambda: torch.device("cpu")


def loader_alone(check: Any, part: dict) -> None:
    """(d): CPU decode by the number of workers, then GPU decode alone (the rehearsal: on CPU
    tensors, every row's options run, its rate no GPU's)."""
    from wdsdist.data import LoaderConfig

    sizes, cuda = check.sizes, not check.cpu
    if check.cpu:
        on_cpu_tensors()
    index = index_of(check, "photos")
    common = {"batch_size": sizes.batch, "image_size": sizes.image_size, "num_classes": NCLASSES, "pin_memory": cuda}
    runs: list[tuple[str, int, dict]] = [("cpu", w, {}) for w in sizes.loader_workers if sizes.cpu_rows]
    runs += gpu_rows(sizes)
    if sizes.augment_models:  # with TrivialAugment: CPU decode, and the first GPU decode row
        augmented = [("cpu", sizes.loader_workers[-1], {})] * sizes.cpu_rows + gpu_rows(sizes)[:1]
        runs += [(f"{d} + trivialaugment", w, o | {"augment": "trivialaugment"}) for d, w, o in augmented]
    for decode, workers, extra in runs:
        row: dict = {"decode": decode, "workers": workers}
        part["rows"].append(row)
        if not decode.startswith("cpu") and not cuda:
            row["note"] = "rehearsal: decode=gpu's functions on CPU tensors"
        if check.left() < sizes.loader_most_s / 2:  # not begun where it could not become steady
            row |= {"status": "skipped", "error": f"the time budget ({sizes.budget_s:.0f} s) is spent"}
            continue
        try:
            config = LoaderConfig(**common, **extra, workers=workers)
            row["workers_used"] = config.workers  # workers=auto: the number it came to
            row |= loader_rate(index, config, sizes.loader_window_s, sizes.loader_most_s, cuda)
            state = "steady" if row["steady"] else f"not steady after {row['timed_s']} s"
            check.say(f"  {decode} decode, {workers} workers: {row['samples_per_s']:.0f} samples/s ({state})")
        except Exception as exc:  # a row that fails is reported; the others still run
            row |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400]}
            check.say(f"  {decode} decode, {workers} workers: failed: {row['error']}")
        check.save()


# ---------------------------------------------------------------- (e) pixels


def differences(a: Any, b: Any, hist: Any) -> None:
    """Add the absolute differences of two uint8 image batches to a 256-bin histogram."""
    import torch

    diff = (a.cpu().to(torch.int16) - b.cpu().to(torch.int16)).abs().flatten()
    hist += torch.bincount(diff, minlength=256)


def summarize(hist: Any) -> dict:
    """Exact share, p99.9, max and mean of the grey-level differences a histogram holds."""
    counts = hist.double()
    total = float(counts.sum())
    cumulative = counts.cumsum(0) / total
    nonzero = counts.nonzero()
    return {
        "values": int(total),
        "exact_share": float(counts[0]) / total,
        "p99_9": int((cumulative >= 0.999).nonzero()[0]),
        "max": int(nonzero[-1]) if len(nonzero) else 0,
        "mean": float((counts * counts.new_tensor(range(256))).sum()) / total,
    }


def compare(index: str, configs: tuple[Any, Any], images: int) -> dict:
    """The same batches from two loaders (same seed, shards, workers): their keys and labels
    must agree; their images' differences, value by value."""
    import torch

    from wdsdist.data import Loader

    hist = torch.zeros(256, dtype=torch.int64)
    same, seen = True, 0
    streams, firsts = [], []
    for c in configs:
        # The DataLoader seeds its workers from torch's generator at the first batch: the same
        # seed there, the same draws in both.
        torch.manual_seed(0)
        streams.append(iter(Loader(index, c, rank=0, world=1)))
        firsts.append(next(streams[-1]))
    pairs = itertools.chain([tuple(firsts)], zip(*streams, strict=True))
    while seen < images:
        a, b = next(pairs)
        same = same and list(a["key"]) == list(b["key"]) and torch.equal(a["label"].cpu(), b["label"].cpu())
        differences(a["image"], b["image"], hist)
        seen += len(a["label"])
    del streams, firsts, pairs
    gc.collect()
    return {"images": seen, "same_samples": same, **summarize(hist)}


def pixels(check: Any, part: dict) -> None:
    """(e): GPU decode against CPU decode, on the photo-like and the noise set. The rehearsal
    runs decode=gpu's functions on CPU tensors instead (its device pointed at the CPU), which
    runs every step of the comparison."""

    from wdsdist.data import LoaderConfig

    sizes = check.sizes
    batch = min(PIXEL_BATCH, sizes.pixel_images)  # the rehearsal's sets are smaller than a batch
    common = {"batch_size": batch, "image_size": sizes.image_size, "num_classes": NCLASSES, "workers": 2}
    common |= {"with_keys": True, "seed": 0}
    part["compared"] = "CPU decode (libjpeg-turbo, region) against each GPU decoder, the same draws"
    if check.cpu:
        on_cpu_tensors()
        part["compared"] = "rehearsal: CPU decode against decode=gpu's functions on CPU tensors"
    for decoder in sizes.gpu_decoders:
        pair = (LoaderConfig(**common), LoaderConfig(**common, decode="gpu", gpu_decoder=decoder))
        for prefix in ("pixels-photos", "pixels-noise"):
            row = {"set": prefix.removeprefix("pixels-"), "decoder": decoder, "status": "ok"}
            part["rows"].append(row)
            try:
                row |= compare(index_of(check, prefix), pair, sizes.pixel_images)
                say = f"max {row['max']}, p99.9 {row['p99_9']}, exact {100 * row['exact_share']:.2f}%"
            except Exception as exc:  # a decoder that fails is reported; the other still runs
                row |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400]}
                say = f"failed: {row['error']}"
            check.say(f"  {decoder}, {row['set']}: {say}")
            check.save()
