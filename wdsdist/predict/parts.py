"""predict.py --out-dir's folder: one part per input shard (or per slice of a folder), each
written whole, and the manifest that says what made them.

    DIR/manifest.json             the model's hash, the spec, the options, the parts done
    DIR/parts/NAME.jsonl          a part's predictions, a line per sample, in the shard's order
    DIR/parts/NAME.npy            --features: its samples' penultimate features, N x D float16
    DIR/parts/NAME.json           what the part holds (scored, skipped and which); written last,
                                  it is what marks the part done
    DIR/pieces/NAME.FIRST-STOP.*  one rank's share of a part the exact split cut between ranks;
                                  rank 0 joins a part's pieces once they cover it

Every file goes to a temporary name beside it first, then is renamed: a job killed at any point
leaves whole files or none. A part without its .json was in flight and is computed again. Names
come from shard URLs, which are data: ``part_names`` keeps to one safe path component each.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from wdsdist.errors import UserError
from wdsdist.tools.outfolder import written_whole

MANIFEST = "manifest.json"
VERSION = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_TEMPORARY = re.compile(r"\.tmp\d+$")  # written_whole's
_PIECE = re.compile(r"^(?P<name>.+)\.(?P<first>\d+)-(?P<stop>\d+)\.json$")
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


def part_names(urls: Sequence[str]) -> list[str]:
    """A file-name stem per shard URL: its last path component less the tar suffix, with anything
    but letters, digits, '.', '_' and '-' replaced; where two would be equal, every name is
    prefixed with its shard's number, so no part is written twice and none outside ``parts/``."""

    def stem(url: str) -> str:
        last = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        last = re.sub(r"\.(tar|tgz|tar\.gz)$", "", last)
        safe = _UNSAFE.sub("_", last).strip(".") or "shard"
        return safe[:100]

    stems = [stem(url) for url in urls]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{i:06d}-{s}" for i, s in enumerate(stems)]


