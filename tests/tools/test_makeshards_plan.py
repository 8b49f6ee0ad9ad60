"""wds-makeshards --source, planned: the same bytes for any --workers, a resume after kill -9 that
keeps what was finished, another conversion into the same folder refused, and no bad file stops it."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from tests.conftest import one_error_line, run_script
from tests.helpers import imagenet
from tests.helpers.shards import make_image_folder
from wdsdist.data import LoaderConfig, decode_eval
from wdsdist.data.sources.index import read_index
from wdsdist.errors import UserError
from wdsdist.tools.convert import Inputs, Run, convert
from wdsdist.tools.planning import Options, parse_size


def folder_bytes(folder):
    """Every file of a folder (hidden ones too) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def samples(index):
    desc = read_index(str(index))
    out = []
    for entry in desc["shardlist"]:
        url = os.path.join(os.path.dirname(index), entry["url"])
        out += list(wds.WebDataset(url, shardshuffle=False, empty_check=False))
    return out


@pytest.mark.parametrize("source", ["folder", "tar"])
def test_one_and_two_workers_write_the_same_bytes(tmp_path, source):
    if source == "folder":
        make_image_folder(tmp_path / "src", per_class=10)
        src = tmp_path / "src"
    else:
        src = tmp_path / "ILSVRC2012_img_train.tar"
        imagenet.train_tar(src, per_class=10)
    options = Options("train", maxcount=7, maxsize=parse_size("30kB"))
    descs = [convert(Inputs(str(src), seed=3), options, Run(str(tmp_path / f"w{n}"), workers=n)) for n in (1, 2)]
    one, two = folder_bytes(tmp_path / "w1"), folder_bytes(tmp_path / "w2")
    assert one == two and descs[0]["nsamples"] == 30 and descs[0]["nshards"] >= 5
    assert set(one) == {f"train-{i:06d}.tar" for i in range(descs[0]["nshards"])} | {
        "train.index.json",
        "train.plan.json",
    }
    sizes = [len(data) for name, data in one.items() if name.endswith(".tar")]
    assert max(sizes) <= 30_000  # cut by --maxsize from the planned sizes, before writing
    assert sorted(s["cls"] for s in samples(tmp_path / "w1" / "train.index.json")) == sorted(
        b"%d" % (i // 10) for i in range(30)
    )


def test_offset_every_shapes_the_index_and_not_the_plan(tmp_path):
    make_image_folder(tmp_path / "src", per_class=10)
    tables = {}
    for every in (4, 0):
        run = Run(str(tmp_path / f"e{every}"), offset_every=every)
        desc = convert(Inputs(str(tmp_path / "src")), Options("t", maxcount=20), run)
        tables[every] = [
            (e["nsamples"], e.get("offsets", {}).get("every"), len(e.get("offsets", {}).get("at", [])))
            for e in desc["shardlist"]
        ]
    assert tables == {4: [(20, 4, 5), (10, 4, 3)], 0: [(20, None, 0), (10, None, 0)]}
    assert (tmp_path / "e4" / "t.plan.json").read_bytes() == (tmp_path / "e0" / "t.plan.json").read_bytes()


def test_sizes_are_read_as_people_write_them():
    assert parse_size("1GB") == 10**9 and parse_size("1GiB") == 1 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("4096") == 4096 and parse_size("1.5kB") == 1500
    with pytest.raises(ValueError, match="expected a size like 1GB"):
        parse_size("lots")


def test_bad_files_are_skipped_and_listed_and_cmyk_and_png_decode_to_pils_rgb(tmp_path):
    src = tmp_path / "train"
    make_image_folder(src, per_class=3)
    good = imagenet.bad_files(src / "n01440764")
    os.mkfifo(src / "n01443537" / "pipe.jpg")
    proc = run_script("makeshards.py", "--source", str(src), "--shards", str(tmp_path / "out"), "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "11 samples, 3 classes, 4 files skipped (listed in the index)" in proc.stdout
    desc = read_index(str(tmp_path / "out" / "train.index.json"))
    reasons = {s["name"]: s["reason"] for s in desc["skipped"]}
    assert reasons == {
        "n01440764/notes.jpg": "not a JPEG or PNG image",
        "n01440764/empty.jpg": "empty file",
        "n01440764/truncated.jpg": reasons["n01440764/truncated.jpg"],
        "n01443537/pipe.jpg": "not a regular file",
    }
    assert "truncated" in reasons["n01440764/truncated.jpg"] and desc["nskipped"] == 4
    stored = {json.loads(s["json"])["path"]: s for s in samples(tmp_path / "out" / "train.index.json")}
    cfg = LoaderConfig(batch_size=1, image_size=32, eval_resize=32)
    for name, data in good.items():
        sample = stored[f"n01440764/{name}"]
        ext = "png" if name.startswith("png") else "jpeg"
        assert sample[ext] == data  # stored as it is; the PNG under .png
        pixels = decode_eval(sample[ext], cfg).permute(1, 2, 0).numpy()
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[:, 4:36]  # the centre crop of 32 x 40
        assert np.array_equal(pixels, want), name


def test_strict_stops_at_the_first_bad_file_naming_it(tmp_path):
    src = tmp_path / "train"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(imagenet.image(1))
    (src / "a" / "y.jpg").write_bytes(b"")
    proc = run_script("makeshards.py", "--source", str(src), "--shards", str(tmp_path / "out"), "--strict")
    assert proc.returncode == 2
    assert one_error_line(proc) == f"error: --strict: {src}/a/y.jpg: empty file"
    assert not (tmp_path / "out" / "train.index.json").exists()


def test_a_flat_folder_without_labels_says_to_add_them(tmp_path):
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(imagenet.image(1))
    with pytest.raises(UserError, match=r"val: images but no class folders; for a flat folder add --labels FILE$"):
        convert(Inputs(str(tmp_path / "val")), Options("v"), Run(str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_header_verify_keeps_a_truncated_jpeg_full_skips_it(tmp_path):
    src = tmp_path / "train"
    imagenet.bad_files(src / "a")
    counts = {}
    for verify in ("full", "header"):
        desc = convert(Inputs(str(src)), Options("t", verify=verify), Run(str(tmp_path / verify)))
        counts[verify] = desc["nsamples"]
    assert counts == {"full": 2, "header": 3}


def makeshards(src, out, *extra, env=None):
    return run_script("makeshards.py", "--source", str(src), "--shards", str(out), "--maxcount", "4", *extra, env=env)


def test_a_killed_run_resumes_keeping_its_finished_shards_and_ends_as_an_unstopped_one(tmp_path):
    src = tmp_path / "ILSVRC2012_img_train.tar"
    imagenet.train_tar(src, per_class=8)  # 24 images: 6 shards of 4
    out, whole = tmp_path / "out", tmp_path / "whole"
    killed = makeshards(src, out, "--workers", "1", env={"WDSDIST_TEST_KILL_AFTER_SHARDS": "2"})
    assert killed.returncode == -9
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert sorted(finished) == ["ILSVRC2012_img_train-000000.tar", "ILSVRC2012_img_train-000001.tar"]
    assert not (out / "ILSVRC2012_img_train.index.json").exists()
    resumed = makeshards(src, out, "--workers", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert "(2 of them finished before, kept)" in resumed.stdout
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == finished  # not rewritten
    assert makeshards(src, whole, "--workers", "2").returncode == 0
    assert folder_bytes(out) == folder_bytes(whole)


@pytest.mark.parametrize(
    "change,why",
    [
        (["--maxcount", "5"], "options maxcount: 4 there, 5 now"),
        (["--verify", "header"], "options verify: 'full' there, 'header' now"),
        (["--seed", "1"], "the source's images differ"),
    ],
)
def test_another_conversion_into_the_same_folder_is_refused_changing_nothing(tmp_path, change, why):
    src = tmp_path / "ILSVRC2012_img_train.tar"
    imagenet.train_tar(src, per_class=4)
    out = tmp_path / "out"
    makeshards(src, out, "--workers", "1", env={"WDSDIST_TEST_KILL_AFTER_SHARDS": "1"})
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    proc = makeshards(src, out, *change)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith(f"error: --shards {out} holds another conversion of prefix ILSVRC2012_img_train ({why}")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == before


def test_a_set_written_without_a_plan_is_refused(tmp_path):
    run_script("makeshards.py", "--synthetic", "5", "--size", "8", "--shards", str(tmp_path), "--prefix", "a")
    make_image_folder(tmp_path / "src", per_class=1)
    with pytest.raises(UserError, match="a.index.json was written by another command"):
        convert(Inputs(str(tmp_path / "src")), Options("a"), Run(str(tmp_path)))


def test_a_finished_conversion_run_again_changes_nothing(tmp_path):
    make_image_folder(tmp_path / "src", per_class=4)
    first = convert(Inputs(str(tmp_path / "src")), Options("t", maxcount=5), Run(str(tmp_path / "out")))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = convert(Inputs(str(tmp_path / "src")), Options("t", maxcount=5), Run(str(tmp_path / "out")))
    assert again["written"] == 0 and again["nsamples"] == first["nsamples"] == 12
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before


def test_resize_and_quality_reencode_and_cut_by_count_alone(tmp_path):
    src = tmp_path / "train"
    (src / "a").mkdir(parents=True)
    for i in range(5):
        (src / "a" / f"{i}.png").write_bytes(imagenet.image(i, size=48, fmt="PNG"))
    convert(Inputs(str(src)), Options("t", maxcount=2, resize=24, quality=80), Run(str(tmp_path / "out")))
    stored = samples(tmp_path / "out" / "t.index.json")
    assert len(stored) == 5 and all(set(s) >= {"jpg", "cls", "json"} for s in stored)
    assert {Image.open(io.BytesIO(s["jpg"])).size for s in stored} == {(28, 24)}  # 48 x 56, shorter side 24
    proc = run_script("makeshards.py", "--source", str(src), "--resize", "24", "--maxsize", "1GB")
    assert proc.returncode == 2
    assert one_error_line(proc).startswith("error: --maxsize with --resize/--quality: a re-encoded image's size")
