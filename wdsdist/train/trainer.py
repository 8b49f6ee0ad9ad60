"""The training loop: DDP under torchrun, exact evaluation, TensorBoard, atomic checkpoints.

``train(cfg)`` reads like torchvision's ``train_one_epoch``: ``setup()`` builds a ``Run`` (run.py: model,
optimizer, loaders, reporter, and the components that own their schedules: the evaluator's
``maybe_eval``, the checkpointer's ``maybe_save``, the metrics window's ``reduce``), the loop takes
``train_step`` after ``train_step``, and ``finish()`` writes the summary. Rank 0 prints, logs and
writes; every rank takes part in the collectives, in the same order.
"""

# A long module: building a run (model, loaders, schedule, checkpoint) and its loop, the screen
# a reader follows from start to the last checkpoint; the step is step.py, the feed feed.py.

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, NoReturn

import torch
from omegaconf import DictConfig, OmegaConf

from wdsdist.cluster import distributed, faults
from wdsdist.cluster.distributed import Dist, on_all_ranks
from wdsdist.data import EvalLoader, Loader, LoaderConfig, Shard, Source, expand_shards
from wdsdist.errors import UserError
from wdsdist.model import classes
from wdsdist.tools.outfolder import make_output_folder, write_text
from wdsdist.tools.shards import check_local_output, from_synthetic, synthetic_is_current
from wdsdist.train import export, recipe
from wdsdist.train.checkpoint import (
    Checkpointer,
    Generation,
    begin_generation,
    load_resume,
    refuse_foreign_run_dir,
    remove_stale_tmp,
    resolve_run_dir,
    restore,
    same_job,
)
from wdsdist.train.config import LoaderMode, check, given_keys
from wdsdist.train.ema import Ema
from wdsdist.train.evaluate import Evaluator, OnDevice, params_fingerprint
from wdsdist.train.feed import Feed
from wdsdist.train.mixing import BatchMix
from wdsdist.train.model import build_optimizer, compiled, pretrained, seeded_model, synced_batchnorm, wrap_ddp
from wdsdist.train.pins import pin_data, pinned
from wdsdist.train.report import Reporter, Window, done_line
from wdsdist.train.run import Run, global_batch, hparams_of, report_epoch, report_start, summarize
from wdsdist.train.step import gather, train_step

# ---------------------------------------------------------------- data


def ensure_synthetic(cfg: DictConfig) -> None:
    """Write the synthetic train/val shards where data.*_shards point, if they are not there."""
    s = cfg.data.synthetic
    if s is None:
        return
    d = cfg.data
    jobs = [("data.train_shards", d.train_shards, "train", s.train_samples, s.seed)] if d.train_shards else []
    if d.val_shards:
        jobs.append(("data.val_shards", d.val_shards, "val", s.val_samples, s.seed))
    # Each source its own set (a seed of its own, so sources differ), the same size as the train
    # or val set: their settings (repeat, samples, weight) make the mix, not their sizes.
    for section, split, n in (("sources", "train", s.train_samples), ("val_sources", "val", s.val_samples)):
        for i, source in enumerate(d.get(section) or ()):  # a config made before data.sources lacks it
            jobs.append((source_key(section, source.name), source.shards, split, n, s.seed + 1 + i))
    for key, index, split, n, seed in jobs:
        check_local_output(index, f"{key}={index}")
        if not index.endswith(".index.json"):
            raise UserError(
                f"{key}={index}: with data.synthetic set it must name the index to write (DIR/PREFIX.index.json); "
                f"for shards of your own use data=shards data.num_classes=N"
            )
        if synthetic_is_current(index, key, {"seed": seed, "split": split, "size": s.size}, n):
            continue
        outdir, prefix = os.path.dirname(index) or ".", os.path.basename(index)[: -len(".index.json")]
        make_output_folder(outdir, key)
        print(f"writing {n} synthetic {split} images ({s.size}x{s.size}) to {outdir}/ (once)", flush=True)
        from_synthetic(
            n, outdir, prefix, maxcount=s.shard_samples, maxsize=1 << 30, seed=seed, split=split, size=s.size
        )


def source_key(section: str, name: str) -> str:
    """How an error names a source's shards: its list and its name."""
    return f"data.{section}[{name}].shards"


