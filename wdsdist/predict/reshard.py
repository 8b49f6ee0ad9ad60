"""predict.py --write-shards DIR2: each input shard written again with its predictions beside
its samples, as shards our trainer reads: every member as it was, plus ``pred.json`` (the top-k)
and, with --features, ``emb.npy`` (the sample's features, float16); and DIR2's index.

A part's shard is written once the part is done, by the rank that wrote the part (rank 0 for
the parts it joins from pieces, and for any a killed job left without its shard), whole or not
at all (temporary, then rename). The input shard is read again through the loader's sources
(``wdsdist.data.shard_samples``): the prediction run never holds a sample's bytes.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Sequence

import numpy as np

from wdsdist.data import DataError, LoaderConfig, shard_samples, write_index
from wdsdist.predict.collect import Unit
from wdsdist.predict.parts import npy_bytes
from wdsdist.tools.outfolder import written_whole

INDEX = "predicted.index.json"


def shard_path(out_dir: str, unit: Unit) -> str:
    return os.path.join(out_dir, unit.name + ".tar")


def write_shard(out_dir: str, parts_dir: str, unit: Unit, cfg: LoaderConfig, features: bool) -> int:
    """The shard of ``unit`` again, with each scored sample's prediction; its sample count."""
    preds: dict[str, dict] = {}
    with open(os.path.join(parts_dir, unit.name + ".jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            preds[row["image"].rsplit("#", 1)[1]] = {"top": row["top"]}
    embs = np.load(os.path.join(parts_dir, unit.name + ".npy")) if features else None
    os.makedirs(out_dir, exist_ok=True)
    path = shard_path(out_dir, unit)
    count, scored = 0, 0
    with written_whole(path) as tmp, tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in shard_samples(unit.source, cfg):
            key = sample.pop("__key__")
            members = dict(sample)
            if key in preds:
                members["pred.json"] = json.dumps(preds[key]).encode()
                if embs is not None:
                    members["emb.npy"] = npy_bytes(embs[scored])
                scored += 1
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size, info.mode = len(data), 0o444
                tar.addfile(info, io.BytesIO(data))
            count += 1
        if count != unit.count:  # raised inside: the temporary file is removed, nothing is renamed
            raise DataError(f"{unit.source}: {count} samples where its index says {unit.count}")
    return count


def write_shards_index(out_dir: str, units: Sequence[Unit]) -> str:
    """DIR2's index: every part's shard and its sample count (write_shard checked it against the
    input's)."""
    path = os.path.join(out_dir, INDEX)
    write_index(path, [(shard_path(out_dir, unit), unit.count) for unit in units], name="predicted")
    return path