def write_whole(path: str, data: bytes) -> None:
    """``data`` at ``path``, through a temporary file renamed over it: whole or not at all."""
    with written_whole(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def remove_temporaries(out_dir: str) -> int:
    """The temporary files a killed job left in parts/ and pieces/ (never renamed, so never
    read); how many. Only at a job's start, when no rank writes."""
    removed = 0
    for folder in (os.path.join(out_dir, "parts"), os.path.join(out_dir, "pieces")):
        for entry in os.listdir(folder) if os.path.isdir(folder) else []:
            if _TEMPORARY.search(entry):
                os.remove(os.path.join(folder, entry))
                removed += 1
    return removed


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_piece(
    out_dir: str,
    name: str,
    span: tuple[int, int],
    count: int,
    lines: list[str],
    features: np.ndarray | None,
    meta: dict,
) -> None:
    """One rank's results for samples [first, stop) of part ``name`` (of ``count``): the part
    itself where they are all of it, else a piece. The .json goes last: it marks the files done."""
    first, stop = span
    whole = (first, stop) == (0, count)
    base = os.path.join(out_dir, "parts", name) if whole else os.path.join(out_dir, "pieces", f"{name}.{first}-{stop}")
    os.makedirs(os.path.dirname(base), exist_ok=True)
    write_whole(base + ".jsonl", "".join(lines).encode())
    if features is not None:
        write_whole(base + ".npy", npy_bytes(features))
    write_whole(base + ".json", json.dumps(meta | {"first": first, "stop": stop}).encode())


def part_meta(out_dir: str, name: str) -> dict | None:
    """A done part's record (None: not done)."""
    try:
        with open(os.path.join(out_dir, "parts", name + ".json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pieces_of(out_dir: str) -> dict[str, list[tuple[int, int]]]:
    """The done pieces in ``DIR/pieces``, by part name: their spans, sorted."""
    found: dict[str, list[tuple[int, int]]] = {}
    folder = os.path.join(out_dir, "pieces")
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        m = _PIECE.match(entry)
        if m:
            found.setdefault(m["name"], []).append((int(m["first"]), int(m["stop"])))
    return {name: sorted(spans) for name, spans in found.items()}


def cover(spans: list[tuple[int, int]], count: int) -> list[tuple[int, int]] | None:
    """Spans that tile [0, count) one after another, chosen from ``spans`` (sorted); None if none do."""
    chosen, at = [], 0
    for first, stop in spans:
        if first == at and stop > first:
            chosen.append((first, stop))
            at = stop
    return chosen if at == count else None


def join_pieces(out_dir: str, name: str, count: int, spans: list[tuple[int, int]], features: bool) -> bool:
    """Part ``name`` from pieces that cover it, in order; the pieces removed. False: they do not."""
    chosen = cover(spans, count)
    if chosen is None:
        return False
    base = os.path.join(out_dir, "pieces", name)
    lines, arrays, metas = [], [], []
    for first, stop in chosen:
        stem = f"{base}.{first}-{stop}"
        with open(stem + ".jsonl", encoding="utf-8") as f:
            lines.append(f.read())
        with open(stem + ".json", encoding="utf-8") as f:
            metas.append(json.load(f))
        if features:
            arrays.append(np.load(stem + ".npy", allow_pickle=False))
    meta = {
        "source": metas[0].get("source"),
        "scored": sum(m["scored"] for m in metas),
        "skipped": [s for m in metas for s in m["skipped"]],
    }
    filled = [a for a in arrays if len(a)]  # a piece whose samples were all skipped: 0 x 0
    feats = (np.concatenate(filled) if filled else np.zeros((0, 0), np.float16)) if features else None
    write_piece(out_dir, name, (0, count), count, lines, feats, meta)
    remove_pieces(out_dir, name, spans)
    return True


def remove_pieces(out_dir: str, name: str, spans: Iterable[tuple[int, int]]) -> None:
    base = os.path.join(out_dir, "pieces", name)
    for first, stop in spans:
        for suffix in (".json", ".jsonl", ".npy"):  # the marker first: a half-removed piece is no piece
            try:
                os.remove(f"{base}.{first}-{stop}{suffix}")
            except FileNotFoundError:
                pass


def open_manifest(out_dir: str, identity: dict[str, Any], where: str) -> dict:
    """The folder's manifest, made for ``identity`` (model, spec, options) or checked against it:
    another model, spec or options is refused in one line, and nothing is written."""
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        if os.path.isdir(os.path.join(out_dir, "parts")):
            raise UserError(f"{where}: {out_dir} holds parts but no {MANIFEST}: use another --out-dir") from None
        return {"version": VERSION, **identity, "parts": {}}
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: {path} cannot be read ({exc}): use another --out-dir") from None
    for key, value in identity.items():
        if manifest.get(key) != value:
            raise UserError(
                f"{where}: {out_dir} holds predictions made with {OTHER.get(key, f'another {key}')} "
                f"({differs(manifest.get(key), value)}); "
                "nothing was written: use another --out-dir, or the same model and options"
            )
    return manifest


OTHER = {"model": "another model", "spec": "another spec", "options": "other options"}


def differs(was: Any, now: Any) -> str:
    if isinstance(was, dict) and isinstance(now, dict):
        keys = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
        return ", ".join(f"{k}: {was.get(k)!r} there, {now.get(k)!r} now" for k in keys[:3])
    text = lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else repr(v)  # noqa: E731 (a hash: its start)
    return f"{text(was)} there, {text(now)} now"


def save_manifest(out_dir: str, manifest: dict) -> None:
    write_whole(os.path.join(out_dir, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


def output_format(path: str) -> str:
    """--out's format, from its suffix: jsonl, csv or parquet (this last with pyarrow only)."""
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise UserError(f"--out {path}: end it in .jsonl, .csv or .parquet")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(f"--out {path}: parquet needs pyarrow (pip install 'wds-distributed[parquet]')") from None
    return fmt


def part_rows(out_dir: str, names: Sequence[str]) -> Iterator[tuple[str, list[tuple[str, int, float]]]]:
    """The done parts' predictions, in the order of ``names``, as (image, top-k) rows."""
    for name in names:
        with open(os.path.join(out_dir, "parts", name + ".jsonl"), encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield row["image"], [(h["class"], h["label"], h["p"]) for h in row["top"]]


def join(out_dir: str, names: Sequence[str], out: str) -> int:
    """The parts joined into ``out`` in the order of ``names`` (the spec's); the rows written."""
    fmt = output_format(out)
    rows = list(part_rows(out_dir, names))
    with written_whole(out) as tmp:
        if fmt == "parquet":
            write_parquet(rows, tmp)
        else:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                write(rows, fmt, f)
    return len(rows)


def write_parquet(rows: list[tuple[str, list]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = len(rows[0][1]) if rows else 0
    columns: dict[str, list] = {"image": [name for name, _ in rows]}
    for j in range(k):
        columns[f"class{j + 1}"] = [top[j][0] for _, top in rows]
        columns[f"p{j + 1}"] = [top[j][2] for _, top in rows]
    pq.write_table(pa.table(columns), path)


def write(rows: list[tuple[str, list]], fmt: str, out: TextIO) -> None:
    """(image, top-k) rows as JSON lines, CSV or a table."""
    if fmt == "jsonl":
        for name, top in rows:
            out.write(json_line(name, top))
    elif fmt == "csv":
        writer = csv.writer(out)
        k = len(rows[0][1]) if rows else 0
        writer.writerow(["image", *[f"{w}{j + 1}" for j in range(k) for w in ("class", "p")]])
        for name, top in rows:
            writer.writerow([name, *[x for c, _, p in top for x in (c, f"{p:.6f}")]])
    else:
        width = max((len(name) for name, _ in rows), default=5)
        for name, top in rows:
            out.write(f"{name:<{width}}  " + "  ".join(f"{c} {100 * p:5.1f}%" for c, _, p in top) + "\n")


def json_line(name: str, top: list[tuple[str, int, float]]) -> str:
    hits = [{"class": c, "label": i, "p": round(p, 6)} for c, i, p in top]
    return json.dumps({"image": name, "top": hits}, ensure_ascii=False) + "\n"
