"""Batches: assembled in the worker (into a reused shared buffer where there is one), finished in
the main process (tensors, pinned memory), and taken apart and rebuilt around the cross-worker
shuffle."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from wdsdist.data.decode.gpu import Drawn, pack
from wdsdist.data.delivery.sharedbatches import SharedBatches, plain_copy, plain_stack
from wdsdist.data.sources import cache

NO_COUNTS = (0,) * len(cache.CACHE_COUNTS)


def collate(rows: list[tuple], shared: SharedBatches | None = None, worker: int = 0) -> dict[str, Any]:
    """A batch as it leaves the worker. Labels and ids stay lists (pickled inline: a small tensor
    would cost a shared-memory file of its own); ``finish_batches`` makes tensors of them."""
    images, labels, ids, bad, keys, *rest = zip(*rows, strict=True)
    skipped = rest[0] if rest else ((),) * len(rows)
    # skipped: per row, the runs (epoch, first seq, stop) its worker skipped before it (bad or missing samples)
    batch: dict[str, Any] = {"label": labels, "id": ids, "bad": bad, "skipped": skipped}
    # What the node cache did in this process since its previous batch (collate runs where the shards are read)
    batch["cache"] = cache.take_counts()
    if any(isinstance(image, Drawn) for image in images):  # decode=gpu: bytes and draws (decode/gpu.py)
        batch["jpeg"] = pack(images)
    elif shared is not None and (ref := shared.fill(worker, list(images))) is not None:
        batch["shared"] = ref
    else:
        # default_collate stacks straight into shared memory inside a worker: the batch then
        # reaches the main process without the extra 10 MB copy the DataLoader makes otherwise.
        batch["image"] = default_collate(list(images))
    if keys[0] is not None:
        batch["key"] = list(keys)
    return batch


def batched(rows: Iterable[tuple], size: int, collation: Callable[[list], Any], partial: bool) -> Iterator[Any]:
    """A worker's rows in batches of ``size``, each collated as soon as its last row has come
    (webdataset's ``batched`` waits for the first row of the next batch: one more decode before
    every batch); a short last one only if ``partial``."""
    batch: list = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield collation(batch)
            batch = []
    if batch and partial:
        yield collation(batch)


def opened(gate: Any | None) -> None:
    """Open the warm start's gate (warmstart.py): the rank's first batch is in the main process
    now, and the other workers may start decoding. Opened any sooner (as the leader hands the
    batch to its queue), they take the cores while the main process is still taking the batch
    over (unpickling, copying it), which delays the first batch (bench/results/2026-11-24-peers.md).
    Called for every batch: setting it again costs next to nothing."""
    if gate is not None:
        gate.set()


def bad_counts(bad: Sequence[Sequence]) -> tuple[torch.Tensor, list[str], list[tuple[str, str]]]:
    """Rows' loss records (samples lost, shard reads failed, then the URL of each shard read that
    failed and, as pairs, each damaged sample's name and why) -> a [b, 2] count tensor, the
    failed URLs (a shard that fails on every pass is one bad shard, read many times) and the
    damaged samples' ("URL KEY", the warning's text)."""
    names = [x for b in bad for x in b[2:]]
    urls = [x for x in names if isinstance(x, str)]
    damaged = [tuple(x) for x in names if not isinstance(x, str)]
    return torch.tensor([b[:2] for b in bad], dtype=torch.int64), urls, damaged


def with_losses(batch: dict, bad: Sequence[Sequence]) -> None:
    """A finished batch's loss fields: ``bad`` [b, 2], ``bad_shards`` (URLs), ``bad_samples``
    (the damaged samples' "URL KEY") and ``bad_errors`` (why each could not be used)."""
    batch["bad"], batch["bad_shards"], damaged = bad_counts(bad)
    batch["bad_samples"], batch["bad_errors"] = [n for n, _ in damaged], [e for _, e in damaged]


def finish_batches(
    batches: Iterable[dict], shared: SharedBatches | None, pin_memory: bool, gate: Any | None = None
) -> Iterator[dict]:
    """In the main process: each batch's images as its own tensor, labels and ids as tensors.
    ``gate`` (loader.warm_start) is set when a batch has been taken (``opened``)."""
    if shared is not None and not pin_memory:  # the workers have started: the first copy's memory now
        shared.copies.reserve(math.prod(shared.shape))
    for batch in batches:
        if "shared" in batch:
            batch["image"] = shared.claim(batch.pop("shared"), pin_memory)  # type: ignore[union-attr]
        elif pin_memory and shared is not None:
            # A worker that found no free buffer sent a batch of its own, which the DataLoader
            # does not pin (its pin_memory is off when buffers are shared): pin it here, or its
            # non_blocking copy to the GPU waits.
            batch["image"] = pin(batch["image"])
        batch["label"] = torch.tensor(batch["label"], dtype=torch.int64)
        batch["id"], batch["pos"] = split_ids(batch["id"])
        with_losses(batch, batch["bad"])
        batch["cache"] = torch.tensor(batch.get("cache", NO_COUNTS), dtype=torch.int64)
        opened(gate)
        yield batch


def split_ids(ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker rows' ids, (epoch, worker, seq, position) -> the [b, 3] id (what resume.py tracks)
    and the [b] position in the epoch's sample sequence (split=samples; -1 otherwise)."""
    both = torch.tensor(ids, dtype=torch.int64).reshape(len(ids), -1)
    if both.shape[1] > 3:
        return both[:, :3].contiguous(), both[:, 3].contiguous()
    return both, torch.full((len(ids),), -1, dtype=torch.int64)


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in pinned memory (needs CUDA), in the same layout."""
    return plain_copy(tensor, pin_memory=True)


def unbatch_samples(batches: Iterable[dict], shared: SharedBatches | None, gate: Any | None = None) -> Iterator[dict]:
    """In the main process, for the cross-worker shuffle: the samples of each batch, each image
    its own tensor. A view into its batch would keep the whole batch alive in the shuffle buffer
    until the last of its samples left (measured: 3.2 GB peak RSS with a buffer of 1000).
    ``gate``: as finish_batches'."""
    for batch in batches:
        if "shared" in batch:
            images = shared.claim_rows(batch.pop("shared"))  # type: ignore[union-attr]
        else:
            images = [plain_copy(image) for image in batch.pop("image")]
        opened(gate)
        keys = batch.get("key") or [None] * len(images)
        skips = batch.get("skipped") or [()] * len(images)
        # The worker's cache counts ride on the batch's first sample, so the new batches sum to them.
        counts = [batch.get("cache", NO_COUNTS)] + [NO_COUNTS] * (len(images) - 1)
        rows = zip(images, batch["label"], batch["id"], batch["bad"], keys, skips, counts, strict=True)
        for image, label, id_, bad, key, skipped, cached in rows:
            pos = id_[3] if len(id_) > 3 else -1
            yield {
                "image": image,
                "label": label,
                "id": tuple(id_[:3]),
                "pos": pos,
                "bad": bad,
                "key": key,
                "skipped": skipped,
                "cache": cached,
            }


def collate_samples(rows: list[dict], pin_memory: bool = False) -> dict[str, Any]:
    """Re-batch samples after the cross-worker shuffle."""
    batch: dict[str, Any] = {
        "image": plain_stack([r["image"] for r in rows], pin_memory),
        "label": torch.tensor([r["label"] for r in rows], dtype=torch.int64),
        "id": torch.tensor([r["id"] for r in rows], dtype=torch.int64),
        "pos": torch.tensor([r["pos"] for r in rows], dtype=torch.int64),
        "skipped": [r["skipped"] for r in rows],
        "cache": torch.tensor([r.get("cache", NO_COUNTS) for r in rows], dtype=torch.int64).sum(0),
    }
    with_losses(batch, [r["bad"] for r in rows])
    if rows[0]["key"] is not None:
        batch["key"] = [r["key"] for r in rows]
    return batch
