"""One rank's loader, shared by train.py and simdist.py: its shards in, uint8 batches out.

One rank's loader, in order:
  shards[rank::world] -> shards[worker::nworkers] (in each DataLoader worker)
  -> shard order shuffled per epoch (seed + epoch: new every epoch, the same on every rank),
     read ``dsrepeat`` times
     (split=samples instead: all shards in the epoch's order as one sequence of samples, the
     rank's equal span of it, the worker's whole batches of that: splits.plan_samples)
  -> tar -> shuffle buffer of raw (compressed) samples
  -> decode -> augment -> batch inside the worker, into a shared buffer it reuses
  -> WebLoader(batch_size=None) -> the batch copied out (uint8 NCHW images, int64 labels)
  -> optional shuffle of samples across the rank's workers, then batched again
  -> epochless (each worker runs from epoch to epoch without stopping), or one epoch cut to
     ``nbatches``.
Every sample carries an id, so the loader knows exactly what was consumed (resume.py), and
with split=samples its position in the epoch's sample sequence (``batch["pos"]``).

What comes from WebDataset: ``wds.WebLoader`` (a DataLoader with ``compose``, ``batched`` and
``repeat`` stages) is the rank's loader; ``wds.filters.shuffle`` shuffles inside the workers;
``wds.gopen`` opens ``pipe:``, object-store and ``file:``
URLs; ``base_plus_ext`` groups tar members into samples, so WebDataset's shards read unchanged;
``wds.TarWriter`` writes shards (tools/shards.py). What is done here instead, and why (each measured
against what it replaced in bench/results/2026-11-21-loader.md):
  - splitting shards by rank and worker: pure functions (splits.py) that the startup check and
    simdist share, so a layout that would hang DDP is refused before it starts, with numbers;
  - tar reading (``tarfile`` in WebDataset): tarread.py parses the headers itself, several times
    faster, skipping unused members unread and refusing oversized ones (tarfile reads a member
    whole, so a small .tar.gz can hold one that takes gigabytes);
  - http(s) (``gopen`` runs curl in a shell): urllib (httpopen.py), so a URL cannot inject a
    command and a stalled or dripping server fails in bounded time;
  - ``decode("pil")``: torchvision's libjpeg-turbo into uint8, and only the crop's region of a
    JPEG (jpegcrop.py), faster than a whole decode and the same pixels;
  - ``wds.filters.batched`` in the workers: batches.batched, which hands a batch over as soon as
    its last row is made, not once the next batch's first is;
  - a new shared-memory tensor per batch: buffers each worker reuses (sharedbatches.py), so the
    kernel does not zero and fault in a batch's pages every time;
  - a worker stopping at each epoch's end: epochless workers, which do not idle while the
    DataLoader restarts them.
Together they make the loader several times as fast as the WebDataset README's pipeline ((a)
against (b) in that report; the later comparison with other loaders:
bench/results/2026-11-24-peers.md).
"""

# A long module: the diagram above, from a spec to a rank's batches, with the startup checks that
# refuse a layout before it hangs; a worker's own stream is stream.py, resuming plan/restore.py.

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import webdataset as wds

from wdsdist.data.decode import gpu, gpu_augment, jpegcrop
from wdsdist.data.decode.codecs import planned as planned_decoder  # noqa: F401 (the Loader names it)
from wdsdist.data.decode.gpu import Decoders
from wdsdist.data.decode.sample import eval_image
from wdsdist.data.delivery.batches import collate_samples, finish_batches, unbatch_samples
from wdsdist.data.delivery.fill import LossLimit
from wdsdist.data.delivery.gpubatches import decoded_ahead
from wdsdist.data.delivery.sharedbatches import SharedBatches
from wdsdist.data.delivery.stream import ShardStream
from wdsdist.data.delivery.workers import worker_init
from wdsdist.data.options import LoaderConfig, Split
from wdsdist.data.plan import seeds
from wdsdist.data.plan.mix import Mix, epoch_total
from wdsdist.data.plan.order import order_nodes, shuffled
from wdsdist.data.plan.restore import Restored, options_of, restore
from wdsdist.data.plan.resume import ConsumedTracker, ResumePoint
from wdsdist.data.plan.sequence import ranges_length
from wdsdist.data.plan.splits import Plan, plan, plan_samples, rank_batches, split_by_rank
from wdsdist.data.plan.state import LoaderState, MixState, RankState, counts_digest
from wdsdist.data.sources import cache, shardspec
from wdsdist.data.sources.resolve import counted_shards, known_counts, resolve_shards

