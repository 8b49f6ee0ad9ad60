"""One contender of ``./run bench.py``, inside its own process (``bench.py --run NAME``): its loader
(ours, the WebDataset README's pipeline, ImageFolder; the peers' from peers.py), the loops with no
loader that give the limits (d) and (e) (one process, or W at once), and the timed run: batches
per second after the warm-up, time to the first batch, CPU time per sample and the process tree's
memory (memory.py). bench.py runs each contender through here in a fresh subprocess and makes
the table of them; wdsdist and the peers' packages are imported only inside the functions, so that
bench.py --tree puts another checkout's wdsdist on the path before any import of it.
"""

from __future__ import annotations

import multiprocessing
import time

from bench.loader.memory import TreeMemory

PEERS = ("streaming", "litdata", "dali", "ffcv", "wids", "spdl")  # run in .bench-venv (bench/loader/peers.py)
AUGMENTS = ("none", "trivialaugment", "randaugment")  # bench.py --augment: the policy after crop + flip
# With --augment, the contenders that apply the policy (timm's loader: its own RandAugment only);
# every other one is left out, and why.
WITH_POLICY = ("ours", "ours-samples", "ours-cross", "ours-whole", "seed", "imagefolder", "limit", "side-by-side")
WITH_POLICY += ("ours-work", "ours-work-together", "streaming", "litdata", "dali", "wids", "spdl", "timm")
LEFT_OUT = {
    "ffcv": "FFCV's transforms have no TrivialAugment or RandAugment",
    "timm": "timm's loader is run for randaugment (its RandAugment, rand-m9-n2)",
    "predict": "prediction takes no training augmentation",
    "predict-loader": "prediction takes no training augmentation",
    "predict-model": "prediction takes no training augmentation",
}


def seed_transform(augment: str = "none"):
    """The reference's training transform on a PIL image: crop, flip, the policy, to a tensor."""
    from torchvision import transforms as T

    from bench.loader.peers import policy

    chosen = [policy(augment)] if augment != "none" else []
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), *chosen, T.ToTensor()])


def timm_loader(info: dict, workers: int, batch: int, augment: str):
    """timm's own data set and loader (train.py's): its RandAugment, rand-m9-n2 (2 ops at
    magnitude 9, as ours), after its RandomResizedCrop and flip; no prefetcher (that is CUDA's)."""
    from timm.data import create_dataset, create_loader

    if augment != "randaugment":
        raise ValueError(LEFT_OUT["timm"])
    ds = create_dataset("", root=info["tree"], is_training=True, search_split=False)
    return create_loader(
        ds, input_size=224, batch_size=batch, is_training=True, auto_augment="rand-m9-n2", interpolation="bilinear",
        num_workers=workers, use_prefetcher=False, device="cpu",
    )  # fmt: skip


def loader_for(name: str, info: dict, workers: int, batch: int, augment: str = "none"):
    import torch
    import webdataset as wds
    from torchvision.datasets import ImageFolder

    if name in ("ours", "ours-samples", "ours-cross", "ours-whole"):
        from wdsdist.data.delivery.pipeline import make_loader
        from wdsdist.data.options import LoaderConfig

        # The trainer's loader defaults (conf: loader.*): epochless, as the trainer runs it.
        cfg = LoaderConfig(
            batch_size=batch,
            workers=workers,
            mode="repeat",
            image_size=224,
            shuffle_buffer=1000,
            cross_shuffle=1000 if name == "ours-cross" else 0,
            partial=False,
            decode_region=name != "ours-whole",
            # (a*): the epoch's samples in equal spans per worker, starting and stopping mid-shard
            split="samples" if name == "ours-samples" else "shards",
            augment=augment,
        )
        return make_loader(info["index"], 0, 1, cfg)
    if name == "seed":
        from wdsdist.data.sources import shardspec

        urls = [s.url for s in shardspec.expand(info["index"])]
        ds = (
            wds.WebDataset(urls, shardshuffle=True, empty_check=False)
            .shuffle(1000)
            .decode("pil")
            .to_tuple("jpg", "cls")
            .map_tuple(seed_transform(augment), lambda x: x)
            .batched(batch)
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=workers)
    if name == "imagefolder":
        ds = ImageFolder(info["tree"], transform=seed_transform(augment))
        return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    if name == "timm":
        return timm_loader(info, workers, batch, augment)
    raise ValueError(name)


