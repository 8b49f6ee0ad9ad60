"""What a run tells: rank 0's progress lines, train.log and TensorBoard, and the training metrics
window every rank sums and all reduce at each log line. It is handed what it prints (lines,
scalars, the loader's plan, the summary); what reads a ``Run`` lives beside it, in run.py."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torchvision

from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import Dist
from wdsdist.data import CACHE_COUNTS

if TYPE_CHECKING:
    from wdsdist.data import Plan


class Reporter:
    """Rank 0's outputs: a progress bar in a terminal or plain lines in logs, train.log, TensorBoard."""

    def __init__(self, dist: Dist, run_dir: str, steps: int, start: int):
        self.main, self.steps = dist.is_main, steps
        self.bar = self.tb = self.log = None
        self.images_logged = False
        self.since: tuple[float, int] | None = None  # (time, step) of the first step done: the ETA's base
        if not self.main:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.log = open(os.path.join(run_dir, "train.log"), "a", encoding="utf-8")
        self.tb = SummaryWriter(log_dir=run_dir)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, text: str, *, console: bool = True) -> None:
        if not self.main:
            return
        self.log.write(text + "\n")
        self.log.flush()
        if not console:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def tick(self, step: int, took: float | None = None, why: str = "") -> None:
        """A step is done (``took`` seconds, said for the first one, with ``why`` it took that long)."""
        if self.since is None:
            self.since = (time.perf_counter(), step)
            timed = f" in {took:.1f}s{why}" if took is not None else ""
            self.line(f"step {step}: the first step is done{timed}; a line every trainer.log_every steps follows")
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta(self, step: int) -> str:
        """The time to the last step at the pace since the first (evaluations and checkpoints in it)."""
        if self.since is None or step <= self.since[1]:
            return ""
        pace = (time.perf_counter() - self.since[0]) / (step - self.since[1])
        return f" eta {fmt_time(pace * (self.steps - step))}"

    def progress(self, step: int, text: str) -> None:
        """A progress bar update in a terminal, else a plain line."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.line(f"step {step} {text}", console=False)
        else:
            self.line(f"step {step}/{self.steps} {text}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)

    def first_images(self, images: torch.Tensor, step: int) -> None:
        """The run's first training batch as an image grid (once: to see what the model sees)."""
        if self.tb is not None and not self.images_logged:
            grid = torchvision.utils.make_grid(images[:64], nrow=8, padding=2)
            self.tb.add_image("train/batch", grid, step)
        self.images_logged = True

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """A log line's metrics (``Window.reduce``) to TensorBoard and the progress line. The bad
        data counters go to TensorBoard once one is not zero: a run with clean data opens on
        its loss, not on three flat cards."""
        bad = (values["data/bad_samples"], values["data/bad_shards"], values["data/bad_shard_reads"])
        self.scalars(step, {k: v for k, v in values.items() if any(bad) or not k.startswith("data/bad_")})
        self.progress(
            step,
            f"loss {values['train/loss']:.4f} acc {100 * values['train/acc']:.1f}% lr {values['train/lr']:.4g} "
            + (f"grad-norm {values['train/grad_norm']:.3g} " if "train/grad_norm" in values else "")
            + f"{values['perf/samples_per_s']:.0f} samples/s data-wait {100 * values['perf/data_wait']:.0f}%"
            + (f" skipped {skipped_text(*bad, ',')}" if bad[0] or bad[2] else "")
            + ("" if self.bar is not None else self.eta(step)),  # tqdm shows its own
        )

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's hyperparameters and final metrics for TensorBoard's HParams dashboard.
        ``add_hparams`` writes them in a sub-run named ``run_name``; "." names the run directory
        itself, so the dashboard links them with this run's own scalars and a reader
        of the run directory finds them there, in a second events file."""
        if self.tb is not None:
            self.tb.add_hparams(hparams, metrics, run_name=".", global_step=0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.log is not None:
            self.log.close()


def skipped_text(samples: int, shards: int, reads: int, sep: str) -> str:
    text = f"{samples} samples{sep} {shards} shards"
    return text + (f" ({reads} failed reads of them)" if reads != shards else "")


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


@dataclass
class Totals:
    """All ranks' sums over this run, as of the last log line."""

    seconds: float = 0.0  # wall time training (mean over ranks), evaluation and checkpoints excluded
    samples: int = 0
    wait: float = 0.0  # of those seconds, waiting for the loader
    bad_samples: int = 0  # samples the loaders skipped
    bad_reads: int = 0  # failed shard reads (a bad shard fails on every pass over it)
    failed_shards: set[str] = field(default_factory=set)  # distinct shards that failed
    cache: list[int] = field(default_factory=lambda: [0] * len(CACHE_COUNTS))  # the node caches' counts
    sources: list[int] = field(default_factory=list)  # samples trained of each source (data.sources)


@dataclass
class EpochEnd:
    """What an epoch's end says (Window.end_epoch): its number (None: no batch of it was
    counted), all ranks' samples of each source, and the samples lost and filled with their
    first names."""

    SHOWN: ClassVar[int] = 5
    epoch: int | None
    sources: list[int]
    lost: int
    names: list[str]

    def lost_line(self) -> str:
        more = ", ..." if len(self.names) > self.SHOWN else ""
        return f"{self.lost} damaged samples filled by stand-ins ({', '.join(self.names[: self.SHOWN])}{more})"


