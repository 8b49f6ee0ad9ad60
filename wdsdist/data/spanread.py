"""Reading a span of a shard: its samples ``start`` to ``stop`` (sample numbers within the shard),
for the sample-level split, where a worker starts and stops mid-shard.

This first version reads and discards the samples before ``start`` (the fallback every source
supports); seeking over member data and byte-range requests replace it where the source allows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from wdsdist.data.shardspec import Access, Shard
from wdsdist.data.tarread import open_shard, tar_samples


def read_span(
    shard: Shard,
    start: int,
    stop: int | None,
    access: Access,
    wanted: frozenset[str] | None = None,
    max_member: int | None = None,
) -> Iterator[dict]:
    """Samples ``start`` .. ``stop - 1`` of ``shard`` (``stop`` None: to the shard's end), as
    tar_samples gives them. Raises what opening or reading the shard raises."""
    stream = open_shard(shard.url, access)
    try:
        yield from itertools.islice(tar_samples(stream, shard.url, wanted, max_member), start, stop)
    finally:
        stream.close()
