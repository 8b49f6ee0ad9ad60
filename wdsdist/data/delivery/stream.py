"""One rank's stream inside each of its DataLoader workers: the worker's shards in a new order
every epoch, read, shuffled, decoded and batched (the first half of pipeline.py's diagram).

With loader.split=samples a worker reads its span of the epoch's sample sequence instead
(sequence.EpochSequence: the epoch's positions, or those an elastic resume left of it, padded to
equal batches), each position through the epoch's order of shards (sequence.EpochShards; with
loader.shard_order=node each node's own samples, order.node_parts, one stretch after another)
or, for several data sets, the mix's sources (mix.MixEpoch), starting and stopping mid-shard
through spanread.read_span. Every sample's id then carries its tag (``batch["pos"]``): its
position in the epoch, plus N where it is padding (the sample at position tag mod N again).

After a resume each worker plays the part of the worker whose turn it was (``turn``): the
DataLoader asks its worker 0 first, and the uninterrupted run would have asked that one.
"""

# A long module: ShardStream is one worker's whole stream; its reading, shuffling and batching
# share the worker's position (consumed, skipped, padded), which the state reads back.

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from wdsdist.data.delivery import steps
from wdsdist.data.delivery.batches import batched, collate
from wdsdist.data.delivery.fill import LastGood, PositionStand, lost_name
from wdsdist.data.delivery.prep import SamplePrep
from wdsdist.data.delivery.sharedbatches import SharedBatches
from wdsdist.data.delivery.steps import FAILED, POSITION
from wdsdist.data.delivery.stratified import quotas, stratified
from wdsdist.data.delivery.warmstart import WarmStart, threads_for
from wdsdist.data.delivery.workers import pin_malloc_threshold, warn_skip
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan import seeds
from wdsdist.data.plan.mix import Mix, MixEpoch
from wdsdist.data.plan.order import GLOBAL, NodeOrder, Part, epoch_order, node_order, node_parts, shard_order, shuffled
from wdsdist.data.plan.restore import Restored
from wdsdist.data.plan.sequence import EpochSequence, EpochShards, Piece, tags
from wdsdist.data.plan.splits import Layout, split_by_rank, split_by_worker
from wdsdist.data.sources.ahead import ReadAhead
from wdsdist.data.sources.cachefiles import Span
from wdsdist.data.sources.opener import open_shard
from wdsdist.data.sources.retry import StoreDown, describe
from wdsdist.data.sources.shardspec import Shard
from wdsdist.data.sources.spanread import part_span, read_span
from wdsdist.data.tar.tarread import tar_samples
from wdsdist.errors import DataError

log = logging.getLogger(__name__)


def _whole(piece: Piece) -> None:
    """A piece of a mix's source: its shard's cache entry is the whole shard."""
    return None


def transformed(transform: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor, sample: dict):
    """The caller's transform of one image; what it returns must fit the batch's buffer (the
    image's shape). An error in it is the caller's code, not bad data: it is raised, with the
    sample named."""
    size = image.shape[-1]
    try:
        out = transform(image)
    except Exception as exc:
        exc.add_note(f"in the loader's transform, on {sample.get('__url__')}: sample {sample.get('__key__')!r}")
        raise
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (3, size, size):
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(
            f"the loader's transform must return a uint8 tensor of shape (3, {size}, {size}); it returned a {got}"
        )
    return out


