"""loader.read_late: while a local shard's samples wait in the shuffle buffer, their images stay
in the file (lateread.Late: where each lies) and are read as the samples leave it. The samples
and batches are the ones read at once gives; a file that changes underneath fails the samples
it no longer holds, not the run."""

import gc
import gzip
import io
import os
import pickle
import re
import tarfile

import pytest
import torch
import webdataset as wds

from tests.helpers.shards import warm_shards
from wdsdist.data.delivery import workers
from wdsdist.data.delivery.pipeline import make_loader
from wdsdist.data.options import LoaderConfig
from wdsdist.data.tar import lateread, tarread
from wdsdist.data.tar.lateread import Late, read_late
from wdsdist.data.tar.tarread import tar_samples
from wdsdist.errors import DataError


def _shard(path, n, size=6000):
    """n samples: a ``size``-byte jpg (above LATE_MIN), a one-byte cls and a small json."""
    with wds.TarWriter(str(path)) as sink:
        for i in range(n):
            sink.write({"__key__": f"k{i:04d}", "jpg": bytes([i % 251]) * size, "cls": str(i % 10), "json": b"{}"})
    return path


def _read(path, late):
    with open(path, "rb") as f:
        return list(tar_samples(f, str(path), late=late))


def test_large_members_come_late_and_read_to_the_same_samples_after_the_file_closed(tmp_path):
    path = _shard(tmp_path / "a.tar", 30)
    eager, late = _read(path, False), _read(path, True)
    assert all(isinstance(s["jpg"], Late) for s in late)
    assert all(isinstance(s["cls"], bytes) and isinstance(s["json"], bytes) for s in late)
    assert [read_late(s) for s in late] == eager  # the stream was closed when _read returned
    assert all(isinstance(s["jpg"], bytes) for s in eager)


def test_only_a_plain_local_file_is_read_late(tmp_path):
    path = _shard(tmp_path / "a.tar", 5)
    raw = path.read_bytes()
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(raw))
    for stream in (io.BytesIO(raw), open(tmp_path / "a.tar.gz", "rb")):
        with stream:
            samples = list(tar_samples(stream, "u", late=True))
        assert len(samples) == 5 and all(isinstance(s["jpg"], bytes) for s in samples)


def test_the_file_closes_when_its_last_late_member_goes(tmp_path):
    path = _shard(tmp_path / "a.tar", 5)
    gc.collect()
    before = lateread.LateFile.count
    samples = _read(path, True)
    fd = samples[0]["jpg"].file.fd
    assert lateread.LateFile.count == before + 1
    del samples[:4]  # four unread samples gone, one left
    assert os.fstat(fd) and lateread.LateFile.count == before + 1
    read_late(samples[0])  # the last Late member read: the sample holds bytes now
    assert lateread.LateFile.count == before
    with pytest.raises(OSError):
        os.fstat(fd)


def test_at_most_LATE_FILES_shards_are_held_open(tmp_path, monkeypatch):
    monkeypatch.setattr(lateread, "LATE_FILES", lateread.LateFile.count + 2)
    held = [_read(_shard(tmp_path / f"{i}.tar", 3), True) for i in range(3)]
    assert [isinstance(samples[0]["jpg"], Late) for samples in held] == [True, True, False]


def test_a_member_cut_short_fails_the_shard_as_read_at_once_does(tmp_path):
    path = _shard(tmp_path / "a.tar", 10)
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.index(b"k0007.jpg") + 512 + 3000])  # inside sample 7's jpg
    for late in (False, True):
        with open(path, "rb") as f:
            samples = tar_samples(f, str(path), late=late)
            got = [next(samples) for _ in range(7)]
            with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
                next(samples)
        assert [s["__key__"] for s in got] == [f"k{i:04d}" for i in range(7)]