def loader_config(cfg: DictConfig, d: Dist, seed: int) -> LoaderConfig:
    # data and loader extend the loader's own option classes: their fields pass over by name. The
    # ranks per node (loader.shard_order=node keeps shards per node) come from torchrun, via Dist.
    # data.image_size may be a schedule (recipe.py): the loader gets the largest and the schedule.
    t = cfg.trainer
    return LoaderConfig.from_sections(
        cfg.data,
        cfg.loader,
        batch_size=t.batch_size,
        workers=t.workers,
        seed=seed,
        pin_memory=d.device.type == "cuda",
        node_ranks=d.local_world,
        image_size=recipe.largest(cfg),
        size_schedule=recipe.schedule(cfg),
    )


def check_decode(cfg: DictConfig, dist: Dist) -> None:
    """loader.decode=gpu decodes on the GPU the model trains on: refused, in one line, for a run on the CPU."""
    if cfg.loader.decode == "gpu" and dist.device.type != "cuda":
        raise UserError(
            f"loader.decode=gpu: this run trains on the CPU (trainer.device={cfg.trainer.device.value}: "
            f"{'torch sees no CUDA GPU here' if not torch.cuda.is_available() else 'asked for'}); "
            f"use loader.decode=cpu, the default"
        )


def shards_of(key: str, spec: str, loader_cfg: LoaderConfig) -> list[Shard]:
    """The shards a data key names; an error names the key (a spec matching nothing, missing
    shards in strict mode, a refused pipe: URL)."""
    try:
        return expand_shards(spec, loader_cfg)
    except UserError as exc:
        raise UserError(f"{key}: {exc}") from None


def in_config_terms(fn: Any, *args: Any) -> Any:
    """The loader's layout errors (shared with simdist.py) with the trainer's key names."""
    try:
        return fn(*args)
    except UserError as exc:
        raise UserError(re.sub(r"(?<![\w.])(nbatches|dsrepeat|split)(?=[<>=])", r"loader.\1", str(exc))) from None


# ---------------------------------------------------------------- setup


def prepare_run_dir(cfg: DictConfig, dist: Dist) -> tuple[str, list[str], Generation]:
    """The run directory, refused if it holds another run, with the synthetic data written and
    the resolved config saved; also the stale temporary files removed from it, and this start's
    generation recorded in it (the fence for its writes)."""
    run_dir = resolve_run_dir(cfg, dist)
    run_id = distributed.shared_run_id()
    # Rank 0's answer for all: torchrun's restart counts differ between a node that lived through
    # a failure and one that joined since, and every rank must take the same collectives below.
    restarted = distributed.broadcast_object(
        (distributed.restart_count() > 0 or same_job(run_dir, run_id)) if dist.is_main else None
    )
    on_all_ranks(lambda: refuse_foreign_run_dir(run_dir, cfg.trainer.resume, restarted) if dist.is_main else None)
    on_all_ranks(lambda: ensure_synthetic(cfg) if dist.is_main else None)
    # Before any rank writes: an unwritable outputs/ stops every rank with one line.
    on_all_ranks(lambda: make_output_folder(run_dir, "run_dir" if cfg.run_dir else "outputs") if dist.is_main else None)
    stale: list[str] = []
    generation = None
    if dist.is_main:
        generation = begin_generation(run_dir, run_id, restarted)
        stale = remove_stale_tmp(run_dir)
        write_text(os.path.join(run_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))
    return run_dir, stale, distributed.broadcast_object(generation)