class Window:
    """This rank's training metrics since the last log line, summed on the device to avoid a sync
    per step. ``reduce()`` sums them over the ranks in one all-reduce, adds them to ``totals``,
    returns the values to log and starts the next window.

    With several data sets (``sources``: their names) it also counts each source's samples, from
    the batches' ``source``: per window, summed over the ranks in the same all-reduce, and per
    epoch, summed at its end (``end_epoch``)."""

    def __init__(self, dist: Dist, sources: Sequence[str] = ()):
        self.dist = dist
        self.names = list(sources)
        self.totals = Totals(sources=[0] * len(self.names))
        self.epoch_counts = torch.zeros(len(self.names), dtype=torch.int64)  # this rank's, this epoch
        self.epoch_lost = 0  # this rank's samples lost (and filled) this epoch
        self.epoch_names: list[str] = []  # their names (damaged samples, unreadable shards)
        self.epoch: int | None = None  # the epoch those counts are of (its first batch's)
        self._clear()

    def _clear(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        self.loss, self.correct = zero.clone(), zero.clone()
        self.bad = torch.zeros(2, dtype=torch.int64)  # samples and shard reads the loader skipped
        self.failed_shards: set[str] = set()  # their URLs (a bad shard counts once, not per read)
        self.cache = torch.zeros(len(CACHE_COUNTS), dtype=torch.int64)  # what the node cache did
        self.sources = torch.zeros(len(self.names), dtype=torch.int64)  # samples of each source
        self.samples = 0
        self.norms: list[float] = []  # optim.clip_grad_norm: the gradients' norm before clipping, per step
        self.wait = 0.0  # seconds spent waiting for the loader
        self.paused = 0.0  # seconds of evaluation and checkpoints, not training
        self.start = time.perf_counter()

    def add_batch(self, batch: dict) -> None:
        """What the loader skipped before this batch (bad samples, failed shard reads)."""
        if "bad" in batch:
            self.bad += batch["bad"].sum(0)
        if "cache" in batch:
            self.cache += batch["cache"]
        self.failed_shards.update(batch.get("bad_shards", ()))
        if "bad" in batch:
            self.epoch_lost += int(batch["bad"][:, 0].sum())
            names = [f"shard {u}" for u in batch.get("bad_shards", ())] + list(batch.get("bad_samples", ()))
            new = [n for n in names if n not in self.epoch_names]
            self.epoch_names += new[: EpochEnd.SHOWN + 1 - len(self.epoch_names)]
        if self.epoch is None:
            self.epoch = int(batch["id"][0, 0])
        if self.names:
            counts = torch.bincount(batch["source"], minlength=len(self.names))  # on the host, as the loader gives it
            self.sources += counts
            self.epoch_counts += counts

    def end_epoch(self) -> EpochEnd:
        """Collective (epoch mode, every rank at the same step): the epoch whose batches were
        counted since the last call (None before any batch), all ranks' samples of each source in
        it, and the samples lost and filled on every rank, with the first few names."""
        counts = torch.cat([self.epoch_counts, torch.tensor([self.epoch_lost, self.epoch is not None])])
        counts = counts.to(self.dist.device)
        distributed.all_reduce_sum(counts)
        *sources, lost, seen = counts.tolist()
        names = []
        if lost:  # the same on every rank: each gathers the names
            for mine in distributed.all_gather_object(self.epoch_names):
                names += [n for n in mine if n not in names]
        epoch = self.epoch
        if epoch is None and seen:  # this rank saw no batch; others did: theirs is the epoch
            epoch = -1
        self.epoch_counts.zero_()
        self.epoch, self.epoch_lost, self.epoch_names = None, 0, []
        return EpochEnd(epoch, sources, lost, names)

    def add_step(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, wait: float) -> None:
        self.loss += loss.detach().double() * len(labels)
        self.correct += (logits.detach().argmax(1) == labels).sum()
        self.samples += len(labels)
        self.wait += wait

    def add_norm(self, norm: float | None) -> None:
        if norm is not None:
            self.norms.append(norm)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent here (evaluation, checkpoints) is not training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t0

    def reduce(self, lr: float) -> dict[str, float]:
        """Collective: every rank's window summed; the logged values. ``lr``: the next step's."""
        device, world, totals = self.dist.device, self.dist.world, self.totals
        elapsed = time.perf_counter() - self.start - self.paused
        stats = torch.stack([self.loss, self.correct, torch.tensor(self.samples, dtype=torch.float64, device=device)])
        extra = [self.wait, elapsed, *self.bad.tolist(), *self.cache.tolist(), *self.sources.tolist()]
        stats = torch.cat([stats, torch.tensor(extra, dtype=torch.float64, device=device)])
        distributed.all_reduce_sum(stats)
        loss_sum, correct, samples, wait_sum, elapsed_sum, bad_samples, bad_reads, *rest = stats.tolist()
        cache, sources = rest[: len(CACHE_COUNTS)], [int(n) for n in rest[len(CACHE_COUNTS) :]]
        totals.cache = [total + int(n) for total, n in zip(totals.cache, cache, strict=True)]
        totals.sources = [total + n for total, n in zip(totals.sources, sources, strict=True)]
        totals.bad_samples += int(bad_samples)
        totals.bad_reads += int(bad_reads)
        if bad_reads:  # a shard failed on some rank: the one case worth gathering names for
            totals.failed_shards.update(*distributed.all_gather_object(sorted(self.failed_shards)))
        wall = elapsed_sum / world
        totals.seconds += wall
        totals.samples += int(samples)
        totals.wait += wait_sum / world
        # the same on every rank (DDP's gradients are): this rank's mean over the window's steps
        norm = {"train/grad_norm": sum(self.norms) / len(self.norms)} if self.norms else {}
        self._clear()
        return norm | {
            "train/loss": loss_sum / samples,
            "train/acc": correct / samples,
            "train/lr": lr,
            "perf/samples_per_s": samples / wall,
            "perf/data_wait": wait_sum / elapsed_sum,
            # All ranks, since the start of this run: samples skipped, distinct shards that
            # failed, and failed reads of them (a bad shard fails on every pass over it).
            "data/bad_samples": totals.bad_samples,
            "data/bad_shards": len(totals.failed_shards),
            "data/bad_shard_reads": totals.bad_reads,
            # All ranks' node caches, since the start of this run, where one is in use.
            **(
                {f"cache/{name}": n for name, n in zip(CACHE_COUNTS, totals.cache, strict=True)}
                if any(totals.cache)
                else {}
            ),
            # Several data sets: all ranks' samples of each source in this window (since the last log line).
            **{f"data/source/{name}": n for name, n in zip(self.names, sources, strict=True)},
        }


# ---------------------------------------------------------------- the start and the end of a run
# (run.py reads the Run and hands the lines here; these format what they are given)


def plan_line(plan: Plan) -> str:
    """split=samples: the epoch's size, and exactly what the remainder costs."""
    delivered = plan.world * plan.ranks[0].available * plan.batch_size
    if plan.padded:
        rest = f"pad: {plan.padded} samples (the epoch's first) delivered twice"
    elif plan.dropped:
        rest = f"drop: {plan.dropped} samples (the epoch's last) left out"
    else:
        rest = "nothing padded or dropped"
    return (
        f"plan: {plan.nshards} shards, {plan.total_samples} samples over {plan.world} ranks x {plan.nworkers} "
        f"workers, split=samples: {plan.ranks[0].available} batches of {plan.batch_size} per rank per epoch "
        f"({delivered} samples), {rest}" + (f"; cut to {plan.nbatches}" if plan.nbatches is not None else "")
    )


def epoch_line(
    epoch: int, step: int, sources: Sequence[tuple[str, str]], counts: Sequence[int], ended: bool, note: str = ""
) -> str:
    """An epoch's samples of each source (all ranks, the padding included), its share of them, and
    the setting that asked for it: ``sources`` are (name, setting) pairs. ``ended`` False: the
    run ends within the epoch, at ``step``."""
    total = sum(counts) or 1
    parts = [
        f"{name} {n} ({100 * n / total:.1f}%, {setting})" for (name, setting), n in zip(sources, counts, strict=True)
    ]
    head = f"epoch {epoch} ended at step {step}" if ended else f"epoch {epoch} up to step {step}, where the run ends"
    return f"{head}{note}: samples per source {', '.join(parts)}"


def done_line(summary: dict) -> str:
    parts = [f"done: {summary['steps']} steps in {fmt_time(summary['seconds'])}"]
    if summary["samples_per_s"]:
        parts.append(f"{summary['samples_per_s']:.0f} samples/s, data-wait {100 * summary['data_wait']:.1f}%")
    if summary["val_top1"] is not None:
        parts.append(f"val top-1 {100 * summary['val_top1']:.2f}% ({summary['val_samples']} samples)")
        if summary.get("val_top1_ema") is not None:
            parts.append(f"EMA {100 * summary['val_top1_ema']:.2f}%")
        if summary.get("val_weakest"):
            parts.append("weakest " + ", ".join(f"{name} {100 * top1:.1f}%" for name, top1 in summary["val_weakest"]))
    bad = (summary["skipped_samples"], summary["skipped_shards"], summary["skipped_shard_reads"])
    if bad[0] or bad[2]:
        parts.append(f"skipped {skipped_text(*bad, ' and')}")
    sources = summary.get("source_samples")
    if sources:
        parts.append(f"samples per source {', '.join(f'{name} {n}' for name, n in sources.items())}")
    cache = summary.get("cache")
    if cache:
        parts.append(
            f"node cache: {cache['hits']} hits, {cache['misses']} misses, {cache['fetched_bytes'] / 1e6:.1f} MB "
            f"from the store" + (f", {cache['bypassed']} reads past it" if cache["bypassed"] else "")
        )
    parts.append(f"run dir {summary['run_dir']}")
    return ", ".join(parts)
