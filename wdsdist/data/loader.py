"""The public loader: one rank's training batches from WebDataset shards, and its evaluation pass.

``Loader`` is what a training loop iterates, whether it is ours (train.py), a plain torchrun loop
(examples/ddp_loop.py) or PyTorch Lightning (wdsdist.lightning). It follows the protocol of
torchdata's ``StatefulDataLoader``: ``state_dict()`` before a checkpoint, ``load_state_dict()``
before the first ``iter()`` of a resumed run. Unlike a per-rank state, ours holds every rank's
position (gathered over ``torch.distributed``), because Lightning and most checkpointers write
rank 0's copy only, and because a resume on another number of ranks or workers needs all of them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from wdsdist.data.autos import decoded_on_cpu
from wdsdist.data.delivery.mixing import mix_config, resolve_sources
from wdsdist.data.delivery.pipeline import (
    RankLoader,
    check_decode,
    check_layout,
    counted_shards,
    expand_shards,
    make_eval_loader,
    planned_decoder,
    resumed,
)
from wdsdist.data.options import LoaderConfig, Source
from wdsdist.data.plan.restore import Resize, Restored
from wdsdist.data.plan.sequence import EpochShards
from wdsdist.data.plan.splits import Plan
from wdsdist.data.plan.state import LoaderState, RankState, gathered
from wdsdist.data.sources.shardspec import Shard
from wdsdist.errors import DataError, UserError

log = logging.getLogger(__name__)

ShardSpec = str | Sequence[str] | Sequence[Shard]
Transform = Callable[[torch.Tensor], torch.Tensor]


def dist_layout(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world): those given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None or world is None:
        initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
        found = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if initialised else (0, 1)
        rank = found[0] if rank is None else rank
        world = found[1] if world is None else world
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1} (world size {world})")
    return rank, world


class Loader:
    """One rank's training loader: iterate it for batches of uint8 images.

    Each batch is a dict: ``image`` (uint8, N x 3 x S x S, channels_last memory), ``label``
    (int64, N), ``id`` (int64, N x 3: epoch, worker, position in the worker's stream), ``pos``
    (int64, N: the position in the epoch's sample sequence with ``split=samples``, else -1),
    ``bad`` (int64, N x 2: the samples lost and shard reads failed before each row; a stand-in's
    row counts its own loss), ``bad_shards`` and ``bad_samples`` (their names), ``bad_errors`` (why
    each sample could not be used) and ``cache`` (int64, one per count: what
    the node cache, ``config.cache_dir``, did in the worker that made the batch since its previous
    one, named by ``CACHE_COUNTS``; sum them over batches, and over ranks, for a total). Convert
    and normalise on the device; the loader never makes float batches.

    With ``config.decode="gpu"`` the workers hand on each JPEG's bytes and drawn crop, and
    ``image`` is decoded here, on this process's current CUDA device, and lies there
    (``decode_counts`` says how many images took which path).

    In ``mode=epoch`` each ``iter()`` is one epoch of the same number of batches on every rank,
    and ``len()`` is that number, counted from the epoch's start (after a resume it includes the
    batches delivered before it, as a progress bar or Lightning counts them). In ``mode=repeat``
    (and ``resampled``) the batches never end and ``len()`` raises TypeError: count steps.

    ``shards``: a spec (``DIR``, an index JSON, a brace pattern, URLs) or Shard objects; or a
    list of ``Source`` for several data sets in one epoch, each read as its setting says
    (docs/several-datasets.md). Their batches also hold ``source`` (int64, N: each sample's
    source, its index in that list), and ``config.mix`` says how a batch mixes them.
    ``rank`` and ``world``: by default torch.distributed's (or 0 and 1 without it).
    ``transform``: applied in the worker to each training image after its crop, flip and
    ``config.augment``: takes and returns a uint8 3 x S x S tensor (for example
    ``torchvision.transforms.v2.ColorJitter``; its own random draws are not the sample's, so a
    resume draws them anew); it must be picklable where workers are spawned. ``group``: the process group for
    ``state_dict``'s gather (default: torch.distributed's). ``mark_taken``: count a batch as
    consumed only once ``taken(batch)`` is called (for a caller that fetches ahead of what it
    trains, as Lightning does for a loader without a length).

    Damaged data costs only itself: a sample that cannot be decoded, or one in a shard that cannot
    be read, is filled by a stand-in (a good sample of the same epoch, marked as padding in
    ``pos``, its loss counted in ``bad`` and named in ``bad_samples`` or ``bad_shards``), so
    every rank still delivers ``len()`` batches and a plain loop needs no call to stay in step.
    Past ``config.max_bad`` of a rank's samples in an epoch (or at the first loss with
    ``config.strict``) the rank stops: ``on_limit="raise"`` raises DataError naming the shards and
    samples; ``"mark"`` (for a trainer that stops every rank together) delivers the batch with that
    line in ``batch["past_limit"]`` instead.
    """

    def __init__(
        self,
        shards: ShardSpec | Sequence[Source],
        config: LoaderConfig,
        *,
        rank: int | None = None,
        world: int | None = None,
        transform: Transform | None = None,
        group: Any = None,
        mark_taken: bool = False,
        on_limit: str = "raise",
    ):
        if on_limit not in ("raise", "mark"):
            raise ValueError(f"on_limit must be 'raise' or 'mark', not {on_limit!r}")
        self.on_limit = on_limit
        self.rank, self.world = dist_layout(rank, world)
        check_decode(config)  # decode=gpu without CUDA: one line now
        if transform is not None and config.decode == "gpu" and config.decode_why is not None:
            config = decoded_on_cpu(config, "a transform runs in the workers on decoded images")
        if transform is not None and config.decode == "gpu":
            raise UserError(
                "loader.decode=gpu: a transform runs in the workers on decoded images, and under "
                "decode=gpu they decode none; apply it to batch['image'] on the GPU instead"
            )
        self.mix = None
        if isinstance(shards, (list, tuple)) and shards and isinstance(shards[0], Source):
            config = mix_config(config)
            self.shards, self.mix = resolve_sources(shards, config)  # type: ignore[arg-type]
        else:
            self.shards = counted_shards(expand_shards(shards, config), config.by_samples)  # type: ignore[arg-type]
        self.config = config
        self.plan: Plan | None = check_layout(self.shards, self.world, config, mix=self.mix)
        self.transform, self.group, self.mark_taken = transform, group, mark_taken
        self._restored: Restored | None = None  # where a resume starts (load_state_dict)
        self.steps = 0  # batches taken since the run began (carried across resumes)
        self._inner: RankLoader | None = None
        self._stream: Iterator[dict] | None = None  # repeat mode: one stream for every iter()
        self._held: deque[tuple[RankState, int]] = deque()  # mark_taken: (state before, steps before) per batch
        self._delivered = False  # a batch has left this loader (load_state_dict is too late then)

    # ------------------------------------------------------------ iteration

    @property
    def resize(self) -> Resize | None:
        """What an elastic ``load_state_dict`` did with the epoch under way (None: no re-split)."""
        return self._restored.resize if self._restored is not None else None

    def _loader(self) -> RankLoader:
        if self._inner is None:
            self._inner = RankLoader(
                self.shards, self.rank, self.world, self.config, self._restored, self.plan, self.transform, self.mix
            )
        return self._inner

    def __iter__(self) -> Iterator[dict]:
        inner = self._loader()
        if inner.epoch_batches is None:  # never ends: every iter() goes on with the one stream
            if self._stream is None:
                self._stream = iter(inner)
            return self._deliver(self._stream, inner)
        return self._deliver(iter(inner), inner)

    def _deliver(self, batches: Iterator[dict], inner: RankLoader) -> Iterator[dict]:
        while True:
            before = (inner.state(), self.steps) if self.mark_taken else None
            batch = next(batches, None)
            if batch is None:
                if inner.epoch_batches is None:
                    self._stream = None  # a stream that ended (its shards failed): the next iter() starts anew
                return
            if "past_limit" in batch and self.on_limit == "raise":
                raise DataError(batch["past_limit"])
            self.steps, self._delivered = self.steps + 1, True
            if before is not None:
                self._held.append(before)
            yield batch

    @property
    def decode_counts(self) -> dict[str, int]:
        """decode=gpu: training images decoded so far on the GPU (``gpu``), on the CPU (``cpu``: a
        PNG, a CMYK JPEG, one nvJPEG refused) and filled in their batch (``failed``: no decoder
        could); empty under decode=cpu."""
        decoder = self._inner.decoder if self._inner is not None else None
        return {k: decoder.counts[k] for k in ("gpu", "cpu", "failed")} if decoder is not None else {}

    @property
    def gpu_decoder(self) -> str | None:
        """decode=gpu: the JPEG decoder the training process will use, named (None under decode=cpu)."""
        return planned_decoder(self.config.gpu_decoder) if self.config.decode == "gpu" else None

    @property
    def decode_host(self) -> dict:
        """decode=gpu: which decoder makes the training images, and its host time per batch so
        far, in ms, by phase (the decode call, the resize's launch, the augmentations' launches,
        the hand-over) and the decode
        call's CPU time on its own thread (``decode_cpu_ms``; nvImageCodec's own threads are not
        in it); empty under decode=cpu or before the first batch."""
        decoder = self._inner.decoder if self._inner is not None else None
        if decoder is None or not decoder.host["batches"]:
            return {}
        n = decoder.host["batches"]
        keys = ("decode", "decode_cpu", "resize", "augment", "hand_over")
        phases = {f"{k}_ms": 1000 * decoder.host[k] / n for k in keys}
        return {"decoder": decoder.described, "batches": n, **phases}

    def reads(self) -> list[list[tuple[int, int, int, int]]]:
        """split=samples, one data set: what each of this rank's workers reads of the epoch under
        way, in its reading order, padding left out: runs ``(position, stop, shard, first)``, the
        epoch's positions [position, stop) being samples first.. of ``self.shards[shard]``. For a
        caller that files each sample by its shard (``batch["pos"]``, ``batch["id"][:, 1]`` the
        worker): predict.py's parts, one per input shard. Arithmetic only; no shard is read."""
        inner = self._loader()
        if self.mix is not None or not self.config.by_samples:
            raise TypeError("Loader.reads() needs split=samples and one data set")
        out, nworkers = [], max(int(self.config.workers), 1)
        for worker in range(nworkers):
            sequence, where, runs = inner.dataset.worker_runs(inner.tracker.epoch, worker, nworkers)
            assert isinstance(where, EpochShards)
            mine = []
            for a, b, tag in runs:
                if tag >= sequence.total:  # the padding: samples already read once
                    continue
                _, [pieces] = where.reads([(a, b, tag)])
                for shard, first, stop in pieces:
                    mine.append((a, a + stop - first, shard, first))
                    a += stop - first
            out.append(mine)
        return out

    def taken(self, batch: dict | None = None) -> None:
        """With ``mark_taken``: the oldest batch delivered and not yet taken is now consumed."""
        if self._held:
            self._held.popleft()

    def __len__(self) -> int:
        inner = self._loader()
        if inner.epoch_batches is None:
            raise TypeError(f"loader.mode={self.config.mode.value} has no length: its batches never end; count steps")
        epoch, done = inner.tracker.epoch, inner.tracker.batches
        if done >= inner.epoch_batches:  # the epoch under way is over: the next one's
            return inner.batches_of(epoch + 1) or 0
        return (inner.batches_of(epoch) or 0) + self._carried(epoch)

    def _carried(self, epoch: int) -> int:
        """Batches of ``epoch`` delivered before an elastic resume (0 for every other epoch): tied to
        the epoch, because a caller that stops after len() batches never ends the iterator."""
        restored = self._restored
        return restored.before_resume if restored is not None and epoch == restored.resume_epoch else 0

    @property
    def batches_per_epoch(self) -> int | None:
        """Epoch mode: the batches of a whole epoch on this layout (every rank the same); None in
        repeat and resampled mode."""
        return self._loader().plan_batches

    @property
    def batches_done(self) -> int:
        """The batches delivered of the epoch under way, counted as ``len()`` counts them."""
        inner = self._loader()
        if inner.epoch_batches is None:
            return inner.tracker.batches
        if inner.tracker.batches >= inner.epoch_batches:
            return 0
        return inner.tracker.batches + self._carried(inner.tracker.epoch)

    @property
    def epoch(self) -> int:
        """The epoch under way (epoch mode), or the newest one begun (repeat mode)."""
        inner = self._loader()
        if inner.epoch_batches is not None and inner.tracker.batches >= inner.epoch_batches:
            return inner.tracker.epoch + 1
        return inner.tracker.epoch

    def end_epoch(self) -> None:
        """Epoch mode: end the epoch under way now; the next ``iter()`` starts the next one. Not
        needed for damaged data, whose losses are filled so every rank delivers ``len()``
        batches; kept for a loop that stops an epoch early of its own accord."""
        self._loader().end_epoch()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Every rank's exact position (a collective when torch.distributed runs with more than
        one rank: call it on every rank), as state.LoaderState.to_dict writes it: small,
        picklable, JSON-friendly."""
        inner = self._loader()
        local, steps = self._held[0] if self._held else (inner.state(), self.steps)
        ranks: list[Any] = [None] * self.world
        mine = local.to_dict()
        if self.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_gather_object(ranks, mine, group=self.group)
        else:  # no process group: this rank's own (a same-layout resume of this rank only)
            ranks[self.rank] = mine
        return gathered(ranks, steps, self._carried(local.point.epoch))  # 0 once that epoch is over

    def load_state_dict(self, state: dict | list, where: str = "the loader state") -> None:
        """Resume from ``state_dict()``'s result (every rank's), before the first ``iter()``.

        What is checked and what each layout gets is restore.restore's: on the same ranks and
        workers the position is exact, batch for batch; on another layout, with
        ``split=samples``, the epoch under way is re-split exactly over the new layout (every
        sample of it once, plus the stated padding); in repeat or resampled mode with
        ``split=shards`` a fresh stream starts (reseeded: it does not replay the first
        batches), with a warning; other shards, other sources, another seed, and options that
        change what the positions mean are refused (UserError, one line). ``where`` names the
        checkpoint in messages. A list is taken as every rank's entries."""
        # Only a delivered batch makes it too late: a loader built (by len(), say) or already loaded
        # is rebuilt at the new position; Lightning loads the state the DataModule loaded before.
        if self._delivered:
            raise RuntimeError("load_state_dict() must come before the loader's first iter()")
        saved = LoaderState.from_dict(state, where)
        restored = resumed(saved, self.shards, self.rank, self.world, self.config, self.mix, where)
        self._restored, self.mix, self.steps = restored, restored.mix, restored.steps
        self._inner, self._stream = None, None
        if self.rank == 0:
            for level, line in restored.notes:
                log.log(level, "%s", line)


class EvalLoader:
    """This rank's share of an evaluation set: every sample exactly once across all ranks.

    Ranks may get different numbers of batches (no padding, nothing dropped), so evaluate without
    a collective per batch: sum the correct predictions and the samples on each rank, then
    all-reduce the sums once. Batches are as ``Loader``'s, resized and centre-cropped to
    ``config.image_size``; each ``iter()`` is one whole pass.
    """

    def __init__(self, shards: ShardSpec, config: LoaderConfig, *, rank: int | None = None, world: int | None = None):
        self.config = config
        self.rank, self.world = dist_layout(rank, world)
        self._loader = make_eval_loader(shards, self.rank, self.world, config)

    def __iter__(self) -> Iterator[dict]:
        return iter(self._loader)
