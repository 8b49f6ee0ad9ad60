"""One optimizer step as today's recipes make it: ``trainer.accum_steps`` micro-batches, each
normalised on the device and mixed (mixing.py), forward and backward with DDP reducing the
gradients on the last one only; then the gradients clipped, the optimizer's step at this step's
learning rate, and the EMA updated (ema.py). ``gather`` takes the step's micro-batches from the
feed, ending epochs on the way together with every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wdsdist.cluster import faults
from wdsdist.train.run import Run, report_epoch


@dataclass
class Micro:
    """What one micro-batch gave: its loss, logits, the labels its accuracy counts (with mixing,
    each row's larger share) and the seconds waited for it."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor
    wait: float


def train_step(run: Run, batches: list[dict], waits: list[float], step: int) -> tuple[list[Micro], float | None]:
    """One optimizer step over ``batches`` (its micro-batches); what each gave, and the gradients'
    norm before clipping (None without optim.clip_grad_norm)."""
    cfg, last = run.cfg, len(batches) - 1
    run.opt.zero_grad(set_to_none=True)
    done = []
    for micro, (batch, wait) in enumerate(zip(batches, waits, strict=True)):
        images, targets, labels = inputs(run, batch, step, micro)
        # DDP reduces the gradients of the step's last micro-batch, the sum of all of them
        with run.sync(micro == last), run.on_device.autocast():
            logits = run.ddp_model(images)
            loss = F.cross_entropy(logits, targets, label_smoothing=cfg.optim.label_smoothing)
        (loss / len(batches)).backward()
        done.append(Micro(loss.detach(), logits.detach(), labels, wait))
    norm = None
    if cfg.optim.clip_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optim.clip_grad_norm))
    lr = run.lr_at(step)
    for group in run.opt.param_groups:
        group["lr"] = 0.0 if step < group.get("frozen_until", 0) else lr  # model.freeze_steps
    run.opt.step()
    if run.ema is not None:
        run.ema.maybe_update(run.model, step + 1)
    return done, norm


def inputs(run: Run, batch: dict, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A loader batch as the model trains on it: the float images, the targets (labels, or mixed
    soft labels) and the labels accuracy counts against."""
    images = run.on_device.images(batch["image"])
    labels = run.on_device.labels(batch["label"])  # in [0, num_classes): the loader skips (or strict stops at) others
    if run.mix is None:
        return images, labels, labels
    images, targets = run.mix(images, labels, step, micro)
    return images, targets, targets.argmax(1)


def gather(run: Run, step: int) -> tuple[list[dict], list[float], bool]:
    """The step's micro-batches (trainer.accum_steps of them), the seconds waited for each, and
    whether every rank stops after this step (a stop asked on any rank: agreed on a batch, acted
    on at the step's end, so a checkpoint holds whole steps). An epoch that ends on the way is
    ended on every rank together, and the step goes on in the next; a stop with no batch yet
    gathered returns none."""
    feed, watchdog = run.feed, run.watchdog
    batches: list[dict] = []
    waits: list[float] = []
    stop_all = False
    while len(batches) < run.cfg.trainer.accum_steps:
        watchdog.beat(step, "data")
        faults.stall_for_test(run.dist.rank, step)
        faults.hold_for_test(run.dist.rank, step, run.generation.number, lambda: run.stop.requested)
        batch, wait = feed.next()
        watchdog.beat(step, "step")
        stop, ran_out = feed.agree(batch, step)
        stop_all = stop_all or stop
        if ran_out:
            report_epoch(run, step)
            feed.end_epoch_together(step, batch)
            if stop_all and not batches:
                break
            continue
        run.window.add_batch(batch)
        run.report.first_images(batch["image"], step)
        batches.append(batch)
        waits.append(wait)
    return batches, waits, stop_all
