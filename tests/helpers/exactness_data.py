"""The randomized exactness test's data (tests/helpers/exactness.py drives it): a case's shards on
disk, each epoch's sequence as the library defines it, and a batch as the loader delivered it."""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import webdataset as wds
from PIL import Image

from tests.helpers import model as m
from tests.helpers.exactness_cases import Case
from wdsdist.data import Source
from wdsdist.data.plan.mix import MixEpoch
from wdsdist.data.plan.order import GLOBAL, epoch_order, node_parts
from wdsdist.data.plan.sequence import EpochShards
from wdsdist.data.sources.index import index_path, write_index


@dataclass
class Shards:
    """The case's shards on disk: what a Loader is given, and each shard's sample ids (labels)."""

    spec: object
    ids: list[range]  # per shard, in the loader's shard list's order
    source: list[int]  # per sample id, its source
    urls: list[str] = field(default_factory=list)  # per shard
    damaged: frozenset[int] = frozenset()  # sample ids whose image cannot be decoded
    unreadable: frozenset[int] = frozenset()  # shards that cannot be read at all

    def labels_of(self, shard: int, first: int, stop: int) -> range:
        return self.ids[shard][first:stop]

    def shard_of(self, sample: int) -> int:
        return next(s for s, r in enumerate(self.ids) if sample in r)

    def name(self, sample: int) -> str:
        """A damaged sample as ``batch["bad_samples"]`` names it: its shard's URL and its key."""
        return f"{self.urls[self.shard_of(sample)]} k{sample:06d}"


_JPEG: list[bytes] = []


def _jpeg() -> bytes:
    if not _JPEG:
        out = io.BytesIO()
        Image.new("RGB", (8, 8), (90, 120, 150)).save(out, format="JPEG", quality=90)
        _JPEG.append(out.getvalue())
    return _JPEG[0]


def write_shards(case: Case, root: Path) -> Shards:
    """The case's shards and their indexes; its damaged samples' image bytes are garbage (they
    fail to decode), its unreadable shards not tars at all (the indexes count them all the same)."""
    ids, source, specs, urls, n = [], [], [], [], 0
    for s, data in enumerate(case.data):
        folder = root / f"s{s}"
        folder.mkdir(parents=True)
        listed = []
        for i, count in enumerate(data.counts):
            path = folder / f"s{s}-{i:06d}.tar"
            with wds.TarWriter(str(path)) as sink:
                for j in range(count):
                    image = b"not an image " * 8 if n + j in case.damaged else _jpeg()
                    sink.write({"__key__": f"k{n + j:06d}", "jpg": image, "cls": str(n + j)})
            if len(urls) in case.unreadable:
                path.write_bytes(b"not a tar file\n" * 64)
            listed.append((str(path), count))
            urls.append(str(path))
            ids.append(range(n, n + count))
            source += [s] * count
            n += count
        specs.append(index_path(str(folder), f"s{s}"))
        write_index(specs[-1], listed, name=f"s{s}")
    lost = {"urls": urls, "damaged": frozenset(case.damaged), "unreadable": frozenset(case.unreadable)}
    if len(case.data) == 1:
        return Shards(specs[0], ids, source, **lost)
    sources = [
        Source(f"s{s}", spec, **({d.setting: d.value} if d.setting else {}))
        for s, (spec, d) in enumerate(zip(specs, case.data, strict=True))
    ]
    return Shards(sources, ids, source, **lost)


# ---------------------------------------------------------------- what the sequence is