def limit_rate(
    info: dict, seconds: float, barrier=None, results=None, region: bool = False, augment: str = "none"
) -> dict:
    """Single-core rate of decode + RandomResizedCrop + flip with no loader: torchvision's whole
    decode (the limit every loader here shares), or with ``region`` ours (jpegcrop: only the
    crop's region decoded, and our per-sample checks). With ``augment``, the policy after them:
    torchvision's on the crop as a PIL image (its cheaper form: bench/results/2026-12-05-augment-ops.md),
    or with ``region`` ours. With ``barrier``, the clock starts when every process of the barrier
    is ready."""
    import torch
    import webdataset as wds
    from torchvision.io import ImageReadMode, decode_image

    from wdsdist.data.decode.jpegcrop import crop_decoder
    from wdsdist.data.decode.sample import make_augment, make_transform, prepare_sample
    from wdsdist.data.options import LoaderConfig
    from wdsdist.data.sources import shardspec

    torch.set_num_threads(1)  # as in a DataLoader worker
    # The whole set in memory (no I/O), as the loader goes through it: one shard's 22 MB would
    # sit in the 32 MB L3 cache here, which the loader's stream never does.
    urls = [shard.url for shard in shardspec.expand(info["index"])]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    cfg = LoaderConfig(batch_size=64, image_size=224, augment=augment)
    transform = make_transform(cfg)
    if region:
        crop = crop_decoder(transform, cfg.decode_downscale)
        if crop is None:
            raise SystemExit("error: jpegcrop is not available here (see the loader's note)")

        augmented = make_augment(cfg, 224)

        def work(sample: dict) -> torch.Tensor:
            return prepare_sample(sample, cfg, transform, crop, augment=augmented)()[0]
    else:
        from bench.loader.peers import with_policy

        whole = with_policy(transform, augment)

        def work(sample: dict) -> torch.Tensor:
            return whole(decode_image(torch.frombuffer(sample["jpg"], dtype=torch.uint8), mode=ImageReadMode.RGB))

    work(samples[0])
    if barrier is not None:
        barrier.wait()
    n, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        work(samples[n % len(samples)])
        n += 1
    cpu_ms = (time.process_time() - cpu_start) * 1000 / n
    result = {"per_core": n / (time.perf_counter() - start), "cpu_ms_per_sample": cpu_ms}
    if results is not None:
        results.put(result["per_core"])
    return result


def import_first(name: str) -> None:
    """Import what the contender needs before its clock starts: time to first batch is the
    loader's start-up (its workers, its files, its first decodes), not the interpreter loading
    torch and the loader's library, which a trainer pays once whatever it reads with."""
    import importlib

    import torch  # noqa: F401
    import torchvision  # noqa: F401

    modules = {
        "streaming": ["streaming"],
        "litdata": ["litdata"],
        "dali": ["nvidia.dali", "nvidia.dali.plugin.pytorch"],
        "ffcv": ["ffcv", "ffcv.loader", "ffcv.fields.decoders", "ffcv.transforms"],
        "wids": ["wids"],
        "spdl": ["spdl.io", "spdl.pipeline"],
    }
    if name in PEERS:
        for module in ["bench.loader.peers", *modules[name]]:
            importlib.import_module(module)
    else:
        for module in ["webdataset", "torchvision.datasets", "wdsdist.data.delivery.pipeline", "wdsdist.data.options"]:
            importlib.import_module(module)
        if name == "timm":
            importlib.import_module("timm.data")


def batch_shape(batch) -> str:
    """The first batch's images, as "64x3x224x224 uint8": that every contender does the same work."""
    if isinstance(batch, list) and batch and isinstance(batch[0], dict):
        batch = batch[0]  # DALI's iterator: one dict per pipeline
    images = batch["image"] if isinstance(batch, dict) else batch[0]
    return "x".join(map(str, images.shape)) + " " + str(images.dtype).removeprefix("torch.")


def loops_together(info: dict, workers: int, limit_seconds: float, region: bool, augment: str = "none") -> dict:
    """What W cores give together on this machine right now (shared caches, memory bandwidth,
    other tenants): the same loop in W processes at once, as the loader's W workers run."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=limit_rate, args=(info, limit_seconds, barrier, results, region, augment))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    rates = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return {"samples_per_s": sum(rates), "per_process": rates}


def run_one(
    name: str, info: dict, workers: int, batch: int, warmup: int, batches: int, limit_seconds: float, augment: str
) -> dict:
    if name.startswith("predict"):
        import predicting

        return predicting.run(name, info, workers, batch, limit_seconds)
    if name in ("limit", "ours-work"):
        r = limit_rate(info, limit_seconds, region=name == "ours-work", augment=augment)
        return {
            "samples_per_s": r["per_core"] * workers,
            "per_core": r["per_core"],
            "cpu_ms_per_sample": r["cpu_ms_per_sample"],
        }
    if name in ("side-by-side", "ours-work-together"):
        return loops_together(info, workers, limit_seconds, region=name == "ours-work-together", augment=augment)
    import_first(name)
    with TreeMemory() as mem:
        start = time.perf_counter()
        if name in PEERS:
            from bench.loader import peers

            loader = peers.loader_for(name, info, workers, batch, augment)
        else:
            loader = loader_for(name, info, workers, batch, augment)
        first = timed_from = None
        n = 0
        # Each loader is used as a trainer uses it: ours epochless, the others epoch after epoch
        # (their per-epoch worker start-up is part of their cost). The first `warmup` batches
        # are not timed.
        while n < warmup + batches:
            it = iter(loader)  # held until the PSS is read: a loader's workers live as long as it
            for got in it:
                if first is None:
                    first = time.perf_counter()
                    shape = batch_shape(got)
                n += 1
                if n == warmup:
                    timed_from, cpu_from = time.perf_counter(), mem.cpu()
                if n == warmup + batches:
                    break
        end, cpu_end = time.perf_counter(), mem.cpu()
        account = mem.account()  # after the clock stopped, with the loader and its workers still alive
    return {
        "samples_per_s": batches * batch / (end - timed_from),
        "first_batch_s": first - start,
        "batch": shape,
        "timed_batches": batches,
        # CPU time of the whole process tree (main, workers, threads) per sample in the timed part
        "cpu_ms_per_sample": (cpu_end - cpu_from) * 1000 / (batches * batch),
        "peak_rss_mb": mem.peak_rss / 2**20,
        "pss_mb": sum(row["pss"] for row in account),
        "pss_account": account,  # per process, the main one first
    }
