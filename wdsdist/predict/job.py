"""``predict.py MODEL SPEC --out-dir DIR``: a whole data set scored once, on one process or every
rank of a torchrun job, one part per input shard, restartable by part.

    rank 0: units (shards, or a folder's slices) -> manifest checked -> leftover pieces joined
            -> the parts still to do, broadcast
    every rank: its exact split of those (predict_read) -> model -> collect.Collector, which
            writes each part (or piece) whole as soon as it is settled
    rank 0: pieces joined into parts -> manifest's parts -> --out joined in the spec's order

Nothing is collective per batch: ranks may end a sample apart, and only the start and the end
wait for every rank. The progress bar on rank 0 counts every rank's images through the job's
store (distributed.store), so its rate and ETA are the job's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from wdsdist.cluster import distributed, faults
from wdsdist.data import DataError, LoaderConfig, UserError, pin_spec
from wdsdist.model.classify import Penultimate, load_model, model_hash, top_k
from wdsdist.predict import parts, reshard
from wdsdist.predict.collect import Collector, Unit
from wdsdist.predict.options import PredictOptions
from wdsdist.predict.progress import Progress, done_key
from wdsdist.predict.read import Batch, file_stream, file_units, image_files, kind_of, shard_stream, shard_units

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What rank 0 decided and every rank follows."""

    kind: str  # shards or files
    units: list[Unit]
    todo: list[int]
    reused: int
    sources: list[Any] = field(default_factory=list)  # the Shard objects, or the files' paths


def loader_config(opts: PredictOptions, config: dict, dist: distributed.Dist) -> LoaderConfig:
    size, resize = config["image_size"], config.get("resize")
    return LoaderConfig(
        batch_size=opts.batch_size,
        image_size=size,
        eval_size=size,
        eval_resize=resize,
        train=False,
        workers=opts.workers,
        with_keys=True,
        strict=opts.strict,
        shuffle_buffer=0,
        decode=opts.decode,
        pin_memory=dist.device.type == "cuda",
        node_ranks=dist.local_world,
        cache_dir=opts.cache_dir,
        reuse_buffers=False,
    )


def identity(opts: PredictOptions, model_id: str, config: dict, cuda: bool) -> dict:
    """What the output folder's parts depend on: another value of any of these is another job."""
    options = {
        "top_k": opts.top_k,
        "features": opts.features,
        "image_size": config["image_size"],
        "resize": config.get("resize"),
        "precision": "bf16" if cuda else "float32",
    }
    if kind_of(opts.inputs) == "files":
        options["part_size"] = opts.part_size
    return {"model": model_id, "spec": list(opts.inputs), "options": options}


def plan(opts: PredictOptions, cfg: LoaderConfig, ident: dict) -> Job:
    """Rank 0: the units, the manifest made or checked, leftover pieces joined, what is still to do."""
    kind = kind_of(opts.inputs)
    manifest = parts.open_manifest(opts.out_dir, ident, "predict.py --out-dir")
    if kind == "shards":
        # hf:// at the commit its revision names now, kept in the manifest: a restart reads the
        # same bytes, whatever the branch did since
        manifest.setdefault("pinned", [pin_spec(item, cfg.access) for item in opts.inputs])
        units, sources = shard_units(manifest["pinned"], cfg)
    if kind == "files":
        sources = listing(opts.out_dir, opts.inputs)
        units = file_units(sources, opts.part_size)
    if opts.write_shards:
        check_shards_folder(opts.write_shards, kind, units)
    os.makedirs(os.path.join(opts.out_dir, "parts"), exist_ok=True)
    parts.remove_temporaries(opts.out_dir)
    empty_now = write_empty_parts(opts.out_dir, units, opts.features)
    done = settle_parts(opts.out_dir, units, opts.features, manifest)
    parts.save_manifest(opts.out_dir, manifest)
    for name, spans in parts.pieces_of(opts.out_dir).items():  # a layout's leftovers: redone whole
        parts.remove_pieces(opts.out_dir, name, spans)
    todo = [i for i in range(len(units)) if i not in done]
    return Job(kind, units, todo, len(done - empty_now), list(sources))