def test_a_file_cut_while_its_headers_are_read_fails_the_shard_as_read_at_once_does(tmp_path):
    """Late members are passed over by seeking, which never fails past a file's end: a file cut
    short meanwhile must not end like a whole one, its later samples lost without a word."""
    for late in (False, True):
        path = _shard(tmp_path / f"cut{late}.tar", 20)
        cut = path.read_bytes().index(b"k0010.jpg") + 512 + 3000  # inside sample 10's jpg
        with open(path, "rb") as f:
            samples = tar_samples(f, str(path), late=late)
            got = [next(samples) for _ in range(5)]
            os.truncate(path, cut)
            with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
                got += list(samples)
        assert len(got) == 5, late


def test_a_late_read_takes_several_preads_where_one_gives_less(tmp_path, monkeypatch):
    path = _shard(tmp_path / "a.tar", 3)
    eager, late = _read(path, False), _read(path, True)
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: pread(fd, min(n, 1000), at))  # as past 2 GiB
    assert [read_late(s) for s in late] == eager


def test_a_refused_readahead_hint_changes_nothing_and_a_late_file_does_not_travel(tmp_path, monkeypatch):
    def refuse(*args):
        raise OSError(22, "Invalid argument")

    path = _shard(tmp_path / "a.tar", 3)
    monkeypatch.setattr(tarread, "ADVISE", refuse)
    late = _read(path, True)
    with pytest.raises(TypeError, match="stays in the process"):
        pickle.dumps(late[0])
    assert [read_late(s) for s in late] == _read(path, False)


def test_a_file_shortened_after_its_headers_were_read_fails_the_samples_it_lost(tmp_path):
    path = _shard(tmp_path / "a.tar", 10)
    samples = _read(path, True)
    os.truncate(path, samples[6]["jpg"].offset + 100)
    assert [len(read_late(s)["jpg"]) for s in samples[:6]] == [6000] * 6
    with pytest.raises(DataError, match=r"a\.tar: sample 'k0006': cannot read its jpg: 6000 bytes at byte \d+"):
        read_late(samples[6])


def _index(folder, counts):
    """Shards of 96 x 128 noise JPEGs (~25 KB: read late), every 9th failing after its draws."""
    return warm_shards(folder, counts, every=9, shape=(96, 128))


@pytest.mark.parametrize("split", ["shards", "samples"])
def test_the_loader_gives_the_same_batches_read_late_or_at_once(tmp_path, split):
    index = _index(tmp_path / "s", [40, 40, 40])
    runs = {}
    for late in (False, True):
        cfg = LoaderConfig(batch_size=8, workers=2, image_size=32, mode="epoch", split=split, read_late=late)
        torch.manual_seed(0)  # the workers' seeds come from it
        runs[late] = list(make_loader(index, 0, 1, cfg))
    assert len(runs[True]) == len(runs[False]) >= 12
    assert sum(int(b["bad"][:, 0].sum()) for b in runs[True]) > 0
    for a, b in zip(runs[False], runs[True], strict=True):
        for key in ("id", "label", "bad", "image"):
            assert torch.equal(a[key], b[key]), key


def test_a_shard_shortened_while_its_samples_wait_costs_those_samples_not_the_run(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(workers, "_warned", [0])  # this process's count of warnings so far
    index = _index(tmp_path / "s", [120])
    cfg = LoaderConfig(batch_size=8, workers=0, image_size=32, mode="epoch", split="shards", read_late=True)
    it = iter(make_loader(index, 0, 1, cfg))
    batches = [next(it)]  # the shuffle buffer holds the shard's first 100 samples now
    os.truncate(tmp_path / "s" / "w-000000.tar", 60 * 1024)
    batches += list(it)
    delivered = sum(len(b["label"]) for b in batches)
    bad = sum(int(b["bad"][:, 0].sum()) for b in batches)
    assert delivered == 120 and 0 < bad < 120  # the plan's count: each lost sample's row a stand-in
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "cannot read its jpg" in ln]
    line = re.compile(r"warning: skipped: \S*w-000000\.tar: sample 's\d{6}': cannot read its jpg: \d+ bytes at byte")
    assert lines and all(line.match(ln) for ln in lines)
