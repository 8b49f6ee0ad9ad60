"""Shard specs, index files and counting samples from tar headers."""

import json
import subprocess
import tarfile

import pytest

from tests.conftest import one_error_line, run_script
from wdsdist.data.sources import shardspec
from wdsdist.data.sources.index import INDEX_KIND, count_samples, read_index
from wdsdist.errors import UserError


def test_brace_pattern_glob_and_list(tiny_shards):
    index = tiny_shards([3, 4, 5])
    folder = index.parent
    brace = shardspec.expand(f"{folder}/tiny-{{000000..000002}}.tar")
    assert [s.url for s in brace] == [f"{folder}/tiny-{i:06d}.tar" for i in range(3)]
    assert all(s.nsamples is None for s in brace)
    assert [s.url for s in shardspec.expand(f"{folder}/tiny-*.tar")] == [s.url for s in brace]
    two = shardspec.expand(f"{folder}/tiny-000000.tar::{folder}/tiny-000002.tar")
    assert [s.url for s in two] == [brace[0].url, brace[2].url]
    assert [s.url for s in shardspec.expand([brace[1].url])] == [brace[1].url]


def test_index_gives_counts_and_resolves_relative_urls(tiny_shards):
    index = tiny_shards([3, 4, 5])
    desc = json.loads(index.read_text())
    assert desc["__kind__"] == INDEX_KIND and desc["wids_version"] == 1
    assert desc["shardlist"][0] == {"url": "tiny-000000.tar", "nsamples": 3}
    shards = shardspec.expand(str(index))
    assert [s.nsamples for s in shards] == [3, 4, 5]
    assert shards[0].url == str(index.parent / "tiny-000000.tar")
    assert shardspec.sample_counts(shards) == [3, 4, 5]


def test_remote_urls_are_kept_as_they_are():
    shards = shardspec.expand("http://host/x-{0..2}.tar::pipe:curl -s http://host/y.tar")
    assert [s.url for s in shards] == [
        "http://host/x-0.tar",
        "http://host/x-1.tar",
        "http://host/x-2.tar",
        "pipe:curl -s http://host/y.tar",
    ]


def test_specs_that_name_nothing_say_so(tmp_path, tiny_shards):
    with pytest.raises(UserError, match="matches no file"):
        shardspec.expand(str(tmp_path / "none-{0..3}.tar"))
    index = tiny_shards([2, 2])
    with pytest.raises(UserError, match=r"1 of 3 shards do not exist, first .*tiny-000002.tar"):
        shardspec.expand(f"{index.parent}/tiny-{{000000..000002}}.tar")
    bad = tmp_path / "bad.json"
    bad.write_text('{"shards": []}')
    with pytest.raises(UserError, match="not a shard index"):
        shardspec.expand(str(bad))
    with pytest.raises(UserError, match="cannot read shard index"):
        shardspec.expand(str(tmp_path / "missing.json"))


def _plain_tar_tree(root):
    # Keys with directories, several extensions, one member that is not a sample.
    files = {
        "a/b/img1.jpg": b"x",
        "a/b/img1.cls": b"1",
        "a/b/img2.jpg": b"y",
        "a/b/img2.cls": b"2\n",
        "c/img1.png": b"z",
        "c/img1.cls": b"3",
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return sorted(files)


@pytest.mark.parametrize("flags,suffix", [("-cf", ".tar"), ("-czf", ".tgz")])
def test_index_of_tars_written_by_plain_tar(tmp_path, flags, suffix):
    tree = tmp_path / "tree"
    names = _plain_tar_tree(tree)
    shard = tmp_path / f"plain-000000{suffix}"
    subprocess.run(["tar", flags, str(shard), "-C", str(tree), *names], check=True)
    with tarfile.open(shard) as t:
        assert len(t.getnames()) == 6
    assert count_samples(str(shard)) == 3
    proc = run_script("makeshards.py", "--index", str(shard))
    assert proc.returncode == 0, proc.stderr
    index = tmp_path / "plain.index.json"
    desc = read_index(str(index))
    assert desc["shardlist"] == [{"url": shard.name, "nsamples": 3}]
    assert shardspec.expand(str(index))[0].nsamples == 3


def test_count_samples_names_a_broken_shard(tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(UserError, match="junk.tar: not a readable tar shard"):
        count_samples(str(junk))


def test_index_of_nothing_is_one_line_exit_2(tmp_path):
    proc = run_script("makeshards.py", "--index", str(tmp_path / "nothing-{0..9}.tar"))
    assert proc.returncode == 2
    assert "matches no file" in one_error_line(proc)
