"""Late reads (``late``, loader.read_late). A worker's shuffle buffer holds its 1,000 samples
long before they are decoded: at ImageNet sizes, about a hundred megabytes of JPEG bytes per
worker, most of its heap. From a local, uncompressed shard, a wanted member of ``LATE_MIN``
bytes or more is not read with its header: the sample carries a ``Late`` (where the bytes lie),
and ``read_late`` reads them with one ``pread`` as the sample leaves the buffer, just before its
decode, which then finds them in the CPU's cache. This takes memory off every worker and costs
no speed (see bench/results/2026-11-24-late-reads.md). The file stays open (a descriptor of its
own) while any of its Late members lives, at most ``LATE_FILES`` files a process; beyond that,
members are read at once. Passing over the data defeats the kernel's readahead, so the reader
asks for the bytes ahead itself (``posix_fadvise``). A member cut short fails the shard, as when
read at once (its end is checked against the file's size), and so does a file cut while its
headers are read (seeking past a file's end never fails, so where the headers end early the size
is checked again); a file that shrinks later fails the samples it no longer holds, each a bad
sample of its own.

tarread._members makes the Late members (and asks the kernel ahead); this module holds what they
are, the files they keep open, and their reading.
"""

from __future__ import annotations

import contextlib
import os
import stat

from wdsdist.errors import DataError

LATE_MIN = 4096  # smaller members are read with their headers: the copy costs less than a later pread
LATE_FILES = 64  # shards a process holds open for late reads; beyond, members are read at once
AHEAD = 8 << 20  # bytes of a late-read shard asked ahead of its headers (posix_fadvise WILLNEED)
ADVISE = getattr(os, "posix_fadvise", None)  # not on macOS


class Late:
    """In a sample, in place of a member's data: where the data lies in a local shard, to be read
    when the sample leaves the shuffle buffer (``read_late``, loader.read_late)."""

    __slots__ = ("file", "offset", "size")

    def __init__(self, file: LateFile, offset: int, size: int):
        self.file, self.offset, self.size = file, offset, size

    def __repr__(self) -> str:
        return f"Late({self.offset}, {self.size})"

    def read(self) -> bytes:
        data = os.pread(self.file.fd, self.size, self.offset)
        while 0 < len(data) < self.size:  # one pread gives 2 GiB at most
            more = os.pread(self.file.fd, self.size - len(data), self.offset + len(data))
            if not more:
                break
            data += more
        if len(data) != self.size:  # the file shrank since its headers were read
            raise OSError(f"{self.size} bytes at byte {self.offset}, and the file holds {len(data)} of them")
        return data


class LateFile:
    """A shard's file, held open (its own descriptor) while any of its Late members is alive."""

    count = 0  # open in this process

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        LateFile.count += 1

    def __del__(self) -> None:
        LateFile.count -= 1
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __reduce__(self):
        # A descriptor means nothing in another process (and its copy would close another file).
        raise TypeError("a shard's late-read file stays in the process that opened it")


def late_file(stream, consumed: int) -> tuple[LateFile | None, int]:
    """A local shard's file for late reads and the byte at which its first header lies
    (``consumed`` bytes ago); None where the stream is no regular file or too many are open."""
    if LateFile.count >= LATE_FILES or not hasattr(os, "pread"):  # no pread: Windows
        return None, 0
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not stream.seekable():
            return None, 0
        base = stream.tell() - consumed
        return LateFile(os.dup(fd), st.st_size), base
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None, 0


def read_late(sample: dict) -> dict:
    """The sample with its Late members read (in place); raises DataError naming the shard, the
    key and the member where the file no longer holds them."""
    for name, value in sample.items():
        if isinstance(value, Late):
            try:
                sample[name] = value.read()
            except OSError as exc:
                where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
                raise DataError(f"{where}: cannot read its {name}: {exc}") from None
    return sample