def build_loaders(
    cfg: DictConfig,
    dist: Dist,
    loader_cfg: LoaderConfig,
    ckpt: dict | None,
    resume_path: str | None,
    pins: dict[str, str],
) -> tuple[Loader, dict[str | None, EvalLoader]]:
    """This rank's train loader (at its saved position when resuming) and eval loaders: None's
    for data.val_shards, each of data.val_sources' by its name (none: nothing to evaluate).
    Every rank builds, and so checks, its own: a layout that would hang stops here. Each spec is
    read as ``pins`` pin it (pins.py: one commit of a data set on the Hub for the whole run)."""
    d = cfg.data
    if d.sources is not None:
        # The loader expands each source's spec and names the source in its errors.
        train_shards: Any = [Source(s.name, pinned(s.shards, pins), s.weight, s.repeat, s.samples) for s in d.sources]
    else:
        train_shards = on_all_ranks(lambda: shards_of("data.train_shards", pinned(d.train_shards, pins), loader_cfg))

    def train_loader() -> Loader:
        # on_limit=mark: past data.max_bad the feed stops every rank at one step (feed.py)
        group = distributed.control_group()
        loader = Loader(train_shards, loader_cfg, rank=dist.rank, world=dist.world, group=group, on_limit="mark")
        if ckpt is not None:
            loader.load_state_dict(loader_state_of(ckpt), where=str(resume_path))
            # The position checked against this config now, at start-up, not at the first batch:
            # other data.sources than the checkpoint's are refused here in one line.
            loader.batches_done  # noqa: B018
        return loader

    loader = on_all_ranks(lambda: in_config_terms(train_loader))
    evals: list[tuple[str | None, str, str]] = [(None, "data.val_shards", d.val_shards)] if d.val_shards else []
    evals += [(s.name, source_key("val_sources", s.name), s.shards) for s in d.val_sources or ()]
    eval_loaders = {}
    for name, key, spec in evals:
        spec = pinned(spec, pins)
        shards = on_all_ranks(lambda key=key, spec=spec: shards_of(key, spec, loader_cfg))
        eval_loaders[name] = on_all_ranks(
            lambda shards=shards: EvalLoader(shards, loader_cfg, rank=dist.rank, world=dist.world)
        )
    return loader, eval_loaders


def loader_state_of(ckpt: dict) -> dict | list:
    """The loader state a checkpoint holds: Loader.state_dict()'s, or, in checkpoints written
    before it held the steps, the list of every rank's state (a fresh stream is then reseeded
    with the checkpoint's step, so it does not replay the first samples)."""
    state = ckpt["loader"]
    return state if isinstance(state, dict) else {"ranks": state, "steps": int(ckpt["step"])}


def epoch_steps(loader: Loader, epochs: int, done: int, accum: int = 1) -> int:
    """trainer.epochs as steps: the steps done, then the rest of the epoch under way and whole
    epochs to ``epochs``, in batches, ``accum`` of them a step (a step may span an epoch's end; a
    last part short of a step is not trained). After an elastic resume the epoch under way has
    its own length (the remaining samples re-split) and the later ones the new layout's, so the
    total differs from the first run's; the learning rate schedule follows the new total (lr_at
    reads it every step)."""
    epoch = loader.epoch
    if epoch >= epochs:
        return done
    batches = len(loader) - loader.batches_done + (epochs - epoch - 1) * (loader.batches_per_epoch or 0)
    return done + batches // accum


def pretrained_and_classes(cfg: DictConfig, dist: Dist, run_dir: str) -> Any:
    """The pretrained start (model.weights: its mean, std and size set in ``cfg`` first), and the
    class names, written into the run directory with the config that holds them."""
    start_from = on_all_ranks(lambda: pretrained(cfg, given_keys()))
    names = on_all_ranks(lambda: classes.resolve(cfg, loader_config(cfg, dist, cfg.seed)))
    if dist.is_main:
        classes.write(run_dir, names)
        write_text(os.path.join(run_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))  # with them
    return start_from


def trained_parts(
    cfg: DictConfig, dist: Dist, start_from: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Ema | None, float, list[str]]:
    """The model on this rank's device (SyncBatchNorm where asked: trainer.sync_bn), its optimizer
    at the global batch's learning rate and its EMA (trainer.ema); the lines to say about its
    weights. The EMA starts as the model (a resume then loads it)."""
    model, weight_lines = seeded_model(cfg, dist, start_from)
    model = on_all_ranks(lambda: synced_batchnorm(model, cfg, dist))
    base_lr = cfg.optim.lr * global_batch(cfg, dist) / 256
    opt = build_optimizer(cfg, model, base_lr)
    e = cfg.trainer.ema
    ema = Ema(model, e.decay, e.every, e.warmup) if e.decay > 0 else None
    return model, opt, ema, base_lr, weight_lines


