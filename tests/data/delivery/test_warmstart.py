"""loader.warm_start: worker 0 makes its first batch on several threads while the other workers
wait, and the batches stay the same, image for image (warmstart.py)."""

import threading

import pytest
import torch

from tests.helpers.shards import warm_shards
from wdsdist.data.decode import jpegcrop
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.delivery.warmstart import WarmStart
from wdsdist.data.options import LoaderConfig
from wdsdist.errors import DataError

needs_lib = pytest.mark.skipif(isinstance(jpegcrop.load(), str), reason="jpegcrop cannot be built here")


def _batches(index, n, **kw):
    cfg = LoaderConfig(batch_size=8, workers=2, image_size=32, **kw)
    loader = make_loader(index, 0, 1, cfg)
    torch.manual_seed(0)  # the workers' seeds come from it
    it = iter(loader)
    got = [next(it)]
    gate = loader.dataset.gate
    # The main process opened the gate with the first batch (the leader, in repeat mode, never ends).
    assert gate.is_set() if cfg.warm_start else gate is None
    return got + [next(it) for _ in range(n - 1)]


@needs_lib
def test_a_warm_start_gives_the_same_batches_image_for_image(tmp_path):
    index = warm_shards(tmp_path / "s", [40, 40])
    warm = _batches(index, 10, warm_start=True)
    cold = _batches(index, 10, warm_start=False)
    # Worker 0's first batch (made on threads) passed over samples that failed after their draws.
    assert warm[0]["bad"][:, 0].sum() > 0
    for a, b in zip(warm, cold, strict=True):
        for key in ("id", "label", "bad", "image"):
            assert torch.equal(a[key], b[key]), key


def _items(n, fail=(), ran=None):
    """(seq, sample, prepared) as stream._prepared gives them; each function notes its thread."""

    def make(i):
        def pixels():
            ran[i] = threading.current_thread().name
            if i in fail:
                raise DataError(f"sample {i}: cannot decode image")
            return f"image {i}", i

        return pixels

    return [(i, {"__key__": str(i)}, make(i)) for i in range(n)]


def test_the_leader_makes_its_first_rows_on_threads_in_order_and_leaves_the_gate_to_the_main_process():
    ran, gate, seen = {}, threading.Event(), []
    warm = WarmStart(gate, leader=True, rows=4, threads=2)
    warm.ahead(lambda: ran.setdefault("ahead", threading.current_thread().name))
    for seq, _, done in warm.run(_items(9, fail={2}, ran=ran)):
        seen.append((seq, done if not isinstance(done, DataError) else "error"))
        if not isinstance(done, DataError):
            warm.row()
    assert [s for s, _ in seen] == list(range(9))
    assert seen[2] == (2, "error")  # a failure in its place, and it is not a row
    assert seen[4] == (4, ("image 4", 4))
    # The function asked ahead, four rows and the failure among them on the pool's threads; the
    # rest on the caller's, once the pool is gone.
    assert ran["ahead"].startswith("warm") and all(ran[i].startswith("warm") for i in range(5))
    assert all(ran[i] == threading.current_thread().name for i in range(5, 9))
    assert warm.pool is None
    # The followers wait until the main process has the batch (batches.opened), or until the
    # leader's stream ends, as here.
    assert not gate.is_set()
    warm.done()
    assert gate.is_set()


def test_a_follower_waits_for_the_gate_only_before_its_first_pixels():
    calls, ran = [], {}

    class Gate:
        def wait(self, timeout):
            calls.append((timeout, sorted(ran)))

    items = [(0, {}, "__failed__"), (1, {}, DataError("sample 1: no 'jpg' in it"))] + _items(4, ran=ran)[2:]
    warm = WarmStart(Gate(), leader=False, rows=8, threads=2, wait_s=7.0)
    got = [(seq, done) for seq, _, done in warm.run(items)]
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert calls == [(7.0, [])]  # once, after the placeholder and the failed check, before any pixels
    assert ran == {2: threading.current_thread().name, 3: threading.current_thread().name}


def test_a_leader_with_one_thread_or_no_rows_to_warm_holds_nobody():
    for threads, rows in ((1, 8), (4, 0)):
        gate = threading.Event()
        warm = WarmStart(gate, leader=True, rows=rows, threads=threads)
        assert gate.is_set() and warm.pool is None


def test_a_leader_closed_before_its_rows_cancels_what_waits_and_opens_the_gate():
    ran, gate = {}, threading.Event()
    warm = WarmStart(gate, leader=True, rows=50, threads=2)
    rows = warm.run(_items(50, ran=ran))
    next(rows)
    rows.close()
    warm.done()  # as stream._rows does when its generator ends
    assert gate.is_set() and warm.pool is None
