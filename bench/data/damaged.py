#!/usr/bin/env python3
"""What damaged data costs, layout by layout: scikit-learn's 1,437 digits in 10 shards (9 x 150
+ 87), and a copy with 5 samples in 5 shards damaged inside the tar (noise over their bytes; the
index unchanged), read for one epoch by the public Loader on every rank of each layout, both
splits. Run with ``./run bench/data/damaged.py`` (``--json`` for the rows).

Per layout: the batches each rank delivered (and len(), the clean run's), the good samples the
clean run delivers that the damaged run never did, damaged samples delivered, and the losses
counted. Counts, not times: the same on any machine. To see the code before a change, run this
file with that checkout first on ``PYTHONPATH`` (tests/helpers/damaged.py beside it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/ is imported as the package it is, from the checkout
    sys.path[0] = str(ROOT)

from tests.helpers.damaged import DAMAGED, PER_SHARD, TOTAL, damage, one_epoch, write_digits  # noqa: E402
from wdsdist.data import LoaderConfig  # noqa: E402

# (split, ranks, workers, batch): the layouts of the report that asked for it
LAYOUTS = [
    ("samples", 1, 1, 10), ("samples", 1, 2, 16), ("samples", 2, 1, 16), ("samples", 2, 2, 10),
    ("samples", 3, 1, 10), ("samples", 3, 2, 16), ("shards", 2, 2, 10), ("shards", 3, 1, 10),
]  # fmt: skip


def config(split: str, workers: int, batch: int) -> LoaderConfig:
    options = dict(
        batch_size=batch, workers=workers, mode="epoch", split=split, image_size=16, with_keys=True,
        nbatches="auto" if split == "shards" else None,
    )  # fmt: skip
    if "max_bad" in LoaderConfig.__dataclass_fields__:  # the limit is not the point here
        options["max_bad"] = 1.0
    return LoaderConfig(**options)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="damaged-"))
    try:
        clean, _ = write_digits(root / "clean")
        shutil.copytree(root / "clean", root / "bad")
        lost = damage(root / "bad", DAMAGED)
        bad = str(root / "bad" / "digits.index.json")
        rows = []
        print("| split | ranks x workers, batch | batches per rank (len) | good samples never delivered "
              "| damaged delivered | losses counted |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for split, world, workers, batch in LAYOUTS:
            cfg = config(split, workers, batch)
            ref, got = one_epoch(clean, world, cfg), one_epoch(bad, world, cfg)
            missing = len(set(ref["real"]) - lost - set(got["real"]))
            row = {"split": split, "world": world, "workers": workers, "batch": batch, "batches": got["batches"],
                   "len": ref["lens"], "missing": missing, "damaged_delivered": len(lost & set(got["real"])),
                   "lost": got["lost"]}  # fmt: skip
            rows.append(row)
            print(f"| {split} | {world} x {workers}, {batch} | {' '.join(map(str, got['batches']))} ({ref['lens'][0]}) "
                  f"| {missing} | {row['damaged_delivered']} | {got['lost']} |")  # fmt: skip
        print(f"\n{len(lost)} damaged samples of {TOTAL} in shards of {PER_SHARD}")
        if args.json:
            print(json.dumps(rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