def setup(cfg: DictConfig, dist: Dist, stop: faults.StopRequest, watchdog: faults.Watchdog) -> Run:
    """Everything before the first step. Each ``on_all_ranks`` is a collective: every rank takes
    these steps in this order."""
    started = time.perf_counter()
    run_dir, stale, generation = prepare_run_dir(cfg, dist)
    watchdog.prefix = f"wdsdist/generation_{generation.number}"  # fresh keys for each start
    start_from = pretrained_and_classes(cfg, dist, run_dir)
    model, opt, ema, base_lr, weight_lines = trained_parts(cfg, dist, start_from)
    resume_path, ckpt, resume_warnings = load_resume(cfg, dist, run_dir, generation.restarted)
    loader_cfg = loader_config(cfg, dist, cfg.seed)
    pins = pin_data(cfg, dist, loader_cfg, ckpt, run_dir)
    train_loader, eval_loaders = build_loaders(cfg, dist, loader_cfg, ckpt, resume_path, pins)
    sources = tuple((s.name, s.setting) for s in train_loader.mix.sources) if train_loader.mix is not None else ()
    resumed_mid_epoch = ckpt is not None and cfg.loader.mode == LoaderMode.epoch and train_loader.batches_done > 0
    start = 0
    if ckpt is not None:
        start = on_all_ranks(lambda: restore(ckpt, resume_path, dist, cfg, model, opt, ema))
        del ckpt
    t = cfg.trainer
    steps = t.steps if t.epochs is None else epoch_steps(train_loader, t.epochs, start, t.accum_steps)
    ddp_model = wrap_ddp(model, dist)
    compiles, compile_why = recipe.compile_choice(t.compile, dist.device.type)
    on_device = OnDevice(cfg, dist)
    report = Reporter(dist, run_dir, steps, start)
    maybe = compiled if compiles else (lambda module: module)  # trainer.compile: what trains and is evaluated
    evaluated = {"model": maybe(model)} | ({"EMA": maybe(ema.model)} if ema else {})
    run = Run(
        cfg=cfg,
        dist=dist,
        run_dir=run_dir,
        started=started,
        stop=stop,
        watchdog=watchdog,
        model=model,
        ddp_model=maybe(ddp_model),
        opt=opt,
        base_lr=base_lr,
        steps=steps,
        start=start,
        resume_path=resume_path,
        on_device=on_device,
        report=report,
        feed=Feed(cfg, dist, train_loader, stop, report),
        window=Window(dist, [name for name, _ in sources]),
        evaluator=Evaluator(cfg, dist, evaluated, eval_loaders, on_device, steps, report, watchdog),
        checkpointer=Checkpointer(
            run_dir, dist, cfg, model, opt, train_loader, report, watchdog, generation, pins, ema
        ),
        generation=generation,
        sources=sources,
        resumed_mid_epoch=resumed_mid_epoch,
        compiled=compiles,
        mix=BatchMix(t.mixup, t.cutmix, cfg.data.num_classes, cfg.seed, dist.rank) if t.mixup or t.cutmix else None,
        ema=ema,
    )
    # a resume has its weights from the checkpoint: nothing to say of the start's
    report_start(run, resume_warnings, stale, compile_why, weight_lines if resume_path is None else [])
    return run


# ---------------------------------------------------------------- the loop


def train_loop(run: Run) -> int:
    """Steps from run.start to run.steps, then the last evaluation and checkpoint; the step reached.
    A stop request (SIGTERM on any rank) ends every rank at one step, with a checkpoint."""
    feed, window = run.feed, run.window
    step, stop_all = run.start, False
    run.stop.install()
    run.watchdog.start()
    run.ddp_model.train()
    while step < run.steps:
        batches, waits, stop_all = gather(run, step)
        if not batches:
            break
        t0 = time.perf_counter()
        micro, norm = train_step(run, batches, waits, step)
        took = time.perf_counter() - t0
        for batch in batches:
            faults.trace_for_test(run.dist.rank, step, batch, run.generation.number)
        faults.pixels_for_test(run.dist.rank, step, batches)
        step += 1
        run.report.tick(step, took, " (compiling the model: trainer.compile)" if run.compiled else "")
        for m in micro:
            window.add_step(m.loss, m.logits, m.labels, m.wait)
        window.add_norm(norm)
        if step % run.cfg.trainer.log_every == 0 or step == run.steps or stop_all:
            run.report.metrics(step, window.reduce(lr=run.lr_at(step)))
        with window.pause():
            if not stop_all:
                run.evaluator.maybe_eval(step)
            run.checkpointer.maybe_save(step)
        if stop_all:
            break
    feed.close()
    if run.cfg.loader.mode == LoaderMode.epoch:
        report_epoch(run, step, whole=feed.loader.batches_done == 0)
    if stop_all and step < run.steps:
        stopped(run, step)
    run.evaluator.maybe_eval(step, last=True)
    run.checkpointer.maybe_save(step, last=True)
    return step


