"""The loader: it yields exactly what the planner says, every sample once, and resumes exactly."""

import io
import itertools
import tarfile
from collections import Counter

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from tests.conftest import jpeg
from wdsdist.data.delivery.pipeline import RankLoader, check_layout, make_eval_loader, make_loader
from wdsdist.data.delivery.steps import primed as _primed
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan.order import shard_order
from wdsdist.data.plan.resume import ResumePoint
from wdsdist.data.plan.splits import plan
from wdsdist.data.sources import shardspec
from wdsdist.errors import DataError, UserError

COUNTS = [7, 13, 5, 11, 9, 6, 12]  # uneven on purpose


def cfg(**kw):
    # split=shards: these test whole-shard splitting (split=samples, the epoch default: plan/test_sample_split.py)
    base = dict(batch_size=4, workers=2, mode="epoch", split="shards", image_size=8, with_keys=True, shuffle_buffer=20)
    return LoaderConfig(**(base | kw))


def one_epoch(loader):
    """Everything one pass of the rank's underlying WebLoader yields (no cut applied)."""
    return list(loader.loader)


GRID = list(itertools.product([1, 2, 3], [0, 1, 2], [3, 5], [False, True], [1, 2], [0, 6]))


@pytest.mark.parametrize("world,workers,bs,partial,dsrepeat,cross", GRID[::5] + GRID[1::11])
def test_loader_yields_what_the_planner_says(tiny_shards, world, workers, bs, partial, dsrepeat, cross):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(batch_size=bs, workers=workers, partial=partial, dsrepeat=dsrepeat, cross_shuffle=cross)
    p = plan(COUNTS, world, workers, bs, partial=partial, dsrepeat=dsrepeat, rebatch=cross > 0)
    for rank in range(world):
        batches = one_epoch(RankLoader(shards, rank, world, c, None, p))
        assert len(batches) == p.ranks[rank].available, (rank, p.batches)
        sizes = [len(b["label"]) for b in batches]
        assert sum(sizes) == (p.ranks[rank].samples if partial else bs * len(batches))
        assert all(s == bs for s in sizes) or partial


def test_every_sample_once_per_epoch_when_the_layout_divides(tiny_shards):
    shards = shardspec.expand(str(tiny_shards([10] * 12)))
    world, c = 2, cfg(batch_size=5, workers=3, cross_shuffle=10)
    loaders = [make_loader(shards, r, world, c) for r in range(world)]
    orders = []
    for _epoch in range(2):
        keys = [k for loader in loaders for b in loader for k in b["key"]]
        assert Counter(keys) == Counter(f"s{i:07d}" for i in range(120))
        orders.append(keys)
    assert orders[0] != orders[1]  # reshuffled every epoch


def test_batches_are_uint8_nchw_with_int64_labels(tiny_shards):
    shards = shardspec.expand(str(tiny_shards([6, 6])))
    (batch, *_) = list(make_loader(shards, 0, 1, cfg(batch_size=3, image_size=8, nbatches="auto")))
    assert batch["image"].dtype.is_floating_point is False and str(batch["image"].dtype) == "torch.uint8"
    assert tuple(batch["image"].shape) == (3, 3, 8, 8)
    assert str(batch["label"].dtype) == "torch.int64"
    assert tuple(batch["id"].shape) == (3, 3)


def test_shard_order_changes_per_epoch_and_is_the_same_on_every_rank(tiny_shards):
    shards = shardspec.expand(str(tiny_shards([1] * 8)))
    e0, e0_again, e1 = shard_order(shards, 5, 0, 1), shard_order(shards, 5, 0, 1), shard_order(shards, 5, 1, 1)
    assert e0 == e0_again and e0 != e1 and sorted(s.url for s in e0) == sorted(s.url for s in shards)
    twice = shard_order(shards, 5, 0, 2)
    assert len(twice) == 16 and Counter(s.url for s in twice) == Counter(2 * [s.url for s in shards])


