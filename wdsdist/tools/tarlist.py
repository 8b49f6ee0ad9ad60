"""The members of an uncompressed tar, listed from their headers alone: ImageNet's train tar (a tar
of class tars, ``n01440764.tar`` holding ``n01440764_10026.JPEG``), a tar of class folders, or a
flat tar (its validation set). Nothing is extracted and no member's data is read here: each image
is named by its byte offset in the outer file (a class tar's members lie whole inside it), so the
writers read it with one ``pread`` from any process, in any order."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from wdsdist.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")


@dataclass(frozen=True)
class Member:
    name: str  # CLASS/FILE for a class tar's member, the member's own path otherwise
    offset: int  # of its data in the outer file
    size: int
    kind: str  # "file", or what else it is ("link", "fifo", ...): listed, then skipped when written


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a file of their own (a class tar inside the
    outer tar): tarfile reads its headers through it and seeks over its members' data."""

    def __init__(self, f: io.BufferedReader, start: int, size: int):
        self.f, self.start, self.size, self.pos = f, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        data = os.pread(self.f.fileno(), n, self.start + self.pos) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _members(tf: tarfile.TarFile, where: str) -> Iterator[tarfile.TarInfo]:
    """Each header once, without tarfile's list of every member (1.28 M TarInfos for ImageNet)."""
    while True:
        try:
            info = tf.next()
        except tarfile.TarError as exc:
            raise UserError(f"{where}: not a readable tar ({exc})") from None
        if info is None:
            return
        tf.members.clear()
        yield info


def _kind(info: tarfile.TarInfo) -> str:
    if info.isreg():
        return "file"
    return {tarfile.SYMTYPE: "link", tarfile.LNKTYPE: "link", tarfile.FIFOTYPE: "fifo"}.get(info.type, "special")


def _open(path: str) -> tarfile.TarFile:
    try:
        f = open(path, "rb")  # noqa: SIM115 (the TarFile closes it)
    except OSError as exc:
        raise UserError(f"--source {path}: {exc.strerror}") from None
    with f:
        if f.read(6).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"(\xb5/\xfd")):
            raise UserError(f"--source {path}: a compressed tar; decompress it first (its members are read by offset)")
    try:
        return tarfile.open(path, mode="r:")
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"--source {path}: not a readable tar ({exc})") from None


def list_tar(path: str) -> Iterator[Member]:
    """Every member that may be an image, with class tars opened in place (their members named
    CLASS/NAME); other members (links, FIFOs) are listed too, so the summary counts them."""
    with _open(path) as outer:
        for info in _members(outer, f"--source {path}"):
            if info.isdir():
                continue
            name = info.name
            if info.isreg() and name.lower().endswith(".tar"):
                yield from _inner(outer, path, info)
            elif name.lower().endswith(IMAGE_SUFFIXES):
                yield Member(name, info.offset_data, info.size, _kind(info))


def _inner(outer: tarfile.TarFile, path: str, info: tarfile.TarInfo) -> Iterator[Member]:
    """A class tar's images. One whose headers cannot be read (a damaged download) ends in a
    "damaged" member naming its class, so the conversion goes on and the class keeps its place."""
    cls = os.path.basename(info.name)[: -len(".tar")]
    window = _Window(outer.fileobj, info.offset_data, info.size)
    where = f"--source {path}: member {info.name}"
    try:
        # The window itself, unbuffered: each header is one 512-byte pread, where a buffer would
        # read its size of image data after every header (82 GB of ImageNet's 138 at 64 KiB).
        with tarfile.open(fileobj=window, mode="r:") as inner:
            for m in _members(inner, where):
                if m.isdir() or not m.name.lower().endswith(IMAGE_SUFFIXES):
                    continue
                name = f"{cls}/{os.path.basename(m.name)}"
                yield Member(name, info.offset_data + m.offset_data, m.size, _kind(m))
    except (tarfile.TarError, UserError) as exc:
        why = str(exc).removeprefix(f"{where}: ") if isinstance(exc, UserError) else f"not a readable tar ({exc})"
        yield Member(f"{cls}/{os.path.basename(info.name)}", info.offset_data, info.size, f"damaged: {why}")


def is_tar(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".tar")
