"""A conversion to shards, planned, in parallel and resumable: list the source, fix the plan, check
the output against a plan saved there before (the same: go on; another: refuse, changing nothing),
write the shards not yet finished with N worker processes (and, under torchrun, only this rank's
share: shards r, r + world, ...), then the index once every shard exists (rank 0).

A shard is finished when its record names this plan and the shard's size is the record's; so a
run killed at any point, started again with the same command, keeps what was finished and
writes the rest, and the result is byte for byte that of a run never stopped."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from wdsdist.data.sources.index import OFFSET_EVERY, index_bytes, index_desc
from wdsdist.errors import UserError
from wdsdist.tools import planning
from wdsdist.tools.listing import Inputs, list_source
from wdsdist.tools.outstore import LocalStore, ObjectStore, open_store
from wdsdist.tools.shardwrite import Job, record_name, shard_name, write_shard

log = logging.getLogger(__name__)
POLL_S = 1.0  # rank 0 looks this often for the other ranks' records while it waits for them


@dataclass(frozen=True)
class Run:
    """How this process takes part: where to, with how many workers, which rank of how many."""

    shards: str
    workers: int = 1
    rank: int = 0
    world: int = 1
    strict: bool = False
    offset_every: int = OFFSET_EVERY  # the index's offset tables (not the shards': not in the plan)


class Progress:
    """What a conversion reports as it goes; the command line draws a bar of it (the library prints nothing)."""

    def start(self, total: int, done: int) -> None: ...

    def update(self, images: int, nbytes: int) -> None: ...

    def close(self) -> None: ...


def convert(inputs: Inputs, options: planning.Options, run: Run, progress: Progress | None = None) -> dict:
    """Convert; return the index (rank 0) or this rank's share's summary, with "written", "kept",
    "skipped" (name, reason) and "seconds"."""
    began = time.monotonic()
    listing = list_source(inputs)
    if run.strict and listing.skipped:
        name, why = listing.skipped[0]
        raise UserError(f"--strict: {listing.path}:{name}: {why}")
    plan = planning.make_plan(listing, options)
    store = open_store(run.shards)
    try:
        digest = planning.digest(plan)
        finished = _check_output(store, plan, digest, options.prefix, run.rank)
        if finished is None:  # the index of this plan is there: nothing to do
            desc = json.loads(store.read(f"{options.prefix}.index.json"))
            return desc | {"written": 0, "kept": desc["nshards"], "seconds": time.monotonic() - began}
        nshards = len(plan["ends"])
        todo = [i for i in range(run.rank, nshards, run.world) if i not in finished]
        job = Job(plan, digest, store.staging, run.strict, inputs.image_column)
        progress = progress or Progress()
        share = [i for i in range(run.rank, nshards, run.world)]
        progress.start(sum(_count(plan, i) for i in share), sum(_count(plan, i) for i in share if i in finished))
        try:
            records = _write_all(job, store, todo, run.workers, progress)
        finally:
            progress.close()
        summary = {
            "written": len(records),
            "kept": len(share) - len(todo),
            "seconds": time.monotonic() - began,
            "images": sum(r["nsamples"] for r in records),
            "bytes": sum(r["bytes"] for r in records),
        }
        if run.rank != 0:
            return summary | {"nshards": len(share), "rank": run.rank}
        records = _wait_for_all(store, plan, digest, nshards)
        return _write_index(store, plan, digest, records, run.offset_every) | summary
    finally:
        store.close()


def _count(plan: dict, shard: int) -> int:
    start, end = planning.shard_range(plan, shard)
    return end - start


def _check_output(store, plan: dict, digest: str, prefix: str, rank: int) -> dict[int, dict] | None:
    """The finished shards of this plan in the output ({shard: record}); None when its index is
    there already. Another conversion's plan there, or an index without a plan, is refused in one
    line before anything is written. Rank 0 saves a new plan; the other ranks wait for it."""
    plan_name, index_name = f"{prefix}.plan.json", f"{prefix}.index.json"
    raw, index = store.read(plan_name), store.read(index_name)
    while raw is None and index is None and rank != 0:
        time.sleep(POLL_S)  # rank 0 is listing the source, or saving the plan (a failed rank 0 ends the job)
        raw, index = store.read(plan_name), store.read(index_name)
    if raw is None:
        if index is not None:
            raise UserError(
                f"--shards {store.path(index_name)} was written by another command (it has no plan beside it); "
                "choose another --shards folder or --prefix, or remove that set"
            )
        store.write(plan_name, planning.plan_bytes(plan))
        return {}
    try:
        saved = json.loads(raw)
    except ValueError:
        raise UserError(f"{store.path(plan_name)}: not a readable plan; remove it to start again") from None
    why = planning.difference(saved, plan)
    if why is not None:
        raise UserError(
            f"--shards {store.where} holds another conversion of prefix {prefix} ({why}); choose another "
            f"--shards folder or --prefix, or remove {store.path(plan_name)} and its shards to start again"
        )
    if index is not None and json.loads(index).get("plan") == digest:
        return None
    return _finished(store, prefix, digest, len(plan["ends"]))


def _finished(store, prefix: str, digest: str, nshards: int) -> dict[int, dict]:
    done = {}
    for i in range(nshards):
        raw = store.read(record_name(prefix, i))
        if raw is None:
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            continue  # a torn record: the shard is written again
        if rec.get("plan") == digest and store.size(shard_name(prefix, i)) == rec.get("bytes"):
            done[i] = rec
    return done


def _publish(job: Job, store, record: dict) -> dict:
    prefix = job.plan["options"]["prefix"]
    store.publish(shard_name(prefix, record["shard"]))
    store.write(record_name(prefix, record["shard"]), json.dumps(record).encode())
    return record


_WORKER: dict = {}  # in a worker process: its Job, store and shared counters


def _init_worker(job: Job, store, images, nbytes) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _WORKER.update(job=job, store=store, images=images, nbytes=nbytes)


def _die_with_parent() -> None:
    """A worker ends with the process that started it (a kill -9 of the command ends them all),
    instead of writing on with nobody to collect its shards."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _counted(n: int, size: int) -> None:
    with _WORKER["images"].get_lock():
        _WORKER["images"].value += n
    with _WORKER["nbytes"].get_lock():
        _WORKER["nbytes"].value += size