@pytest.mark.parametrize("cross,workers", [(0, 2), (12, 2), (12, 0)])
def test_resume_mid_epoch_skips_exactly_what_was_consumed(tiny_shards, cross, workers):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(batch_size=4, workers=workers, cross_shuffle=cross, nbatches="auto")
    full = make_loader(shards, 0, 1, c)
    n = full.epoch_batches
    first = []
    for i, b in enumerate(full):
        first += b["key"]
        if i + 1 == 7:
            break
    state = full.state_dict()
    assert state["batches"] == 7
    resumed = make_loader(shards, 0, 1, c, state=state)
    rest = [b["key"] for b in resumed]
    assert len(rest) == n - 7  # the epoch keeps its length: every rank stays in step
    seen = first + [k for keys in rest for k in keys]
    assert len(seen) == len(set(seen)) == n * 4  # no sample twice, and the epoch is full
    # The next epoch starts fresh and complete.
    assert sum(len(b["key"]) for b in resumed) == n * 4


def test_state_at_the_end_of_an_epoch_points_at_the_next(tiny_shards):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    loader = make_loader(shards, 0, 1, cfg(nbatches=5))
    assert len(list(loader)) == 5
    state = loader.state_dict()
    assert state["point"]["epoch"] == 1 and state["batches"] == 0
    assert len(list(make_loader(shards, 0, 1, cfg(nbatches=5), state=state))) == 5


def test_resume_in_repeat_mode_never_repeats_a_sample_within_the_epoch(tiny_shards):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(mode="repeat", cross_shuffle=8)
    loader = make_loader(shards, 0, 1, c)
    first = [k for b in itertools.islice(iter(loader), 6) for k in b["key"]]
    resumed = make_loader(shards, 0, 1, c, state=loader.state_dict())
    total = sum(COUNTS)
    # Read to the end of epoch 0 (ids carry the epoch) and check the union is the data set.
    rest = []
    for b in resumed:
        if int(b["id"][:, 0].max()) > 0:
            break
        rest += b["key"]
    assert not set(first) & set(rest)
    assert len(set(first) | set(rest)) >= total - 4 * 2  # at most the last partial batches dropped


def test_repeat_mode_runs_through_epochs_without_dropping_and_resumes_across_them(tiny_shards):
    """Workers go from one epoch into the next inside a batch: no sample of an epoch is left
    out, and a resume taken while workers straddle epochs delivers every sample once per epoch."""
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(mode="repeat")
    loader = make_loader(shards, 0, 1, c)
    first = list(itertools.islice(iter(loader), 20))  # 80 samples: every worker is in its epoch 1
    state = loader.state_dict()
    assert [list(eps) for eps in state["point"]["workers"].values()] == [["1"], ["1"]]
    resumed = list(itertools.islice(iter(make_loader(shards, 0, 1, c, state=state)), 30))
    by_epoch: dict[int, list[str]] = {}
    for b in first + resumed:
        for (epoch, _, _), key in zip(b["id"].tolist(), b["key"], strict=True):
            by_epoch.setdefault(epoch, []).append(key)
    everything = Counter(f"s{i:07d}" for i in range(sum(COUNTS)))
    assert Counter(by_epoch[0]) == everything and Counter(by_epoch[1]) == everything
    assert any(len(set(b["id"][:, 0].tolist())) == 2 for b in first)  # a batch ends one epoch, starts the next


def test_resume_with_a_cross_shuffle_larger_than_an_epoch_loses_nothing(tiny_shards):
    """The cross-worker shuffle buffer empties at each epoch's end, so samples waiting in it are
    never taken for consumed when a worker's next epoch shows (the buffer here holds more than
    a worker's epoch)."""
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    c = cfg(mode="repeat", cross_shuffle=40)
    loader = make_loader(shards, 0, 1, c)
    first = list(itertools.islice(iter(loader), 18))
    resumed = list(itertools.islice(iter(make_loader(shards, 0, 1, c, state=loader.state_dict())), 30))
    by_epoch: dict[int, list[str]] = {}
    for b in first + resumed:
        for (epoch, _, _), key in zip(b["id"].tolist(), b["key"], strict=True):
            by_epoch.setdefault(epoch, []).append(key)
    for epoch in (0, 1, 2):
        keys = by_epoch[epoch]
        assert len(keys) == len(set(keys)) == sum(COUNTS) // 4 * 4  # all but the last partial batch


