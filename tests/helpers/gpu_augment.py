"""decode=gpu's augmentations against the CPU path's through the loader: the draws each batch's
BatchAugment was given (recorded), and each op's pixel differences over the rows that drew it."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from wdsdist.data.decode.gpu_augment import TOLERANCE, BatchAugment


@contextmanager
def recorded_draws() -> Iterator[list[list]]:
    """Each BatchAugment call's draws, in the order of the calls (with one decode thread: the
    batches' order, and maybe a batch made ahead of the last one taken)."""
    seen: list[list] = []
    apply = BatchAugment.__call__

    def recorded(self, images, drawn):
        seen.append(list(drawn))
        return apply(self, images, drawn)

    BatchAugment.__call__ = recorded  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        BatchAugment.__call__ = apply  # type: ignore[method-assign]


def op_differences(cpu: list[dict], gpu: list[dict], draws: list[list]) -> dict[str, torch.Tensor]:
    """Each op's absolute pixel differences, flattened: a row's go to its op, or for a chain of
    ops (RandAugment's, AutoAugment's) to the one with the loosest tolerance; ``Erase``: the
    erased boxes' pixels, which are left out of their row's op."""
    parts: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    assert len(draws) >= len(gpu)
    for a, b, drawn in zip(cpu, gpu, draws, strict=False):
        assert len(drawn) == len(b["label"])
        for row, d in enumerate(drawn):
            diff = (a["image"][row].int() - b["image"][row].int()).abs()
            if d.erase is not None:
                top, left, h, w = d.erase
                parts["Erase"].append(diff[:, top : top + h, left : left + w].flatten())
                diff[:, top : top + h, left : left + w] = -1
            op = max((op for op, _ in d.ops), key=TOLERANCE.__getitem__, default="Identity")
            parts[op].append(diff[diff >= 0].flatten())
    return {op: torch.cat(p) for op, p in parts.items()}


def stats(diffs: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per op: pixels, the 99th percentile, the mean and the largest absolute difference."""
    out = {}
    for op, diff in sorted(diffs.items()):
        d = diff.float()
        q99 = torch.quantile(d[torch.randperm(len(d), generator=torch.Generator().manual_seed(0))[:10_000_000]], 0.99)
        out[op] = {"pixels": len(d), "q99": q99.item(), "mean": d.mean().item(), "max": d.max().item()}
    return out