def _pool_shard(shard: int) -> dict:
    job, store = _WORKER["job"], _WORKER["store"]
    return _publish(job, store, write_shard(job, shard, _counted))


def _write_all(job: Job, store, todo: list[int], workers: int, progress: Progress) -> list[dict]:
    if workers <= 1 or len(todo) <= 1:
        records = []
        for shard in todo:
            records.append(_publish(job, store, write_shard(job, shard, progress.update)))
            _kill_for_test(len(records))
        return records
    ctx = mp.get_context("fork")
    images, nbytes = ctx.Value("q", 0), ctx.Value("q", 0)
    records, seen = [], (0, 0)
    init = (job, store, images, nbytes)
    pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx, initializer=_init_worker, initargs=init)
    try:
        pending = {pool.submit(_pool_shard, shard) for shard in todo}
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            now = (images.value, nbytes.value)
            progress.update(now[0] - seen[0], now[1] - seen[1])
            seen = now
            for future in done:
                if future.exception() is not None:
                    raise future.exception()
                records.append(future.result())
                _kill_for_test(len(records))
    except BaseException:
        # A failed shard (--strict) or Ctrl-C: the others stop now, not when their shards end;
        # what they were writing is a temporary the next run removes.
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return records


def _kill_for_test(written: int) -> None:
    """TEST HOOK: WDSDIST_TEST_KILL_AFTER_SHARDS=N kills this process (SIGKILL, as the OOM killer
    would) once it has written N shards, so a test can resume from a known state."""
    after = os.environ.get("WDSDIST_TEST_KILL_AFTER_SHARDS")
    if after and written >= int(after):
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_all(store, plan: dict, digest: str, nshards: int) -> list[dict]:
    """Every shard's record (rank 0, after its own share): the other ranks' appear as they finish.
    A rank that fails ends the job through torchrun, so this never waits for a dead rank."""
    prefix = plan["options"]["prefix"]
    done = _finished(store, prefix, digest, nshards)
    noted = time.monotonic()
    while len(done) < nshards:
        if time.monotonic() - noted > 60:
            log.info("waiting for %d of %d shards from the other ranks", nshards - len(done), nshards)
            noted = time.monotonic()
        time.sleep(POLL_S)
        done |= {i: r for i, r in _finished(store, prefix, digest, nshards).items()}
    return [done[i] for i in range(nshards)]


def _write_index(store, plan: dict, digest: str, records: list[dict], offset_every: int) -> dict:
    prefix = plan["options"]["prefix"]
    index = store.path(f"{prefix}.index.json")
    skipped = [s for s in plan["skipped"]] + [s for r in records for s in r["skipped"]]
    nonempty = [r for r in records if r["nsamples"]]
    desc = index_desc(
        index,
        [(store.path(shard_name(prefix, r["shard"])), r["nsamples"]) for r in nonempty],
        offsets=[r["offsets"] for r in nonempty],
        offset_every=offset_every,
        name=prefix,
        classes=plan["classes"],
        source=plan["source"]["path"],
        plan=digest,
        nskipped=len(skipped),
        skipped=[{"name": name, "reason": why} for name, why in skipped],
    )
    store.write(f"{prefix}.index.json", index_bytes(desc))
    store.remove_tree(f".{prefix}.work")
    return desc


__all__ = ["Inputs", "LocalStore", "ObjectStore", "Progress", "Run", "convert"]
