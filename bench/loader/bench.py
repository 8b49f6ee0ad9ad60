#!/usr/bin/env python3
"""Loader throughput, side by side: ours, the WebDataset README's pipeline, torchvision
ImageFolder, the decode limit, predict.py's rate beside its loader and its model alone
(bench/predict/predicting.py) and, with --peers, the other streaming loaders (MosaicML
Streaming, LitData, DALI on the CPU, FFCV, wids). Run with ``./run bench.py`` (see --help).

The limit (d) is torchvision's whole decode + RandomResizedCrop + flip in a loop, no loader:
what every loader decoding whole images can reach. Ours decodes only the crop's region
(wdsdist/jpegcrop), so it also runs (a'') with whole-image decoding, and (e) its own
per-sample work in a loop: (a)/(e) is what the loader keeps of its workers' cores. (e') runs
that loop in W processes at once, as the loader's W workers run: on a shared machine two busy
cores give less than twice one busy core, and (a)/(e') keeps that out of the loader's account.

Each contender runs in its own subprocess, so its memory is its own: peak RSS summed over the
process and its DataLoader workers (sampled every 50 ms), and PSS at the end of the run.
Contenders run in rounds (--repeat), interleaved, and the table gives each one's median round,
so a slow minute of a shared machine does not land on one contender only. Data (--dataset):
``noise``, ImageNet-like JPEGs of textured noise (500x375, quality 90, about 90 KB), and
``photos``, crops of the photographs inside scikit-learn's and scikit-image's wheels (shorter
side 300-500, mixed aspect ratios, quality 75-95, sharpened and grained as a camera does;
bench/loader/photos.py), each written once as shards
and as an ImageFolder tree. The peers run in .bench-venv/ (bench/requirements-peers.txt, made
here when missing or when that file changes; bench/loader/peervenv.py), each converting the images to
its own format once (cached under the data set's folder, peers/NAME/). Work: RandomResizedCrop
(224) + horizontal flip, uint8 batches of 64, W workers. With --augment trivialaugment or
randaugment, the policy follows the flip in every contender that can apply it, each its own way
(contenders.py WITH_POLICY; --peers then adds ImageFolder's and WebDataset's pipelines, and for
randaugment timm's loader); the others are named as left out, in the table and the JSON.
"""
# Every contender runs as a subprocess of this same file (--run, --convert), so the data, the
# contenders and the table stay one command; what runs in a contender's process is contenders.py,
# the peers' environment peervenv.py, their code peers.py, the photographs photos.py, the charts
# charts.py, and --conversion's writers conversion.py.
# What stays here (about 420 lines: the options, the rounds, the medians and the table) is one
# command's flow read top down; split further, a contender's row would be defined far from its column.

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from bench.common.machine import cpu_model  # noqa: E402
from bench.loader import peervenv  # noqa: E402
from bench.loader.contenders import AUGMENTS, LEFT_OUT, PEERS, WITH_POLICY, run_one  # noqa: E402
from bench.loader.memory import evict_libraries  # noqa: E402
from bench.predict import predicting  # noqa: E402

