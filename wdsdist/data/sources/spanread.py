"""Reading a span of a shard: its samples ``start`` to ``stop`` (sample numbers within the shard),
for the sample-level split, where a worker starts and stops mid-shard.

The samples before ``start`` are passed over without reading their data: a local file seeks
past each member (only headers are read); where the index gives the shard's sample offsets
(``Shard.offsets``), the read begins at the table's last sample at or before ``start``, with
a seek for a local file (and for a remote shard in the node cache, which holds it whole) and an
http ``Range: bytes=OFF-END`` request for a URL. A compressed
shard, or a source that cannot seek, reads and drops them. Reading ends at the first header of
sample ``stop``: nothing after the span is read beyond a buffer.

With a node cache, a span that lies in a ``part`` of the shard (loader.shard_order=node: the
samples this node keeps of a shard another node reads the rest of) is read from the cache's
entry of that part's bytes (``part_span``, from the index's offsets), fetched once with one
ranged request, never from the whole shard.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from wdsdist.data.sources.cachefiles import Span
from wdsdist.data.sources.opener import Access, open_shard
from wdsdist.data.sources.shardspec import Shard
from wdsdist.data.tar.tarread import tar_samples


def part_span(shard: Shard, part: tuple[int, int] | None) -> Span | None:
    """The bytes [lo, hi) that hold samples ``part`` = [first, stop) of ``shard`` whole (hi None:
    to the shard's end), from the index's offsets: from the table's last sample at or before
    ``first`` to its first at or after ``stop``. None: the whole shard (no part, or no offsets)."""
    table = shard.offsets
    if part is None or table is None or not len(table):
        return None
    first, stop = part
    lo = table.seek_point(first)[1] if first > 0 else 0
    hi = table.bound(stop) if shard.nsamples is None or stop < shard.nsamples else None
    return lo, hi


def read_span(
    shard: Shard,
    start: int,
    stop: int | None,
    access: Access,
    wanted: frozenset[str] | None = None,
    max_member: int | None = None,
    *,
    use_offsets: bool = True,
    late: bool = False,
    part: tuple[int, int] | None = None,
) -> Iterator[dict]:
    """Samples ``start`` .. ``stop - 1`` of ``shard`` (``stop`` None: to the shard's end), as
    ``islice(tar_samples(...), start, stop)`` gives them. ``use_offsets`` False: ignore the
    index's byte offsets (for measuring them). ``late``: as tar_samples'. ``part``: the samples
    [first, stop) of the shard, holding these, that the node cache keeps as one entry (None:
    the whole shard). Raises what opening or reading the shard raises; an error before the first
    sample read from an index's offset says so (a stale index)."""
    if stop is not None and stop <= start:
        return
    table = shard.offsets if use_offsets else None
    first, offset, end = 0, 0, None
    if table is not None and len(table):
        if start > 0:
            first, offset = table.seek_point(start)
        if stop is not None:
            end = table.bound(stop)
    count = None if stop is None else stop - start
    span = part_span(shard, part) if use_offsets else None
    stream = open_shard(shard.url, access, start=offset, end=end, span=span)
    try:
        samples = tar_samples(stream, shard.url, wanted, max_member, skip=start - first, count=count, late=late)
        got = 0
        try:
            for sample in samples:
                got += 1
                yield sample
        except tarfile.ReadError as exc:
            if got or not offset:
                raise
            raise tarfile.ReadError(
                f"{exc}, reading from byte {offset} where the index puts sample {first} "
                f"(a stale index? makeshards.py --index rewrites it)"
            ) from None
        if end is not None and count is not None and got < count:
            # A read cut at the index's end offset that came short: a wrong offset, not a short shard.
            raise tarfile.ReadError(
                f"the bytes {offset} .. {end} the index gives for samples {first} .. {stop - 1} "
                f"held only {got} of samples {start} .. {stop - 1} (a stale index? makeshards.py --index rewrites it)"
            )
    finally:
        stream.close()