def test_resume_state_of_the_previous_format_still_loads():
    point = ResumePoint.from_state({"epoch": 3, "workers": {"1": [5, [7, 9]]}})
    assert point.workers == {1: {3: (5, frozenset({7, 9}))}} and point.first_epoch(0) == 3
    assert ResumePoint.from_state(point.state()) == point


def test_resume_with_other_worker_count_is_refused(tiny_shards):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    loader = make_loader(shards, 0, 1, cfg(nbatches=3))
    next(iter(loader))
    with pytest.raises(UserError, match="saved with 1 rank x 2 workers, now 1 rank x 1 worker"):
        make_loader(shards, 0, 1, cfg(nbatches=3, workers=1), state=loader.state_dict())


def test_check_layout_refuses_what_would_hang(tiny_shards):
    shards = shardspec.expand(str(tiny_shards(COUNTS)))
    with pytest.raises(UserError, match=r"unequal batch counts per epoch \(\d+\.\.\d+\).*use split=samples"):
        check_layout(shards, 2, cfg())
    with pytest.raises(UserError, match="worker 2 gets no shard"):
        check_layout(shards, 3, cfg(workers=3, mode="repeat"))
    # Ranks deliver 8 and 6 batches; 12 needs each worker to read its shards twice.
    with pytest.raises(UserError, match=r"nbatches=12 is more than 2 ranks .* use nbatches<=6 or use dsrepeat=2"):
        check_layout(shards, 2, cfg(nbatches=12))
    assert check_layout(shards, 2, cfg(nbatches=12, dsrepeat=2)).batches == [12, 12]
    remote = [shardspec.Shard("http://127.0.0.1:9/x.tar")] * 4
    with pytest.raises(UserError, match="epoch mode needs sample counts"):
        check_layout(remote, 2, cfg())
    assert check_layout(remote, 2, cfg(mode="repeat")) is None


def test_epoch_mode_counts_local_shards_without_an_index(tiny_shards):
    index = tiny_shards(COUNTS)
    shards = shardspec.expand(f"{index.parent}/tiny-*.tar")
    # One rank, two workers: worker 0 reads shards 0, 2, 4, 6 and worker 1 shards 1, 3, 5.
    expected = sum(COUNTS[0::2]) // 4 + sum(COUNTS[1::2]) // 4
    assert check_layout(shards, 1, cfg(nbatches="auto")).batches == [expected]
    assert len(list(make_loader(shards, 0, 1, cfg(nbatches="auto")))) == expected


def test_eval_loader_counts_every_sample_once_on_uneven_layouts(tiny_shards):
    shards = shardspec.expand(str(tiny_shards([5, 9, 3, 7, 4])))
    for world in (1, 2, 3, 6):
        keys = []
        for rank in range(world):
            keys += [k for b in make_eval_loader(shards, rank, world, cfg(workers=2)) for k in b["key"]]
        assert Counter(keys) == Counter(f"s{i:07d}" for i in range(28)), world


def _write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_png_grayscale_keys_with_folders_and_labels_without_newline(tmp_path):
    gray = io.BytesIO()
    Image.fromarray(np.full((9, 7), 128, dtype=np.uint8), mode="L").save(gray, format="PNG")
    path = tmp_path / "mixed.tar"
    _write_tar(
        path,
        [
            ("a/b/one.png", gray.getvalue()),
            ("a/b/one.cls", b"3"),
            ("c/two.jpeg", jpeg(1)[0]),
            ("c/two.cls", b"4\n"),
        ],
    )
    (batch,) = list(make_eval_loader([shardspec.Shard(str(path), 2)], 0, 1, cfg(workers=0)))
    assert batch["key"] == ["a/b/one", "c/two"]
    assert batch["label"].tolist() == [3, 4]
    assert tuple(batch["image"].shape) == (2, 3, 8, 8)