NCLASSES = 10
CONTENDERS = (
    "ours",
    "ours-samples",
    "ours-cross",
    "ours-whole",
    "seed",
    "imagefolder",
    "limit",
    "side-by-side",
    "ours-work",
    "ours-work-together",
    "predict",
    "predict-loader",
    "predict-model",
    "timm",
)
# With --peers: ours, the limits and the peers (the seed and our variants are in the default run).
WITH_PEERS = ("ours", "limit", "ours-work", "ours-work-together", *PEERS)
DATASETS = ("noise", "photos")
SIZES = {"noise": "500x375 q90", "photos": "shorter side 300-500, mixed aspect, q75-95, camera grain"}
LABELS = {
    "ours": "(a) ours: wdsdist training loader",
    "ours-samples": "(a*) ours, loader.split=samples",
    "ours-cross": "(a') ours + cross-worker shuffle 1000",
    "ours-whole": "(a'') ours, whole-image decode",
    "seed": "(b) seed: WebDataset README pipeline",
    "imagefolder": "(c) torchvision ImageFolder + DataLoader",
    "limit": "(d) limit: W x single-core decode+crop+flip",
    "side-by-side": "(d') W such loops at once, summed",
    "ours-work": "(e) W x single-core region decode+crop+flip",
    "ours-work-together": "(e') W such region loops at once, summed",
    "predict": "(p) predict.py --out-dir, ResNet-18 at 224, CPU",
    "predict-loader": "(p') its loader alone (evaluation crops)",
    "predict-model": "(p'') its model alone (random batches)",
    "streaming": "(f) MosaicML Streaming: MDS + StreamingDataset",
    "litdata": "(g) LitData: optimize + StreamingDataLoader",
    "dali": "(h) DALI, CPU: readers.webdataset + decoders",
    "ffcv": "(i) FFCV: .beton + RandomResizedCropRGBDecoder",
    "wids": "(j) wids: ShardListDataset + ChunkedSampler",
    "spdl": "(k) SPDL: PipelineBuilder + FFmpeg, threads",
    "timm": "(l) timm: create_dataset + create_loader",
}


