"""The plan of a conversion, fixed before a shard is written (DESIGN.md principle 21): the listing
(every image's name, label, size and place, in the shards' order), the options, and where each
shard begins and ends. Saved beside the output as PREFIX.plan.json, it is what lets any number of
workers or ranks write the same bytes, and what a restart checks the folder against.

The boundaries are cut by --maxcount and by --maxsize, the latter from each image's bytes as
listed plus its tar headers: a shard's size is known before it is written, since images are
stored as they are. Re-encoded images (--resize, --quality) have no size until encoded, so their
shards are cut by --maxcount alone (makeshards refuses --maxsize with them)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass

from wdsdist.errors import UserError
from wdsdist.tools.listing import Listing

VERSION = 1
BLOCK = 512
# tarfile pads a closed archive to 20 blocks; two of them end it
TAR_RECORD = 20 * BLOCK


@dataclass(frozen=True)
class Options:
    """What decides the shards' bytes (the number of workers or ranks does not)."""

    prefix: str
    maxcount: int = 1000
    maxsize: int = 1 << 30
    verify: str = "full"  # "full": decode every image; "header": read its header only
    resize: int | None = None
    quality: int | None = None
    max_member: int = 64 << 20  # an image larger than this is skipped, never read into memory


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1GB' -> 10**9, '1GiB' -> 2**30, '500MB', '4096' (bytes)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size like 1GB, 512MiB or 4096, got {text!r}")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    value = int(number * ((1024 if binary else 1000) ** power))
    if value < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return value


def _padded(n: int) -> int:
    return BLOCK + (n + BLOCK - 1) // BLOCK * BLOCK


def sample_meta(name: str, cls: str) -> bytes:
    return json.dumps({"path": name, "class": cls}).encode()


def sample_bytes(name: str, size: int, label: int, cls: str) -> int:
    """A sample's bytes in a shard: its image, class and JSON members, each a header and padded
    data; a name too long for a plain header takes a PAX header (and padded record) per member."""
    long = 3 * (2 * BLOCK + _padded(len(name) + 32)) if len(name) > 90 else 0
    return _padded(size) + _padded(len(str(label))) + _padded(len(sample_meta(name, cls))) + long


def cut(listing: Listing, options: Options) -> list[int]:
    """Where each shard ends (exclusive item index): at maxcount samples, or before the sample
    that would take the shard over maxsize bytes (a single larger sample gets a shard of its own)."""
    ends, count, size = [], 0, TAR_RECORD
    sized = options.resize is None and options.quality is None
    for i, (name, label, nbytes, _) in enumerate(listing.items):
        cls = listing.classes[label] if 0 <= label < len(listing.classes) else ""
        add = sample_bytes(name, nbytes, label, cls) if sized else 0
        if count and (count >= options.maxcount or size + add > options.maxsize):
            ends.append(i)
            count, size = 0, TAR_RECORD
        count += 1
        size += add
    ends.append(len(listing.items))
    return ends


def make_plan(listing: Listing, options: Options) -> dict:
    return {
        "version": VERSION,
        "source": {"kind": listing.kind, "path": listing.path, **listing.identity},
        "options": asdict(options),
        "classes": listing.classes,
        "mtime": listing.mtime,
        "skipped": listing.skipped,
        "ends": cut(listing, options),
        "items": listing.items,
    }


def plan_bytes(plan: dict) -> bytes:
    """One item to a line: a plan of 1.28 M images is read and compared quickly, and diffs well."""
    head = {k: v for k, v in plan.items() if k != "items"}
    items = ",\n".join(json.dumps(it, separators=(",", ":")) for it in plan["items"])
    text = json.dumps(head, sort_keys=True)[:-1] + ', "items": [\n' + items + "\n]}\n"
    return text.encode("utf-8")


def digest(plan: dict) -> str:
    return hashlib.sha256(plan_bytes(plan)).hexdigest()[:16]


def plan_path(outdir: str, prefix: str) -> str:
    return os.path.join(outdir, f"{prefix}.plan.json")


def read_plan(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable plan ({exc}); remove it to start this conversion again") from None


def difference(saved: dict, new: dict) -> str | None:
    """What tells the saved plan from this command's, in words; None when they are the same."""
    for key in ("version", "source", "options", "classes", "skipped", "items", "ends", "mtime"):
        a, b = saved.get(key), new.get(key)
        if key in ("source", "options") and isinstance(a, dict) and a != b:
            k = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            return f"{key} {k}: {a.get(k)!r} there, {b.get(k)!r} now"
        if a != b:
            if key == "items" and isinstance(a, list):
                return f"the source's images differ ({len(a)} images there, {len(b)} now)"
            return f"{key} differ"
    return None


def shard_range(plan: dict, shard: int) -> tuple[int, int]:
    ends = plan["ends"]
    return (ends[shard - 1] if shard else 0), ends[shard]