@pytest.mark.parametrize(
    "members,message",
    [
        ([("k1.jpg", b"not an image"), ("k1.cls", b"1")], r"bad.tar: sample 'k1': cannot decode image"),
        ([("k1.jpg", jpeg(1)[0])], r"bad.tar: sample 'k1': no 'cls' in it \(has jpg\)"),
        ([("k1.txt", b"x"), ("k1.cls", b"1")], r"bad.tar: sample 'k1': no 'jpg;jpeg;png' in it"),
        ([("k1.jpg", jpeg(1)[0]), ("k1.cls", b"cat")], r"bad.tar: sample 'k1': label b'cat' is not an integer"),
    ],
)
def test_bad_samples_name_the_shard_and_key(tmp_path, members, message, capfd):
    path = tmp_path / "bad.tar"
    good = [(f"g{i}.jpg", jpeg(i)[0]) for i in range(3)] + [(f"g{i}.cls", b"1") for i in range(3)]
    _write_tar(path, members + sorted(good))  # the bad one first: its count rides on the next
    with pytest.raises(DataError, match=message):
        list(make_eval_loader([shardspec.Shard(str(path), 4)], 0, 1, cfg(workers=0, strict=True)))
    # By default the sample is skipped with a warning naming it, and counted in the batch.
    batches = list(make_eval_loader([shardspec.Shard(str(path), 4)], 0, 1, cfg(workers=0)))
    assert sum(len(b["label"]) for b in batches) == 3
    assert "warning: skipped:" in capfd.readouterr().err
    assert int(sum(b["bad"][:, 0].sum() for b in batches)) == 1


def test_a_shard_that_is_not_a_tar_is_named(tmp_path):
    path = tmp_path / "junk.tar"
    path.write_bytes(b"\x01" * 2000)
    loader = RankLoader([shardspec.Shard(str(path), 1)], 0, 1, cfg(workers=0, mode="repeat", strict=True))
    with pytest.raises(DataError, match="junk.tar: cannot read shard: ReadError: invalid header$"):
        next(iter(loader))
    # Not strict: skipped, but a worker that reads nothing at all is still an error.
    loader = RankLoader([shardspec.Shard(str(path), 1)], 0, 1, cfg(workers=0, mode="repeat"))
    with pytest.raises(DataError, match="rank 0 worker 0 read no sample from its shards"):
        next(iter(loader))


def test_tar_written_by_webdataset_tools_reads_back(tmp_path):
    path = tmp_path / "w.tar"
    with wds.TarWriter(str(path)) as w:
        for i in range(5):
            w.write({"__key__": f"x{i}", "jpg": jpeg(i)[0], "cls": str(i)})
    labels = [
        int(v) for b in make_eval_loader([shardspec.Shard(str(path), 5)], 0, 1, cfg(workers=0)) for v in b["label"]
    ]
    assert labels == [0, 1, 2, 3, 4]


def test_dsrepeat_shows_every_sample_once_before_any_twice(tiny_shards):
    shards = shardspec.expand(str(tiny_shards([9, 9, 9, 9])))
    c = cfg(batch_size=3, workers=2, dsrepeat=2, shuffle_buffer=50, nbatches="auto")
    loader = make_loader(shards, 0, 1, c)
    per_worker: dict[int, list[str]] = {}
    for b in loader:
        for (_, worker, _), key in zip(b["id"].tolist(), b["key"], strict=True):
            per_worker.setdefault(worker, []).append(key)
    for keys in per_worker.values():
        assert len(keys) == 36 and len(set(keys)) == 18
        assert len(set(keys[:18])) == 18  # the first pass is complete before the second starts


def test_a_worker_makes_its_first_row_when_it_starts_and_keeps_an_error_for_the_first_batch():
    """A DataLoader worker calls iter() as soon as it starts and then waits for the other workers:
    the first row is made in that wait. An error is not raised by iter() (a persistent worker's
    next epoch would die of it) but at the first batch, unchanged."""
    made = []

    def rows(n, fail=None):
        for i in range(n):
            made.append(i)
            if i == fail:
                raise DataError(f"bad row {i}")
            yield i

    primed = _primed(rows(3))
    assert made == [0]  # made before anything was asked for
    assert list(primed) == [0, 1, 2]
    assert list(_primed(rows(0))) == []
    failing = _primed(rows(3, fail=0))  # no raise here
    with pytest.raises(DataError, match="bad row 0"):
        next(failing)
    later = _primed(rows(3, fail=1))
    assert next(later) == 0
    with pytest.raises(DataError, match="bad row 1"):
        next(later)
