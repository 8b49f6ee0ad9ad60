"""Workers' reused shared batch buffers: the caller's batches are its own, nothing is overwritten,
a worker never takes a buffer that was not handed back, and never waits for one."""

import ctypes
import gc
import itertools
import multiprocessing
import os
import pickle
import sys
import threading

import numpy as np
import pytest
import torch

from wdsdist.data.delivery.batches import collate, collate_samples, finish_batches, unbatch_samples
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.delivery.sharedbatches import SharedBatches, plain_copy, plain_stack
from wdsdist.data.options import LoaderConfig
from wdsdist.data.sources import shardspec


def images(value: int, n: int = 3) -> list[torch.Tensor]:
    return [torch.full((3, 4, 4), value + i, dtype=torch.uint8) for i in range(n)]


def test_claimed_batches_are_copies_and_buffers_come_back():
    shared = SharedBatches(workers=1, buffers=2, shape=(3, 3, 4, 4))
    shared.restart(0)
    first, second = shared.fill(0, images(10)), shared.fill(0, images(20, n=2))
    assert first[2] != second[2] and second[3] == 2  # two buffers, a short batch keeps its length
    # More batches in flight than buffers (the DataLoader hands a worker the share of workers
    # that ended): no buffer, and the caller stacks the batch elsewhere rather than wait.
    assert shared.fill(0, images(30)) is None
    got = shared.claim(first)
    assert got.tolist() == torch.stack(images(10)).tolist()
    third = shared.fill(0, images(30))  # the buffer handed back is the one taken
    assert third[2] == first[2]
    assert got.tolist() == torch.stack(images(10)).tolist()  # the claimed copy is untouched
    assert tuple(shared.claim(second).shape) == (2, 3, 4, 4)


def test_a_restart_frees_every_buffer_and_ignores_late_releases():
    shared = SharedBatches(workers=2, buffers=1, shape=(3, 3, 4, 4))
    shared.restart(1)
    stale = shared.fill(1, images(1))
    shared.restart(1)  # a new iteration: the DataLoader dropped what was in flight
    fresh = shared.fill(1, images(2))
    shared.claim(stale)  # handed back too late: it must not free the buffer `fresh` is in
    assert shared.fill(1, images(3)) is None
    assert shared.claim(fresh).tolist() == torch.stack(images(2)).tolist()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores is the point
@pytest.mark.parametrize(
    "counts,workers,mode,nbatches",
    [
        ([9, 14, 11, 8], 2, "repeat", None),
        ([9, 14, 11, 8], 2, "epoch", 3),  # cut short: batches in flight are dropped at each epoch's end
        # Two of three workers end their epoch early and the DataLoader hands their share to the
        # one left: more batches in flight than it has buffers.
        ([40, 4, 4], 3, "epoch", 8),
    ],
)
def test_loader_batches_equal_those_without_shared_buffers(tiny_shards, counts, workers, mode, nbatches):
    """Every batch the caller keeps stays as it was received (no buffer is reused under it), over
    several epochs and the DataLoader resets between them, and equals the same loader's batch
    without shared buffers (images: until the first reset, after which the crops drawn depend on
    how many batches the workers had prefetched)."""
    shards = shardspec.expand(str(tiny_shards(counts)))
    base = dict(batch_size=4, workers=workers, mode=mode, image_size=8, shuffle_buffer=10, prefetch=1)
    runs, received = {}, []
    for reuse in (True, False):
        loader = make_loader(shards, 0, 1, LoaderConfig(**base, nbatches=nbatches, reuse_buffers=reuse))
        torch.manual_seed(0)  # the workers' seeds, so both runs crop alike
        batches = []
        for batch in itertools.chain.from_iterable(loader for _ in range(4)) if nbatches else loader:
            batches.append(batch)
            if reuse:
                received.append(batch["image"].clone())
            if len(batches) == (4 * nbatches if nbatches else 30):
                break
        runs[reuse] = batches
    assert (runs[True][0]["image"].ne(0)).any()  # real pixels
    assert all(torch.equal(b["image"], snap) for b, snap in zip(runs[True], received, strict=True))
    assert len(runs[True]) == len(runs[False])
    for i, (ours, plain) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert torch.equal(ours["id"], plain["id"]) and ours["label"].tolist() == plain["label"].tolist()
        if nbatches is None or i < nbatches:
            assert torch.equal(ours["image"], plain["image"])


