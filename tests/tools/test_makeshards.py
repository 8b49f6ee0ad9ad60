"""makeshards.py: ImageFolder and synthetic shards with their index; bad input."""

import json
import os
import random
from collections import Counter

import pytest
import webdataset as wds
from PIL import Image

from tests.conftest import ROOT, jpeg, one_error_line, run_script
from tests.helpers.shards import CLASSES, make_image_folder
from wdsdist.data.sources import shardspec
from wdsdist.data.sources.index import read_index
from wdsdist.errors import UserError
from wdsdist.tools import synthetic
from wdsdist.tools.shards import (
    Sample,
    ShardSink,
    from_synthetic,
    write_shards,
)
from wdsdist.tools.sourcetree import image_folder_samples


def read_all(index):
    samples = []
    for shard in shardspec.expand(str(index)):
        for s in wds.WebDataset(shard.url, shardshuffle=False, empty_check=False):
            samples.append((shard.url, s))
    return samples


def test_image_folder_round_trip_keeps_bytes_labels_and_names(tmp_path):
    files = make_image_folder(tmp_path / "train")
    out = tmp_path / "shards"
    proc = run_script("makeshards.py", "--source", str(tmp_path / "train"), "--shards", str(out), "--maxcount", "9")
    assert proc.returncode == 0, proc.stderr
    assert "wrote 4 shards, 36 samples, 3 classes" in proc.stdout
    index = out / "train.index.json"
    desc = read_index(str(index))
    assert desc["classes"] == CLASSES and desc["nsamples"] == 36
    assert [s["nsamples"] for s in desc["shardlist"]] == [9, 9, 9, 9]
    assert sorted(os.listdir(out)) == [f"train-{i:06d}.tar" for i in range(4)] + ["train.index.json", "train.plan.json"]

    samples = read_all(index)
    assert len(samples) == 36
    seen = {}
    for _, s in samples:
        meta = json.loads(s["json"])
        image_ext = next(k for k in s if k in ("jpg", "jpeg", "png"))
        assert "." not in os.path.basename(s["__key__"])  # dots would split the sample
        assert "/" in s["__key__"]  # the class folder is part of the key
        seen[meta["path"]] = (s[image_ext], int(s["cls"]))
        assert meta["class"] == CLASSES[int(s["cls"])]
        assert image_ext == os.path.splitext(meta["path"])[1][1:].lower()
    assert seen == files  # bytes kept as they are (never re-encoded), labels in sorted class order

    # Shuffled with the seed: every shard mixes classes, unlike the sorted folder listing.
    for url in {u for u, _ in samples}:
        classes = Counter(int(s["cls"]) for u, s in samples if u == url)
        assert len(classes) >= 2, (url, classes)


def test_same_seed_same_shards_other_seed_other_order(tmp_path):
    make_image_folder(tmp_path / "train", per_class=5)
    orders = []
    for seed, out in [(0, "a"), (0, "b"), (1, "c")]:
        run_script(
            "makeshards.py", "--source", str(tmp_path / "train"), "--shards", str(tmp_path / out), "--seed", str(seed)
        )
        orders.append([s["__key__"] for _, s in read_all(tmp_path / out / "train.index.json")])
    assert orders[0] == orders[1] and orders[0] != orders[2] and sorted(orders[0]) == sorted(orders[2])


def test_synthetic_train_and_val_are_disjoint_and_learnable_labels(tmp_path):
    out = tmp_path / "syn"
    for split, n in [("train", 60), ("val", 20)]:
        proc = run_script(
            "makeshards.py",
            "--synthetic",
            str(n),
            "--split",
            split,
            "--size",
            "16",
            "--shards",
            str(out),
            "--maxcount",
            "25",
        )
        assert proc.returncode == 0, proc.stderr
    train = read_all(out / "synthetic-train.index.json")
    val = read_all(out / "synthetic-val.index.json")
    assert len(train) == 60 and len(val) == 20
    assert [s["nsamples"] for s in read_index(str(out / "synthetic-train.index.json"))["shardlist"]] == [25, 25, 10]
    assert not {s["jpg"] for _, s in train} & {s["jpg"] for _, s in val}
    labels = Counter(int(s["cls"]) for _, s in train)
    assert set(labels) <= set(range(len(synthetic.CLASSES))) and len(labels) >= 5
    first = train[0][1]
    img, label = synthetic.draw(0, size=16, split="train")
    assert int(first["cls"]) == label and Image.open(__import__("io").BytesIO(first["jpg"])).size == (16, 16)


