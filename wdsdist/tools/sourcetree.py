"""The listing of an ImageFolder tree for makeshards.py --source: torchvision's order, but the walk
stays inside --source (a symlink out of it is skipped and counted, a loop is an error), half of
shards.py's guarantee "a re-run reads and writes only where told"."""

from __future__ import annotations

import errno
import os
import random
import stat
import sys
from dataclasses import dataclass

from wdsdist.errors import UserError

# torchvision.datasets.folder.IMG_EXTENSIONS, the listing's rule, as a copy: importing torchvision
# costs seconds of every makeshards run (tests/tools/test_makeshards.py compares the two listings).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class SourceTree:
    files: list[tuple[str, int]]  # (path, label) in seeded shuffled order
    classes: list[str]
    skipped_links: list[tuple[str, str]]  # (link, where it leads) out of the tree, not followed


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class _TreeWalk:
    """torchvision's ImageFolder listing (find_classes + make_dataset: sorted class folders,
    IMG_EXTENSIONS, the same order), except that symlinks are followed only while they stay
    inside the source tree, and a link back to a folder above it is an error, not an endless walk."""

    def __init__(self, source: str):
        self.source = source
        self.root = os.path.realpath(source)
        self.skipped: list[tuple[str, str]] = []

    def _list(self, folder: str) -> list[os.DirEntry]:
        try:
            with os.scandir(folder) as it:
                return list(it)
        except OSError as exc:
            raise UserError(f"--source {self.source}: cannot list {folder}: {exc.strerror}") from None

    def _kind(self, entry: os.DirEntry, ancestors: set[tuple[int, int]]) -> tuple[str, tuple[int, int] | None]:
        """("dir", its id), ("file", None) or ("skip", None) for a link out of the tree."""
        try:
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if not _inside(target, self.root):
                    self.skipped.append((entry.path, target))
                    return "skip", None
                st = os.stat(entry.path)
            else:
                st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UserError(f"--source {self.source}: symlink loop at {entry.path}") from None
            return "file", None  # e.g. a dangling link: listed as torchvision does; reading it names it
        if stat.S_ISDIR(st.st_mode):
            ident = (st.st_dev, st.st_ino)
            if ident in ancestors:
                back = os.path.realpath(entry.path)
                raise UserError(f"--source {self.source}: symlink loop at {entry.path} (leads back to {back})")
            return "dir", ident
        return "file", None

    def classes(self) -> list[tuple[str, tuple[int, int]]]:
        st = os.stat(self.root)
        top = {(st.st_dev, st.st_ino)}
        found = []
        for e in self._list(self.source):
            kind, ident = self._kind(e, top)
            if kind == "dir":
                found.append((e.name, ident))
        return sorted(found)

    def images(self, folder: str, ancestors: set[tuple[int, int]]) -> list[str]:
        """Image files under folder, in make_dataset's order: folders sorted by path, names sorted."""
        listed: list[tuple[str, list[str]]] = []
        stack = [(folder, ancestors)]
        while stack:
            path, above = stack.pop()
            names = []
            for e in self._list(path):
                kind, ident = self._kind(e, above)
                if kind == "dir":
                    stack.append((e.path, above | {ident}))
                elif kind == "file" and e.name.lower().endswith(IMG_EXTENSIONS):
                    names.append(e.name)
            listed.append((path, sorted(names)))
        return [os.path.join(path, name) for path, names in sorted(listed) for name in names]


def image_folder_samples(source: str, seed: int) -> SourceTree:
    """List an ImageFolder tree: the image files with their labels in seeded shuffled order."""
    if not os.path.isdir(source):
        raise UserError(f"--source {source}: no such folder")
    walk = _TreeWalk(source)
    class_dirs = walk.classes()
    if not class_dirs:
        raise UserError(f"--source {source}: no class folders in it (expected SOURCE/CLASS/IMAGE){_skipped(walk)}")
    top = os.stat(walk.root)
    files = []
    for label, (name, ident) in enumerate(class_dirs):
        above = {(top.st_dev, top.st_ino), ident}
        files.extend((path, label) for path in walk.images(os.path.join(source, name), above))
    if not files:
        raise UserError(
            f"--source {source}: no images ({', '.join(IMG_EXTENSIONS)}) in its class folders{_skipped(walk)}"
        )
    if walk.skipped:
        link, target = walk.skipped[0]
        print(
            f"warning: --source {source}: skipped {len(walk.skipped)} symlinks that lead out of the source tree "
            f"(first {link} -> {target}); copy what they point to into the tree to include it",
            file=sys.stderr,
        )
    random.Random(seed).shuffle(files)
    return SourceTree(files, [name for name, _ in class_dirs], walk.skipped)


def _skipped(walk: _TreeWalk) -> str:
    return f"; {len(walk.skipped)} symlinks out of the tree were not followed" if walk.skipped else ""
