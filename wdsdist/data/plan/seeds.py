"""Every random draw of the loader's orders, seeded here and nowhere else.

Each generator is a ``random.Random`` seeded by a string of the run's seed and what the draw is
for (a sample's draws: torch's generator, seeded by a hash of such a string). The strings are
part of the saved state's meaning: a resume (on the same layout or another) replays the orders
an epoch was read in, so changing one breaks every checkpoint written before it. They are kept
as they were when first written.
"""

from __future__ import annotations

import hashlib
import random


def epoch_order(seed: int, epoch: int) -> random.Random:
    """The epoch's shard order (split=samples), and a worker's shards each epoch (split=shards)."""
    return random.Random(f"{seed}:{epoch}")


def node_blocks(seed: int, nodes: int) -> random.Random:
    """Which shards each node keeps (loader.shard_order=node): fixed for a node count."""
    return random.Random(f"{seed}:nodes:{nodes}")


def sample_shuffle(seed: int, epoch: int, rank: int, worker: int, number: int = 0) -> random.Random:
    """A worker's shuffle buffer in ``epoch`` (``number``: the pass, with dsrepeat)."""
    return random.Random(f"{seed}:{epoch}:{rank}:{worker}:{number}:samples")


def resampled(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    """loader.mode=resampled: a worker's shards, drawn with replacement."""
    return random.Random(f"{seed}:{epoch}:{rank}:{worker}")


def cross_shuffle(seed: int, rank: int, epoch: int) -> random.Random:
    """loader.cross_shuffle: the shuffle across a rank's workers, in its ``epoch``-th iteration."""
    return random.Random(f"{seed}:{rank}:cross:{epoch}")


def source_pass(seed: int, source: str, number: int) -> random.Random:
    """Several data sets: pass ``number`` of a source's stream (its shards' order)."""
    return random.Random(f"{seed}:{source}:pass:{number}")


def sample_draws(seed: int, epoch: int, tag: int | tuple[int, ...]) -> int:
    """The seed of one training sample's random draws (its crop, flip and augmentations): torch's
    generator is seeded with it before the sample's draws, so they depend on the sample alone,
    not on the worker or the samples before it. ``tag``: its position in the epoch's sample
    sequence (split=samples: the same on any layout, so an elastic resume draws the same), else
    (rank, worker, seq), which a resume on its own layout replays."""
    # blake2b of the string, not random.Random's seeding (sha512 and a state): a tenth of its cost,
    # paid once per sample in the worker's hot path
    digest = hashlib.blake2b(f"{seed}:{epoch}:{tag}:draws".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_fill(seed: int, epoch: int, position: int) -> int:
    """split=samples: where the stand-in for a lost sample at ``position`` of ``epoch`` is sought
    (delivery/fill.py), taken mod the epoch's length: a function of the loss alone, so any layout
    and any resume choose the same one."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{position}:fill".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
