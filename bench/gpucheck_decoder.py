"""gpu-check's part (probe): each nvImageCodec release the kit carries, tried on this GPU in a
process of its own (a release's region decode may crash the process: NVIDIA/nvImageCodec#55),
with region decode and chroma interpolation on, against libjpeg-turbo's pixels. The release the
rest of the check uses is the newest whose region decode works and that decode=gpu uses regions
with; its folder goes on the path of this process and of the runs it starts.

    python bench/gpucheck_decoder.py SITE regions|whole    # one release, installed in SITE: JSON out
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMAGES = 64


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
            for mode in ("regions", "whole"):  # apart: a crash in one leaves the other measured
                done = subprocess.run(
                    [sys.executable, __file__, str(site), mode],
                    env=with_site(site),
                    capture_output=True,
                    text=True,
                    timeout=180,
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


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split(".") if x.isdigit())


def measure(mode: str) -> dict:
    """In the release's own process: a batch of photo-like and of noise JPEGs decoded as regions,
    then as whole images, against libjpeg-turbo's pixels of the same regions."""
    import torch
    from gpucheck_loader import noise_sample, photo_sample
    from torchvision.io import ImageReadMode, decode_jpeg

    from wdsdist.data.decode.codecs import NvImageCodec

    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    out: dict = {}
    g = torch.Generator().manual_seed(0)
    datas = [photo_sample(i) for i in range(IMAGES)] + [noise_sample(i) for i in range(IMAGES // 4)]
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
    for name, use_regions in ((mode, mode == "regions"),):
        codec = NvImageCodec(device, stream, regions=use_regions)
        with torch.cuda.stream(stream):
            src, places = codec.decode(tensors, regions)
        stream.synchronize()
        src = src.cpu()
        worst, diffs = 0, []
        for image, region, place in zip(turbo, regions, places, strict=True):
            if place is None:
                continue
            top, left, h, w = region
            want = image[:, top : top + h, left : left + w]
            rows = src[place.start : place.start + (place.height - 1) * place.stride + place.width * 3]
            got = rows.as_strided((3, place.height, place.width), (1, place.stride, 3))
            d = (got.int() - want.int()).abs().flatten()
            diffs.append(d)
            worst = max(worst, int(d.max()))
        every = torch.cat(diffs).float() if diffs else torch.zeros(1)
        refused = sum(p is None for p in places)
        out[name] = {
            "ok": refused == 0,
            "refused": refused,
            "images": len(places),
            "max": worst,
            "p99_9": float(torch.quantile(every[:: max(1, every.numel() // 4_000_000)], 0.999)),
            "mean": float(every.mean()),
            "name": codec.name,
        }
    return out[mode]


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    print(json.dumps(measure(sys.argv[2])))
