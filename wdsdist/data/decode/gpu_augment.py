"""decode=gpu's augmentations (data.augment, data.random_erase): the workers' draws, executed on
the batch on its device after the batched resize.

A worker draws a sample's ops, magnitudes and erased box as on the CPU path (augment.py's
``SampleAugment.draw``, from the sample's own generator, right after its crop and flip) and hands
them on with the JPEG's bytes (gpu.Drawn). ``BatchAugment`` then makes the pixels for the whole
batch: for each op slot (TrivialAugment draws one op, RandAugment ``n``, AutoAugment up to two),
the rows that drew the same op are taken out together (``index_select``), the op runs on them as a
few tensor ops with a magnitude per row (gpu_augment_ops.py), and they are put back
(``index_copy_``); the erased boxes are one masked fill. Rows a worker decoded itself come
augmented already and have no draws here.

Tolerance. On the same uint8 crop and draws, every op gives the CPU path's pixels exactly (max abs
diff 0), the affine ops included, whose matrix is the one PIL is asked for (augment_ops.affine_of)
and whose right-angle rotations are PIL's transposes; tests/data/decode/test_gpu_augment.py holds this for
every op at every magnitude TrivialAugment, RandAugment and AutoAugment draw. Through the loader
the crops themselves differ: decode=gpu resizes in floating point, the CPU path with integer
weights (gpu.py: within a grey level or two). Each op carries that on in its own way, and
``TOLERANCE`` states per op what the suite holds over the rows that drew it: the largest absolute
difference in 99% of the pixels, and the mean absolute difference, in uint8 steps. The geometric
ops, the blends and erasing keep it near a grey level; the tables can amplify it (autocontrast
stretches a narrow range; a value at solarize's threshold, posterize's bit boundary or one of
equalize's steps lands on either side), so theirs are looser.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torchvision.transforms import v2

from wdsdist.data.decode import augment_ops
from wdsdist.data.decode.augment import INTERPOLATION, Drawn
from wdsdist.data.decode.gpu_augment_ops import COLOUR, affine, on_device

# Per op: (the largest abs difference from the CPU path in 99% of the pixels, the mean abs
# difference), uint8 steps, over the rows that drew it, through the loader on the same draws.
TOLERANCE: dict[str, tuple[int, float]] = {
    **dict.fromkeys(("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"), (2, 0.3)),
    **dict.fromkeys(("Brightness", "Color", "Contrast", "Sharpness", "Invert"), (3, 0.5)),
    "Posterize": (16, 1.0),
    "Solarize": (2, 1.0),
    "AutoContrast": (8, 1.5),
    "Equalize": (32, 4.0),
    "Erase": (0, 0.0),  # the box's pixels: the same fill on either path
}
_QUARTERS = {90.0: 1, 180.0: 2, 270.0: 3}  # PIL's rotate by a right angle: a transpose


class BatchAugment:
    """The drawn augmentations on a batch's uint8 N x 3 x S x S images, in place; ``counts``:
    the rows each op was applied to (``Erase``: the erased boxes)."""

    def __init__(self, mean: Sequence[float]):
        # What an op reads of its policy: the interpolation and the fill (the policies' default)
        self.policy = v2.TrivialAugmentWide(interpolation=INTERPOLATION)
        self.fill = [round(255 * c) for c in mean]
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, images: torch.Tensor, drawn: Sequence[Drawn | None]) -> torch.Tensor:
        slots = max((len(d.ops) for d in drawn if d is not None), default=0)
        for k in range(slots):
            groups: dict[str, tuple[list[int], list[float]]] = {}
            for row, d in enumerate(drawn):
                if d is not None and k < len(d.ops):
                    op, magnitude = d.ops[k]
                    rows, mags = groups.setdefault(op, ([], []))
                    rows.append(row)
                    mags.append(float(magnitude))
            for op, (rows, mags) in groups.items():
                self._op(images, op, rows, mags)
        boxes = [(row, d.erase) for row, d in enumerate(drawn) if d is not None and d.erase is not None]
        if boxes:
            self._erase(images, [row for row, _ in boxes], [box for _, box in boxes])
        return images

    def _op(self, images: torch.Tensor, op: str, rows: list[int], mags: list[float]) -> None:
        self.counts[op] += len(rows)
        if op == "Identity":
            return
        index = on_device(rows, torch.int64, images.device)
        x = images.index_select(0, index)
        out = COLOUR[op](x, mags) if op in COLOUR else self._geometric(x, op, mags)
        images.index_copy_(0, index, out)

    def _geometric(self, x: torch.Tensor, op: str, mags: list[float]) -> torch.Tensor:
        """An affine op per row by the matrix PIL is asked for; a right-angle rotation as PIL's
        transpose; anything else PIL would do otherwise by PIL itself, row by row."""
        height, width = x.shape[-2], x.shape[-1]
        matrices, turns, others = [], [], []
        for i, magnitude in enumerate(mags):
            got = augment_ops.affine_of(op, magnitude, width, height, INTERPOLATION)
            if got:
                matrices.append((i, *got))
            elif got is None and op == "Rotate" and width == height and magnitude % 360.0 in _QUARTERS:
                turns.append((i, _QUARTERS[magnitude % 360.0]))
            elif got is None:
                others.append((i, magnitude))
        out = x.clone()
        if matrices:
            index = on_device([i for i, _, _ in matrices], torch.int64, x.device)
            a = on_device([m for _, m, _ in matrices], torch.float64, x.device)
            fills = on_device([f for _, _, f in matrices], torch.int32, x.device)
            out.index_copy_(0, index, affine(x.index_select(0, index), a, fills))
        for i, k in turns:
            out[i] = torch.rot90(x[i], k, dims=(-2, -1))
        for i, magnitude in others:
            crop = augment_ops.Crop(x[i].cpu())
            augment_ops.apply_op(self.policy, crop, op, magnitude, augment_ops.library())
            out[i] = crop.tensor().to(x.device)
        return out

    def _erase(self, images: torch.Tensor, rows: list[int], boxes: list[tuple[int, int, int, int]]) -> None:
        """F.erase of each row's box (top, left, height, width) with the data's mean colour."""
        self.counts["Erase"] += len(rows)
        device = images.device
        index = on_device(rows, torch.int64, device)
        top, left, h, w = on_device(boxes, torch.int64, device).T.reshape(4, -1, 1, 1)
        ys = torch.arange(images.shape[-2], device=device).view(1, -1, 1)
        xs = torch.arange(images.shape[-1], device=device).view(1, 1, -1)
        inside = (ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)
        fill = on_device(self.fill, torch.uint8, device).view(1, 3, 1, 1)
        x = images.index_select(0, index)
        images.index_copy_(0, index, torch.where(inside.unsqueeze(1), fill, x))


def wanted(name: str, erase: float, train: bool) -> bool:
    """Whether a decode=gpu loader has augmentations to make (training, data.augment or erasing)."""
    return train and (name != "none" or erase > 0)
