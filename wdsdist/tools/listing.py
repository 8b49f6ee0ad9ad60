"""What a conversion reads, listed before anything is written: each image's name, label, size and
where it lies (a file of a folder, a byte offset in a tar, a row of a Parquet file), in the order
the shards will hold them, with the class names. Sizes come from the file system or the tar
headers, so the shard boundaries are fixed here, without reading an image (tools/planning.py).

Sources: an ImageFolder tree; a tar of class tars or of class folders; a flat folder or tar with
``--labels``; a Parquet file or a folder of them (tools/parquetsrc.py)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from wdsdist.data.sources.index import read_index
from wdsdist.errors import UserError
from wdsdist.tools import labels as labelfiles
from wdsdist.tools import parquetsrc, tarlist
from wdsdist.tools.sourcetree import image_folder_samples

PARQUET_WINDOW = 8  # row groups whose rows are mixed together (parquetsrc.windowed_shuffle)
NO_LABEL = -1  # an image the labels file does not name: skipped, and listed, when written


@dataclass(frozen=True)
class Inputs:
    """Where the images and their labels come from (the command line's choices)."""

    source: str
    seed: int = 0
    labels: str | None = None
    devkit_classes: str | None = None
    classes_from: str | None = None
    image_column: str = "image"
    label_column: str = "label"


@dataclass
class Listing:
    kind: str  # "folder", "tar" or "parquet"
    path: str  # the source, absolute
    items: list[list]  # [name, label, size, offset]: offset in the tar, the row in Parquet, -1 for a file
    classes: list[str]
    identity: dict  # what tells this source from another of its name (a file's size and time)
    mtime: int  # the shards' members carry it, so every run writes the same bytes
    skipped: list[list[str]] = field(default_factory=list)  # [name, reason] known from the listing
    skipped_links: int = 0


def list_source(inputs: Inputs) -> Listing:
    """The source's images in the shards' order (shuffled with the seed), one line for a source
    that cannot be used."""
    src = inputs.source
    if not os.path.exists(src):
        raise UserError(f"--source {src}: no such file or folder")
    if parquetsrc.is_parquet(src):
        listing = _parquet(inputs)
    elif tarlist.is_tar(src):
        listing = _tar(inputs)
    elif os.path.isdir(src):
        listing = _labeled_folder(inputs) if inputs.labels else _image_folder(inputs)
    else:
        raise UserError(f"--source {src}: not a folder, an uncompressed .tar or a .parquet file")
    if inputs.labels is None and inputs.classes_from is not None:
        want = training_classes(inputs.classes_from)
        if listing.classes != want:
            raise UserError(_mismatch(f"--source {src}", listing.classes, inputs.classes_from, want))
    if not listing.items:
        raise UserError(f"--source {src}: no images in it")
    return listing


def _stat(path: str) -> tuple[dict, int]:
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}, int(st.st_mtime)


def _image_folder(inputs: Inputs) -> Listing:
    with os.scandir(inputs.source) as it:
        entries = list(it)
    if not any(e.is_dir() for e in entries) and any(e.name.lower().endswith(tarlist.IMAGE_SUFFIXES) for e in entries):
        raise UserError(f"--source {inputs.source}: images but no class folders; for a flat folder add --labels FILE")
    tree = image_folder_samples(inputs.source, inputs.seed)
    root = os.path.abspath(inputs.source)
    items = []
    for path, label in tree.files:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = 0  # a dangling link: reading it names it
        items.append([os.path.relpath(path, inputs.source), label, size, -1])
    return Listing("folder", root, items, tree.classes, {}, int(os.stat(root).st_mtime), [], len(tree.skipped_links))


def _labeled_folder(inputs: Inputs) -> Listing:
    root = os.path.abspath(inputs.source)
    with os.scandir(root) as it:
        names = sorted(e.name for e in it if e.name.lower().endswith(tarlist.IMAGE_SUFFIXES))
    members = []
    for name in names:
        try:
            size = os.stat(os.path.join(root, name)).st_size
        except OSError:
            size = 0
        members.append((name, size, -1))
    listing = Listing("folder", root, [], [], {}, int(os.stat(root).st_mtime))
    return _label(listing, members, inputs)


