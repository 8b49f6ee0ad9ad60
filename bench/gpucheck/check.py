#!/usr/bin/env python3
"""``./run gpu-check``: what one GPU node does with this project, measured in one go.

    ./run gpu-kit                      # here, where pip reaches PyPI: the wheels and jpegcrop build
    ./run gpu-check [--out DIR]        # on the GPU node, with gpu-kit/ brought along (no internet)
    ./run gpu-check --cpu [--out DIR]  # the rehearsal: every step that needs no CUDA, small (outputs/gpu-check/)

Five parts, each beside the same training step on random tensors already on the device ("pure
compute": the trainer's own model, optimizer, autocast and memory format): (a) the default job;
(b) a torchrun run resumed with trainer.resume=auto; (c) ResNet-50 and ResNet-18 at 224 px on
ImageNet-size JPEGs through train.py, CPU decode against GPU decode, and ResNet-50 again with
TrivialAugment (data.augment); (d) the loader alone, with TrivialAugment too;
(e) the pixels of GPU decode against CPU decode. A part that fails is reported with its error
and the others still run; the JSON and the report are rewritten after each part, so a run cut
short still leaves what it measured. Data and runs go to a temporary folder under /tmp.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

# The parts live beside this file (train, runs, loader, decoder, report); what stays here, about
# 440 lines, is the check's sizes, its options and the loop over the parts, kept together because
# each option picks sizes and parts that the rehearsal and the GPU run must agree on.
from bench.common.machine import cpu_model  # noqa: E402
from bench.gpucheck import decoder, fork, loader, report, train  # noqa: E402

PROG = "./run gpu-check"  # what its usage and errors name


@dataclass(frozen=True)
class Sizes:
    """How much each part does: sized to end within six minutes on 16 cores and an H100, or, for
    the rehearsal, within a minute on two cores."""

    device: str
    photos: int  # ImageNet-size JPEGs for (c) and (d)
    photo_shards: int
    pixel_images: int  # per set in (e)
    synthetic_extra: tuple[str, ...]  # (a), (b): the synthetic set's size
    default_extra: tuple[str, ...]  # (a): overrides beyond the run and data folders
    steady_after: int  # (a): the steps before the steady rate is taken
    resume_steps: int  # (b): N, then 2N
    resume_extra: tuple[str, ...]
    image_size: int  # (c), (d), (e)
    batch: int
    steps: int  # (c)
    warmup: int  # (c): steps before the steady rate
    log_every: int  # (c)
    models: tuple[str, ...]
    cpu_workers: str  # (c): trainer.workers for CPU decode
    gpu_workers: tuple[int | str, ...]  # (c), (d): trainer.workers for GPU decode (a number or "auto")
    gpu_decoders: tuple[str, ...]  # (c), (d), (e): loader.gpu_decoder values
    accuracy_seeds: tuple[int, ...]  # (f)
    loader_workers: tuple[int, ...]  # (d): CPU decode
    loader_window_s: float  # (d): each row timed in windows of this, until three agree (steady)
    loader_most_s: float  # (d): or until this has passed
    compute_steps: int
    budget_s: float  # parts not begun by then are skipped; runs are cut at it
    cpu_rows: bool = True  # (c), (d): the CPU decode rows beside the GPU's
    decode_threads: tuple[int, ...] = (1,)  # (c), (d): loader.gpu_decode_threads for GPU decode
    decode_shares: tuple[float, ...] = (1.0,)  # (c), (d): loader.gpu_decode_share for GPU decode
    compile_rows: bool = False  # (c): each model's CPU-decode row again with trainer.compile=true
    augment_models: tuple[str, ...] = ("resnet50",)  # (c), (d): rows with data.augment=trivialaugment


GPU = Sizes(
    device="cuda",
    photos=4000,
    photo_shards=32,
    pixel_images=256,
    synthetic_extra=(),
    default_extra=(),
    steady_after=20,
    resume_steps=20,
    resume_extra=("trainer.eval_every=0",),
    image_size=224,
    batch=256,
    steps=60,
    warmup=20,
    log_every=10,
    models=("resnet50", "resnet18"),
    cpu_workers="auto",
    gpu_workers=(2,),
    gpu_decoders=("torchvision", "nvimgcodec"),
    accuracy_seeds=(0, 1, 2),
    loader_workers=(15,),
    loader_window_s=2.0,
    loader_most_s=30.0,
    compute_steps=30,
    budget_s=480.0,
)
# The rehearsal: tiny sizes, the CPU, explicit worker numbers; each run a few steps, since every
# step of each part is what it rehearses, not the rates.
CPU = Sizes(
    device="cpu",
    photos=16,
    photo_shards=4,
    pixel_images=16,
    synthetic_extra=(
        "data.synthetic.train_samples=64",
        "data.synthetic.val_samples=16",
        "data.synthetic.shard_samples=16",
        "data.synthetic.size=32",
    ),
    default_extra=(
        "trainer.device=cpu",
        "trainer.steps=4",
        "trainer.batch_size=4",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.ckpt_every=0",
    ),
    steady_after=2,
    resume_steps=2,
    resume_extra=("trainer.device=cpu", "trainer.batch_size=4", "trainer.log_every=1", "trainer.eval_every=0"),
    image_size=32,
    batch=4,
    steps=4,
    warmup=2,
    log_every=1,
    models=("resnet18",),  # one model rehearses every step of the part
    augment_models=("resnet18",),  # and its rows with TrivialAugment (ResNet-50's on a GPU)
    cpu_workers="1",
    gpu_workers=(2,),
    gpu_decoders=("torchvision", "nvimgcodec"),
    accuracy_seeds=(0,),
    loader_workers=(1, 2),
    loader_window_s=0.1,
    loader_most_s=0.3,
    compute_steps=1,
    budget_s=600.0,
    decode_shares=(1.0, 0.5),  # (d) runs both on CPU tensors
)


class Skipped(Exception):
    """A part (or a row) that is not run here, and why."""


@dataclass
class Check:
    """One gpu-check run: its sizes, folders, clock and results, saved after every part."""

    sizes: Sizes
    work: Path  # data and run folders (temporary)
    out: Path
    command: str
    kit: Path = Path("gpu-kit")
    preloaded: fork.Preloaded | None = None  # the rehearsal's runs are forked from it
    time_settings: bool = True  # the probe times nvImageCodec's settings (else it only picks the release)
    started: float = field(default_factory=time.perf_counter)
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    results: dict = field(default_factory=dict)

    @property
    def cpu(self) -> bool:
        return self.sizes.device == "cpu"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.sizes.budget_s - self.elapsed()

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)

    def path(self, suffix: str) -> Path:
        return self.out / f"{self.date}-gpu-check{suffix}"

    def save(self, chart: bool = False) -> None:
        """The JSON and the report as they stand (and the chart, at a part's end)."""
        self.results["seconds"] = round(self.elapsed(), 1)
        self.path(".json").write_text(json.dumps(self.results, indent=1) + "\n")
        self.path(".md").write_text(report.markdown(self.results, self.path(".png").name))
        if chart:
            report.chart(self.results, self.path(".png"), self.path(".md").name)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


def run_part(check: Check, key: str, title: str, fn: Callable[[Check, dict], None]) -> None:
    """A part in its own try: its rows as they come, its status, its error line and time."""
    part = {"title": title, "status": "running", "rows": []}
    check.results["parts"][key] = part
    t0 = time.perf_counter()
    check.say(f"({key}) {title}")
    try:
        if check.left() < 15:
            raise Skipped(f"the time budget ({check.sizes.budget_s:.0f} s) is spent")
        fn(check, part)
        part["status"] = "ok"
    except Skipped as exc:
        part["status"], part["error"] = "skipped", str(exc)
    except Exception as exc:  # a failed part is reported; the others still run
        part["status"], part["error"] = "failed", one_line(exc)
        traceback.print_exc(file=sys.stdout)
    part["seconds"] = round(time.perf_counter() - t0, 1)
    check.say(f"({key}) {part['status']} in {part['seconds']} s" + (f": {part['error']}" if "error" in part else ""))
    check.save(chart=True)


def prepare(check: Check, part: dict) -> None:
    """The JPEG sets the loader parts read, written with every core."""
    part["rows"] += loader.write_sets(check.work, check.sizes, check.say)


PARTS = (
    ("data", "the JPEG sets, as shards", prepare),
    ("probe", "nvImageCodec's releases on this GPU: region decode and pixels", decoder.probe),
    ("a", "the default job", train.default_job),
    ("b", "a torchrun run resumed with trainer.resume=auto", train.resume),
    ("c", "ImageNet-size JPEGs through train.py: CPU and GPU decode", train.imagenet_size),
    ("d", "the loader alone", loader.loader_alone),
    ("e", "pixels: GPU decode against CPU decode", loader.pixels),
    ("f", "the default job's accuracy: decode=cpu against decode=gpu, seed by seed", train.accuracy),
)


GPU_DECODE_PARTS = {"c", "d", "e", "f"}  # the parts that run decode=gpu, through the probe's release


def machine(sizes: Sizes) -> dict:
    """What the report names the machine by."""
    import torch
    import torchvision

    from wdsdist.data.decode import jpegcrop

    lib = jpegcrop.load()
    info = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu_model(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "jpegcrop": lib if isinstance(lib, str) else f"loaded ({Path(lib._name).name})",
        "device": sizes.device,
    }
    if sizes.device == "cuda":
        from wdsdist.cluster.distributed import driver_version

        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        nv = Path("/proc/driver/nvidia/version")
        info["driver"] = driver_version(nv.read_text()) if nv.exists() else None
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the rehearsal: small sizes, the CPU, no GPU decode; its runs forked from one Python with torch imported",
    )
    p.add_argument(
        "--out",
        help="where the report goes (default: bench/results/ on a GPU; with --cpu, outputs/gpu-check/: "
        "a rehearsal is no measurement to keep)",
    )
    p.add_argument("--kit", default="gpu-kit", help="the kit's folder (./run reads it before this starts)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the data and run folders under /tmp, and copy the runs' logs beside the report "
        "(DATE-gpu-check-logs/)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=[k for k, _, _ in PARTS],
        help="these parts only (data is written first; on a GPU, c-f run the probe's choice of release)",
    )
    p.add_argument(
        "--decoders",
        nargs="+",
        choices=["cpu", "torchvision", "nvimgcodec"],
        help="(c), (d), (e): these decoders' rows only (default: all three)",
    )
    p.add_argument(
        "--gpu-workers",
        nargs="+",
        type=workers_arg,
        help="(c), (d): trainer.workers for GPU decode, numbers or auto (default: 2)",
    )
    p.add_argument(
        "--decode-threads", nargs="+", type=int, help="(c), (d): loader.gpu_decode_threads for GPU decode (default: 1)"
    )
    p.add_argument(
        "--decode-shares",
        nargs="+",
        type=share_arg,
        help="(c), (d): loader.gpu_decode_share for GPU decode, the share the GPU decodes (default: 1)",
    )
    p.add_argument("--models", nargs="+", help="(c): these models only (default: resnet50 resnet18)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="(c): each model again with trainer.compile=true beside its eager CPU-decode row (and the compile time)",
    )
    return p.parse_args(argv)


