"""A stand-in for timm/imagenet-1k-wds, for rehearsing the Hub recipe against the fake Hub
(tests/helpers/hub.py): the same file names (imagenet1k-train-{0000..1023}.tar,
imagenet1k-validation-{00..63}.tar) and an _info.json with each split's filenames and
shard_lengths, holding a few tiny synthetic JPEGs (labels 0..999) per shard.

  ./run tests/helpers/hubdata.py data/hub-imagenet [--per-shard N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import webdataset as wds

from tests.conftest import jpeg

SPLITS = {"train": ("imagenet1k-train-{:04d}.tar", 1024), "validation": ("imagenet1k-validation-{:02d}.tar", 64)}


def write(folder: Path, per_shard: int = 2, size: int = 16) -> dict:
    """The shards and _info.json in ``folder``; returns the info."""
    folder.mkdir(parents=True, exist_ok=True)
    info: dict = {"name": "imagenet-1k", "splits": {}}
    n = 0
    for split, (pattern, shards) in SPLITS.items():
        names = [pattern.format(i) for i in range(shards)]
        for name in names:
            with wds.TarWriter(str(folder / name)) as w:
                for _ in range(per_shard):
                    data, _ = jpeg(n, size)
                    w.write({"__key__": f"{split}-{n:08d}", "jpg": data, "cls": str(n % 1000)})
                    n += 1
        lengths = [per_shard] * shards
        info["splits"][split] = {
            "name": split,
            "num_samples": sum(lengths),
            "filenames": names,
            "shard_lengths": lengths,
        }
    (folder / "_info.json").write_text(json.dumps(info))
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--per-shard", type=int, default=2, help="samples per shard (default: %(default)s)")
    args = parser.parse_args()
    info = write(args.folder, args.per_shard)
    counts = ", ".join(
        f"{s} {d['num_samples']} samples in {len(d['filenames'])} shards" for s, d in info["splits"].items()
    )
    print(f"wrote {counts} -> {args.folder}")


if __name__ == "__main__":
    main()
