"""makeshards.py: ImageFolder and synthetic shards with their index; bad input."""

import json
import os
from collections import Counter

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from tests.conftest import jpeg, one_error_line, run_script
from wdsdist import shardspec, synthetic
from wdsdist.index import read_index

CLASSES = ["n01440764", "n01443537", "n09999999"]


def make_image_folder(root, per_class=12):
    """An ImageNet-like train tree: JPEGs, one PNG (grayscale) and one .JPEG per class."""
    files = {}
    for c, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            if i == 0:
                path = folder / f"{name}_{i}.png"
                Image.fromarray(np.full((10, 12), 40 * c, dtype=np.uint8), mode="L").save(path)
            else:
                ext = "JPEG" if i == 1 else "jpg"
                path = folder / f"{name}_{i}.v2.{ext}"  # a dot inside the name, as some datasets have
                path.write_bytes(jpeg(100 * c + i)[0])
            files[os.path.relpath(path, root)] = (path.read_bytes(), c)
    return files


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
    assert sorted(os.listdir(out)) == [f"train-{i:06d}.tar" for i in range(4)] + ["train.index.json"]

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
        (None, ["--source", "{tmp}/nope"], "--source {tmp}/nope: no such folder"),
        ("empty", ["--source", "{tmp}/empty"], "no class folders"),
        ("noimages", ["--source", "{tmp}/noimages"], "no images"),
        ("bad", ["--source", "{tmp}/bad"], "unreadable image {tmp}/bad/cat/broken.jpg"),
        (None, ["--synthetic", "0"], "argument --synthetic: must be >= 1, got 0"),
        (None, ["--synthetic", "10", "--maxcount", "-3"], "argument --maxcount: must be >= 1, got -3"),
        (None, ["--synthetic", "10", "--size", "many"], "argument --size: expected an integer, got 'many'"),
        (None, ["--synthetic", "10", "--sizes", "8"], "unrecognized arguments: --sizes 8"),
        (None, ["--index", "{tmp}/none-{{000..009}}.tar"], "shard spec '{tmp}/none-{{000..009}}.tar' matches no file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, setup, args, expected):
    if setup == "empty":
        (tmp_path / "empty").mkdir()
    elif setup == "noimages":
        (tmp_path / "noimages" / "cat").mkdir(parents=True)
        (tmp_path / "noimages" / "cat" / "notes.txt").write_text("no image here")
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