def share_arg(value: str) -> float:
    """--decode-shares: a share between 0 and 1."""
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r}: a share between 0 and 1")
    return share


def workers_arg(value: str) -> int | str:
    """--gpu-workers: a number of workers, or auto (the loader sizes them: decode=gpu's two, and
    more for the share they decode)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of workers or auto") from None


def sized(args: argparse.Namespace) -> Sizes:
    """The sizes for this machine, less the rows --decoders and --models leave out, with the GPU
    rows' workers, decode threads and shares as asked."""
    sizes = CPU if args.cpu else GPU
    if args.decoders:
        gpu = tuple(d for d in args.decoders if d != "cpu")
        sizes = replace(sizes, cpu_rows="cpu" in args.decoders, gpu_decoders=gpu)
    if args.gpu_workers:
        sizes = replace(sizes, gpu_workers=tuple(args.gpu_workers))
    if args.decode_threads:
        sizes = replace(sizes, decode_threads=tuple(args.decode_threads))
    if args.decode_shares:
        sizes = replace(sizes, decode_shares=tuple(args.decode_shares))
    if args.models:
        sizes = replace(sizes, models=tuple(args.models))
    if args.compile:
        sizes = replace(sizes, compile_rows=True)
    return sizes


def report_folder(args: argparse.Namespace) -> Path:
    """--out; else the dated reports' folder for a GPU's run, and outputs/ for a rehearsal."""
    return Path(args.out) if args.out else ROOT / ("outputs/gpu-check" if args.cpu else "bench/results")


