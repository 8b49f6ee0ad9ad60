"""Forked DataLoader workers keep sharing their parent's memory: what a worker inherited is out of
its garbage collector's reach (workers.worker_init freezes it first thing), so a full collection
in a worker copies none of the parent's heap, and the parent's collector is left as it is."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path

import pytest

from wdsdist.data.delivery import pipeline
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.delivery.workers import worker_init
from wdsdist.data.options import LoaderConfig

BALLAST = 400_000  # lists in the parent: enough that a collection touching them writes many MB


@pytest.fixture(autouse=True)
def unfrozen_collector():
    """The collector as a process that froze nothing has it: the suite froze what each pytest
    process had imported (tests/conftest.py); thawed for these tests, frozen again after."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def ballast() -> list[list]:
    """The parent's Python heap for these tests, made only by them (not at the suite's import)."""
    return [[i, str(i)] for i in range(BALLAST)]  # lists: the collector tracks every one


def _private_dirty_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))


def _report(out: Path, worker_id: int) -> None:
    """In a worker: its freeze count and what a full collection made it copy of its parent's pages."""
    before = _private_dirty_kb()
    gc.collect()
    grew = _private_dirty_kb() - before
    (out / f"worker{worker_id}").write_text(f"{gc.get_freeze_count()} {grew}")


def _probe(out: Path, worker_id: int) -> None:
    worker_init(worker_id)
    _report(out, worker_id)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_a_workers_full_collection_copies_none_of_its_parents_heap(tiny_shards, tmp_path, monkeypatch):
    index = tiny_shards([8, 8])
    heap = ballast()
    monkeypatch.setattr(pipeline, "worker_init", lambda worker_id: _probe(tmp_path, worker_id))
    cfg = LoaderConfig(batch_size=4, workers=2, image_size=8, mode="repeat", shuffle_buffer=0)
    loader = make_loader(str(index), 0, 1, cfg)
    batches = iter(loader)
    next(batches), next(batches)  # one from each worker: both have run their init
    assert gc.get_freeze_count() == 0  # the parent's collector untouched
    for worker in range(2):
        frozen, grew_kb = map(int, (tmp_path / f"worker{worker}").read_text().split())
        assert frozen >= len(heap)
        # Unfrozen, the collection writes to every one of the ballast's 400,000 lists: tens of MB.
        assert grew_kb < 8 * 1024, f"worker {worker}'s collection copied {grew_kb} kB of its parent's pages"
    del batches, heap


def test_without_it_a_workers_collection_copies_the_parents_heap(tmp_path):
    """The measure above can fail: a fork without the freeze copies the ballast's pages."""
    heap = ballast()
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_report, args=(tmp_path, 9))
    proc.start()
    proc.join()
    del heap
    frozen, grew_kb = map(int, (tmp_path / "worker9").read_text().split())
    assert frozen == 0 and grew_kb > 16 * 1024
