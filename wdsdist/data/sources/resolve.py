"""A spec to the shards a loader reads, with their sample counts: the one walk every caller takes
(Loader, the trainer, the evaluation loader). Expansion is the scheme's (shardspec, schemes/), the
counts the index's or the data set's metadata, else counted from local tar headers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from wdsdist.data.sources import schemes, shardspec
from wdsdist.data.sources.access import Access, is_remote
from wdsdist.data.sources.index import count_samples
from wdsdist.data.sources.shard import Shard
from wdsdist.errors import UserError


def pin_spec(spec: str, access: Access) -> str:
    """A spec pinned to what it names now: an hf:// revision to its commit (the scheme's ``pin``);
    a spec of another scheme is itself."""
    return schemes.of(spec.strip()).pin(spec.strip(), access)


def resolve_shards(spec: str | Sequence[str] | Sequence[Shard], access: Access, *, strict: bool = True) -> list[Shard]:
    """The spec's shards (Shard objects are taken as they are), with missing local files an error
    (``strict``) or a warning, and each scheme's checks made (shardspec.check_access)."""
    if spec and isinstance(spec, (list, tuple)) and isinstance(spec[0], Shard):
        shards = list(spec)
    else:
        shards = shardspec.expand(spec, strict=strict, access=access)  # type: ignore[arg-type]
    shardspec.check_access(shards, access)
    return shards


def known_counts(shards: Sequence[Shard], *, count_local: bool) -> list[int] | None:
    """Per-shard sample counts from the index or metadata, or counted from local tar headers if asked."""
    counts = shardspec.sample_counts(shards)
    if counts is None and count_local and not any(is_remote(s.url) for s in shards):
        counts = [s.nsamples if s.nsamples is not None else count_samples(s.url) for s in shards]
    return counts


def counted_shards(shards: Sequence[Shard], by_samples: bool) -> list[Shard]:
    """The shards with their sample counts, as split=samples (``by_samples``) needs them: from the
    index or metadata, or counted from local tar headers; refused (one line, the fix) when a
    remote shard has none."""
    if not by_samples:
        return list(shards)
    counts = known_counts(shards, count_local=True)
    if counts is None:
        first = next(s.url for s in shards if s.nsamples is None)
        raise UserError(
            f"loader.split=samples needs sample counts per shard and {first} has none: give an index JSON "
            f"(makeshards.py --index), or use loader.split=shards"
        )
    return [s if s.nsamples == n else replace(s, nsamples=n) for s, n in zip(shards, counts, strict=True)]
