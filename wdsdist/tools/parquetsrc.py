"""A local Parquet data set as a makeshards source: an image-bytes column and a label column, as the
Hugging Face Hub stores its image data sets (``image`` a struct of ``bytes`` and ``path``, ``label``
an integer with its class names in the file's metadata). pyarrow comes with the ``[parquet]``
extra. Rows are read a row group at a time, only the image column, and only the rows a shard
needs, so memory stays that of one row group whatever the data set's size; the order mixes rows
within windows of row groups (``windowed_shuffle``), so each shard reads only a few of them."""

from __future__ import annotations

import bisect
import json
import os
import random
from collections import defaultdict
from dataclasses import dataclass

from wdsdist.errors import UserError


def is_parquet(path: str) -> bool:
    if os.path.isfile(path):
        return path.lower().endswith(".parquet")
    return os.path.isdir(path) and any(n.lower().endswith(".parquet") for n in os.listdir(path))


def _pq(source: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"--source {source}: Parquet needs pyarrow, in the [parquet] extra: pip install 'wds-distributed[parquet]'"
        ) from None
    return pq


def parquet_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.lower().endswith(".parquet"))


@dataclass
class Found:
    files: list[str]
    rows: list[tuple[str, int, int, int]]  # (name, label, image bytes, row number over all files)
    classes: list[str]
    groups: list[int]  # each row group's first row (over all files), in order


def _bytes_column(table, column: str):
    col = table.column(column)
    import pyarrow as pa

    if pa.types.is_struct(col.type):
        col = col.combine_chunks().field("bytes")
    return col


def _class_names(schema, label_column: str) -> list[str] | None:
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(meta)["info"]["features"][label_column]
        names = feature.get("names")
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def list_parquet(path: str, image_column: str, label_column: str) -> Found:
    """Every row's name, label and image size (read from the image column, one row group at a time)."""
    pq = _pq(path)
    files, rows, raw_labels, names, groups = parquet_files(path), [], [], None, []
    total = 0
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:  # noqa: BLE001 (an untrusted file: one line, whatever pyarrow raises)
            raise UserError(f"--source {f}: not a readable Parquet file ({exc.__class__.__name__})") from None
        missing = [c for c in (image_column, label_column) if c not in pf.schema_arrow.names]
        if missing:
            have = ", ".join(pf.schema_arrow.names)
            raise UserError(
                f"--source {f}: no column {missing[0]!r} (it has {have}); name it with --image-column/--label-column"
            )
        names = names or _class_names(pf.schema_arrow, label_column)
        stem = os.path.splitext(os.path.basename(f))[0]
        for g in range(pf.num_row_groups):
            groups.append(total)
            table = pf.read_row_group(g, columns=[image_column, label_column])
            images = _bytes_column(table, image_column).to_pylist()
            for data, label in zip(images, table.column(label_column).to_pylist(), strict=True):
                rows.append((f"{stem}/{total:09d}", len(data) if data else 0, total))
                raw_labels.append(label)
                total += 1
    if all(isinstance(x, int) for x in raw_labels):
        classes = names or [str(i) for i in range(max(raw_labels, default=-1) + 1)]
        labels = raw_labels
    else:
        classes = sorted({str(x) for x in raw_labels})
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[str(x)] for x in raw_labels]
    rows = [(n, lab, size, r) for (n, size, r), lab in zip(rows, labels, strict=True)]
    return Found(files, rows, classes, groups)


def windowed_shuffle(rows: list, groups: list[int], seed: int, window: int) -> list:
    """The rows in a shuffled order that a shard reads in few row groups: the row groups in a
    seeded order, cut into windows of ``window`` groups, the rows shuffled within each window. A
    global shuffle would have every shard read (and decompress) nearly every row group."""
    rng = random.Random(seed)
    bounds = [*groups, len(rows)]
    spans = [(bounds[i], bounds[i + 1]) for i in range(len(groups))]
    rng.shuffle(spans)
    out = []
    for w in range(0, len(spans), window):
        part = [row for a, b in spans[w : w + window] for row in rows[a:b]]
        rng.shuffle(part)
        out += part
    return out


class RowReader:
    """The image bytes of given rows (numbered over all files), a row group at a time."""

    def __init__(self, path: str, image_column: str):
        self.pq = _pq(path)
        self.column = image_column
        self.files = [self.pq.ParquetFile(f) for f in parquet_files(path)]
        self.starts: list[tuple[int, int, int]] = []  # (first row, file, group)
        first = 0
        for i, pf in enumerate(self.files):
            for g in range(pf.num_row_groups):
                self.starts.append((first, i, g))
                first += pf.metadata.row_group(g).num_rows
        self._firsts = [s[0] for s in self.starts]

    def read(self, rows: list[int]) -> dict[int, bytes]:
        wanted: dict[int, list[int]] = defaultdict(list)
        for r in rows:
            wanted[bisect.bisect_right(self._firsts, r) - 1].append(r)
        out = {}
        for group, rs in sorted(wanted.items()):
            first, i, g = self.starts[group]
            col = _bytes_column(self.files[i].read_row_group(g, columns=[self.column]), self.column)
            for r in rs:
                out[r] = col[r - first].as_py() or b""
        return out