def write_empty_parts(out_dir: str, units: list[Unit], features: bool) -> set[int]:
    """The parts of shards that hold no sample, written now (no rank reads them); which."""
    written = set()
    for i, unit in enumerate(units):
        if unit.count == 0 and parts.part_meta(out_dir, unit.name) is None:
            empty = np.zeros((0, 0), np.float16) if features else None
            meta = {"source": unit.source, "scored": 0, "skipped": []}
            parts.write_piece(out_dir, unit.name, (0, 0), 0, [], empty, meta)
            written.add(i)
    return written


def check_shards_folder(folder: str, kind: str, units: list[Unit]) -> None:
    """--write-shards takes shard specs, into a folder that holds none of them (it would write
    over an input shard)."""
    if kind != "shards":
        raise UserError("--write-shards: the inputs must be shards (a folder's images are scored, not written again)")
    clash = next(
        (u.source for u in units if os.path.abspath(reshard.shard_path(folder, u)) == os.path.abspath(u.source)), None
    )
    if clash is not None:
        raise UserError(f"--write-shards {folder}: it would write over the input shard {clash}: use another folder")


def listing(out_dir: str, inputs: list[str]) -> list[str]:
    """The folders' images, listed once and sorted: DIR/listing.json, which a restart reads, so
    images added since then do not move the parts' bounds."""
    path = os.path.join(out_dir, "listing.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    files = sorted(image_files(inputs))
    if not files:
        raise UserError(f"predict.py: no image files in {', '.join(inputs)}")
    os.makedirs(out_dir, exist_ok=True)
    parts.write_whole(path, json.dumps(files).encode())
    return files


def settle_parts(out_dir: str, units: list[Unit], features: bool, manifest: dict) -> set[int]:
    """Pieces that cover a part joined into it; the parts done, recorded in the manifest."""
    pieces = parts.pieces_of(out_dir)
    done = set()
    for i, unit in enumerate(units):
        meta = parts.part_meta(out_dir, unit.name)
        if meta is None and unit.name in pieces:
            if parts.join_pieces(out_dir, unit.name, unit.count, pieces[unit.name], features):
                meta = parts.part_meta(out_dir, unit.name)
        if meta is not None:
            done.add(i)
            manifest["parts"][unit.name] = {k: meta[k] for k in ("source", "scored", "skipped")}
    return done


class Scorer:
    """The model on the device: uint8 batches in, top-k rows (and features) out; bf16 and
    channels_last on a GPU, float32 on the CPU."""

    def __init__(self, model: torch.nn.Module, config: dict, device: torch.device, k: int, features: bool):
        self.cuda = device.type == "cuda"
        fmt = torch.channels_last if self.cuda else torch.contiguous_format
        self.model = model.to(device, memory_format=fmt).eval()
        self.device, self.fmt, self.k, self.classes = device, fmt, k, config["classes"]
        self.hook = Penultimate(model) if features else None

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[list, np.ndarray | None]:
        x = images.to(self.device, non_blocking=True).float().contiguous(memory_format=self.fmt)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            logits = self.model(x)
        feats = None
        if self.hook is not None:
            feats = self.hook.features.float().cpu().numpy().astype(np.float16)
        return top_k(logits.float().cpu(), self.classes, self.k), feats


def score_rank(
    opts: PredictOptions, job: Job, cfg: LoaderConfig, scorer: Scorer, dist: distributed.Dist, progress: Progress
) -> dict:
    """This rank's share of the parts to do, scored and written; its counts."""
    start = time.monotonic()
    if not job.todo:  # every part done: nothing to read
        reads, batches, name = [], iter(()), None
    elif job.kind == "shards":
        reads, batches = shard_stream(job.sources, job.todo, cfg, dist.rank, dist.world)
        name = lambda u, key: f"{job.units[u].source}#{key}"  # noqa: E731
    else:
        reads, batches = file_stream(job.sources, job.units, job.todo, cfg, dist.rank, dist.world)
        name = lambda u, key: key  # noqa: E731
    collector = Collector(
        opts.out_dir, job.units, reads, opts.features, lambda u, o: skipped_name(job, u, o), on_part(opts, job, cfg)
    )
    store = distributed.store()
    by_url = {u.source: i for i, u in enumerate(job.units)}
    first: tuple[float, int] | None = None  # when the first batch was scored, and its images
    try:
        for batch in batches:
            file_batch(batch, collector, scorer, name, by_url)
            first = first or (time.monotonic(), len(batch.names))
            if store is not None:
                store.add(done_key(), len(batch.names))
            progress.advance(len(batch.names))
            faults.kill_for_test(dist.rank, collector.written)
    except DataError as exc:  # --strict: a shard that cannot be read stops the job, named
        # From a DataLoader worker the message carries the worker's traceback: its last line.
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        raise UserError(f"{last.split('DataError: ', 1)[-1]} (--strict)") from None
    collector.finish()
    end = time.monotonic()
    # after the first batch: the rate of the workers and the model running, without their start
    steady = (collector.scored - first[1], end - first[0]) if first else (0, 0.0)
    return {"scored": collector.scored, "skipped": collector.skipped, "seconds": end - start, "steady": steady}


def on_part(opts: PredictOptions, job: Job, cfg: LoaderConfig) -> Any:
    """What follows a part written whole on this rank: with --write-shards, its shard again."""
    if not opts.write_shards or job.kind != "shards":
        return lambda unit: None
    parts_dir = os.path.join(opts.out_dir, "parts")

    def write(unit: int) -> None:
        try:
            reshard.write_shard(opts.write_shards, parts_dir, job.units[unit], cfg, opts.features)
        except DataError as exc:  # its part is done; the shard is tried again at the end, and by the next run
            log.warning("--write-shards: %s; that shard is left for later", str(exc).splitlines()[-1])

    return write


def write_missing_shards(opts: PredictOptions, job: Job, cfg: LoaderConfig, done: set[int]) -> str | None:
    """Rank 0 at the end: the shards of done parts that no rank wrote (parts joined from pieces,
    or left by a killed job), then DIR2's index once every part is done."""
    write = on_part(opts, job, cfg)
    for i in sorted(done):
        if not os.path.isfile(reshard.shard_path(opts.write_shards, job.units[i])):
            write(i)
    written = all(os.path.isfile(reshard.shard_path(opts.write_shards, u)) for u in job.units)
    return reshard.write_shards_index(opts.write_shards, job.units) if written else None


def file_batch(batch: Batch, collector: Collector, scorer: Scorer, name: Any, by_url: dict[str, int]) -> None:
    for url in batch.bad_shards:
        if url in by_url:
            collector.fail(by_url[url])
    for damaged in batch.bad_samples:
        url, key = damaged.rsplit(" ", 1)
        if url in by_url:
            collector.damage(by_url[url], key)
    if not batch.names:
        return
    tops, feats = scorer(batch.images)
    for j, (worker, pos, key) in enumerate(zip(batch.workers, batch.positions, batch.names, strict=True)):
        unit, offset = collector.locate(worker, pos)
        line = parts.json_line(name(unit, key), tops[j])
        collector.put(unit, offset, line, feats[j] if feats is not None else None)


def skipped_name(job: Job, unit: int, offset: int) -> str:
    """How the manifest names a sample that could not be scored: a file's path, or the shard
    and the sample's number in it."""
    if job.kind == "files":
        return job.sources[sum(u.count for u in job.units[:unit]) + offset]
    return f"{job.units[unit].source} sample {offset}"


def finish(opts: PredictOptions, job: Job, cfg: LoaderConfig, stats: list[dict]) -> tuple[str, int]:
    """Rank 0, once every rank is done: pieces joined, the manifest's parts, --out; the summary
    line and the exit status (1 where a part's shard could not be read)."""
    manifest = parts.open_manifest(opts.out_dir, {}, "predict.py --out-dir")
    done = settle_parts(opts.out_dir, job.units, opts.features, manifest)
    steady = sum(s["steady"][0] for s in stats), max(s["steady"][1] for s in stats)
    manifest["timing"] = {"images": steady[0], "seconds": round(steady[1], 3), "after": "each rank's first batch"}
    parts.save_manifest(opts.out_dir, manifest)
    missing = [u.source for i, u in enumerate(job.units) if i not in done]
    index = write_missing_shards(opts, job, cfg, done) if opts.write_shards and job.kind == "shards" else None
    rows = None
    if opts.out and not missing:
        rows = parts.join(opts.out_dir, [u.name for u in job.units], opts.out)
    scored = sum(s["scored"] for s in stats)
    seconds = max(s["seconds"] for s in stats)
    rates = ", ".join(f"{s['scored'] / max(s['seconds'], 1e-9):.1f}" for s in stats)
    line = (
        f"predict: {scored} images, {sum(s['skipped'] for s in stats)} skipped, {seconds:.1f} s, "
        f"images/s per rank {rates}, {job.reused} of {len(job.units)} parts reused"
    )
    if rows is not None:
        line += f"; {rows} rows joined into {opts.out}"
    if index is not None:
        line += f"; shards with predictions: {index}"
    if missing:
        line += f"; {len(missing)} parts not done (their shards could not be read: {missing[0]} first): run again"
    return line, 1 if missing else 0


def unshared(out_dir: str) -> str | None:
    """Where a rank does not see the manifest rank 0 wrote (a folder not shared between nodes,
    whose parts rank 0 could not join), why in one line; None where every rank sees it."""
    seen = distributed.all_gather_object(os.path.isfile(os.path.join(out_dir, parts.MANIFEST)))
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    return (
        f"--out-dir {out_dir}: rank {blind[0]} does not see rank 0's files there: use a shared folder"
        if blind
        else None
    )


def run_job(opts: PredictOptions) -> tuple[str, int]:
    """The whole job on this rank, in its steps: plan (rank 0), score this rank's share (filed by
    shard, each part written whole as it settles), join (rank 0). Rank 0's summary line and exit
    status. A refusal on rank 0 (another model in the folder, a spec that names nothing) is one
    line there, and the other ranks exit with it."""
    dist = distributed.init("auto" if opts.device == "auto" else opts.device.split(":")[0])
    try:
        if opts.decode == "gpu" and dist.device.type != "cuda":  # before any file is written
            raise UserError(f"--decode gpu: this rank runs on {dist.device}, with no CUDA GPU to decode on")
        model, config = load_model(opts.model)
        cfg = loader_config(opts, config, dist)
        if opts.out:
            parts.output_format(opts.out)
        job = planned(opts, cfg, model, config, dist)
        if job is None:
            return "", 2
        scorer = Scorer(model, config, dist.device, opts.top_k, opts.features)
        with Progress(dist, sum(job.units[i].count for i in job.todo)) as progress:
            stats = distributed.all_gather_object(score_rank(opts, job, cfg, scorer, dist, progress))
        return finish(opts, job, cfg, stats) if dist.is_main else ("", 0)
    finally:
        distributed.cleanup()


def planned(
    opts: PredictOptions, cfg: LoaderConfig, model: torch.nn.Module, config: dict, dist: distributed.Dist
) -> Job | None:
    """Rank 0's plan, on every rank; a refusal raised on rank 0 and None on the others (they exit)."""
    refusal, job = None, None
    if dist.is_main:
        try:
            ident = identity(opts, model_hash(model, config), config, dist.device.type == "cuda")
            job = plan(opts, cfg, ident)
        except (UserError, DataError) as exc:  # refused, or a shard that cannot be counted
            refusal = str(exc)
    refusal, job = distributed.broadcast_object((refusal, job) if dist.is_main else None)
    refusal = refusal or unshared(opts.out_dir)
    if refusal and dist.is_main:
        raise UserError(refusal)
    return None if refusal else job