@dataclass
class Sequence:
    """Each epoch's sequence as the library defines it (its shard order, a mix's windows and
    padding): its length, its padding's positions, and the sample id at each position."""

    case: Case
    shards: Shards
    mix: object  # the Loader's Mix, or None
    cache: dict[int, tuple[int, list[int], object]] = field(default_factory=dict)
    pixels: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (epoch, tag, size) -> its pixels' CRC
    stood: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, lost position) -> its stand-in's tag
    losses: dict[int, frozenset[int]] = field(default_factory=dict)  # epoch -> its lost positions

    def _epoch(self, epoch: int) -> tuple[int, list[int], object]:
        if epoch not in self.cache:
            case, shards = self.case, self.shards
            if self.mix is None:
                counts = [len(r) for r in shards.ids]
                order = epoch_order(node_parts(counts, GLOBAL, case.seed), case.seed, epoch)
                _, (pieces,) = EpochShards(counts, order).reads([(0, sum(counts), 0)])
                ids = [i for shard, a, b in pieces for i in shards.labels_of(shard, a, b)]
                self.cache[epoch] = (len(ids), ids, m.cyclic(range(len(ids))))
            else:
                mixed = MixEpoch(self.mix, case.seed, epoch, case.batch)
                which, pieces = mixed.reads([(0, mixed.total, 0)])
                each = [iter([i for shard, a, b in p for i in shards.labels_of(shard, a, b)]) for p in pieces]
                ids = [next(each[s]) for s in which.tolist()]
                self.cache[epoch] = (mixed.total, ids, mixed.padding)
        return self.cache[epoch]

    def total(self, epoch: int) -> int:
        return self._epoch(epoch)[0]

    def padding(self, epoch: int):  # noqa: ANN201 (count -> positions)
        return self._epoch(epoch)[2]

    def sample(self, epoch: int, tag: int) -> int:
        n, ids, _ = self._epoch(epoch)
        return ids[tag % n]

    def lost(self, epoch: int) -> frozenset[int]:
        """The epoch's positions whose sample is lost: damaged, or in a shard that cannot be read."""
        if epoch not in self.losses:
            n, ids, _ = self._epoch(epoch)
            hurt = self.shards.damaged | {i for s in self.shards.unreadable for i in self.shards.ids[s]}
            self.losses[epoch] = frozenset(p for p, i in enumerate(ids) if i in hurt)
        return self.losses[epoch]

    def model(self) -> m.Sequence_:
        return m.Sequence_(self.total, self.padding, self.case.batch, self.case.remainder)


@dataclass(frozen=True)
class Got:
    """One batch as the loader delivered it."""

    epoch: int
    worker: int
    tags: tuple[int, ...]
    labels: tuple[int, ...]
    epochs: tuple[int, ...]
    sources: tuple[int, ...] | None
    pixels: tuple[int, ...]  # a CRC of each row's pixels: its crop's and augmentations' draws
    size: int
    seqs: tuple[int, ...]  # each row's number in its worker's stream of the epoch (``id``'s last)
    lost: tuple[int, ...]  # each row's losses counted (``bad[:, 0]``)
    named: tuple[str, ...]  # the damaged samples the batch names (``bad_samples``)
    # the shard reads that failed (``bad[:, 1]``) and their URLs: a resumed worker reads such a
    # shard again, so the batch after a checkpoint may count it where the uninterrupted run did not
    reads: tuple[int, ...] = field(default=(), compare=False)
    failed: tuple[str, ...] = field(default=(), compare=False)


def got(batch: dict) -> Got:
    ids = batch["id"].tolist()
    epochs = tuple(e for e, _, _ in ids)
    workers = {w for _, w, _ in ids}
    assert len(workers) == 1, f"a batch holds rows of workers {sorted(workers)}"
    sources = tuple(batch["source"].tolist()) if "source" in batch else None
    pixels = tuple(zlib.crc32(image.contiguous().numpy().tobytes()) for image in batch["image"])
    tags, labels = tuple(batch["pos"].tolist()), tuple(batch["label"].tolist())
    bad = batch["bad"].tolist()
    return Got(
        epochs[0], workers.pop(), tags, labels, epochs, sources, pixels, batch["image"].shape[-1],
        seqs=tuple(s for _, _, s in ids), lost=tuple(b for b, _ in bad), named=tuple(batch["bad_samples"]),
        reads=tuple(r for _, r in bad), failed=tuple(batch["bad_shards"]),
    )  # fmt: skip


@dataclass
class RankRun:
    steps: list[Got]
    state: dict | None  # its state_dict() after ``stop`` steps
    lens: dict[int, tuple[int, int]]  # epoch mode: epoch -> (len(), batches_done) as its iteration began
