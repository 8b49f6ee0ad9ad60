"""gpu-check's part (probe): each nvImageCodec release the kit carries, tried on this GPU in a
process of its own (a release's region decode may crash the process: NVIDIA/nvImageCodec#55),
with region decode and chroma interpolation on, against libjpeg-turbo's pixels. The release the
rest of the check uses is the newest whose region decode works and that decode=gpu uses regions
with; its folder goes on the path of this process and of the runs it starts.

    python bench/gpucheck/decoder.py SITE regions|whole|progressive    # one release in SITE: JSON out
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IMAGES = 64
TIMED = 256  # the timed batch: ImageNet-size photos, RandomResizedCrop's regions
FANCY, GPU_HUFFMAN = ":fancy_upsampling=1", " nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"
HW, CUDA = "HW_GPU_ONLY", "GPU_ONLY"
SETTINGS = [  # name, backends, options, regions[, host threads] (the second: decode=gpu's default, codecs.py)
    ("hw+cuda regions", (HW, CUDA), FANCY, True),
    ("hw+cuda regions gpu-huffman", (HW, CUDA), FANCY + GPU_HUFFMAN, True),
    ("hw regions", (HW,), FANCY, True),
    ("cuda regions gpu-huffman", (CUDA,), FANCY + GPU_HUFFMAN, True),
    ("cuda regions", (CUDA,), FANCY, True),
    ("hybrid regions", ("HYBRID_CPU_GPU",), FANCY, True),
    ("hw+cuda whole gpu-huffman", (HW, CUDA), FANCY + GPU_HUFFMAN, False),
    ("hw whole", (HW,), FANCY, False),
    ("cuda whole gpu-huffman", (CUDA,), FANCY + GPU_HUFFMAN, False),
    ("hw+cuda regions no-fancy", (HW, CUDA), GPU_HUFFMAN.strip(), True),
    ("hw 3/4 + cuda regions gpu-huffman", (f"{HW}:0.75", CUDA), FANCY + GPU_HUFFMAN, True),
    ("hw 1/2 + cuda regions gpu-huffman", (f"{HW}:0.5", CUDA), FANCY + GPU_HUFFMAN, True),
    ("hw 3/4 + cuda whole gpu-huffman", (f"{HW}:0.75", CUDA), FANCY + GPU_HUFFMAN, False),
    ("hw+cuda regions gpu-huffman, 2 host threads", (HW, CUDA), FANCY + GPU_HUFFMAN, True, 2),
    ("hw+cuda regions gpu-huffman, 4 host threads", (HW, CUDA), FANCY + GPU_HUFFMAN, True, 4),
]
# Each release: regions and whole images (the choice); progressive JPEGs as regions (reported:
# one the GPU refuses is decoded by libjpeg on the decode thread)
MODES = ("regions", "whole", "progressive")
AT_ONCE = 2  # decode=gpu's default setting in as many threads, each a decoder and stream of its own


def install(kit: Path, release: Path) -> Path:
    """The release's wheel and nvJPEG's into a folder of their own under /tmp."""
    site = Path(f"/tmp/wdsdist-nvimgcodec-{release.name}")
    wheels = [*release.glob("*.whl"), *(kit / "nvimgcodec").glob("nvidia_nvjpeg-*.whl")]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
    cmd += ["--no-deps", "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return site


def with_site(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", ""), str(site)) if p)
    return env


def probe(check: Any, part: dict) -> None:
    """(probe): every release in the kit, then the one chosen for the other parts."""
    from wdsdist.data.decode import codecs

    kit = Path(check.kit)
    releases = sorted((p for p in (kit / "nvimgcodec").glob("*") if p.is_dir()), key=lambda p: _key(p.name))
    if check.cpu or not releases:
        part["verdict"] = "no GPU (rehearsal)" if check.cpu else f"no nvImageCodec release in {kit}/nvimgcodec"
        return
    for release in reversed(releases):  # newest first
        row: dict = {"release": release.name}
        part["rows"].append(row)
        try:
            site = install(kit, release)
            row |= {"status": "ok", "site": str(site)}
            for mode in MODES:  # apart: a crash in one leaves the others measured
                done = subprocess.run(
                    [sys.executable, __file__, str(site), mode],
                    env=with_site(site),
                    capture_output=True,
                    text=True,
                    timeout=max(15.0, min(180.0, check.left())),
                )
                if done.returncode != 0:
                    row[mode] = {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
                else:
                    row[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        except Exception as exc:  # noqa: BLE001 (a release that fails is reported; the others still run)
            row |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
        check.say(f"  nvImageCodec {release.name}: {json.dumps({k: v for k, v in row.items() if k != 'site'})}")
        check.save()
    usable = [
        r
        for r in part["rows"]
        if r["status"] == "ok" and r["regions"].get("ok") and not r["release"].startswith(codecs.REGIONS_BROKEN)
    ]
    usable = usable or [r for r in part["rows"] if r["status"] == "ok" and r["whole"].get("ok")]
    if not usable:
        part["verdict"] = "no release decodes here: decode=gpu uses torchvision's decoder"
        return
    chosen = usable[0]
    part["chosen"] = chosen["release"]
    sys.path.append(chosen["site"])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), chosen["site"]) if p)
    part["verdict"] = f"nvImageCodec {chosen['release']} is used for the other parts"
    said = chosen.get("progressive", {})
    if "images" in said:  # those it refuses go to libjpeg, on the decode thread
        part["verdict"] += f"; it refused {said['refused']} of {said['images']} progressive JPEGs"
    if check.time_settings:
        settings(check, part, chosen)
    else:
        part["verdict"] += " (its settings not timed: --only leaves the probe out)"


def settings(check: Any, part: dict, chosen: dict) -> None:
    """The chosen release's settings timed on a batch of ImageNet-size crops, with torchvision's
    nvJPEG and with the kit's (as wdsdist.preload loads it): the fastest whose pixels are
    libjpeg-turbo's (p99.9 at most 2) is named."""
    part["timing"] = rows = []
    for mode in ("timing", "timing-own-nvjpeg"):  # the second: the kit's nvJPEG loaded before torchvision's
        done = subprocess.run(
            [sys.executable, __file__, chosen["site"], mode],
            env=with_site(Path(chosen["site"])),
            capture_output=True,
            text=True,
            timeout=max(15.0, min(240.0, check.left())),
        )
        if done.returncode != 0:
            error = f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
            rows.append({"mode": mode, "setting": "-", "ok": False, "error": error})
            continue
        got = [r | {"mode": mode} for r in json.loads(done.stdout.strip().splitlines()[-1])]
        rows += got
        check.say(f"  {mode}: " + "; ".join(f"{r['setting']} {r.get('wall_ms', 0):.1f} ms" for r in got))
    # (the rows of decoders at once have no pixels of their own: they are not candidates)
    good = [r for r in rows if r.get("ok") and r["mode"] == "timing-own-nvjpeg" and r.get("p99_9", 99) <= 2]
    if good:  # reported; the other parts run decode=gpu's defaults (WDSDIST_NVIMGCODEC_* would set it)
        best = min(good, key=lambda r: r["wall_ms"])
        part["best"] = best["setting"]
        part["verdict"] += f"; fastest alone: {best['setting']} ({best['wall_ms']:.1f} ms per {TIMED} crops)"


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split(".") if x.isdigit())


