"""Shards and image trees made for the tests: ImageFolder trees, raw tar members, JPEGs that fail late."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import webdataset as wds
from PIL import Image

from tests.conftest import jpeg
from wdsdist.data.sources.index import index_path, write_index

CLASSES = ["n01440764", "n01443537", "n09999999"]


def make_image_folder(root, per_class=12):
    """An ImageNet-like train tree: JPEGs, one PNG (grayscale) and one .JPEG per class."""
    files = {}
    for c, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            if i == 0:
                path = folder / f"{name}_{i}.png"
                Image.fromarray(np.full((10, 12), 40 * c, dtype=np.uint8), mode="L").save(path)
            else:
                ext = "JPEG" if i == 1 else "jpg"
                path = folder / f"{name}_{i}.v2.{ext}"  # a dot inside the name, as some datasets have
                path.write_bytes(jpeg(100 * c + i)[0])
            files[os.path.relpath(path, root)] = (path.read_bytes(), c)
    return files


def raw_member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    return info.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def garbled_jpeg(seed: int, garbled: bool, shape: tuple[int, int] = (72, 96)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*shape, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    data = out.getvalue()
    if garbled:  # a header that reads, then a scan neither libjpeg nor torchvision decodes
        sos = data.index(b"\xff\xda")
        data = data[: sos + 20] + b"\xff\xc5" * 200 + b"\xff\xd9"
    return data


def warm_shards(folder, counts, every=4, shape=(72, 96)):
    """Shards whose every ``every``-th JPEG fails only when its pixels are made (after its draws)."""
    folder.mkdir()
    shards, n = [], 0
    for i, count in enumerate(counts):
        path = folder / f"w-{i:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(count):
                sink.write({"__key__": f"s{n:06d}", "jpg": garbled_jpeg(n, n % every == 1, shape), "cls": str(n % 10)})
                n += 1
        shards.append((str(path), count))
    index = index_path(str(folder), "w")
    write_index(index, shards, name="w")
    return index
