"""The index's per-shard sample byte offsets: written by makeshards (and --index), one line a
shard, checked on reading (a table that cannot be a tar's is refused with one line naming it,
one too large is dropped with a warning), and still an index wids reads."""

from __future__ import annotations

import gzip
import io
import json
import shutil

import pytest

from tests.conftest import one_error_line, run_script
from wdsdist.data.sources import shardspec
from wdsdist.data.sources.index import read_index, write_index
from wdsdist.data.sources.shardspec import Shard
from wdsdist.data.tar.tarread import sample_offsets
from wdsdist.errors import UserError


def entries(path) -> list[dict]:
    return read_index(str(path))["shardlist"]


def test_makeshards_writes_every_kth_sample_offset_one_line_a_shard(tmp_path):
    out = tmp_path / "out"
    proc = run_script(
        "makeshards.py", "--synthetic", "50", "--maxcount", "20", "--offset-every", "4", "--shards", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    path = out / "synthetic-train.index.json"
    listed = entries(path)
    assert [e["nsamples"] for e in listed] == [20, 20, 10]
    for e in listed:
        every_sample = sample_offsets(io.BytesIO((out / e["url"]).read_bytes()))
        assert e["offsets"] == {"every": 4, "at": every_sample[::4]}
        assert len(e["offsets"]["at"]) == -(-e["nsamples"] // 4)
    lines = path.read_text().splitlines()
    assert sum('"offsets"' in line for line in lines) == 3  # a shard's table on its own line
    shards = shardspec.expand(str(path))
    assert [len(s.offsets) for s in shards] == [5, 5, 3]
    assert [shards[0].offsets.at(j) for j in range(5)] == listed[0]["offsets"]["at"]
    # A reading aid, not part of the shard's identity.
    assert shards[0] == Shard(shards[0].url, 20) and hash(shards[0]) == hash(Shard(shards[0].url, 20))


def test_makeshards_index_computes_offsets_of_existing_plain_shards_only(tiny_shards, tmp_path):
    index = tiny_shards([9, 3, 7])
    folder = index.parent
    with open(folder / "tiny-000001.tar", "rb") as f:
        (folder / "tiny-000001.tar.gz").write_bytes(gzip.compress(f.read()))
    (folder / "tiny-000001.tar").unlink()
    shutil.move(folder / "tiny-000001.tar.gz", folder / "tiny-000001.tgz")
    spec = f"{folder}/tiny-{{000000..000002}}.t*"
    out = tmp_path / "re.index.json"
    proc = run_script("makeshards.py", "--index", spec, "--offset-every", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    by_name = {e["url"].rsplit("/", 1)[-1]: e for e in entries(out)}
    assert by_name["tiny-000000.tar"]["offsets"]["every"] == 2
    assert len(by_name["tiny-000000.tar"]["offsets"]["at"]) == 5
    assert "offsets" not in by_name["tiny-000001.tgz"]  # no byte of a gzip stream can be sought
    assert len(by_name["tiny-000002.tar"]["offsets"]["at"]) == 4
    proc = run_script("makeshards.py", "--index", spec, "--offset-every", "0", "--output", str(out))
    assert proc.returncode == 0 and all("offsets" not in e for e in entries(out))


def test_an_index_with_offsets_is_still_a_wids_index(tiny_shards, tmp_path):
    index = tiny_shards([5, 6])
    shards = [(e["url"], e["nsamples"]) for e in entries(index)]
    offsets = [sample_offsets(open(index.parent / url, "rb")) for url, _ in shards]
    path = index.parent / "with-offsets.index.json"
    write_index(str(path), [(str(index.parent / u), n) for u, n in shards], offsets=offsets, offset_every=2)
    desc = json.loads(path.read_text())
    # What wids' resolve_dsdesc asserts, and the two keys it reads from every entry.
    assert desc["wids_version"] == 1
    assert all(isinstance(e, dict) and isinstance(e["url"], str) and e["nsamples"] >= 0 for e in desc["shardlist"])
    assert all("offsets" in e for e in desc["shardlist"])
    wids = pytest.importorskip("wids")  # not in our venv: checked by hand with wids 0.1.11 (see the README)
    dataset = wids.ShardListDataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 11 and dataset[10]["__key__"] == "s0000010"


GOOD = {"every": 2, "at": [0, 2048, 4096]}


@pytest.mark.parametrize(
    "table,message",
    [
        ([0, 2048, 4096], r'must be \{"every": K, "at": \[byte offsets\]\}, got \[0, 2048, 4096\]'),
        ({"every": True, "at": [0]}, "must be {"),
        ({"every": 0, "at": []}, r'"every" must be 1 \.\. nsamples=5, got 0'),
        ({"every": 2, "at": [0, 2048]}, r"2 offsets for nsamples=5 every 2, need 3"),
        ({"every": 2, "at": [0, 2048, 4000]}, r"at\[2\]=4000 is not a byte offset on a 512-byte tar block"),
        ({"every": 2, "at": [0, 2048, -512]}, r"at\[2\]=-512 is not a byte offset"),
        ({"every": 2, "at": [0, 2048, 1 << 60]}, r"at\[2\]=1152921504606846976 is not a byte offset"),
        ({"every": 2, "at": [0, 2048, "4096"]}, r'at\[2\]="4096" is not a byte offset'),
        ({"every": 2, "at": [0, 4096, 4608]}, r"at\[2\]=4608 is less than 2 headers after at\[1\]=4096"),
    ],
)
def test_a_malformed_offset_table_is_refused_naming_index_entry_and_offset(tmp_path, table, message):
    path = tmp_path / "bad.index.json"
    good = {"url": "a.tar", "nsamples": 5, "offsets": GOOD}
    bad = {"url": "b.tar", "nsamples": 5, "offsets": table}
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [good, bad]}))
    with pytest.raises(UserError, match=rf'^{path}: shardlist\[1\]: "offsets": {message}') as err:
        shardspec.expand(str(path))
    assert "\n" not in str(err.value) and "makeshards.py --index" in str(err.value)


def test_a_malformed_offset_table_stops_simdist_with_one_line(tmp_path):
    path = tmp_path / "bad.index.json"
    bad = {"url": "b.tar", "nsamples": 5, "offsets": {"every": 2, "at": [0, 2048, 4000]}}
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [bad]}))
    proc = run_script("simdist.py", "--plan", "--shards", str(path), "--size", "1", "--nworkers", "1")
    assert proc.returncode == 2
    assert 'shardlist[0]: "offsets": at[2]=4000 is not a byte offset' in one_error_line(proc)


def test_an_index_with_more_offsets_than_the_cap_is_read_without_them(tmp_path, monkeypatch, capsys):
    path = tmp_path / "big.index.json"
    shardlist = [{"url": f"s{i}.tar", "nsamples": 5, "offsets": GOOD} for i in range(4)]
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist}))
    monkeypatch.setattr(shardspec, "MAX_INDEX_OFFSETS", 11)
    shards = shardspec.expand(str(path))
    assert [s.nsamples for s in shards] == [5] * 4 and all(s.offsets is None for s in shards)
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{path}: 12 sample offsets, more than the 11" in warning[0]
    monkeypatch.setattr(shardspec, "MAX_INDEX_OFFSETS", 12)
    assert all(len(s.offsets) == 3 for s in shardspec.expand(str(path)))