@pytest.mark.parametrize(
    "setup,args,expected",
    [
        (None, ["--source", "{tmp}/nope"], "--source {tmp}/nope: no such file or folder"),
        ("empty", ["--source", "{tmp}/empty"], "no class folders"),
        ("noimages", ["--source", "{tmp}/noimages"], "no images"),
        ("bad", ["--source", "{tmp}/bad", "--strict"], "--strict: {tmp}/bad/cat/broken.jpg: not a JPEG or PNG image"),
        (None, ["--synthetic", "0"], "argument --synthetic: must be >= 1, got 0"),
        (None, ["--synthetic", "10", "--maxcount", "-3"], "argument --maxcount: must be >= 1, got -3"),
        (None, ["--synthetic", "10", "--size", "many"], "argument --size: expected an integer, got 'many'"),
        (None, ["--synthetic", "10", "--sizes", "8"], "unrecognized arguments: --sizes 8"),
        (None, ["--index", "{tmp}/none-{{000..009}}.tar"], "shard spec '{tmp}/none-{{000..009}}.tar' matches no file"),
        (
            "loop",
            ["--source", "{tmp}/loop"],
            "--source {tmp}/loop: symlink loop at {tmp}/loop/cat/up (leads back to {tmp}/loop)",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, setup, args, expected):
    if setup == "empty":
        (tmp_path / "empty").mkdir()
    elif setup == "noimages":
        (tmp_path / "noimages" / "cat").mkdir(parents=True)
        (tmp_path / "noimages" / "cat" / "notes.txt").write_text("no image here")
    elif setup == "loop":
        (tmp_path / "loop" / "cat").mkdir(parents=True)
        (tmp_path / "loop" / "cat" / "good.jpg").write_bytes(jpeg(1)[0])
        (tmp_path / "loop" / "cat" / "up").symlink_to("..")
    elif setup == "bad":
        (tmp_path / "bad" / "cat").mkdir(parents=True)
        (tmp_path / "bad" / "cat" / "good.jpg").write_bytes(jpeg(1)[0])
        (tmp_path / "bad" / "cat" / "broken.jpg").write_bytes(b"this is not a jpeg")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = run_script("makeshards.py", *args, "--shards", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert expected.format(tmp=tmp_path) in one_error_line(proc)
    # Nothing half-written is left where a reader could take it for a shard.
    if (tmp_path / "out").exists():
        assert not [f for f in os.listdir(tmp_path / "out") if ".tar" in f]


# ---------------------------------------------------------------- writing: a whole new set or nothing, only where told


def snapshot(folder):
    """Every entry of a folder (hidden ones too) with its bytes, or its link target."""
    return {
        p.name: ("link", os.readlink(p)) if p.is_symlink() else ("file", p.read_bytes())
        for p in sorted(folder.iterdir())
    }


def test_an_interrupted_write_leaves_the_previous_set(tmp_path):
    out = tmp_path / "syn"
    from_synthetic(12, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=0, size=8)
    before = snapshot(out)

    def samples():
        for i in range(20):
            if i == 13:
                raise KeyboardInterrupt
            yield Sample(f"k{i}", "jpg", jpeg(i)[0], 0, {})

    with pytest.raises(KeyboardInterrupt):
        write_shards(samples(), 20, str(out), "syn", maxcount=5, maxsize=1 << 30)
    assert snapshot(out) == before


def test_a_rerun_with_fewer_shards_leaves_no_stale_shards(tmp_path):
    out = tmp_path / "syn"
    from_synthetic(30, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=0, size=8)
    assert len(list(out.glob("*.tar"))) == 6
    (out / "other-000005.tar").write_bytes(b"another prefix's shard")
    desc = from_synthetic(10, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=1, size=8)
    shards = sorted(out.glob("syn-*.tar"))
    assert [p.name for p in shards] == ["syn-000000.tar", "syn-000001.tar"] and desc["nsamples"] == 10
    # What a glob reads is what the index says.
    assert sum(1 for p in shards for _ in wds.WebDataset(str(p), shardshuffle=False)) == 10
    assert (out / "other-000005.tar").read_bytes() == b"another prefix's shard"
    assert sorted(p.name for p in out.iterdir()) == [
        "other-000005.tar",
        "syn-000000.tar",
        "syn-000001.tar",
        "syn.index.json",
    ]


def test_links_planted_in_the_output_folder_are_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    # The old fixed temporary names, the final names, and a stale shard beyond the new set.
    for name in ["syn-000000.tar.tmp", "syn-000000.tar", "syn-000001.tar", "syn-000007.tar"]:
        (out / name).symlink_to(victim)
    for name in ["syn.index.json.tmp", "syn.index.json"]:
        (out / name).symlink_to(victim)
    desc = from_synthetic(8, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=0, size=8)
    assert victim.read_bytes() == b"precious"
    assert desc["nsamples"] == 8 and read_index(str(out / "syn.index.json"))["nsamples"] == 8
    for name in ["syn-000000.tar", "syn-000001.tar", "syn.index.json"]:
        assert not (out / name).is_symlink()
    assert not (out / "syn-000007.tar").exists() and not (out / "syn-000007.tar").is_symlink()
    assert len(read_all(out / "syn.index.json")) == 8


def test_two_writers_of_one_prefix_keep_their_temporaries_apart(tmp_path):
    out = tmp_path / "out"
    with ShardSink(str(out), "p", maxcount=3, maxsize=1 << 30) as a, ShardSink(str(out), "p", 3, 1 << 30) as b:
        for i in range(7):  # interleaved, as two processes would
            a.write(Sample(f"a{i}", "jpg", jpeg(i)[0], 1, {}))
            b.write(Sample(f"b{i}", "jpg", jpeg(i)[0], 2, {}))
        b.write(Sample("b7", "jpg", jpeg(7)[0], 2, {}))
        a.commit()
        b.commit()
    # The last commit wins whole: its index, its shards, nothing of the other's.
    samples = read_all(out / "p.index.json")
    assert [s["__key__"] for _, s in samples] == [f"b{i}" for i in range(8)]
    assert read_index(str(out / "p.index.json"))["nsamples"] == 8
    assert sorted(p.name for p in out.iterdir()) == ["p-000000.tar", "p-000001.tar", "p-000002.tar", "p.index.json"]


def test_a_killed_writers_temporaries_are_removed_by_the_next(tmp_path):
    out = tmp_path / "out"
    (out / ".syn.tmp-dead1").mkdir(parents=True)
    (out / ".syn.tmp-dead1" / "syn-000000.tar").write_bytes(b"half a shard")
    with ShardSink(str(out), "syn", 5, 1 << 30) as live:  # alive: its folder stays
        from_synthetic(3, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=0, size=8)
        assert os.path.isdir(live.tmpdir) and not (out / ".syn.tmp-dead1").exists()
    assert sorted(p.name for p in out.iterdir()) == ["syn-000000.tar", "syn.index.json"]


# ---------------------------------------------------------------- reading the source tree: links stay inside it


def test_symlinks_out_of_the_source_tree_are_not_followed(tmp_path, capsys):
    files = make_image_folder(tmp_path / "train", per_class=3)
    outside = tmp_path / "outside"
    make_image_folder(outside, per_class=2)
    train = tmp_path / "train"
    (train / "zz_linked_class").symlink_to(outside / CLASSES[0])  # a class folder
    (train / CLASSES[0] / "sub").symlink_to(outside / CLASSES[1])  # a folder inside a class
    (train / CLASSES[1] / "secret.jpg").symlink_to(outside / CLASSES[2] / f"{CLASSES[2]}_1.v2.jpg")  # a file
    (train / CLASSES[1] / "abs.png").symlink_to("/etc/hostname")
    # Inside the tree a link is followed, as torchvision does.
    (train / CLASSES[2] / "again.jpg").symlink_to(train / CLASSES[0] / f"{CLASSES[0]}_2.v2.jpg")
    tree = image_folder_samples(str(train), 0)
    assert tree.classes == CLASSES
    got = sorted(os.path.relpath(p, train) for p, _ in tree.files)
    assert got == sorted([*files, os.path.join(CLASSES[2], "again.jpg")])
    assert len(tree.skipped_links) == 4
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "skipped 4 symlinks that lead out of the source tree" in err


def test_a_self_link_is_an_error_naming_it(tmp_path):
    make_image_folder(tmp_path / "train", per_class=1)
    loop = tmp_path / "train" / CLASSES[0] / "loop.jpg"
    loop.symlink_to(loop)
    with pytest.raises(UserError, match=f"symlink loop at {loop}$"):
        image_folder_samples(str(tmp_path / "train"), 0)


def test_same_listing_as_torchvision_inside_the_tree(tmp_path):
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    train = tmp_path / "train"
    make_image_folder(train, per_class=4)
    for c in CLASSES[:2]:
        (train / c / "nested" / "deeper").mkdir(parents=True)
        (train / c / "nested" / "deeper" / "x.jpg").write_bytes(jpeg(1)[0])
        (train / c / "Nested.b").mkdir()
        (train / c / "Nested.b" / "y.PNG").write_bytes(jpeg(2)[0])
    (train / CLASSES[2] / "from_a").symlink_to(train / CLASSES[0] / "nested")
    (train / ".hidden").mkdir()
    (train / ".hidden" / "h.jpg").write_bytes(jpeg(3)[0])
    classes, class_to_idx = find_classes(str(train))
    expected = make_dataset(str(train), class_to_idx, extensions=IMG_EXTENSIONS)
    random.Random(5).shuffle(expected)
    tree = image_folder_samples(str(train), 5)
    assert tree.classes == classes and tree.files == expected


# ---------------------------------------------------------------- outputs are local files


@pytest.mark.parametrize("script", ["makeshards.py", "train.py"])
def test_a_pipe_output_runs_nothing_and_is_one_error_line(tmp_path, script):
    marker = tmp_path / "marker"
    target = f"pipe:touch {marker} #"
    if script == "makeshards.py":
        args, culprit = ["--synthetic", "10", "--shards", target], f"--shards {target}"
    else:
        spec = f"{target}/x.index.json"
        # data=synthetic: the synthetic set asked to be written there (without it, shards named with the
        # default group are refused sooner, pointing to data=shards).
        args = ["data=synthetic", f'data.train_shards="{spec}"', "data.allow_pipe=false", f"outputs={tmp_path}"]
        culprit = f"data.train_shards={spec}"
    proc = run_script(str(ROOT / script), *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"error: {culprit}: shards are written to a local folder only")
    assert not marker.exists() and os.listdir(tmp_path) == []


def test_an_error_inside_the_commit_moves_the_previous_set_back(tmp_path, monkeypatch):
    out = tmp_path / "syn"
    from_synthetic(12, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=0, size=8)
    before = snapshot(out)
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 4:  # old index and shard 0 moved aside, new shard 0 in place
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        from_synthetic(12, str(out), "syn", maxcount=5, maxsize=1 << 30, seed=1, size=8)
    monkeypatch.undo()
    assert len(calls) == 4 + 3 and snapshot(out) == before  # the 3 renames done were undone


def test_train_writes_its_synthetic_set_once_and_rewrites_it_whole(tmp_path):
    from omegaconf import OmegaConf

    from wdsdist.train.trainer import ensure_synthetic

    index = tmp_path / "data" / "syn-train.index.json"

    def cfg(n, seed):
        synth = {"train_samples": n, "val_samples": 0, "size": 8, "shard_samples": 4, "seed": seed}
        return OmegaConf.create({"data": {"train_shards": str(index), "val_shards": None, "synthetic": synth}})

    ensure_synthetic(cfg(10, 0))
    first = snapshot(index.parent)
    assert len(first) == 4
    ensure_synthetic(cfg(10, 0))  # already there: untouched
    assert snapshot(index.parent) == first
    ensure_synthetic(cfg(6, 1))
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "syn-train-000000.tar",
        "syn-train-000001.tar",
        index.name,
    ]
    assert len(read_all(index)) == 6


def test_index_of_pipe_shards_runs_them_only_with_allow_pipe(tmp_path, tiny_shards):
    index = tiny_shards([3, 2])
    marker = tmp_path / "marker"
    spec = f"pipe:touch {marker}; cat {index.parent}/tiny-{{000000..000001}}.tar"
    out = tmp_path / "pipe.index.json"
    proc = run_script("makeshards.py", "--index", spec, "--output", str(out))
    assert proc.returncode == 2
    assert "pipe: URLs are refused (allow_pipe is false)" in one_error_line(proc)
    assert not marker.exists() and not out.exists()
    proc = run_script("makeshards.py", "--index", spec, "--output", str(out), "--allow-pipe")
    assert proc.returncode == 0, proc.stderr
    assert marker.exists() and read_index(str(out))["nsamples"] == 5


def test_index_output_in_a_missing_folder_is_one_line_before_counting(tmp_path, tiny_shards):
    index = tiny_shards([3])
    out = tmp_path / "nope" / "x.index.json"
    proc = run_script("makeshards.py", "--index", f"{index.parent}/tiny-000000.tar", "--output", str(out))
    assert proc.returncode == 2
    assert one_error_line(proc) == f"error: --output {out}: no folder {out.parent} to write it in"


@pytest.mark.parametrize("script", ["makeshards", "simdist"])
def test_a_brace_pattern_the_shell_expanded_gets_a_hint_to_quote_it(script):
    """bash turns --index a-{000..002}.tar into --index a-000.tar a-001.tar a-002.tar."""
    import importlib

    from wdsdist.errors import UserError

    module = importlib.import_module(
        {"makeshards": "wdsdist.tools.makeshards", "simdist": "wdsdist.simdist.cli"}[script]
    )
    option = "--index" if script == "makeshards" else "--shards"
    with pytest.raises(UserError) as err:
        module.parse_args([option, "d/a-000.tar", "d/a-001.tar", "d/a-002.tar"])
    message = str(err.value)
    assert message.startswith("unrecognized arguments: d/a-001.tar d/a-002.tar; a brace pattern the shell expanded?")
    assert "quote it" in message
    with pytest.raises(UserError) as err:  # not a shard: no hint
        module.parse_args([option, "d/a-000.tar", "--sizes", "8"])
    assert "brace" not in str(err.value)


def test_the_options_are_typed_once_frozen_and_refuse_a_bad_value_in_one_line(tmp_path):
    import dataclasses

    from wdsdist.tools.makeshards import parse

    options = parse(["--source", str(tmp_path), "--shards", str(tmp_path / "out"), "--resize", "64"])
    assert (options.source, options.resize, options.maxcount, options.maxsize) == (str(tmp_path), 64, 1000, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.maxcount = 5  # type: ignore[misc]
    with pytest.raises(UserError) as err:
        dataclasses.replace(options, maxsize=1 << 20)
    assert str(err.value).startswith("--maxsize with --resize/--quality: ") and "\n" not in str(err.value)
    with pytest.raises(UserError) as err:
        dataclasses.replace(options, shards="pipe:cat > x")
    assert str(err.value).startswith("--shards pipe:cat > x: shards are written to a local folder only")