def photo(i: int, w: int = 500, h: int = 375, quality: int = 90) -> bytes:
    """A JPEG that compresses like a photo: colour field + texture + grain (~90 KB)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    low = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
    img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
    mid = rng.normal(0, 1, size=(h // 4, w // 4, 3)).astype(np.float32)
    mid = Image.fromarray(np.clip(mid * 40 + 128, 0, 255).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    grain = rng.normal(0, 10, size=(h, w, 3)).astype(np.float32)
    arr = np.clip(img + np.asarray(mid, dtype=np.float32) - 128 + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def data_folder(args: argparse.Namespace, dataset: str) -> Path:
    """noise in --data itself (where it always was), photos in --data/photos."""
    return Path(args.data) if dataset == "noise" else Path(args.data) / "photos"


def prepare(data: Path, n: int, dataset: str = "noise") -> dict:
    """Write n images as shards (with index) and as an ImageFolder tree, once."""
    marker = data / f"ready-{n}.json"
    if dataset == "photos":  # made anew whenever bench/loader/photos.py draws other images
        marker = data / f"ready-{n}-{peervenv.file_hash(ROOT / 'bench' / 'loader' / 'photos.py')[:12]}.json"
    if marker.exists():  # (a marker of an older bench.py lacks dataset and size)
        return {"dataset": dataset, "size": SIZES[dataset]} | json.loads(marker.read_text())
    from tqdm import tqdm

    from wdsdist.data.sources.index import index_path
    from wdsdist.tools.shards import Sample, ShardSink

    shutil.rmtree(data / "peers", ignore_errors=True)  # the peers' copies of images about to be replaced
    if dataset == "photos":
        # The photographs come from packages installed only in .bench-venv.
        print(f"writing {n} photo crops to {data / 'tree'} (in .bench-venv)", file=sys.stderr, flush=True)
        tree = data / "tree"
        if tree.exists():
            shutil.rmtree(tree)  # an earlier run that did not finish
        photos = ROOT / "bench" / "loader" / "photos.py"
        subprocess.run([str(peervenv.python()), str(photos), str(tree), str(n)], check=True)
        files = sorted(tree.glob("class*/*.jpg"), key=lambda p: p.name)
        images = ((int(p.parent.name[5:]), p.read_bytes()) for p in files)
    else:
        images = ((i % NCLASSES, photo(i)) for i in range(n))
    total = 0
    with ShardSink(str(data / "shards"), "bench", maxcount=250, maxsize=1 << 30) as sink:
        for i, (label, jpg) in enumerate(
            tqdm(images, total=n, desc=f"bench data ({dataset})", unit="img", mininterval=1.0)
        ):
            total += len(jpg)
            if dataset == "noise":
                folder = data / "tree" / f"class{label:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"img{i:06d}.jpg").write_bytes(jpg)
            sink.write(Sample(f"img{i:06d}", "jpg", jpg, label, {}))
        sink.commit()
    index = index_path(str(data / "shards"), "bench")
    info = {"images": n, "mean_kb": round(total / n / 1024, 1), "index": index, "tree": str(data / "tree")}
    info |= {"dataset": dataset, "size": SIZES[dataset]}
    marker.write_text(json.dumps(info))
    return info


# ---------------------------------------------------------------- the report


def run_contender(name: str, dataset: str, args: argparse.Namespace, tree: Path = ROOT) -> dict:
    """One contender in a fresh subprocess (the peers in .bench-venv's Python), with wdsdist
    imported from ``tree`` (--against: another commit's worktree); on failure
    ``{"error": its last line of stderr}``, the whole stderr printed."""
    python = str(peervenv.python()) if name in PEERS else sys.executable
    cmd = [python, __file__, "--run", name, "--set", dataset, "--images", str(args.images)]
    cmd += ["--workers", str(args.workers), "--batch", str(args.batch), "--warmup", str(args.warmup)]
    cmd += ["--batches", str(args.batches), "--limit-seconds", str(args.limit_seconds), "--data", args.data]
    cmd += ["--tree", str(tree), "--augment", args.augment]
    if hasattr(os, "posix_fadvise") and not args.keep_page_cache:
        evict_libraries(python)
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    return outcome(out)


def outcome(out: subprocess.CompletedProcess) -> dict:
    """A contender's JSON line; ``{"error": ...}`` if it printed none. One that printed its result
    and then died (FFCV at times ends with "terminate called without an active exception" while
    tearing down its threads) keeps its result, and the error as ``exit_error``."""
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
    said = lines[-1] if lines else f"exit status {out.returncode}"
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
    last = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
    if last and last[0].startswith("{"):
        result = json.loads(last[0])
        return result if out.returncode == 0 else result | {"exit_error": said}
    return {"error": said}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000, help="images in the data set (default: %(default)s)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers (default: all cores)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10, help="batches before the clock starts (default: %(default)s)")
    p.add_argument("--batches", type=int, default=100, help="batches timed (default: %(default)s, about 3 epochs)")
    p.add_argument(
        "--limit-seconds",
        type=float,
        default=5.0,
        help="how long to time each loop with no loader, (d) and (e) (default: %(default)s)",
    )
    p.add_argument("--data", default=str(ROOT / "data" / "bench"), help="where the generated data goes")
    p.add_argument("--json", default=str(ROOT / "outputs" / "bench" / "loader.json"), help="JSON output")
    p.add_argument("--only", nargs="*", choices=CONTENDERS + PEERS, help="run only these contenders")
    p.add_argument("--repeat", type=int, default=5, help="rounds over all contenders (default: %(default)s)")
    p.add_argument(
        "--peers",
        action="store_true",
        help="the peer loaders (streaming, litdata, dali, ffcv, wids, in .bench-venv/, made here if needed) "
        "beside ours and the limits (d), (e)",
    )
    p.add_argument(
        "--dataset",
        choices=(*DATASETS, "both"),
        default="noise",
        help="noise: textured noise; photos: crops of packaged photographs (needs .bench-venv); default %(default)s",
    )
    p.add_argument(
        "--against",
        metavar="REV",
        help="ours and its own work (e) at this checkout against commit REV (a temporary worktree, the same "
        "venv), interleaved over --repeat rounds; prints each figure as new / old (bench/loader/against.py)",
    )
    p.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="leave the venvs' libraries in the page cache between contenders (each contender's PSS then "
        "depends on how the cache got their pages; by default they are dropped before each run)",
    )
    p.add_argument(
        "--conversion",
        action="store_true",
        help="conversion to shards instead of loading, on the photos set: ours (1 and 2 workers), webdataset's "
        "ShardWriter, LitData's optimize (bench/loader/conversion.py; --images, --repeat)",
    )
    p.add_argument(
        "--augment",
        choices=AUGMENTS,
        default="none",
        help="the policy after crop and flip, in every contender that can apply it (the others are named as "
        "left out); randaugment is 2 ops at magnitude 9, and adds timm's loader (l) (default: %(default)s)",
    )
    p.add_argument("--run", choices=CONTENDERS + PEERS, help=argparse.SUPPRESS)  # internal: one contender
    p.add_argument("--tree", help=argparse.SUPPRESS)  # internal: the checkout whose wdsdist it runs
    p.add_argument("--set", choices=DATASETS, default="noise", help=argparse.SUPPRESS)  # internal: its data set
    p.add_argument("--convert", choices=PEERS, help=argparse.SUPPRESS)  # internal: one peer's format, once
    return p.parse_args()


def run_rounds(
    names: list[str], datasets: list[str], args: argparse.Namespace, conversions: dict[str, dict[str, dict]]
) -> dict[str, dict[str, list[dict]]]:
    """Every contender on every data set once per round, interleaved. A round that fails is kept
    with its error (the others still count); a peer whose conversion failed is not run."""
    rounds: dict[str, dict[str, list[dict]]] = {ds: {name: [] for name in names} for ds in datasets}
    for ds, converted in conversions.items():
        for name, result in converted.items():
            if "error" in result:
                rounds[ds][name].append({"error": f"conversion: {result['error']}"})
    for round_ in range(args.repeat):
        for ds in datasets:
            for name in names:
                if any(r.get("error", "").startswith("conversion: ") for r in rounds[ds][name]):
                    continue
                print(f"round {round_ + 1}/{args.repeat}, {ds}: {LABELS[name]} ...", file=sys.stderr, flush=True)
                rounds[ds][name].append(run_contender(name, ds, args))
    return rounds


def median_rounds(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Each contender's median round by rate (the whole round, so its numbers belong together),
    with the spread of its rounds' rates; a failed contender's error."""
    results = {}
    ours = rounds.get("ours", [])
    for name, all_rounds in rounds.items():
        rs = [r for r in all_rounds if "error" not in r]
        failed = [r["error"] for r in all_rounds if "error" in r]
        if not rs:
            results[name] = {"error": failed[0] if failed else "not run"}
            continue
        rates = [r["samples_per_s"] for r in rs]
        results[name] = sorted(rs, key=lambda r: r["samples_per_s"])[(len(rs) - 1) // 2] | {
            "min_samples_per_s": min(rates),
            "max_samples_per_s": max(rates),
            "rounds": len(rs),
        }
        if failed:
            results[name]["failed_rounds"] = failed
        # ours over this contender within each round (minutes apart, not a whole run apart)
        pairs = sorted(
            o["samples_per_s"] / r["samples_per_s"]
            for o, r in zip(ours, all_rounds, strict=False)
            if "samples_per_s" in o and "samples_per_s" in r
        )
        if pairs:
            results[name]["ours_x_per_round"] = pairs
            results[name]["ours_x_median_round"] = pairs[(len(pairs) - 1) // 2]
    return results


def print_table(results: dict[str, dict], args: argparse.Namespace, info: dict) -> None:
    rate = {name: r["samples_per_s"] for name, r in results.items() if "samples_per_s" in r}
    limit, seed, ours = rate.get("limit"), rate.get("seed"), rate.get("ours")
    header = (
        f"{'loader':48} {'samples/s':>9} {'rounds':>11} {'CPU/sample':>10} {'first batch':>11} "
        f"{'peak RSS':>9} {'PSS':>8} {'x limit':>7} {'x seed':>6} {'ours x':>6}"
    )
    print(
        f"\n{info['dataset']}: {args.images} JPEGs ({info['mean_kb']} KB mean, {info['size']}), "
        f"RandomResizedCrop(224) + flip{'' if args.augment == 'none' else ' + ' + args.augment}, batch {args.batch}, "
        f"{args.workers} workers, {os.cpu_count()} cores, "
        f"{cpu_model()}; median of {args.repeat} rounds"
    )
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        if "error" in result:
            print(f"{LABELS[name]:48} failed: {result['error']}")
            continue
        r = result["samples_per_s"]
        spread = f"{result['min_samples_per_s']:.0f}-{result['max_samples_per_s']:.0f}"
        first = f"{result['first_batch_s']:.2f} s" if "first_batch_s" in result else "-"
        rss = f"{result['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in result else "-"
        pss = f"{result['pss_mb']:.0f} MB" if "pss_mb" in result else "-"
        x_limit = f"{r / limit:.2f}" if limit else "-"
        x_seed = f"{r / seed:.2f}" if seed else "-"
        x_ours = f"{result['ours_x_median_round']:.2f}" if "ours_x_median_round" in result else "-"
        cpu = f"{result['cpu_ms_per_sample']:.2f} ms" if "cpu_ms_per_sample" in result else "-"
        cells = f"{r:9.1f} {spread:>11} {cpu:>10} {first:>11} {rss:>9} {pss:>8} {x_limit:>7} {x_seed:>6} {x_ours:>6}"
        print(f"{LABELS[name]:48} {cells}")
    cpu = {name: r["cpu_ms_per_sample"] for name, r in results.items() if "cpu_ms_per_sample" in r}
    if ours and "ours-work" in rate:
        print(f"ours / (e): {ours / rate['ours-work']:.2f} in samples/s", end="")
        if "ours-work-together" in rate:
            print(f", ours / (e'): {ours / rate['ours-work-together']:.2f}", end="")
        if "ours" in cpu and "ours-work" in cpu:
            print(f", (e) / ours {cpu['ours-work'] / cpu['ours']:.2f} in CPU time per sample", end="")
        print()
    print("ours x: ours' samples/s over that row's, the median over rounds of each round's ratio")


def write_json(
    args: argparse.Namespace,
    infos: dict[str, dict],
    results: dict[str, dict[str, dict]],
    rounds: dict[str, dict[str, list[dict]]],
    extra: dict,
) -> None:
    """``results`` (and ``rounds``) for the noise set, keyed by contender as before;
    ``results_photos`` (``rounds_photos``) for the photos; ``data`` describes each set."""
    report = {"config": vars(args) | {"cores": os.cpu_count(), "cpu": cpu_model()}, "data": infos} | extra
    for ds in results:
        suffix = "" if ds == "noise" else f"_{ds}"
        report[f"results{suffix}"] = results[ds]
        report[f"rounds{suffix}"] = rounds[ds]
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")


def main() -> int:
    args = parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)  # this contender's wdsdist (--against: the other commit's)
    if args.against:
        from bench.loader import against

        if args.dataset != "noise":
            peervenv.ensure()  # the photographs come from packages in .bench-venv

        return against.run(args, lambda ds: prepare(data_folder(args, ds), args.images, ds), run_contender)
    if args.run or args.convert:
        return run_inside(args)
    if args.conversion:
        return run_conversion(args)
    datasets = list(DATASETS) if args.dataset == "both" else [args.dataset]
    names, extra = contenders_for(args), {}
    if args.augment != "none":
        extra["left_out"] = left_out(args)
    for peer in ("ffcv", "spdl"):  # what they need from Debian: the one line that installs it
        if peer in names and (wanted := peervenv.missing_packages(peer)):
            others = " ".join(n for n in names if n != peer)
            raise SystemExit(f"error: {peervenv.needs_line(peer, wanted)}; or leave {peer} out: --only {others}")
    if "photos" in datasets or any(name in PEERS for name in names):
        extra["bench_venv"] = peervenv.ensure()
    infos = {ds: prepare(data_folder(args, ds), args.images, ds) for ds in datasets}
    conversions: dict[str, dict] = {}
    not_built = extra.get("bench_venv", {}).get("not_built", {})
    for ds in datasets:
        for name in [n for n in names if n in PEERS]:
            if name in not_built:
                conversions.setdefault(ds, {})[name] = {"error": f"not built: {not_built[name]}"}
                continue
            # Each peer's own format, once, outside the timed runs (in .bench-venv).
            print(f"{ds}: {LABELS[name]}: converting the images (once) ...", file=sys.stderr, flush=True)
            conversions.setdefault(ds, {})[name] = run_convert(name, ds, args)
    if conversions:
        extra["conversions"] = conversions
    rounds = run_rounds(names, datasets, args, conversions)
    results = {ds: median_rounds(rounds[ds]) for ds in datasets}
    for ds in datasets:
        print_table(results[ds], args, infos[ds])
        said = predicting.ratio_line(rounds[ds])
        if said:
            print(said)
    for name, why in extra.get("left_out", {}).items():
        print(f"left out: {LABELS[name]}: {why}")
    write_json(args, infos, results, rounds, extra)
    return 0


def run_inside(args: argparse.Namespace) -> int:
    """--run NAME or --convert NAME: one contender's run, or one peer's conversion, in this
    process (bench.py's own subprocess); its JSON on stdout."""
    info = prepare(data_folder(args, args.set), args.images, args.set)
    if args.convert:
        from bench.loader import peers

        print(json.dumps(peers.convert(args.convert, info)))
        return 0
    result = run_one(
        args.run, info, args.workers, args.batch, args.warmup, args.batches, args.limit_seconds, args.augment
    )
    if "wdsdist" in sys.modules:  # which checkout's loader ran (--against: each tree's own)
        result["wdsdist"] = str(Path(sys.modules["wdsdist"].__file__).resolve().parent.parent)
    print(json.dumps(result))
    return 0


def run_conversion(args: argparse.Namespace) -> int:
    """--conversion: the photos set's ImageFolder tree to shards by each writer (bench/loader/conversion.py)."""
    from bench.loader import conversion

    venv = peervenv.ensure()
    data = data_folder(args, "photos")
    info = prepare(data, args.images, "photos")
    results = conversion.measure(Path(info["tree"]), data / "conversion", args.repeat)
    said = f"{args.images} photos ({info['mean_kb']} KB mean), {os.cpu_count()} cores, {cpu_model()}"
    conversion.print_table(results, said)
    out = Path(args.json).with_name("conversion.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": vars(args) | {"cores": os.cpu_count(), "cpu": cpu_model()}, "data": info, "results": results}
    out.write_text(json.dumps(report | {"bench_venv": venv}, indent=1))
    print(f"-> {out}")
    return 0


def contenders_for(args: argparse.Namespace) -> list[str]:
    """The contenders to run: --only, or the default set (--peers: ours, the limits, the peers);
    with --augment, those of them that apply the policy, and (--peers) the reference pipelines
    beside the peers: ImageFolder's, WebDataset's README's, and for randaugment timm's loader."""
    if args.only:
        return [n for n in args.only if n not in left_out(args)]
    names = list(WITH_PEERS) if args.peers else [n for n in CONTENDERS if n != "timm"]
    if args.augment != "none":
        names += [n for n in ("seed", "imagefolder", "timm") if n not in names]
    return [n for n in names if n not in left_out(args)]


def left_out(args: argparse.Namespace) -> dict[str, str]:
    """With --augment: each contender asked for (--only, or the default set) that cannot apply
    the policy, and why; timm's loader runs for randaugment alone, and only with it."""
    asked = args.only or [*(WITH_PEERS if args.peers else CONTENDERS), "timm"]
    if args.augment == "none":
        return {n: "runs with --augment randaugment" for n in asked if n == "timm"}
    out = {n: LEFT_OUT.get(n, f"applies no {args.augment}") for n in asked if n not in WITH_POLICY}
    if args.augment != "randaugment" and "timm" in asked:
        out["timm"] = LEFT_OUT["timm"]
    return out


def run_convert(name: str, dataset: str, args: argparse.Namespace) -> dict:
    cmd = [str(peervenv.python()), __file__, "--convert", name, "--set", dataset, "--images", str(args.images)]
    out = subprocess.run(
        cmd + ["--data", args.data], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit status {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
