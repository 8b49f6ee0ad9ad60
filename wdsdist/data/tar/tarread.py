"""Samples from a shard's tar stream, read with as little Python per member as we can.

Python's ``tarfile`` in stream mode parses each member into a TarInfo and copies it through its
stream buffer (three members per ImageNet sample): a noticeable share of a DataLoader worker's
time (bench/results/2026-11-21-loader.md). Shards are plain ustar/GNU/PAX tar files, so this
module parses the 512-byte headers itself, reads each wanted member with one ``read`` and skips
the rest. Sample grouping follows WebDataset (``base_plus_ext``, lower-case suffixes, ``__*__``
meta members skipped, one sample per key run). A gzip, bzip2 or xz stream is decompressed as it
is read and parsed the same way, so its members obey the same limits (tarfile, as WebDataset
uses it, reads every member whole, so a small .tar.gz can hold a member that takes gigabytes).
Anything else fails with the error tarfile would give.

The data is untrusted: a member larger than ``max_member`` is skipped without being read (its
sample carries an ``Oversized`` in its place, for the caller to refuse), and a size no reader
could honour (negative) fails the shard, since the next header's place is then unknown.

Late reads (``late``, loader.read_late): lateread.py.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import re
import struct
import tarfile
from collections.abc import Iterator

from webdataset.tariterators import base_plus_ext

from wdsdist.data.tar.lateread import ADVISE, AHEAD, LATE_MIN, Late, LateFile, late_file

BLOCK = 512
_CHUNK = 1 << 20  # bytes per read when skipping a member of a stream that cannot seek
_SIGNED = struct.Struct("148b8x356b")
_META = re.compile(r"__[^/]*__($|/)")
_REGULAR = (b"0", b"\0", b"7")
# The streams tarfile's "r|*" mode recognises, by their first bytes.
_COMPRESSED = (
    (b"\x1f\x8b\x08", lambda f: gzip.GzipFile(fileobj=f, mode="rb")),
    (b"BZh", lambda f: bz2.BZ2File(f)),
    (b"\xfd7zXZ\0", lambda f: lzma.LZMAFile(f)),
    (b"\x5d\0\0\x80", lambda f: lzma.LZMAFile(f)),  # legacy .lzma
)


class Oversized:
    """In a sample, in place of a member's data: the member was larger than the limit and was
    skipped unread."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __repr__(self) -> str:
        return f"Oversized({self.size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Oversized) and other.size == self.size


class _Prepended:
    """A stream whose first bytes were already read (to sniff the format)."""

    def __init__(self, head: bytes, stream):
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(n)
        if n is None or n < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:n], self.head[n:]
        if len(data) < n:
            data += self.stream.read(n - len(data))
        return data


def _valid(header: bytes) -> bool:
    """A tar header whose checksum holds (the checksum field itself counts as 8 spaces), summed
    over unsigned bytes or, as some old tars wrote it, signed ones (tarfile accepts both)."""
    try:
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    if stored == sum(header) - sum(header[148:156]) + 256:  # one pass over the block, not two slices
        return True
    return stored == sum(_SIGNED.unpack_from(header)) + 256


def is_tar_header(block: bytes) -> bool:
    """Whether a file's first 512 bytes are a plain tar's header (not a compressed stream's
    start, not garbage)."""
    return len(block) == BLOCK and _valid(block)


def _number(field: bytes) -> int:
    if field[0] == 0x80:  # GNU base-256, for members of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    if field[0] == 0xFF:  # base-256, negative (as tarfile reads it)
        return int.from_bytes(field[1:], "big") - (1 << (8 * (len(field) - 1)))
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise tarfile.ReadError("invalid header") from None


def _size(size: int | str, name: str, limit: int | None = None) -> int:
    """A member's size, refused where no reader could honour it: after a negative size (PAX
    ``size=-1`` would read the rest of the stream) the next header's place is unknowable."""
    try:
        size = int(size)
    except ValueError:
        raise tarfile.ReadError(f"{name}: invalid size {str(size)[:20]!r}") from None
    if size < 0:
        raise tarfile.ReadError(f"{name}: negative size {size}")
    if limit is not None and size > limit:
        raise tarfile.ReadError(f"{name} of {size} bytes exceeds max_member_bytes={limit}")
    return size


def _read_up_to(stream, n: int) -> bytes:
    """n bytes, fewer only at the end of the stream (pipes and sockets may return less than asked)."""
    data = stream.read(n)
    while 0 < len(data) < n:
        more = stream.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _read_exactly(stream, n: int) -> bytes:
    data = _read_up_to(stream, n)
    if len(data) < n:
        raise tarfile.ReadError("unexpected end of data")
    return data