class ShardStream(IterableDataset):
    """One rank's stream: splits, shuffles, reads, decodes and batches inside each worker."""

    def __init__(
        self,
        shards: Sequence[Shard],
        rank: int,
        world: int,
        cfg: LoaderConfig,
        restored: Restored | None = None,
        shared: SharedBatches | None = None,
        gate: Any | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mix: Mix | None = None,
    ):
        super().__init__()
        self.all_shards = list(shards)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.rank_shards = split_by_rank(self.all_shards, rank, world)
        if cfg.by_samples and any(s.nsamples is None for s in self.all_shards):
            first = next(s.url for s in self.all_shards if s.nsamples is None)
            raise DataError(f"loader.split=samples needs every shard's sample count, and {first} has none")
        restored = restored or Restored()
        self.resume = restored.point  # where each worker stands, for its first iter() only
        # The DataLoader takes batches from its workers in turn, from its worker 0: after a
        # resume the worker whose turn it was plays worker 0's part (every worker's role moves
        # by ``turn``), for the resumed iteration: the whole run in repeat mode, one epoch in epoch mode.
        self.turn = restored.turn
        self.start = restored.steps  # the batches the run had taken when this stream began (prep.py)
        self.elastic = restored.elastic  # split=samples: epoch -> its positions still to deliver (resumed elsewhere)
        self.epoch = -1  # the last epoch begun, in each worker
        self.shared = shared  # used in DataLoader workers only
        self.gate = gate  # loader.warm_start: set when worker 0's first batch is made (warmstart.py)
        self.warmed = False  # in each worker: its first batch was begun
        self.transform = transform  # the caller's, on each training image after its crop and flip
        # split=samples: the nodes the epoch's order keeps blocks for (order.node_order), and
        # epoch -> those of the layout an epoch in flight began on (resumed on another one)
        self.order = GLOBAL
        if cfg.by_samples:
            total = sum(s.nsamples or 0 for s in self.all_shards)
            self.order = node_order(cfg.shard_order, total, world, cfg.node_ranks, cfg.batch_size, cfg.remainder)
        self.orders = restored.orders
        self.blocks: dict[NodeOrder, tuple[tuple[Part, ...], ...]] = {}  # made once per order
        self.mix = mix  # several data sets (plan/mix.py): the epoch's sequence interleaves their windows
        self.mixed: MixEpoch | None = None  # the last epoch's, in each worker
        # loader.mix=stratified, in each worker: epoch -> each source's rows in each batch of its span
        self.stripes: dict[int, list[list[int]]] = {}
        # Equal batches: each lost sample gets a stand-in row (fill.py); with partial batches
        # (prediction, evaluation) a loss is only skipped.
        self.fills = not cfg.partial and cfg.mode != "resampled"
        self.counts = {s.url: s.nsamples for s in self.all_shards}  # split=shards: the placeholders' count
        self.failed: set[str] = set()  # in each worker: shards whose read failed (no stand-in is sought there)
        self.last_failure = ""  # in each worker: the last shard read or sample that failed, as warned

    def mix_epoch(self, epoch: int) -> MixEpoch:
        """The mix's epoch ``epoch`` (kept while it is the one read)."""
        if self.mixed is None or self.mixed.epoch != epoch:
            self.mixed = MixEpoch(self.mix, self.cfg.seed, epoch, self.cfg.batch_size)  # type: ignore[arg-type]
        return self.mixed

    def _passes(self, worker: int, nworkers: int, epoch: int) -> list[Iterable[str]]:
        """The worker's shard URLs for this epoch, one list per pass (``dsrepeat`` passes)."""
        cfg = self.cfg
        if cfg.mode == "resampled":
            rng = seeds.resampled(cfg.seed, epoch, self.rank, worker)
            return [(rng.choice(self.all_shards).url for _ in itertools.count())]
        mine = split_by_worker(self.rank_shards, worker, nworkers)
        if not mine:
            raise DataError(f"rank {self.rank} worker {worker} of {nworkers} has no shard")
        order = [s.url for s in shard_order(mine, cfg.seed, epoch, cfg.dsrepeat)]
        return [order[k * len(mine) : (k + 1) * len(mine)] for k in range(cfg.dsrepeat)]

    def sequence(self, epoch: int) -> tuple[EpochSequence, EpochShards | MixEpoch]:
        """The epoch's sequence as this rank's layout reads it, and where its positions read from:
        one data set's shards in the epoch's order, or the mix's sources."""
        if self.mix is not None:
            mixed = self.mix_epoch(epoch)
            return EpochSequence.of(mixed.total, self.elastic.get(epoch), mixed.padding), mixed
        counts = [s.nsamples or 0 for s in self.all_shards]
        key = self.orders.get(epoch, self.order)
        if key not in self.blocks:
            self.blocks[key] = node_parts(counts, key, self.cfg.seed)
        shards = EpochShards(counts, epoch_order(self.blocks[key], self.cfg.seed, epoch))
        return EpochSequence.of(shards.total, self.elastic.get(epoch), order=key), shards

    def worker_runs(self, epoch: int, worker: int, nworkers: int) -> tuple[EpochSequence, Any, list]:
        """split=samples: the epoch's sequence, where its positions read from (``sequence``), and
        the runs of positions this worker reads, in order: the one split every reader of the
        worker's span uses (the stream, and Loader.reads for prediction's filing)."""
        cfg = self.cfg
        sequence, where = self.sequence(epoch)
        layout = Layout(self.world, nworkers, cfg.batch_size, str(cfg.remainder))
        return sequence, where, sequence.runs(*sequence.span(layout, self.rank, worker))

    def _span(self, worker: int, nworkers: int, epoch: int, bad: list) -> Iterator[dict]:
        """split=samples: the raw samples of this worker's span of the epoch's sequence, in order,
        each marked with its tag (its position; plus N for the padding); a position its read did
        not deliver (the shard failed, or held fewer samples than its count) comes as a FAILED
        placeholder. Each source is read shard after shard by a reader of its own, so a worker
        holds one shard open per source."""
        cfg = self.cfg
        sequence, where, runs = self.worker_runs(epoch, worker, nworkers)
        if cfg.partial:  # batches may be short: no padding to read (nor to decode and drop)
            runs = [run for run in runs if run[2] < sequence.total]
        sources, pieces = where.reads(runs)
        if sources is not None and cfg.mix == "stratified":
            self._stripe(epoch, sources, whole=epoch not in self.elastic)
        part_of = where.part_of if isinstance(where, EpochShards) else _whole
        readers = [self._source_samples(p, worker, bad, part_of) for p in pieces]
        which = itertools.repeat(0) if sources is None else sources.tolist()
        for tag, source in zip(tags(runs), which, strict=False):  # which: endless for one source
            sample = next(readers[source])
            sample[POSITION] = tag
            yield sample

    def _stripe(self, epoch: int, sources: np.ndarray, whole: bool) -> None:
        """loader.mix=stratified: each source's rows in each batch of this worker's span."""
        width, size = len(self.mix.sources), self.cfg.batch_size  # type: ignore[union-attr]
        # kept for the epoch before too: its batches may still be made as this one is read
        self.stripes = {e: plan for e, plan in self.stripes.items() if e == epoch - 1}
        if whole:  # whole batches of the sequence: its stretches
            batches = sources[: len(sources) // size * size].reshape(-1, size)
            self.stripes[epoch] = [np.bincount(b, minlength=width).tolist() for b in batches]
        else:  # a re-split epoch's batches are not stretches: the worker's own shares, rounded
            shares = (np.bincount(sources, minlength=width) / max(len(sources), 1)).tolist()
            carry = [0.0] * width
            self.stripes[epoch] = [quotas(shares, carry, size) for _ in range(len(sources) // size)]

    def _source_samples(
        self, pieces: list[Piece], worker: int, bad: list, part_of: Callable[[Piece], tuple[int, int] | None]
    ) -> Iterator[dict]:
        """One source's samples of these (shard, first, stop) pieces, a FAILED placeholder for each
        that its read did not deliver. ``part_of``: the part of its shard a piece lies in, where
        the node cache keeps that part alone (EpochShards.part_of)."""
        shards = self.all_shards

        def target(piece: Piece) -> tuple[str, Span | None]:
            return shards[piece[0]].url, part_span(shards[piece[0]], part_of(piece))

        ahead = ReadAhead(pieces, target, self.cfg.access, self.cfg.cache_ahead)
        for piece in ahead:
            index, first, last = piece
            shard = shards[index]
            got, read = 0, functools.partial(self._read_piece, shard, first, last, part_of(piece))
            for sample in self._read_guarded(shard.url, read, worker, bad, ahead.opened):
                got += 1
                yield sample
            for _ in range(got, last - first):
                yield {FAILED: True}

    def _read_piece(self, shard: Shard, first: int, last: int, part: tuple[int, int] | None) -> Iterator[dict]:
        """Samples first..last-1 of a shard (in ``part`` of it: read_span's); one that ends before
        ``last`` fails (its count was wrong)."""
        cfg = self.cfg
        got = 0
        wanted, limit = cfg.wanted_suffixes, cfg.max_member_bytes
        for sample in read_span(shard, first, last, cfg.access, wanted, limit, late=cfg.read_late, part=part):
            got += 1
            yield sample
        if got < last - first:
            raise DataError(f"it ends at sample {first + got}, and its count says {shard.nsamples} (a stale index?)")

    def _samples(self, worker: int, nworkers: int, epoch: int, bad: list[int]) -> Iterator[dict]:
        """Raw samples, shuffled within each pass: with dsrepeat, a worker shows every sample
        once before it shows any a second time."""
        cfg = self.cfg
        if cfg.by_samples:
            passes: list = [None]
        else:
            passes = self._passes(worker, nworkers, epoch)
        for k, urls in enumerate(passes):
            if urls is None:
                samples = self._span(worker, nworkers, epoch, bad)
            else:
                samples = self._raw_samples(urls, worker, bad)
            rng = seeds.sample_shuffle(cfg.seed, epoch, self.rank, worker, k)
            yield from shuffled(samples, cfg.shuffle_buffer, rng)

    def _raw_samples(self, urls: Iterable[str], worker: int, bad: list[int]) -> Iterator[dict]:
        """Raw samples of these shards; a shard that fails is skipped, counted in ``bad[1]`` and
        its URL appended to ``bad`` (or raises DataError in strict mode). Where stand-ins fill
        losses and the shard's count is known, a FAILED placeholder follows for each sample of
        its count that the read did not deliver."""
        ahead = ReadAhead(urls, lambda url: (url, None), self.cfg.access, self.cfg.cache_ahead)
        for url in ahead:
            got = 0
            for sample in self._read_guarded(url, functools.partial(self._read_whole, url), worker, bad, ahead.opened):
                got += 1
                yield sample
            if self.fills:
                for _ in range(got, self.counts.get(url) or 0):
                    yield {FAILED: True}

    def _read_whole(self, url: str) -> Iterator[dict]:
        stream = open_shard(url, self.cfg.access)
        try:
            yield from tar_samples(
                stream, url, self.cfg.wanted_suffixes, self.cfg.max_member_bytes, late=self.cfg.read_late
            )
        finally:
            stream.close()

    def _read_guarded(
        self, url: str, read: Callable[[], Iterator[dict]], worker: int, bad: list, opened: Callable[[], None]
    ) -> Iterator[dict]:
        """The samples ``read()`` gives of one shard; a failure is skipped and counted, as above,
        but for a store that is down (retry.StoreDown), which raises DataError in any mode.
        ``opened()`` is called once the shard is open (its first sample read) or has failed:
        read-ahead starts on the next shards then, not against this one."""
        if self.cfg.trace:
            log.debug("rank %d worker %d open  %s", self.rank, worker, url)
        try:
            yield from steps.opening(read(), opened)
        except StoreDown as exc:
            # Not a bad shard: every shard on that server would fail alike, each after the whole
            # wait. The run ends with one line naming the server, strict or not.
            raise DataError(str(exc)) from None
        except Exception as exc:
            error = DataError(f"{url}: cannot read shard: {describe(exc)}")
            if self.cfg.strict and not self.fills:
                raise error from None
            warn_skip(error)
            bad[1] += 1
            bad.append(url)
            self.failed.add(url)
            self.last_failure = str(error)
        if self.cfg.trace:
            log.debug("rank %d worker %d close %s", self.rank, worker, url)

    def __iter__(self) -> Iterator[dict]:
        """In epoch mode (and with the cross-worker shuffle), one epoch; in repeat and resampled
        mode, epoch after epoch without end. A worker that stopped at each epoch's end would
        decode the samples of its last, partial batch only to drop them and then sit idle while
        the DataLoader restarts it (bench/results/2026-11-21-loader.md)."""
        pin_malloc_threshold()
        info = get_worker_info()
        physical, nworkers = (info.id, info.num_workers) if info else (0, 1)
        worker = (physical + self.turn) % nworkers  # whose stream it reads (the turn, __init__)
        self.turn = 0
        cfg = self.cfg
        partial, skips, runs = cfg.partial, {}, {}
        if self.resume is not None:
            self.epoch = self.resume.first_epoch(worker) - 1
            skips, runs = self.resume.workers.get(worker, {}), self.resume.runs.get(worker, {})
            # Re-batched ranks keep every remaining sample so the epoch's count still holds.
            partial = partial or cfg.rebatch
            self.resume = None
        # each sample's draws from its own seed, at its batch's size (prep.py)
        prep = SamplePrep(cfg, self.rank, physical, nworkers, self.start, in_worker=info is not None)
        shared = self.shared if info else None
        if shared is not None:
            shared.restart(physical)
        collation = functools.partial(collate, shared=shared, worker=physical)
        # The worker's first batch only (a persistent worker's later epochs start as they are).
        warm_rows = cfg.batch_size if cfg.warm_start and prep.regions and not self.warmed else 0
        self.warmed = True
        warm = WarmStart(self.gate, leader=physical == 0, rows=warm_rows, threads=threads_for(nworkers))
        if shared is not None:
            warm.ahead(functools.partial(shared.populate, physical))  # the first batch's buffer, while it decodes
        rows = self._rows(worker, nworkers, skips, prep, runs, warm)
        if info is not None:
            rows = steps.primed(rows)
        if self.mix is not None and cfg.mix == "stratified":
            made = {epoch: (start + len(skip)) // cfg.batch_size for epoch, (start, skip) in skips.items()}
            cap = 4 * cfg.batch_size + cfg.shuffle_buffer
            return stratified(rows, self, cfg.batch_size, collation, partial, cap, made)
        return batched(rows, cfg.batch_size, collation, partial)

    def _stand(self, epoch: int, prepare: Callable) -> PositionStand | LastGood | None:
        """What stands in for a lost sample this epoch (fill.py); None: losses are skipped."""
        if not self.fills:
            return None
        if not self.cfg.by_samples:
            return LastGood(prepare)
        return PositionStand(self.all_shards, self.cfg, epoch, self.sequence(epoch)[1], prepare)

    def _made(
        self, seq: int, sample: dict, done: Any, stand: Any, bad: list, skipped: list, epoch: int
    ) -> Sequence[tuple[Any, dict, int]]:
        """The rows one sample of the stream makes, as (prepared, sample, seq): itself; for a loss,
        its stand-in (none without stand-ins: the loss is skipped, a run for the tracker); and
        under split=shards, after the first good sample, the stand-ins that waited for it. (A
        tuple, not a generator: this runs once per sample.)"""
        if done is not FAILED and not isinstance(done, DataError):
            if isinstance(stand, LastGood) and (stand.last is None or stand.waiting):
                return ((done, sample, seq), *stand.good(sample, seq))
            if isinstance(stand, LastGood):
                stand.last = sample
            return ((done, sample, seq),)
        tag = sample.get(POSITION, -1)
        total = stand.total if isinstance(stand, PositionStand) else None
        if total is None or tag < total:  # a padding read of a loss is not a second loss
            bad[0] += 1
            if isinstance(done, DataError):
                if self.cfg.strict and stand is None:
                    raise done
                warn_skip(done)
                bad.append((lost_name(sample), str(done)))
                self.last_failure = str(done)
        if stand is None:
            steps.skip(skipped, epoch, seq)
            return ()
        if isinstance(stand, PositionStand):
            made, stood = stand(seq, tag % stand.total, self.failed)
            return ((made, stood, seq),)
        return tuple(stand(seq))

    def _rows(
        self,
        worker: int,
        nworkers: int,
        skips: dict,
        prep: SamplePrep,
        runs: dict,
        warm: WarmStart,
    ) -> Iterator[tuple]:
        """(image, label, id, skips before it, key, runs skipped before it) rows, epoch after epoch;
        the samples a resumed worker had delivered (``skips``, and ``runs``: epoch -> sorted runs
        [first, stop) of seqs) are passed over before decoding.

        A sample that fails to decode and a FAILED placeholder are skipped, and ride on the next
        row as a run (epoch, first seq, stop), so the tracker counts them consumed: a hole would
        otherwise stop the worker's consumed prefix there and every later seq would pile into
        its skip set. Every seq between two rows of one epoch is skipped or was consumed before
        (passed over on resume), so one run per epoch covers them: a shard whose index claims
        millions of samples it does not hold costs a row three numbers, not millions."""
        try:
            yield from self._epochs(worker, nworkers, skips, prep, runs, warm)
        finally:
            warm.done()  # a leader whose stream ended or failed first holds nobody

    # One long method: the per-sample loop of the hot path, with what it passes over
    # (resumed, failed, undecodable) and how that is counted, in one place a reader follows top down.
    def _epochs(
        self, worker: int, nworkers: int, skips: dict, prep: SamplePrep, runs: dict, warm: WarmStart
    ) -> Iterator[tuple]:
        cfg = self.cfg
        bad: list = [0, 0]  # samples and shard reads skipped since the last row, then the failed URLs
        skipped: list[list[int]] = []  # [epoch, first seq, stop] runs skipped since the last row
        while True:
            self.epoch += 1
            epoch = self.epoch
            start, skip = skips.get(epoch, (0, frozenset()))
            passed = list(runs.get(epoch, ()))[::-1]  # consumed runs still ahead, the next one last
            produced = seen = 0
            wanted = steps.wanted(self._samples(worker, nworkers, epoch, bad), start, skip, passed)
            prepare = functools.partial(prep, epoch=epoch, worker=worker)
            stand = self._stand(epoch, prepare)
            for read_seq, read, done in warm.run(steps.prepared(wanted, prepare)):
                seen += 1
                for (image, label), sample, seq in self._made(read_seq, read, done, stand, bad, skipped, epoch):
                    if self.transform is not None:
                        image = transformed(self.transform, image, sample)
                    key = sample["__key__"] if cfg.with_keys else None
                    ids = (epoch, worker, seq, sample.get(POSITION, -1))
                    warm.row()
                    yield image, label, ids, tuple(bad), key, tuple(tuple(r) for r in skipped)
                    bad[:] = [0, 0]
                    skipped = []
                    produced += 1
                    prep.rows += 1
            # Placeholders are not samples read; an empty span (a resumed epoch's) reads none.
            if not produced and start == 0 and not skip and not runs.get(epoch) and (seen or not cfg.by_samples):
                # Never a silent empty rank: every shard of this worker failed.
                last = f"; the last: {self.last_failure}" if self.last_failure else "; see the warnings above"
                raise DataError(
                    f"rank {self.rank} worker {worker} read no sample from its shards (epoch {epoch}){last}"
                )
            if cfg.mode == "epoch" or cfg.rebatch:
                # With the cross-worker shuffle each epoch stays one DataLoader iteration, so
                # the shuffle buffer empties before the next begins and a resume is exact.
                return
