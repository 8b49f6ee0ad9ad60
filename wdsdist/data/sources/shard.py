"""A shard as the loader knows it: its URL, and its sample count and offsets where an index or
the data set's metadata gives them. Every scheme's ``expand`` makes these."""

from __future__ import annotations

from dataclasses import dataclass, field

# The most samples an index or metadata may claim for one shard. With loader.split=samples each position a
# shard does not deliver is a placeholder the loader passes (2-3 us each), so a claim is time
# spent: 16.7 M samples take >= 8 GiB of tar headers alone, more than any shard we know of
# holds, and the loader passes them in under a minute. A local plain tar too small for its claim is
# warned of.
MAX_SHARD_SAMPLES = 1 << 24


@dataclass(frozen=True)
class SampleOffsets:
    """Where in a plain tar shard every ``every``-th sample begins: ``at(j)`` is the byte offset of
    sample ``j * every``'s first header. Packed as 8-byte integers (``packed``): ImageNet's
    1.28 M samples at every=16 take 640 KB in each process, where a list of ints took 3 MB."""

    every: int
    packed: bytes

    def __len__(self) -> int:
        return len(self.packed) // 8

    def at(self, j: int) -> int:
        return int.from_bytes(self.packed[8 * j : 8 * j + 8], "little")

    def seek_point(self, sample: int) -> tuple[int, int]:
        """(first, offset): the table's last sample ``first`` <= ``sample`` and where it begins."""
        j = min(sample // self.every, len(self) - 1)
        return j * self.every, self.at(j)

    def bound(self, sample: int) -> int | None:
        """A byte offset at or after the start of ``sample`` (None: the table ends before it)."""
        j = -(-sample // self.every)
        return self.at(j) if j < len(self) else None


@dataclass(frozen=True)
class Shard:
    url: str
    nsamples: int | None = None
    # A reading aid from the index, not part of what the shard is: two Shards of one URL and
    # count are equal (and hash alike) with or without it.
    offsets: SampleOffsets | None = field(default=None, compare=False, repr=False)