def skip_bytes(stream, n: int, seek_above: int = 1 << 16) -> None:
    """Pass n bytes: by seeking where the stream can, else read and dropped a chunk at a time
    (never n bytes at once: n comes from the shard). Below ``seek_above`` bytes a read through
    the buffer is cheaper than the seek that empties it."""
    if n <= 0:
        return
    if n > seek_above and getattr(stream, "seekable", lambda: False)():
        stream.seek(n, 1)
        return
    while n > 0:
        got = len(_read_exactly(stream, min(n, _CHUNK)))
        n -= got


def _at_end(header: bytes, late: LateFile | None) -> None:
    """At the end-of-archive marker, or a read of less than a block: raise unless the stream
    ended cleanly there."""
    if len(header) == BLOCK:  # the marker
        return
    if header:
        raise tarfile.ReadError("unexpected end of data")
    if late is not None and (now := os.fstat(late.fd).st_size) < late.size:
        # Passing over late members by seeking, a file cut short meanwhile ends here
        # rather than in a member's data: it fails as a cut file read at once does.
        raise tarfile.ReadError(f"unexpected end of data: the file shrank to {now} bytes")


def _header_size(header: bytes) -> int:
    """A header's member size, checked; raises for an invalid header or a GNU sparse member."""
    if not _valid(header):
        raise tarfile.ReadError("invalid header")
    size = _size(_number(header[124:136]), "member")
    if header[156:157] == b"S":  # GNU sparse: its data needs the sparse map, which we do not read
        raise tarfile.ReadError("GNU sparse members are not supported")
    return size


def _extended(stream, kind: bytes, size: int, limit: int | None, pos: int, long_name: str | None, pax: dict):
    """Read an extended header's data (L: a long name, x: pax records, g: ignored), which begins
    at ``pos``; return the position after its padding, and the long name and pax records for the
    next member."""
    _size(size, "extended header", limit)
    meta = _read_exactly(stream, size)
    padding = -size % BLOCK
    skip_bytes(stream, padding)
    if kind == b"L":
        long_name = meta.rstrip(b"\0").decode("utf-8", "surrogateescape")
    elif kind == b"x":
        pax = _pax_records(meta)
    return pos + size + padding, long_name, pax


def _member_name(header: bytes, long_name: str | None, pax: dict, size: int) -> tuple[str, int]:
    """A member's name and size, from the extended headers before it where they give them."""
    name = long_name or pax.get("path")
    if name is None:
        name = _header_name(header)
    return name, (_size(pax["size"], name) if "size" in pax else size)


def _header_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if header[257:263] == b"ustar\0" and header[345] != 0:
        prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        name = f"{prefix}/{name}"
    return name


def _pass_late(stream, late: LateFile, where: int, size: int, padding: int, ahead: int) -> int:
    """Pass over a late member's data at byte ``where`` of the file; return how far the bytes
    were asked for ahead."""
    if where + size > late.size:
        raise tarfile.ReadError("unexpected end of data")
    skip_bytes(stream, size + padding, seek_above=0)
    if where + size > ahead - AHEAD // 2 and ADVISE is not None:
        # Passing over the data defeats the kernel's readahead: ask for the next
        # bytes ourselves, so that headers and late reads find them in memory.
        start = max(ahead, where)
        with contextlib.suppress(OSError):  # a hint, which a file system may refuse
            ADVISE(late.fd, start, AHEAD, os.POSIX_FADV_WILLNEED)
        ahead = start + AHEAD
    return ahead