def stopped(run: Run, step: int) -> NoReturn:
    """SIGTERM: a checkpoint of this step, then a prompt exit (see faults.EXIT_STOPPED)."""
    run.checkpointer.maybe_save(step, last=True)
    run.report.line(
        f"stopped by SIGTERM at step {step} of {run.steps}: checkpoint {run.checkpointer.path}; "
        f"rerun with trainer.resume=auto to continue"
    )
    run.report.close()
    raise SystemExit(faults.EXIT_STOPPED)


# ---------------------------------------------------------------- the end


def decode_line(decoded: dict, host: dict) -> str:
    """loader.decode=gpu's last line: where rank 0's images were made, by which decoder, and the
    host time per batch by phase (bench/gpucheck/train.py reads it)."""
    return (
        f"loader.decode=gpu on rank 0: {decoded['gpu']} images decoded on the GPU, {decoded['cpu']} on the "
        f"CPU (in the workers, PNG, CMYK, or refused by the GPU's decoder), {decoded['failed']} left out (no "
        f"decoder took them); {host.get('decoder', '')}; host time per batch: decode {host.get('decode_ms', 0):.2f} "
        f"ms ({host.get('decode_cpu_ms', 0):.2f} ms of it its thread's CPU), resize {host.get('resize_ms', 0):.2f} ms, "
        f"augmentations {host.get('augment_ms', 0):.2f} ms, hand-over {host.get('hand_over_ms', 0):.2f} ms"
    )


def finish(run: Run, step: int) -> dict:
    """Every rank reports its step and weights (they must agree after DDP); rank 0 writes the
    summary and the hyperparameters, and says the run is done."""
    fingerprints = distributed.all_gather_object((step, params_fingerprint(run.model)))
    summary = summarize(run, step, fingerprints)
    if run.dist.is_main:
        if len(set(fingerprints)) > 1:
            run.report.line(f"warning: ranks disagree at the end (step, weights): {fingerprints}")
        decoded = run.feed.loader.decode_counts  # loader.decode=gpu: where rank 0's images were made
        if decoded:
            run.report.line(decode_line(decoded, run.feed.loader.decode_host))
        metrics = {"hparam/val_top1": summary["val_top1"] or 0.0, "hparam/val_loss": summary["val_loss"] or 0.0}
        run.report.hparams(hparams_of(run), metrics)
        write_text(os.path.join(run.run_dir, "summary.json"), json.dumps(summary, indent=1) + "\n")
        # model.safetensors + config.json: the EMA's weights where there is one (as timm and torchvision ship)
        export.export(run.run_dir, run.cfg, run.ema.model if run.ema else run.model, step, ema=run.ema)
    run.report.line(done_line(summary))
    run.report.close()
    return summary


def train(cfg: DictConfig) -> dict:
    """Train as configured; returns the summary (also written to RUN_DIR/summary.json)."""
    # Collectives outside the watched loop (start-up, the last summary) time out here; inside it
    # the watchdog names a stalled rank after trainer.timeout_s, well before.
    dist = distributed.init(cfg.trainer.device.value, timeout_s=max(2 * cfg.trainer.timeout_s, 300.0))
    stop = faults.StopRequest()
    watchdog = faults.Watchdog(
        dist.rank,
        dist.world,
        cfg.trainer.timeout_s,
        distributed.watch_store(faults.Watchdog.period_for(cfg.trainer.timeout_s)),
        "wdsdist/start",  # until setup() knows this start's generation
        stop,
    )
    try:
        on_all_ranks(lambda: check(cfg))
        on_all_ranks(lambda: check_decode(cfg, dist))
        run = setup(cfg, dist, stop, watchdog)
        return finish(run, train_loop(run))
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, DistNetworkError) are these
        lost = distributed.peer_lost(exc, watchdog.state[1])
        if lost is None:
            raise
        raise lost from None
    finally:
        watchdog.close()
        stop.uninstall()
        distributed.cleanup()