def keep_logs(work: Path, to: Path) -> None:
    """Each run's output and train.log (runs/NAME.out, runs/NAME/train.log) copied under ``to``."""
    for log in [*work.glob("runs/*.out"), *work.glob("runs/*/train.log")]:
        target = to / log.relative_to(work / "runs")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)


def wanted_parts(args: argparse.Namespace) -> set[str]:
    """The parts --only asks for, and the data. On a GPU the probe too where a part decodes on the
    GPU: it installs the nvImageCodec release they use (without --only probe, it times no settings)."""
    every = {key for key, _, _ in PARTS}
    if args.only is None:
        return every
    wanted = {"data", *args.only}
    if not args.cpu and wanted & GPU_DECODE_PARTS:
        wanted.add("probe")
    return wanted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sized(args)
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("error: gpu-check: torch sees no GPU here; --cpu rehearses it without one", file=sys.stderr)
            return 2
    out = report_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wdsdist-gpu-check-"))
    command = " ".join(["./run gpu-check", *(argv if argv is not None else sys.argv[1:])])
    check = Check(sizes, work, out, command, Path(args.kit).resolve())
    check.time_settings = args.only is None or "probe" in args.only
    check.results = {"command": command, "date": check.date, "sizes": asdict(sizes), "parts": {}}
    check.say(f"gpu-check ({'rehearsal on the CPU' if args.cpu else 'GPU'}): work in {work}, report in {out}")
    try:
        check.results["machine"] = machine(sizes)
        check.say(f"machine: {json.dumps(check.results['machine'])}")
        if args.cpu:  # forked now, with torch imported and nothing yet computed (gpucheck/fork.py)
            check.preloaded = fork.Preloaded()
            # The objects so far, out of the collector's sight: the loader workers and the pool
            # this process forks would copy every page of them in their collections (3 s of the
            # rehearsal's CPU).
            gc.freeze()
        for key, title, fn in PARTS:
            if key in wanted_parts(args):
                run_part(check, key, title, fn)
    finally:
        if check.preloaded:
            check.preloaded.close()
        if args.keep:  # the runs' logs beside the report, where a lent machine's /tmp is not
            keep_logs(work, check.path("-logs"))
        else:
            shutil.rmtree(work, ignore_errors=True)
    check.save(chart=True)
    failed = [k for k, p in check.results["parts"].items() if p["status"] == "failed"]
    check.say(f"done: {check.path('.md')}" + (f"; failed parts: {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