# The loop over headers runs once per tar member on the loader's hot path: the rare or bulky
# steps are plain helper functions (a call per header at most), no generator layer per member.
def _members(
    stream,
    head: bytes,
    wanted: frozenset[str] | None,
    limit: int | None,
    skip: int = 0,
    count: int | None = None,
    late: LateFile | None = None,
    base: int = 0,
) -> Iterator[tuple[str, str, bytes | Oversized | Late | None, int]]:
    """(key, suffix, data, at) for each regular sample member; data is None where the suffix is
    not ``wanted``, an Oversized where the member is larger than ``limit`` bytes; ``at`` is the
    byte (from ``head``'s first) where the member's headers begin, its extended headers included.

    ``skip``: the members of the first ``skip`` samples (runs of one key, as tar_samples groups
    them) are passed over unread and not yielded, by seeking wherever the stream can. ``count``:
    the stream is left at the first header of sample ``skip + count``, its data unread.
    ``late``: the stream's file, whose first header lies at byte ``base``: a wanted member of
    ``LATE_MIN`` bytes or more comes as a Late, its data passed over unread."""
    header, long_name, pax = head, None, {}
    pos, at, ahead = 0, 0, base  # ahead, for late: the bytes up to here were asked for ahead
    last, started = None, 0  # the last sample key seen, and how many samples have begun
    end = None if count is None else skip + count
    while True:
        if len(header) < BLOCK or header.count(0) == BLOCK:  # the end, or the end-of-archive marker
            _at_end(header, late)
            return
        size, kind = _header_size(header), header[156:157]
        pos += BLOCK
        if kind in (b"x", b"L", b"g"):
            pos, long_name, pax = _extended(stream, kind, size, limit, pos, long_name, pax)
        else:
            name, size = _member_name(header, long_name, pax, size)
            padding = -size % BLOCK
            long_name, pax = None, {}
            key, suffix = base_plus_ext(name) if kind in _REGULAR else (None, None)
            if key is None or (name.startswith("__") and _META.match(name)):
                skip_bytes(stream, size + padding)
            else:
                if key != last:
                    last, started = key, started + 1
                    if end is not None and started > end:
                        return
                if started <= skip:
                    skip_bytes(stream, size + padding, seek_above=0)
                elif wanted is not None and suffix.lower() not in wanted:
                    skip_bytes(stream, size + padding)
                    yield key, suffix.lower(), None, at
                elif limit is not None and size > limit:
                    skip_bytes(stream, size + padding)
                    yield key, suffix.lower(), Oversized(size), at
                elif late is not None and size >= LATE_MIN:
                    ahead = _pass_late(stream, late, base + pos, size, padding, ahead)
                    yield key, suffix.lower(), Late(late, base + pos, size), at
                else:
                    data = _read_exactly(stream, size)
                    skip_bytes(stream, padding)
                    yield key, suffix.lower(), data, at
            pos = at = pos + size + padding
        header = _read_up_to(stream, BLOCK)


def _pax_records(meta: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(meta):
        length, _, rest = meta[pos:].partition(b" ")
        try:
            n = int(length)
        except ValueError:
            n = 0
        if n <= len(length) + 1 or pos + n > len(meta):
            raise tarfile.ReadError("invalid pax header")
        key, _, value = rest[: n - len(length) - 2].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += n
    return records


def _decompressed(head: bytes, stream):
    """A decompressing reader of ``stream`` if ``head`` starts a gzip, bzip2 or xz stream."""
    for magic, opener in _COMPRESSED:
        if head.startswith(magic):
            return opener(_Prepended(head, stream))
    return None


def tar_samples(
    stream,
    url: str,
    wanted: frozenset[str] | None = None,
    max_member: int | None = None,
    *,
    skip: int = 0,
    count: int | None = None,
    late: bool = False,
) -> Iterator[dict]:
    """WebDataset samples ({"__key__", "__url__", suffix: bytes}) of the tar stream ``stream``.

    ``wanted``: the suffixes to read; other members are skipped without reading where the
    stream can seek, and appear in the sample with the value None (so an error can list them).
    ``max_member``: wanted members larger than this many bytes are skipped unread and appear as
    an ``Oversized``; extended headers larger than it fail the shard.
    ``skip``, ``count``: only samples ``skip`` .. ``skip + count - 1`` of the stream, those
    before passed over unread (seeking where the stream can), nothing after them read but the
    next sample's first header.
    ``late``: where the stream is a local file (not compressed), wanted members of ``LATE_MIN``
    bytes or more come as Late, read by ``read_late`` (loader.read_late).
    """
    head = _read_up_to(stream, BLOCK)
    if not is_tar_header(head):
        unpacked = _decompressed(head, stream)
        if unpacked is not None:
            stream, late = unpacked, False
            head = _read_up_to(stream, BLOCK)
    if not head:
        raise tarfile.ReadError("empty file")
    if not is_tar_header(head):
        raise tarfile.ReadError("invalid header")
    file, base = late_file(stream, len(head)) if late else (None, 0)
    sample: dict | None = None
    for key, suffix, data, _ in _members(stream, head, wanted, max_member, skip, count, file, base):
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        if suffix in sample:
            raise ValueError(f"{key}.{suffix}: duplicate file name in tar file")
        sample[suffix] = data
    if sample is not None:
        yield sample


def sample_offsets(stream) -> list[int] | None:
    """The byte offset of every sample of a plain tar stream (where the headers of its first
    member begin), grouped as tar_samples groups them; None where the stream is not a plain tar
    (a compressed shard has no byte offset a reader could seek to)."""
    head = _read_up_to(stream, BLOCK)
    if not is_tar_header(head):
        return None
    offsets, last = [], None
    for key, _, _, at in _members(stream, head, frozenset(), None):
        if key != last:
            offsets.append(at)
            last = key
    return offsets
