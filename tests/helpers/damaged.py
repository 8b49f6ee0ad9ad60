"""Damaged shards as users meet them: scikit-learn's 1,437 digits (the first 1,437 of its
1,797) as JPEGs in 10 shards (9 x 150 + 87) with an index, and in a copy some samples' image
bytes overwritten with noise inside the tar (the tar, its headers and the index unchanged), or a
shard made unreadable. A sample's label is its digit; its key is its number (0..1436), and
``positions`` says where each stands in an epoch's sample sequence (split=samples).
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from wdsdist.data.sources.index import write_index

TOTAL, PER_SHARD = 1437, 150
# (shard, sample in it): 5 damaged samples in 5 of the 10 shards, one of them the epoch's first
# in shard order 0 (read again as padding) and one a shard's last
DAMAGED = ((0, 0), (2, 77), (4, 149), (6, 3), (9, 86))


def digit_jpegs(count: int = TOTAL, side: int = 16) -> tuple[list[bytes], list[int]]:
    """The first ``count`` digits as JPEGs, and their digits."""
    from sklearn.datasets import load_digits

    out, data = [], load_digits()
    for image in data.images[:count]:
        grey = Image.fromarray((image * 16).clip(0, 255).astype(np.uint8)).resize((side, side), Image.BILINEAR)
        buf = io.BytesIO()
        grey.convert("RGB").save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out, [int(t) for t in data.target[:count]]


def write_digits(folder: Path, prefix: str = "digits") -> tuple[str, list[Path]]:
    """The clean shards and their index: (the index's path, the shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    jpegs, digits = digit_jpegs()
    paths, counts = [], []
    for s, first in enumerate(range(0, TOTAL, PER_SHARD)):
        path = folder / f"{prefix}-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for n in range(first, min(first + PER_SHARD, TOTAL)):
                sink.write({"__key__": f"{n:06d}", "jpg": jpegs[n], "cls": str(digits[n]).encode()})
        paths.append(path)
        counts.append(min(PER_SHARD, TOTAL - first))
    index = folder / f"{prefix}.index.json"
    write_index(str(index), [(str(p), c) for p, c in zip(paths, counts, strict=True)])
    return str(index), paths


def damage(folder: Path, damaged: tuple[tuple[int, int], ...] = DAMAGED, prefix: str = "digits") -> set[int]:
    """Noise over the image bytes of these (shard, sample) in place; the damaged samples' numbers."""
    rng = np.random.default_rng(0)
    lost = set()
    for shard, sample in damaged:
        path = folder / f"{prefix}-{shard:06d}.tar"
        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name == f"{shard * PER_SHARD + sample:06d}.jpg")
        with open(path, "r+b") as f:
            f.seek(member.offset_data)
            f.write(rng.integers(0, 256, member.size, dtype=np.uint8).tobytes())
        lost.add(shard * PER_SHARD + sample)
    return lost


def damaged_copy(clean: Path, to: Path, damaged: tuple[tuple[int, int], ...] = DAMAGED) -> tuple[str, set[int]]:
    """A copy of the clean folder with these samples damaged: (its index, the damaged numbers)."""
    shutil.copytree(clean, to)
    index = next(str(to / n) for n in os.listdir(to) if n.endswith(".index.json"))
    return index, damage(to, damaged)


def unreadable(folder: Path, shard: int, prefix: str = "digits") -> set[int]:
    """Shard ``shard`` made unreadable (not a tar any more); its samples' numbers."""
    path = folder / f"{prefix}-{shard:06d}.tar"
    path.write_bytes(b"not a tar file\n" * 100)
    return set(range(shard * PER_SHARD, min((shard + 1) * PER_SHARD, TOTAL)))


def counts() -> list[int]:
    return [min(PER_SHARD, TOTAL - first) for first in range(0, TOTAL, PER_SHARD)]


def positions(seed: int, epoch: int) -> dict[int, int]:
    """Sample number -> its position in the epoch's sequence (split=samples, one node)."""
    from wdsdist.data.plan.order import GLOBAL, epoch_order, node_parts
    from wdsdist.data.plan.sequence import EpochShards

    sizes = counts()
    where = EpochShards(sizes, epoch_order(node_parts(sizes, GLOBAL, seed), seed, epoch))
    out, pos = {}, 0
    for shard, first, stop in where.order:
        for n in range(first, stop):
            out[shard * PER_SHARD + n] = pos
            pos += 1
    return out


def one_epoch(spec: str, world: int, cfg) -> dict:  # noqa: ANN001 (a LoaderConfig)
    """One epoch on every rank of ``world`` (``cfg`` with_keys): batches and len() per rank, the
    keys of the real rows (positions below N under split=samples; rows that stand in for nothing
    under split=shards), the stand-in and padding rows' keys, the losses counted and named. Code
    from before stand-ins (no ``bad_samples``) has no stand-in rows."""
    import torch

    from wdsdist.data import Loader

    out: dict = {"batches": [], "lens": [], "real": [], "padding": [], "lost": 0, "names": []}
    for rank in range(world):
        loader = Loader(spec, cfg, rank=rank, world=world)
        out["lens"].append(len(loader))
        n = 0
        for batch in loader:
            n += 1
            keys = torch.tensor([int(k) for k in batch["key"]])
            if cfg.by_samples:
                stand_in = batch["pos"] >= TOTAL
            else:
                stand_in = (
                    batch["bad"][:, 0] > 0 if "bad_samples" in batch else torch.zeros(len(keys), dtype=torch.bool)
                )
            out["real"] += keys[~stand_in].tolist()
            out["padding"] += keys[stand_in].tolist()
            out["lost"] += int(batch["bad"][:, 0].sum())
            out["names"] += batch.get("bad_samples", [])
        out["batches"].append(n)
    return out