def measure(mode: str, images: int = IMAGES) -> dict:
    """In the release's own process: a batch of photo-like and of noise JPEGs decoded as regions
    (``mode`` regions), as whole images (whole), or the photos again as progressive JPEGs, as
    regions (progressive), against libjpeg-turbo's pixels of the same regions. (Without CUDA, a
    rehearsal: nvImageCodec's CPU backend.)"""
    import contextlib

    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.gpucheck.loader import noise_sample, photo_sample
    from wdsdist.data.decode.codecs import NvImageCodec
    from wdsdist.data.decode.resize import region_of

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    stream = torch.cuda.Stream(device) if cuda else None
    g = torch.Generator().manual_seed(0)
    datas = [photo_sample(i) for i in range(images)] + [noise_sample(i) for i in range(images // 4)]
    if mode == "progressive":  # the same photos, progressive (SOF2): does a GPU decoder take them?
        datas = [progressive(d) for d in datas[:images]]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    turbo = [decode_jpeg(t, mode=ImageReadMode.RGB) for t in tensors]
    regions = []
    for image in turbo:
        _, h, w = image.shape
        rh, rw = int(torch.randint(h // 4, h, (1,), generator=g)), int(torch.randint(w // 4, w, (1,), generator=g))
        top, left = (
            int(torch.randint(0, h - rh + 1, (1,), generator=g)),
            int(torch.randint(0, w - rw + 1, (1,), generator=g)),
        )
        regions.append((top, left, rh, rw))
    use_regions = mode != "whole"
    codec = NvImageCodec(device, stream, regions=use_regions)
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        src, places = codec.decode(tensors, regions)
    if stream is not None:
        stream.synchronize()
    src = src.cpu()
    worst, diffs = 0, []
    for image, region, place in zip(turbo, regions, places, strict=True):
        if place is None:
            continue
        top, left, h, w = region
        want = image[:, top : top + h, left : left + w]
        d = (region_of(src, place).int() - want.int()).abs().flatten()
        diffs.append(d)
        worst = max(worst, int(d.max()))
    every = torch.cat(diffs).float() if diffs else torch.zeros(1)
    refused = sum(p is None for p in places)
    return {  # regions asked for and turned off (every one refused): region decode does not work
        "ok": refused == 0 and codec.regions == use_regions,
        "refused": refused,
        "images": len(places),
        "max": worst,
        "p99_9": float(torch.quantile(every[:: max(1, every.numel() // 4_000_000)], 0.999)),
        "mean": float(every.mean()),
        "name": codec.name,
    }


def progressive(jpeg: bytes) -> bytes:
    """A JPEG's pixels again as a progressive JPEG."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(out, format="JPEG", quality=90, progressive=True)
    return out.getvalue()


def timing() -> list[dict]:
    """Each of SETTINGS on one batch of TIMED photos: the decode call's host time, the CPU time
    the process spent in it (every thread's), its time until the stream is done (median of 8
    after 2 untimed), the images its first decoder refused, and the pixels against
    libjpeg-turbo's. Then decode=gpu's default in AT_ONCE threads at once (gpu_decode_threads)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms import RandomResizedCrop

    from bench.gpucheck.loader import photo_sample
    from wdsdist.data.decode.codecs import NvImageCodec

    # (without CUDA, a rehearsal: nvImageCodec's CPU backend, whatever the setting says)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    torch.manual_seed(0)
    tensors = [torch.frombuffer(bytearray(photo_sample(10_000 + i)), dtype=torch.uint8) for i in range(TIMED)]
    turbo = [decode_jpeg(t, mode=ImageReadMode.RGB) for t in tensors]
    regions = [RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3)) for image in turbo]
    wants = [image[:, t : t + h, le : le + w].to(device) for image, (t, le, h, w) in zip(turbo, regions, strict=True)]
    rows = []
    for name, backends, options, use_regions, *threads in SETTINGS if stream is not None else SETTINGS[:1]:
        row: dict = {"setting": name, "backends": list(backends), "options": options, "regions": use_regions}
        rows.append(row)
        try:
            codec = NvImageCodec(device, stream, use_regions, backends, options, *threads)
            row |= _time_one(codec, tensors, regions, wants)
        except Exception as exc:  # noqa: BLE001 (a setting that fails is reported; the others still run)
            row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    row = {"setting": f"decode=gpu's default, {AT_ONCE} decoders at once", "images": AT_ONCE * TIMED}
    rows.append(row)
    try:
        row |= _time_at_once(device, tensors, regions)
    except Exception as exc:  # noqa: BLE001 (reported; the rows above stand)
        row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    rows.append({"setting": "nvjpeg loaded", "ok": False, "error": _mapped("libnvjpeg")})
    return rows


def _time_at_once(device, tensors, regions) -> dict:
    """AT_ONCE decoders (decode=gpu's default setting), each on a thread, stream and buffer of its
    own, decoding the batch at the same time, as loader.gpu_decode_threads runs them: the time
    until all are done, and the process's CPU time meanwhile (median of 8 rounds after 2)."""
    import contextlib
    import threading
    import time

    import torch

    from wdsdist.data.decode.codecs import NvImageCodec

    cuda = device.type == "cuda"
    codecs_ = [NvImageCodec(device, torch.cuda.Stream(device) if cuda else None) for _ in range(AT_ONCE)]
    walls, cpus, refused = [], [], []

    def run(codec, out: list) -> None:
        if cuda:
            torch.cuda.set_device(device)
        # on its own stream, as the loader's decode threads run it: its buffer and copies there too
        with torch.cuda.stream(codec.stream) if cuda else contextlib.nullcontext():
            _, places = codec.decode(tensors, regions)
        if codec.stream is not None:
            codec.stream.synchronize()
        out.append(sum(p is None for p in places))

    for _ in range(10):
        threads = [threading.Thread(target=run, args=(c, refused)) for c in codecs_]
        t0, c0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append((time.perf_counter() - t0) * 1e3), cpus.append((time.process_time() - c0) * 1e3)
    return {
        "ok": len(refused) == 10 * AT_ONCE and not any(refused),
        "refused": sum(refused[-AT_ONCE:]),
        "first_refused": sum(refused[:AT_ONCE]),
        "wall_ms": sorted(walls[2:])[4],
        "cpu_ms": sorted(cpus[2:])[4],
        "name": codecs_[0].name,
    }


def _time_one(codec, tensors, regions, wants) -> dict:
    import contextlib
    import time

    import torch

    from wdsdist.data.decode.resize import region_of

    first = []
    plain = codec._whole_for_refused

    def counted(parents, regions_, places, out):
        first.append(sum(o is None for o in out))
        plain(parents, regions_, places, out)

    codec._whole_for_refused = counted
    host, wall, cpu = [], [], []
    for _ in range(10):
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.cuda.stream(codec.stream) if codec.stream is not None else contextlib.nullcontext():
            src, places = codec.decode(tensors, regions)
        t1, c1 = time.perf_counter(), time.process_time()
        if codec.stream is not None:
            codec.stream.synchronize()
        host.append((t1 - t0) * 1e3), wall.append((time.perf_counter() - t0) * 1e3), cpu.append((c1 - c0) * 1e3)
    diffs = []
    for want, place in zip(wants, places, strict=True):
        if place is not None:
            diffs.append((region_of(src, place).int() - want.int()).abs().flatten()[::7].float())
    every = torch.cat(diffs) if diffs else torch.zeros(1, device=src.device)
    refused = sum(p is None for p in places)
    return {
        "ok": refused == 0,
        "refused": refused,
        "first_refused": first[-1] if first else 0,
        "images": len(tensors),
        "host_ms": sorted(host[2:])[4],
        "cpu_ms": sorted(cpu[2:])[4],
        "wall_ms": sorted(wall[2:])[4],
        "p99_9": float(torch.quantile(every[: 1 << 24], 0.999)),
        "max": int(every.max()),
        "name": codec.name,
    }


def _mapped(library: str) -> str:
    """Where this process loaded ``library`` from (its memory map)."""
    with open("/proc/self/maps") as f:
        found = sorted({line.split()[-1] for line in f if library in line})
    return ", ".join(found) or "not loaded"


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # bench/ imported as the package it is
    if sys.argv[2] == "timing":  # torchvision's nvJPEG: nothing preloaded
        print(json.dumps(timing()))
        sys.exit(0)
    import wdsdist  # its import loads the kit's nvJPEG, before torchvision's (wdsdist/preload.py), as decode=gpu runs

    if sys.argv[2] == "timing-own-nvjpeg":
        print(json.dumps(timing() + [{"setting": "preloaded", "ok": False, "error": str(wdsdist.preload.loaded)}]))
        sys.exit(0)
    print(json.dumps(measure(sys.argv[2])))
