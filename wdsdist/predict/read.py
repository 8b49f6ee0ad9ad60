"""What a prediction job reads: shard specs through the loader's exact split, or folders of
images listed once, sorted, cut into parts of a fixed size and split the same way.

Both give the job a list of units (collect.Unit: the parts of the output, in the spec's order)
and, for one rank and the units still to do, its reads (collect's runs per worker) and its
batches: uint8 images with each sample's worker, position and name. Positions at or past the
total are the loader's padding (equal batches on every rank) and never reach the output.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.utils.data import DataLoader, Dataset

from wdsdist.data import DataError, Loader, LoaderConfig, Shard, UserError, decode_eval
from wdsdist.predict.collect import Run, Unit
from wdsdist.predict.parts import part_names

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".ppm", ".tif", ".tiff")
SHARD_MARKS = (".tar", ".index.json", "{", "://")


@dataclass
class Batch:
    images: torch.Tensor  # uint8, N x 3 x S x S
    workers: list[int]
    positions: list[int]
    names: list[str]
    bad_shards: list[str]
    bad_samples: list[str] = field(default_factory=list)  # damaged samples read before these: "URL KEY"


def is_shards(item: str) -> bool:
    return not os.path.isdir(item) and any(mark in item for mark in SHARD_MARKS)


def image_files(inputs: Sequence[str]) -> Iterator[str]:
    """The image files the inputs name, folders walked in sorted order."""
    for item in inputs:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs.sort()
                yield from (os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMAGE_SUFFIXES))
        else:
            yield item


def kind_of(inputs: Sequence[str]) -> str:
    """``shards`` or ``files``: a job reads one kind (one line where the inputs mix them)."""
    kinds = {"shards" if is_shards(item) else "files" for item in inputs}
    if len(kinds) > 1:
        raise UserError("predict.py --out-dir: give shard specs or folders of images, not both in one job")
    return kinds.pop()


# ------------------------------------------------------------------ shards


def shard_units(inputs: Sequence[str], cfg: LoaderConfig) -> tuple[list[Unit], list[Shard]]:
    """Every shard the specs name, in their order, with its sample count (from the index, else
    counted as the training loader counts them), as units."""
    one = replace(cfg, batch_size=1, workers=0, mode="epoch", split="samples")
    shards = list(Loader(list(inputs) if len(inputs) > 1 else inputs[0], one, rank=0, world=1).shards)
    names = part_names([s.url for s in shards])
    return [Unit(n, s.url, int(s.nsamples or 0)) for n, s in zip(names, shards, strict=True)], shards


def shard_stream(
    shards: Sequence[Shard], todo: Sequence[int], cfg: LoaderConfig, rank: int, world: int
) -> tuple[list[list[Run]], Iterator[Batch]]:
    """This rank's reads and batches of the shards ``todo`` (indices into ``shards``), by the exact
    split (loader.split=samples): each sample on one rank, the padding dropped here."""
    mine = [shards[i] for i in todo]
    total = sum(int(s.nsamples or 0) for s in mine)
    # Fewer samples left than ranks (a restart's last small part): the first ``total`` ranks
    # read one each, the others nothing; every worker needs a batch, so fewer of them as well.
    world = min(world, total)
    if rank >= world:
        return [], iter(())
    workers = min(int(cfg.workers), total // world)
    batch = max(1, min(cfg.batch_size, total // (world * max(workers, 1))))
    # partial: a worker whose span lost samples (corrupt, or a shard unread) keeps its short last batch
    cfg = replace(cfg, batch_size=batch, workers=workers, mode="epoch", split="samples", remainder="pad", partial=True)
    loader = Loader(mine, cfg, rank=rank, world=world)
    reads = [[(a, b, todo[s], first) for a, b, s, first in runs] for runs in loader.reads()]
    return reads, _shard_batches(loader, total)


def _shard_batches(loader: Loader, total: int) -> Iterator[Batch]:
    """The loader's batches less its padding (positions past ``total``), before any is scored."""
    for b in loader:
        keep = [i for i, p in enumerate(b["pos"].tolist()) if p < total]
        if not keep and not b.get("bad_samples"):
            continue
        images = b["image"] if len(keep) == len(b["key"]) else b["image"][keep]
        workers = b["id"][:, 1].tolist()
        positions = b["pos"].tolist()
        yield Batch(
            images,
            [workers[i] for i in keep],
            [positions[i] for i in keep],
            [b["key"][i] for i in keep],
            list(b.get("bad_shards") or []),
            list(b.get("bad_samples") or []),
        )


# ------------------------------------------------------------------ folders


def file_units(files: Sequence[str], part_size: int) -> list[Unit]:
    """A sorted listing cut into parts of ``part_size`` files: images-000000, images-000001, ..."""
    units = []
    for i in range(0, len(files), part_size):
        n = min(part_size, len(files) - i)
        units.append(Unit(f"images-{i // part_size:06d}", f"{files[i]} .. {files[i + n - 1]}", n))
    return units


class _Files(Dataset):
    def __init__(self, files: Sequence[str], cfg: LoaderConfig):
        self.files, self.cfg = files, cfg

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None]:
        path = self.files[i]
        try:
            with open(path, "rb") as f:
                return i, decode_eval(f.read(), self.cfg, path)
        except (OSError, DataError) as exc:
            log.warning("%s; skipped", exc if isinstance(exc, DataError) else f"{path}: {exc}")
            return i, None


def _collate(items: list) -> list:
    return items


def file_stream(
    files: Sequence[str], units: Sequence[Unit], todo: Sequence[int], cfg: LoaderConfig, rank: int, world: int
) -> tuple[list[list[Run]], Iterator[Batch]]:
    """This rank's reads and batches of the folder parts ``todo``: their files, one sequence, cut
    into equal contiguous spans per rank (no padding: ranks may differ by one image)."""
    starts, at = [], 0
    for u in units:
        starts.append(at)
        at += u.count
    sequence = [(i, starts[i]) for i in todo]
    total = sum(units[i].count for i in todo)
    lo, hi = rank * total // world, (rank + 1) * total // world
    runs, paths, pos = [], [], 0
    for i, start in sequence:
        a, b = max(lo, pos), min(hi, pos + units[i].count)
        if a < b:
            runs.append((a, b, i, a - pos))
            paths += files[start + a - pos : start + b - pos]
        pos += units[i].count
    loader = DataLoader(
        _Files(paths, cfg), batch_size=cfg.batch_size, num_workers=int(cfg.workers), collate_fn=_collate
    )
    return [runs], _file_batches(loader, paths, lo)


def _file_batches(loader: DataLoader, paths: Sequence[str], lo: int) -> Iterator[Batch]:
    for items in loader:
        good = [(i, image) for i, image in items if image is not None]
        if good:
            images = torch.stack([image for _, image in good])
            yield Batch(images, [0] * len(good), [lo + i for i, _ in good], [paths[i] for i, _ in good], [])
