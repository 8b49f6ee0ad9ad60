"""A shard's samples as they are stored, for a tool that writes shards again (predict.py
--write-shards): read through the loader's sources, so any scheme, the node cache and the
retries apply as they do to the training stream."""

from __future__ import annotations

from collections.abc import Iterator

from wdsdist.data.options import LoaderConfig
from wdsdist.data.sources.opener import open_shard
from wdsdist.data.sources.retry import describe
from wdsdist.data.tar.tarread import tar_samples
from wdsdist.errors import DataError


def shard_samples(url: str, config: LoaderConfig) -> Iterator[dict]:
    """Every sample of the shard at ``url``, in order: ``{"__key__": key, suffix: bytes, ...}``
    with every member (none decoded). A member over ``config.max_member_bytes`` or a shard that
    cannot be read raises DataError naming the shard."""
    try:
        stream = open_shard(url, config.access)
    except Exception as exc:  # noqa: BLE001 (whatever the scheme raises: one line naming the shard)
        raise DataError(f"{url}: cannot read shard: {describe(exc)}") from None
    try:
        for sample in tar_samples(stream, url, None, config.max_member_bytes):
            bad = [k for k, v in sample.items() if not k.startswith("__") and not isinstance(v, bytes)]
            if bad:
                raise DataError(f"{url}: sample {sample['__key__']!r}: member {bad[0]} cannot be read whole")
            yield {k: v for k, v in sample.items() if k != "__url__"}
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 (a truncated or garbled tar, a dropped connection)
        raise DataError(f"{url}: cannot read shard: {describe(exc)}") from None
    finally:
        stream.close()