def test_cross_worker_shuffle_samples_do_not_keep_their_batch_alive():
    """Each sample leaving a batch for the shuffle buffer owns its image: a view would pin the
    whole batch in memory until its last sample left the buffer."""
    shared = SharedBatches(workers=1, buffers=1, shape=(3, 3, 4, 4))
    shared.restart(0)
    ref = shared.fill(0, images(40))
    plain = {"image": torch.stack(images(50)), "label": [1, 2, 3], "id": [(0, 0, i) for i in range(3)]}
    batches = [{"shared": ref, "label": [4, 5, 6], "id": [(0, 0, i) for i in range(3, 6)], "bad": [(0, 0)] * 3}]
    batches.append(plain | {"bad": [(0, 0)] * 3, "key": ["a", "b", "c"]})
    samples = list(unbatch_samples(batches, shared))
    assert [s["label"] for s in samples] == [4, 5, 6, 1, 2, 3] and samples[3]["key"] == "a"
    for s in samples:
        assert s["image"].untyped_storage().nbytes() == 3 * 4 * 4  # its own, not its batch's
    assert samples[0]["image"].tolist() == images(40)[0].tolist()
    batch = collate_samples(samples[:4])
    assert batch["image"].tolist() == torch.stack([s["image"] for s in samples[:4]]).tolist()
    assert batch["id"].tolist() == [[0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 0, 0]] and "key" not in batch


def test_claimed_copies_reuse_a_batchs_memory_only_after_the_caller_lets_go_of_it():
    """The copies go into regions used again once a batch is dropped; a batch the caller keeps,
    or a view of it, is never written over; at most ``keep`` free regions wait."""
    shared = SharedBatches(workers=1, buffers=2, shape=(3, 3, 4, 4), channels_last=True)
    shared.restart(0)
    first = shared.claim(shared.fill(0, images(10)))
    view, where = first[1], first.data_ptr()
    del first  # the view keeps its storage: the region stays the caller's
    held = [shared.claim(shared.fill(0, images(20 + 10 * i))) for i in range(4)]
    assert where not in {b.data_ptr() for b in held} and shared.copies.free_regions() == 0
    assert view.tolist() == images(10)[1].tolist()
    assert all(b.tolist() == torch.stack(images(20 + 10 * i)).tolist() for i, b in enumerate(held))
    assert held[0].is_contiguous(memory_format=torch.channels_last)
    in_use = {b.data_ptr() for b in held}
    del held
    assert shared.copies.free_regions() == 2  # four came back, two are kept
    again = shared.claim(shared.fill(0, images(70)))
    assert again.data_ptr() in in_use and again.tolist() == torch.stack(images(70)).tolist()
    assert shared.copies.free_regions() == 1
    del view
    assert shared.copies.free_regions() == 2
    # Short batches, a size of their own each: a waiting region of another size is let go, so
    # sizes never pile up (one image: 3 x 4 x 4 bytes).
    for n in (2, 1, 2, 1):
        short = shared.claim(shared.fill(0, images(80, n=n)))
        assert tuple(short.shape) == (n, 3, 4, 4) and short.tolist() == torch.stack(images(80, n=n)).tolist()
        del short
        assert [size for size, _ in shared.copies._free] == [48 * n]
    del again
    assert [size for size, _ in shared.copies._free] == [48, 144]  # the newest last; at most two
    assert pickle.loads(pickle.dumps(shared.copies)).free_regions() == 0  # as a spawned worker gets it


def test_the_first_claim_copies_into_the_region_reserved_for_it():
    """finish_batches reserves the first copy's region while the workers start: the first claim
    takes it, and a second reserve while one of that size waits adds none."""
    shared = SharedBatches(workers=1, buffers=2, shape=(3, 3, 4, 4), channels_last=True)
    shared.restart(0)
    shared.copies.reserve(3 * 48)
    shared.copies.reserve(3 * 48)
    assert [size for size, _ in shared.copies._free] == [144]
    region = shared.copies._free[0][1]
    first = shared.claim(shared.fill(0, images(5)))
    assert first.data_ptr() == np.frombuffer(region, dtype=np.uint8).ctypes.data
    assert shared.copies.free_regions() == 0 and first.tolist() == torch.stack(images(5)).tolist()