__all__ = ["counted_shards", "expand_shards"]
from wdsdist.data.sources.shardspec import Shard
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- the rank's loader


class EpochShuffle:
    """The cross-worker shuffle: the loader's sample shuffle (order.shuffled), with a generator
    that changes every epoch (each iteration of the rank's loader)."""

    def __init__(self, bufsize: int, seed: int, rank: int):
        self.bufsize, self.seed, self.rank, self.epoch = bufsize, seed, rank, -1

    def __call__(self, source: Iterator) -> Iterator:
        self.epoch += 1
        return shuffled(source, self.bufsize, seeds.cross_shuffle(self.seed, self.rank, self.epoch))


class RankLoader:
    """One rank's loader: iterate it for batches; ``state`` is its exact position.

    In epoch mode each ``iter()`` is one epoch of ``plan.nbatches`` batches (every rank the
    same); in repeat and resampled mode ``iter()`` never ends and the trainer counts steps.
    ``restored``: where a resume starts (restore.restore's answer; None: at the beginning).
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        rank: int,
        world: int,
        cfg: LoaderConfig,
        restored: Restored | None = None,
        plan_: Plan | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mix: Mix | None = None,
    ):
        cfg = ready_config(cfg, rank)
        restored = restored or Restored()
        self.options = options_of(cfg)  # what the state records: the caller's, not a reseeded stream's
        self.stream_seed = restored.seed  # a reseeded stream's (split=shards, resumed on another layout)
        if restored.seed is not None:
            cfg = replace(cfg, seed=restored.seed)
        self.cfg, self.rank, self.world, self.plan, self.mix = cfg, rank, world, plan_, mix
        self.counts = [s.nsamples or 0 for s in shards] if cfg.by_samples else None
        self.nshards = len(shards)
        self.resize = restored.resize
        self.elastic = restored.elastic  # epochs re-split on resume: their positions still to deliver
        self.tracker = ConsumedTracker(restored.point.epoch if restored.point else 0)
        if restored.point is not None:
            self.tracker.load(restored.point, restored.batches)
        self.turn = restored.turn  # the worker whose batch comes next (the DataLoader's turn)
        # decode=gpu: batches of bytes, decoded on the device (decode/gpu.py)
        self.decoder = None
        if cfg.decode == "gpu":
            device = gpu.device()
            short = None if cfg.train else cfg.eval_crop[0]
            augment = None  # data.augment, data.random_erase: on the device after the resize
            if gpu_augment.wanted(cfg.augment, cfg.random_erase, cfg.train):
                augment = functools.partial(gpu_augment.BatchAugment, cfg.mean)
            threads, engine = cfg.gpu_decode_threads, cfg.gpu_decoder
            self.decoder = Decoders(threads, cfg.image_size, device, cfg.train, engine, short, augment)
        shared = None
        if cfg.workers > 0 and cfg.reuse_buffers and self.decoder is None:
            shape = (cfg.batch_size, 3, cfg.image_size, cfg.image_size)
            # Region-decoded images come out H x W x C in memory: batches keep that layout.
            shared = SharedBatches(cfg.workers, cfg.prefetch + 1, shape, channels_last=cfg.train and cfg.decode_region)
        # loader.warm_start: the other workers wait until worker 0's first batch is here (warmstart.py)
        warm = cfg.workers > 1 and cfg.warm_start and cfg.train and cfg.decode_region and self.decoder is None
        gate = multiprocessing.get_context().Event() if warm else None
        self.dataset = ShardStream(shards, rank, world, cfg, restored, shared, gate, transform, mix)
        self.loader = batch_stages(self.dataset, cfg, rank, shared, gate)
        self.plan_batches: int | None = None  # epoch mode: batches of a whole epoch (None: to the data's end)
        if cfg.mode == "epoch":
            self.plan_batches = plan_.ranks[rank].batches if plan_ is not None else None
        # Losses filled by stand-ins (fill.py), held to loader.max_bad per epoch
        self.limit = LossLimit(cfg, self._per_epoch()) if self.dataset.fills else None

    def _per_epoch(self) -> int | None:
        """A rank's samples in an epoch, where the counts are known: what it delivers (epoch mode),
        or all that its workers read in an epoch's pass (repeat mode: its span, padding included,
        or its shards, as many times as dsrepeat says)."""
        if self.plan_batches is not None:
            return self.plan_batches * self.cfg.batch_size
        if self.plan is None:
            return None
        mine = self.plan.ranks[self.rank]
        return max(mine.samples, mine.batches * self.cfg.batch_size)

    def total_of(self, epoch: int) -> int:
        """split=samples: the positions of ``epoch`` (N; padding is tagged N and up)."""
        return self.dataset.sequence(epoch)[0].total

    def batches_of(self, epoch: int) -> int | None:
        """Epoch mode: the batches every rank delivers in ``epoch`` (an elastic epoch's own count,
        and a mix's: its epochs' windows may differ by a sample per source)."""
        if self.plan_batches is None or (epoch not in self.elastic and self.mix is None):
            return self.plan_batches
        cfg = self.cfg
        total = ranges_length(self.elastic[epoch]) if epoch in self.elastic else epoch_total(self.mix, epoch)
        batches = rank_batches(total, self.world, cfg.batch_size, str(cfg.remainder))
        return min(batches, self.plan.nbatches) if self.plan and self.plan.nbatches is not None else batches

    @property
    def epoch_batches(self) -> int | None:
        """Epoch mode: the batches of the epoch under way (None: each pass runs to the data's end)."""
        return self.batches_of(self.tracker.epoch)

    def __iter__(self) -> Iterator[dict]:
        nworkers = max(self.cfg.workers, 1)
        batches = self._batches()
        try:
            if self.epoch_batches is None:
                for batch in batches:
                    self.tracker.update(batch["id"], batch.get("skipped"))
                    self.turn = (self.turn + 1) % nworkers
                    yield self._finished(batch)
                return
            if self.tracker.batches >= self.epoch_batches:
                self.tracker, self.turn = ConsumedTracker(self.tracker.epoch + 1), 0
            remaining = self.epoch_batches - self.tracker.batches
            for i, batch in enumerate(batches):
                self.tracker.update(batch["id"], batch.get("skipped"))
                self.turn = (self.turn + 1) % nworkers
                yield self._finished(batch)
                if i + 1 >= remaining:
                    break
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # decode=gpu: its thread stops before another iteration begins
                close()

    def _batches(self) -> Iterator[dict]:
        """The workers' batches; under decode=gpu with their images made on the device by a
        thread, a batch ahead (gpubatches.py)."""
        batches = iter(self.loader)
        if self.decoder is None:
            return batches
        # The first batch is taken here: the workers start on this thread, and the kernel ends
        # them with the thread that started them (workers.worker_init), not with the decoder's.
        first = next(batches, None)
        if first is None:
            return iter(())
        return decoded_ahead(itertools.chain([first], batches), self.decoder.pairs)

    def _finished(self, batch: dict) -> dict:
        """A batch as the caller gets it, once the tracker has counted every row it consumed:
        its sources (several data sets), under decode=gpu its images handed over to the caller's
        stream (a row no decoder could make filled), and ``past_limit`` where this epoch's losses
        passed loader.max_bad."""
        batch = self._with_sources(batch)
        if self.decoder is not None:
            batch = self.decoder.hand_over(batch, self.total_of if self.cfg.by_samples else None)
        if self.limit is not None and (past := self.limit.add(batch)):
            batch["past_limit"] = f"rank {self.rank}: {past}"
        return batch

    def _with_sources(self, batch: dict) -> dict:
        """Several data sets: ``batch["source"]``, each sample's source (its index in the mix),
        from its epoch and position."""
        if self.mix is not None:
            epochs, pos = batch["id"][:, 0], batch["pos"]
            source = torch.empty_like(pos)
            for epoch in epochs.unique().tolist():
                rows = epochs == epoch
                source[rows] = torch.from_numpy(self.dataset.mix_epoch(epoch).sources(pos[rows].numpy())).long()
            batch["source"] = source
        return batch

    def end_epoch(self) -> None:
        """Epoch mode: end this epoch here, before its planned length (another rank ran out after
        skipping bad data, and ranks must stay in step); the next ``iter()`` starts the next one."""
        if self.epoch_batches is not None:
            self.tracker, self.turn = ConsumedTracker(self.tracker.epoch + 1), 0

    def state(self) -> RankState:
        """The loader's exact position and what it means (state.RankState)."""
        point, batches, turn = self.tracker.point(), self.tracker.batches, self.turn
        if self.epoch_batches is not None and batches >= self.epoch_batches:
            point, batches, turn = ResumePoint(point.epoch + 1), 0, 0
        # Repeat mode: once every worker stands in a later epoch, the ones before it are over for
        # all of them, and a resume (on this layout or another) starts there.
        opened = [e for epochs in point.workers.values() for e in epochs]
        if len(point.workers) >= max(self.cfg.workers, 1) and min(opened) > point.epoch:
            point = ResumePoint(min(opened), point.workers, point.runs)
        data: dict = {"shards": self.nshards}
        if self.counts is not None:
            data |= {"samples": sum(self.counts), "counts": counts_digest(self.counts), "order": self.dataset.order}
            # An epoch re-split on resume stays as long as a worker may still stand in it.
            data["elastic"] = {e: r for e, r in self.elastic.items() if e >= point.epoch}
            data["orders"] = {e: o for e, o in self.dataset.orders.items() if e >= point.epoch}
        if self.mix is not None:
            data["mix"] = MixState(self.mix.digest(), self.mix.describe(), self.mix.spec())
        data["stream_seed"] = self.stream_seed
        return RankState(self.rank, self.world, self.cfg.workers, point, batches, turn, **self.options, **data)

    def state_dict(self) -> dict:
        """``state()`` as a small, JSON-friendly dict (this rank's entry of a loader state)."""
        return self.state().to_dict()


def ready_config(cfg: LoaderConfig, rank: int) -> LoaderConfig:
    """The config with what this machine cannot do turned off, said once per rank: region decode
    without the jpegcrop library (built here, once, before the workers start), and a cache folder
    that cannot be used. The folder is made ready here, so the workers share its limit."""
    if cfg.train and cfg.decode_region:
        lib = jpegcrop.load()
        if isinstance(lib, str):
            if rank == 0:
                log.info("%s; decoding whole JPEGs (slower)", lib)
            cfg = replace(cfg, decode_region=False)
    check_decode(cfg)
    if cfg.cache_dir is not None:
        limit = cache.prepare(cfg.cache_dir, cfg.cache_limit)
        cfg = replace(cfg, cache_dir=None if limit is None else cfg.cache_dir, cache_limit=limit)
    return cfg


def check_decode(cfg: LoaderConfig) -> None:
    """decode=gpu where torch sees no CUDA GPU: UserError, one line, before any worker starts."""
    if cfg.decode == "gpu":
        gpu.device()


def batch_stages(
    dataset: ShardStream, cfg: LoaderConfig, rank: int, shared: SharedBatches | None, gate: Any | None
) -> wds.WebLoader:
    """The rank's DataLoader over its stream, and what the main process does to each batch: the
    cross-worker shuffle and re-batching, or finishing the workers' batches; repeated without
    end outside epoch mode."""
    nw = cfg.workers
    loader = wds.WebLoader(
        dataset,
        batch_size=None,
        num_workers=nw,
        persistent_workers=nw > 0,
        prefetch_factor=cfg.prefetch if nw > 0 else None,
        # With shared buffers, the batches are copied into pinned memory as they are claimed.
        # decode=gpu: the batches hold bytes, which nvJPEG reads from any host memory.
        pin_memory=cfg.pin_memory and shared is None and not cfg.rebatch and cfg.decode != "gpu",
        worker_init_fn=worker_init if nw > 0 else None,
        collate_fn=as_is,
    )
    if cfg.rebatch:
        loader = loader.compose(functools.partial(unbatch_samples, shared=shared, gate=gate))
        loader = loader.compose(EpochShuffle(cfg.cross_shuffle, cfg.seed, rank))
        collation = functools.partial(collate_samples, pin_memory=cfg.pin_memory)
        loader = loader.batched(cfg.batch_size, collation_fn=collation, partial=cfg.partial)
    else:
        finish = functools.partial(finish_batches, shared=shared, pin_memory=cfg.pin_memory, gate=gate)
        loader = loader.compose(finish)
    return loader if cfg.mode == "epoch" else loader.repeat()


# ---------------------------------------------------------------- startup: plan and check


def as_is(batch: dict) -> dict:
    """The DataLoader's collate_fn: a batch leaves the worker as collate made it. Without it
    (batch_size=None) the DataLoader runs default_convert on every batch, which walks each of its
    lists item by item, to change nothing but tuples into lists (its cost:
    bench/results/2026-11-23-batch-handover.md)."""
    return batch


def check_layout(
    shards: Sequence[Shard], world: int, cfg: LoaderConfig, *, equal: bool = True, mix: Mix | None = None
) -> Plan | None:
    """Plan the layout and refuse, with numbers and a fix, one that would hang or starve a rank.

    Returns the plan when sample counts are known (always in epoch mode), else None. With a
    mix, the plan is of its first epoch's sequence (later ones differ by a sample per source at most).
    """
    nw = max(cfg.workers, 1)
    if cfg.mode == "resampled":
        return None
    if cfg.by_samples:
        order_nodes(cfg.shard_order, world, cfg.node_ranks)  # whole nodes, or refused in one line
        counts = [epoch_total(mix, 0)] if mix is not None else [s.nsamples or 0 for s in counted_shards(shards, True)]
        p = plan_samples(
            counts,
            world,
            nw,
            cfg.batch_size,
            remainder=cfg.remainder,
            rebatch=cfg.rebatch,
            nbatches=cfg.nbatches,
        )
        problems = p.problems()
        if problems:
            raise UserError(problems[0])
        return p
    epoch_mode = cfg.mode == "epoch"
    counts = known_counts(shards, count_local=epoch_mode)
    if counts is None:
        if epoch_mode:
            raise UserError(
                "epoch mode needs sample counts per shard: give an index JSON (makeshards.py --index) "
                "or use loader.mode=repeat"
            )
        structural = plan([1] * len(shards), world, nw, 1)
        problems = structural.problems(epoch_mode=False)
        if problems:
            raise UserError(problems[0])
        return None
    p = plan(
        counts,
        world,
        nw,
        cfg.batch_size,
        partial=cfg.partial,
        dsrepeat=cfg.dsrepeat,
        rebatch=cfg.rebatch,
        nbatches=cfg.nbatches,
    )
    problems = p.problems(epoch_mode=epoch_mode and equal)
    if problems:
        raise UserError(problems[0])
    if epoch_mode and equal and p.batches[0] == 0:
        raise UserError(f"every rank delivers 0 batches of {cfg.batch_size}: use a smaller batch size")
    return p


def expand_shards(spec: str | Sequence[str] | Sequence[Shard], cfg: LoaderConfig) -> list[Shard]:
    """The shards a spec names, checked (sources/resolve.py), as the loader's config says: what may
    be read (``cfg.access``) and whether a missing local shard is an error (``cfg.strict``)."""
    return resolve_shards(spec, cfg.access, strict=cfg.strict)


def decode_eval(data: bytes, cfg: LoaderConfig, where: str = "image") -> torch.Tensor:
    """One image's bytes as the evaluation loader makes them (decode, resize the shorter side and
    centre-crop: ``cfg.eval_crop``, by default round(size / 0.875) and ``cfg.image_size``): uint8
    3 x size x size. DataError naming ``where`` when it cannot be decoded. What predict.py feeds a model."""
    return eval_image(bytes(data), replace(cfg, train=False), where)


def index_classes(spec: str, cfg: LoaderConfig) -> list[str] | None:
    """The class names a shard index lists (label i is ``classes[i]``); None where the spec is not
    one index or its index lists none."""
    return shardspec.spec_classes(spec, cfg.access) if isinstance(spec, str) else None


def resumed(
    state: LoaderState,
    shards: Sequence[Shard],
    rank: int,
    world: int,
    cfg: LoaderConfig,
    mix: Mix | None = None,
    where: str = "the loader state",
) -> Restored:
    """restore.restore for these shards (their counts, where split=samples has them)."""
    counts = [s.nsamples or 0 for s in shards] if cfg.by_samples else shardspec.sample_counts(shards)
    return restore(state, rank, world, cfg, counts, len(shards), mix, where)


def make_loader(
    spec: str | Sequence[str] | Sequence[Shard],
    rank: int,
    world: int,
    cfg: LoaderConfig,
    state: dict | list | None = None,
    where: str = "the loader state",
) -> RankLoader:
    """Expand the spec, check the layout, and build rank ``rank``'s loader, resumed from ``state``
    (what state.LoaderState.from_dict reads: every rank's entries, or one rank's alone)."""
    shards = counted_shards(expand_shards(spec, cfg), cfg.by_samples)
    p = check_layout(shards, world, cfg)
    restored = None
    if state is not None:
        restored = resumed(LoaderState.from_dict(state, where), shards, rank, world, cfg, where=where)
    return RankLoader(shards, rank, world, cfg, restored, p)


def make_eval_loader(
    spec: str | Sequence[str] | Sequence[Shard], rank: int, world: int, cfg: LoaderConfig
) -> RankLoader | list:
    """One pass over this rank's share of the evaluation shards, every sample exactly once.

    Ranks may hold different numbers of samples (the caller all-reduces sums, not batches);
    a rank with fewer shards than workers uses fewer workers, one with none yields nothing.
    """
    shards = expand_shards(spec, cfg)
    mine = len(split_by_rank(shards, rank, world))
    if mine == 0:
        return []
    resize, crop = cfg.eval_crop
    ecfg = replace(
        cfg,
        image_size=crop,
        eval_size=crop,
        eval_resize=resize,
        size_schedule=(),
        mode="epoch",
        split=Split.shards,  # every sample once, no padding: ranks may differ (sums are all-reduced)
        shard_order="global",  # whole shards per rank: no sample sequence to keep per node
        train=False,
        partial=True,
        nbatches=None,
        dsrepeat=1,
        cross_shuffle=0,
        shuffle_buffer=0,
        workers=min(int(cfg.workers), mine),  # decode=gpu: they read, the GPU decodes, as in training
        reuse_buffers=False,  # passes are short and far apart: no shared memory held between them
    )
    # Epoch mode without a plan: each iter() is one whole pass, so no sample counts are needed
    # (and no shard is opened at startup to count them).
    return RankLoader(shards, rank, world, ecfg)