def _tar(inputs: Inputs) -> Listing:
    path = os.path.abspath(inputs.source)
    identity, mtime = _stat(path)
    listing = Listing("tar", path, [], [], identity, mtime)
    members, damaged = [], set()
    for m in tarlist.list_tar(path):
        if m.kind.startswith("damaged"):
            listing.skipped.append([m.name, f"a class tar {m.kind}; its images are left out"])
            damaged.add(_folder(m.name))
        elif m.kind != "file":
            listing.skipped.append([m.name, f"a {m.kind} in the tar, not a file"])
        elif ".." in m.name.split("/"):
            listing.skipped.append([m.name, "its name leads out of its folder ('..')"])
        else:
            members.append((m.name, m.size, m.offset))
    members = _unique(members, listing.skipped)
    if inputs.labels:
        return _label(listing, members, inputs)
    flat = next((name for name, _, _ in members if _folder(name) in ("", ".", "..")), None)
    if flat is not None:
        raise UserError(
            f"--source {path}: member {flat} is in no class folder or class tar; for a flat tar add --labels FILE"
        )
    listing.classes = sorted({_folder(name) for name, _, _ in members} | damaged)  # a class keeps its number
    index = {c: i for i, c in enumerate(listing.classes)}
    listing.items = [[name, index[_folder(name)], size, off] for name, size, off in members]
    random.Random(inputs.seed).shuffle(listing.items)
    return listing


def _folder(name: str) -> str:
    """An image's class in a tar: the folder it is in (train/n01440764/x.JPEG: n01440764); "" for none."""
    parts = name.strip("/").split("/")
    return parts[-2] if len(parts) > 1 else ""


def _unique(members: list[tuple], skipped: list[list[str]]) -> list[tuple]:
    """One image per name: a second member of the same name (a tar may hold both) is skipped."""
    seen: set[str] = set()
    out = []
    for m in members:
        if m[0] in seen:
            skipped.append([m[0], "a second member of this name in the tar"])
        else:
            seen.add(m[0])
            out.append(m)
    return out


def _label(listing: Listing, members: list[tuple], inputs: Inputs) -> Listing:
    """Each image's class from the labels file, numbered as the training set numbers them."""
    named = labelfiles.read_labels(inputs.labels, inputs.devkit_classes)
    if inputs.classes_from is not None:
        listing.classes = training_classes(inputs.classes_from)
        unknown = sorted(set(named.values()) - set(listing.classes))
        if unknown:
            raise UserError(
                f"--labels {inputs.labels}: class {unknown[0]} ({len(unknown)} in all) is not among the "
                f"{len(listing.classes)} classes of --classes-from {inputs.classes_from}"
            )
    elif inputs.devkit_classes is not None:
        listing.classes = sorted(labelfiles.devkit_wnids(inputs.devkit_classes))
    else:
        listing.classes = sorted(set(named.values()))
    index = {c: i for i, c in enumerate(listing.classes)}
    for name, size, off in members:
        cls = named.get(labelfiles.image_stem(name))
        listing.items.append([name, NO_LABEL if cls is None else index[cls], size, off])
    random.Random(inputs.seed).shuffle(listing.items)
    return listing


def _parquet(inputs: Inputs) -> Listing:
    path = os.path.abspath(inputs.source)
    found = parquetsrc.list_parquet(inputs.source, inputs.image_column, inputs.label_column)  # named as given
    identity, mtime = _stat(found.files[0])
    identity["files"] = [[os.path.basename(f), os.path.getsize(f)] for f in found.files]
    classes = found.classes
    if inputs.classes_from is not None:
        classes = training_classes(inputs.classes_from)
    items = [[name, label, size, row] for name, label, size, row in found.rows]
    bad = next((it for it in items if not 0 <= it[1] < len(classes)), None)
    if bad is not None:
        raise UserError(f"--source {inputs.source}: row {bad[3]} has label {bad[1]}, not in 0..{len(classes) - 1}")
    items = parquetsrc.windowed_shuffle(items, found.groups, inputs.seed, PARQUET_WINDOW)
    return Listing("parquet", path, items, classes, identity, mtime)


def training_classes(index: str) -> list[str]:
    """The class names, in order, of the training set's index (--classes-from)."""
    try:
        classes = read_index(index).get("classes")
    except (OSError, ValueError) as exc:
        raise UserError(f"--classes-from {index}: {exc}") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise UserError(f"--classes-from {index}: it names no classes (an index made by makeshards.py --source)")
    return classes


def _mismatch(what: str, got: list[str], index: str, want: list[str]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    at = lambda seq: seq[first] if first < len(seq) else "nothing"  # noqa: E731
    return (
        f"{what}: its {len(got)} classes are not the {len(want)} of --classes-from {index} "
        f"(class {first}: {at(got)} here, {at(want)} there)"
    )