def _resident_pages(tensor: torch.Tensor) -> int:
    """How many of the pages under a tensor's bytes are in memory (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() - tensor.data_ptr() % page
    pages = (tensor.data_ptr() + tensor.numel() - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * page, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")
def test_populate_makes_a_workers_first_buffer_resident_and_no_other():
    """The warm start's leader populates its first buffer beside its decodes; the other buffers
    keep costing nothing until written (shared_uint8)."""
    shared = SharedBatches(workers=2, buffers=3, shape=(8, 3, 64, 64), channels_last=True)
    first, second, other = shared.buffers[0][0], shared.buffers[0][1], shared.buffers[1][0]
    assert _resident_pages(first) == _resident_pages(second) == _resident_pages(other) == 0
    if not shared.populate(0):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    pages = (first.numel() + os.sysconf("SC_PAGE_SIZE") - 1) // os.sysconf("SC_PAGE_SIZE")
    assert _resident_pages(first) == pages
    assert _resident_pages(second) <= 1 and _resident_pages(other) == 0  # a page it shares with the first, at most
    shared.restart(0)
    batch = [torch.full((3, 64, 64), i, dtype=torch.uint8) for i in range(8)]
    assert torch.equal(shared.claim(shared.fill(0, batch)), torch.stack(batch))  # the populated pages hold it


def test_the_first_batch_taken_opens_the_warm_start_gate_before_the_caller_has_it():
    for finish in (finish_batches, unbatch_samples):
        gate, seen = threading.Event(), []
        rows = [(torch.full((3, 4, 4), i, dtype=torch.uint8), i, (0, 0, i), (0, 0), None, ()) for i in range(4)]
        batches = [collate(rows[:2]), collate(rows[2:])]
        kw = {"pin_memory": False} if finish is finish_batches else {}
        it = finish(batches, None, gate=gate, **kw)
        assert not gate.is_set()
        for _ in it:
            seen.append(gate.is_set())
        assert seen and all(seen), finish.__name__


def test_a_batch_freed_by_a_garbage_collection_inside_a_claim_comes_back_without_a_hang():
    """A batch in a reference cycle goes when the garbage collector runs, which can be in the
    middle of the next claim, on the same thread: its region must come back then (a lock held
    by the claim would hang the loader)."""
    shared = SharedBatches(workers=1, buffers=2, shape=(4, 3, 8, 8), channels_last=True)
    shared.restart(0)
    imgs = [torch.full((3, 8, 8), i, dtype=torch.uint8) for i in range(4)]
    done = []

    def claims() -> None:
        old = gc.get_threshold()
        try:
            # A cycle holding a batch, then the collector's threshold set so that it runs at the
            # n-th allocation of the next claim: over n, somewhere inside the claim's own steps.
            for n in range(1, 40):
                gc.collect(0)  # resets the count the threshold is compared with
                batch = {"image": shared.claim(shared.fill(0, imgs))}
                batch["self"] = batch  # only the collector frees it
                del batch
                gc.set_threshold(n)
                claimed = shared.claim(shared.fill(0, imgs))
                gc.set_threshold(*old)
                assert claimed.tolist() == torch.stack(imgs).tolist()
                del claimed
            done.append(True)
        finally:
            gc.set_threshold(*old)

    thread = threading.Thread(target=claims, daemon=True)
    thread.start()
    thread.join(60)
    assert done, "a claim hung (or failed) while a collection gave a region back"
    assert shared.copies.free_regions() <= 2


def _distinct(n: int, shape=(3, 5, 7)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen) for _ in range(n)]


def test_channels_last_buffers_hold_hwc_images_and_the_copies_keep_that_layout():
    """Region-decoded images are H x W x C in memory: buffers and copies keep them so (no
    transpose), and every pixel lands where it belongs, also for contiguous images stacked in."""
    hwc = [t.permute(1, 2, 0).contiguous().permute(2, 0, 1) for t in _distinct(3)]  # as jpegcrop's
    mixed = [hwc[0], hwc[1].contiguous(), hwc[2]]
    shared = SharedBatches(workers=1, buffers=2, shape=(3, 3, 5, 7), channels_last=True)
    shared.restart(0)
    ref = shared.fill(0, mixed)
    batch = shared.claim(ref)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(batch, torch.stack(mixed))
    rows = shared.claim_rows(shared.fill(0, hwc))
    assert all(torch.equal(r, t) and r.stride() == (1, 21, 3) for r, t in zip(rows, hwc, strict=True))


def test_plain_copy_and_stack_keep_layouts_and_values():
    nchw = torch.stack(_distinct(4))
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    for source in (nchw, nhwc, nchw[:, :, 1:4], nhwc[1:3]):  # a sliced, non-dense source too
        copy = plain_copy(source)
        assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    assert plain_copy(nhwc).stride() == nhwc.stride()
    images = list(nhwc)  # each (3, 5, 7) with H x W x C strides
    stacked = plain_stack(images)
    assert torch.equal(stacked, nchw) and stacked.is_contiguous(memory_format=torch.channels_last)
    mixed = plain_stack([images[0], nchw[1], images[2], nchw[3, :, :, :]])
    assert torch.equal(mixed, nchw)
    assert torch.equal(plain_stack(list(nchw)), nchw) and plain_stack(list(nchw)).is_contiguous()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_buffers_take_memory_only_when_a_worker_writes_them_and_forked_writes_are_seen():
    """With forked workers the buffers are an anonymous shared mapping: made at once, a page
    taken only when written (torch's share_memory_ zeroed all 192 MB here before the first
    batch), and what a forked worker writes is what the main process reads."""
    assert multiprocessing.get_start_method(allow_none=True) in (None, "fork")
    before = _rss_bytes()
    shared = SharedBatches(workers=2, buffers=4, shape=(64, 3, 224, 224), channels_last=True)
    assert _rss_bytes() - before < 16 << 20  # 2 x 4 x 9.6 MB reserved, almost none of it taken
    shared.restart(0)
    pid = os.fork()
    if pid == 0:  # a worker: fill one buffer, then hand its reference back by exit status
        try:
            ref = shared.fill(0, [torch.full((3, 224, 224), 9, dtype=torch.uint8)] * 5)
            os._exit(ref[2])
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    k = os.waitstatus_to_exitcode(status)
    assert k == 0  # the lowest free buffer
    batch = shared.claim((0, 1, k, 5, 224))
    assert tuple(batch.shape) == (5, 3, 224, 224) and bool((batch == 9).all())
    assert not bool(shared.buffers[0][1].any())  # another buffer: untouched, zero
