#!/usr/bin/env python3
"""What starting mid-shard costs, side by side: read_span over a span that begins in the middle
of an ImageNet-sized shard, by reading and dropping the samples before it (the fallback), by
seeking past their members (local) and from the index's byte offsets (a seek, or an http Range
request), from a local file and from an http server on 127.0.0.1. Run with
``./run bench/data/spans.py`` (see --help).

Data: one shard of --samples samples of about 110 KB each (a .jpg of random bytes, a .cls and a
.json: three members, as makeshards writes them), in the page cache after the first round, so
the local numbers are the CPU's cost, a floor for a disk's. Each row is the median of --repeat
rounds; "bytes" is what was read from the file or sent by the server.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import itertools
import json
import os
import random
import statistics
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from wdsdist.data.sources import shardspec  # noqa: E402
from wdsdist.data.sources.index import offsets_entry  # noqa: E402
from wdsdist.data.sources.opener import Access, open_shard  # noqa: E402
from wdsdist.data.sources.shardspec import Shard  # noqa: E402
from wdsdist.data.sources.spanread import read_span  # noqa: E402
from wdsdist.data.tar import tarread  # noqa: E402


def make_shard(path: Path, n: int, seed: int = 0) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for suffix, data in (
                ("jpg", rng.randbytes(int(rng.uniform(60_000, 160_000)))),
                ("cls", str(i % 1000).encode()),
                ("json", json.dumps({"index": i}).encode()),
            ):
                info = tarfile.TarInfo(f"s{i:07d}.{suffix}")
                info.size, info.mtime = len(data), 1
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


class _Server(http.server.SimpleHTTPRequestHandler):
    """Its folder, with Range requests answered (206); counts the body bytes it sends."""

    sent = [0]
    honour_range = True

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = Path(self.directory) / self.path.lstrip("/")
        want = self.headers.get("Range") if self.honour_range else None
        size = path.stat().st_size
        first, last = 0, size - 1
        if want:
            a, _, b = want.removeprefix("bytes=").partition("-")
            first, last = int(a), min(int(b) if b else size - 1, size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(first)
            left = last - first + 1
            try:
                while left > 0:
                    chunk = f.read(min(left, 1 << 18))
                    self.wfile.write(chunk)
                    self.sent[0] += len(chunk)
                    left -= len(chunk)
            except OSError:
                pass  # the reader hung up after its span


class _CountingRaw(io.FileIO):
    read_bytes = [0]

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        self.read_bytes[0] += n
        return n


def counting_open(name, mode="rb", buffering=-1):
    return io.BufferedReader(_CountingRaw(name))


def time_span(shard: Shard, start: int, stop: int | None, how: str, counter: list[int]) -> tuple[float, int, int]:
    access = Access(http_timeout=60)
    counter[0] = 0
    t0 = time.perf_counter()
    if how == "read and drop":
        stream = open_shard(shard.url, access)
        try:
            n = sum(1 for _ in itertools.islice(tarread.tar_samples(stream, shard.url), start, stop))
        finally:
            stream.close()
    else:
        n = sum(1 for _ in read_span(shard, start, stop, access, use_offsets=how == "offsets"))
    return time.perf_counter() - t0, counter[0], n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1000, help="samples in the shard (default: %(default)s)")
    p.add_argument("--every", type=int, default=16, help="offset table: every K-th sample (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--data", default=str(ROOT / "data" / "bench" / "spans"))
    p.add_argument("--json", default=str(ROOT / "outputs" / "bench" / "spans.json"))
    args = p.parse_args()
    path = Path(args.data) / f"span-{args.samples}.tar"
    make_shard(path, args.samples)
    with open(path, "rb") as f:
        offsets = tarread.sample_offsets(f)
    table = shardspec._offsets(str(path), offsets_entry(offsets, args.every), args.samples)
    tarread.open = counting_open  # the local rows count the bytes read from the file
    handler = functools.partial(_Server, directory=str(path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    mid = args.samples // 2
    spans = {"mid .. end": (mid, None), "mid, 10 samples": (mid, mid + 10), "whole shard": (0, None)}
    sources = {
        "local": (Shard(str(path), args.samples, table), _CountingRaw.read_bytes),
        "http": (Shard(f"{base}/{path.name}", args.samples, table), _Server.sent),
    }
    rows = []
    for source, (shard, counter) in sources.items():
        for span, (start, stop) in spans.items():
            for how in ("read and drop", "seek headers", "offsets"):
                if source == "http" and how == "seek headers":
                    continue  # an http stream cannot seek: the same as read and drop
                runs = [time_span(shard, start, stop, how, counter) for _ in range(args.repeat)]
                seconds = statistics.median(r[0] for r in runs)
                rows.append(dict(source=source, span=span, how=how, seconds=seconds, bytes=runs[-1][1], n=runs[-1][2]))
    server.shutdown()
    size = path.stat().st_size
    print(f"shard: {args.samples} samples, {size / 1e6:.1f} MB; offsets every {args.every}; median of {args.repeat}")
    print(f"{'source':6} {'span':16} {'how':14} {'ms':>9} {'MB read':>8} {'samples':>7} {'vs drop':>8}")
    for r in rows:
        drop = next(x for x in rows if x["source"] == r["source"] and x["span"] == r["span"])
        ratio = drop["seconds"] / r["seconds"] if r["seconds"] else float("inf")
        print(
            f"{r['source']:6} {r['span']:16} {r['how']:14} {r['seconds'] * 1e3:9.2f} {r['bytes'] / 1e6:8.1f} "
            f"{r['n']:7d} {ratio:7.1f}x"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"samples": args.samples, "bytes": size, "every": args.every, "rows": rows}, indent=1))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
