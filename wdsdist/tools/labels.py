"""Labels for a flat folder or tar of images (ImageNet's validation set), in the three forms they
come in, each read into one map: file name without its extension -> class name.

- a CSV of ``name,class`` (a header line ``name,class`` is allowed);
- Kaggle's ``LOC_val_solution.csv``: ``ImageId,PredictionString``, the class the first token of
  the prediction string (``n01751748 160 29 350 291 ...``);
- the devkit's ``ILSVRC2012_validation_ground_truth.txt``: one ILSVRC2012_ID (1-based) per line,
  line i for ``ILSVRC2012_val_{i:08d}``. The IDs follow the devkit's own class order, not the
  sorted wnids a training folder has: ``--devkit-classes`` maps them, either a text file of the
  wnids in ILSVRC2012_ID order (one a line) or the devkit's ``meta.mat`` (read with scipy, when
  installed).
"""

from __future__ import annotations

import csv
import os

from wdsdist.errors import UserError

KAGGLE_HEADER = ["ImageId", "PredictionString"]
MAX_LABELS_BYTES = 1 << 30


def image_stem(name: str) -> str:
    """What a labels file calls an image: its file name without folder or extension."""
    return os.path.splitext(os.path.basename(name))[0]


def _rows(path: str) -> list[list[str]]:
    try:
        if os.path.getsize(path) > MAX_LABELS_BYTES:
            raise UserError(f"--labels {path}: larger than {MAX_LABELS_BYTES} bytes; is it a labels file?")
        with open(path, newline="", encoding="utf-8") as f:
            return [row for row in csv.reader(f) if row and any(cell.strip() for cell in row)]
    except OSError as exc:
        raise UserError(f"--labels {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UserError(f"--labels {path}: not a text labels file ({exc})") from None


def read_labels(path: str, devkit_classes: str | None = None) -> dict[str, str]:
    """The labels file at ``path`` as {image stem: class name}; a file it cannot read is one line."""
    rows = _rows(path)
    if not rows:
        raise UserError(f"--labels {path}: no labels in it")
    if [c.strip() for c in rows[0][:2]] == KAGGLE_HEADER:
        return _pairs(path, rows[1:], lambda row: row[1].split()[0] if row[1].split() else "")
    if all(len(row) == 1 and row[0].strip().isdigit() for row in rows):
        return _devkit(path, [int(row[0]) for row in rows], devkit_classes)
    header = [c.strip().lower() for c in rows[0]]
    body = rows[1:] if header[:2] == ["name", "class"] else rows
    return _pairs(path, body, lambda row: row[1].strip())


def _pairs(path: str, rows: list[list[str]], cls) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, row in enumerate(rows, 1):
        if len(row) < 2 or not row[0].strip() or not cls(row):
            raise UserError(f"--labels {path}: row {n} {','.join(row)[:80]!r} is not NAME,CLASS")
        stem = image_stem(row[0].strip())
        if out.setdefault(stem, cls(row)) != cls(row):
            raise UserError(f"--labels {path}: {stem} has two classes, {out[stem]} and {cls(row)}")
    return out


def _devkit(path: str, ids: list[int], classes_file: str | None) -> dict[str, str]:
    if classes_file is None:
        raise UserError(
            f"--labels {path}: the devkit's ground truth numbers classes in its own order; name them with "
            "--devkit-classes FILE (a text file of wnids in ILSVRC2012_ID order, or the devkit's meta.mat)"
        )
    wnids = devkit_wnids(classes_file)
    out = {}
    for i, ident in enumerate(ids, 1):
        if not 1 <= ident <= len(wnids):
            raise UserError(f"--labels {path}: line {i}: ILSVRC2012_ID {ident} is not in 1..{len(wnids)}")
        out[f"ILSVRC2012_val_{i:08d}"] = wnids[ident - 1]
    return out


def devkit_wnids(path: str) -> list[str]:
    """The wnids in ILSVRC2012_ID order, from a text file of them or from the devkit's meta.mat."""
    if path.lower().endswith(".mat"):
        return _meta_mat(path)
    try:
        with open(path, encoding="utf-8") as f:
            wnids = [line.split()[0] for line in f.read(1 << 20).splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--devkit-classes {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not wnids:
        raise UserError(f"--devkit-classes {path}: no class names in it")
    return wnids


def _meta_mat(path: str) -> list[str]:
    try:
        from scipy.io import loadmat
    except ImportError:
        raise UserError(
            f"--devkit-classes {path}: reading meta.mat needs scipy (pip install scipy); or pass a text file "
            "of the wnids in ILSVRC2012_ID order"
        ) from None
    try:
        synsets = loadmat(path, squeeze_me=True)["synsets"]
        pairs = sorted((int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets)
    except Exception as exc:  # noqa: BLE001 (an untrusted file: whatever scipy raises, one line)
        raise UserError(f"--devkit-classes {path}: not the devkit's meta.mat ({exc.__class__.__name__})") from None
    # The first 1000 IDs are the leaves, the classes of the challenge; the rest are their ancestors.
    return [wnid for ident, wnid in pairs if ident <= 1000]
