"""The benchmark's pure helpers, without the peers or the packages the photographs come from
(those are only in .bench-venv): bench/loader/photos.py's photo set and bench/loader/peervenv.py's split of
the peers' requirements."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
from conftest import ROOT, one_error_line, run_script
from PIL import Image


def load(name: str):
    """A bench module by its path under bench/ (``loader.photos``): bench/ is a package."""
    return importlib.import_module(f"bench.{name}")


photos, peervenv = load("loader.photos"), load("loader.peervenv")


def sources() -> list[np.ndarray]:
    """Two stand-ins of the packaged photographs' shapes (427x640 and 512x512)."""
    rng = np.random.default_rng(1)
    return [
        rng.integers(0, 256, size=(427, 640, 3), dtype=np.uint8),
        rng.integers(0, 256, size=(512, 512, 3), dtype=np.uint8),
    ]


def test_photo_set_sizes_aspects_and_qualities():
    made = list(photos.photo_set(sources(), 40, seed=3))
    assert len(made) == 40
    aspects, qualities = set(), set()
    for jpg, drawn in made:
        img = Image.open(io.BytesIO(jpg))
        assert img.format == "JPEG" and img.mode == "RGB"
        assert img.size == drawn["size"]
        w, h = img.size
        assert 300 <= min(w, h) <= 500
        # The drawn aspect, up to rounding the longer side to whole pixels.
        assert min(abs(w / h - a) for a in photos.ASPECTS) < 0.01
        aspects.add(min(photos.ASPECTS, key=lambda a: abs(w / h - a)))
        assert 75 <= drawn["quality"] <= 95
        qualities.add(drawn["quality"])
    # Mixed, as ImageNet's are: landscape, portrait and square among 40 images.
    assert any(a > 1 for a in aspects) and any(a < 1 for a in aspects) and 1.0 in aspects
    assert len(qualities) > 5
    assert {d["source"] for _, d in made} == {0, 1}
    assert all(photos.GRAIN[0] <= d["grain"] <= photos.GRAIN[1] for _, d in made)


def test_camera_grain_adds_noise_of_the_drawn_strength():
    """The grain is what makes the packaged (clean, downscaled) photographs compress like camera
    JPEGs: a flat grey image comes back with about the drawn luminance spread, and larger."""
    flat = Image.new("RGB", (400, 300), (128, 128, 128))
    grained = np.asarray(photos.camera(flat, 8.0, np.random.default_rng(0)), dtype=np.float32)
    luma = grained.mean(axis=2)
    assert 7.0 < luma.std() < 10.0  # 8 from the luminance grain, plus the per-channel third averaged
    assert abs(luma.mean() - 128) < 1
    size = {}
    for grain in (0.0, 8.0):
        buf = io.BytesIO()
        photos.camera(flat, grain, np.random.default_rng(0)).save(buf, format="JPEG", quality=90)
        size[grain] = len(buf.getvalue())
    assert size[8.0] > 5 * size[0.0]


def test_photo_set_is_deterministic_per_seed():
    first = [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=7)]
    assert first == [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=7)]
    assert first != [jpg for jpg, _ in photos.photo_set(sources(), 5, seed=8)]


def test_peer_requirements_build_ffcv_apart():
    """FFCV compiles against system headers: it gets its own pip step, so that a machine without
    them still gets the other peers; every other pinned line goes to the first step."""
    wheels, built = peervenv.split_requirements(peervenv.REQUIREMENTS.read_text())
    assert built == ["ffcv==1.0.2"]
    assert "litdata==0.2.76" in wheels and "torch==2.14.1" in wheels
    assert all("==" in r and not r.startswith("#") for r in wheels)  # all pinned, comments dropped
    # The torch trap: never 2.13 (its local CPU wheel shadows PyPI's, torchvision breaks on it).
    assert not [r for r in wheels if r.startswith("torch==2.13")]


def fake_pkg_config(folder, present: tuple[str, ...]):
    """A pkg-config that knows only the modules ``present``."""
    folder.mkdir(exist_ok=True)
    tool = folder / "pkg-config"
    tool.write_text(f'#!/bin/sh\nfor m in {" ".join(present) or "none"}; do [ "$2" = "$m" ] && exit 0; done\nexit 1\n')
    tool.chmod(0o755)
    return folder


def test_ffcv_is_left_out_with_the_debian_packages_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_pkg_config(tmp_path / "one", ("opencv4",))))
    assert peervenv.missing_packages("ffcv") == ["libturbojpeg0-dev"]
    assert peervenv.missing_packages("litdata") == []  # a wheel
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peervenv.missing_packages("ffcv") == ["pkg-config", "libopencv-dev", "libturbojpeg0-dev"]
    monkeypatch.setattr(peervenv, "VENV", tmp_path / "venv")
    not_built, wanting = peervenv.build_from_source(["ffcv==1.0.2"])  # no pip is run: nothing to build with
    assert wanting == {"ffcv": ["pkg-config", "libopencv-dev", "libturbojpeg0-dev"]}
    assert not_built["ffcv"].endswith("apt-get install -y pkg-config libopencv-dev libturbojpeg0-dev (as root)")


def test_spdl_names_the_package_of_the_ffmpeg_libraries_it_opens(monkeypatch):
    found = {"avcodec": "libavcodec.so.59", "avformat": "libavformat.so.59"}
    monkeypatch.setattr(peervenv.ctypes.util, "find_library", found.get)
    assert peervenv.missing_packages("spdl") == ["ffmpeg"]
    line = peervenv.needs_line("spdl", ["ffmpeg"])
    assert line == "spdl opens at run time the libraries of Debian's ffmpeg: apt-get install -y ffmpeg (as root)"
    monkeypatch.setattr(peervenv.ctypes.util, "find_library", lambda name: f"lib{name}.so")
    assert peervenv.missing_packages("spdl") == []


def test_a_peer_left_out_for_packages_is_built_once_they_are_installed(tmp_path, monkeypatch):
    """The stamp keeps why a peer is missing; a later run builds it once its packages are there,
    and never retries a pip failure that had them (an older stamp, without the reason: any)."""
    monkeypatch.setattr(peervenv, "VENV", tmp_path)
    built = []
    monkeypatch.setattr(peervenv, "build_from_source", lambda reqs: (built.extend(reqs), ({}, {}))[1])
    wants = {"not_built": {"ffcv": "ffcv builds from source against ..."}, "wanting": {"ffcv": ["libturbojpeg0-dev"]}}
    monkeypatch.setenv("PATH", str(fake_pkg_config(tmp_path / "bin", ("opencv4",))))
    assert peervenv._retry(json.loads(json.dumps(wants)))["not_built"] == {"ffcv": wants["not_built"]["ffcv"]}
    assert built == []  # still missing: not tried
    monkeypatch.setenv("PATH", str(fake_pkg_config(tmp_path / "bin", ("opencv4", "libturbojpeg"))))
    info = peervenv._retry(json.loads(json.dumps(wants)))
    assert built == ["ffcv==1.0.2"] and info["not_built"] == {} and info["wanting"] == {}
    assert json.loads((tmp_path / peervenv.STAMP).read_text())["not_built"] == {}
    built.clear()
    assert peervenv._retry({"not_built": {"ffcv": "pip: error"}, "wanting": {}})["not_built"] == {"ffcv": "pip: error"}
    assert built == []
    peervenv._retry({"not_built": {"ffcv": "error: opencv4 not found"}})  # written before the reason was kept
    assert built == ["ffcv==1.0.2"]


def test_the_peers_bench_stops_in_one_line_naming_what_ffcv_lacks(tmp_path):
    proc = run_script("bench/loader/bench.py", "--peers", env={"PATH": str(fake_pkg_config(tmp_path, ()))})
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert "apt-get install -y libopencv-dev libturbojpeg0-dev" in line
    others = line.split("or leave ffcv out: --only ")[1].split()
    assert "ffcv" not in others and {"ours", "litdata", "streaming", "wids"} <= set(others)


def test_spdls_crop_draw_is_random_resized_crops():
    """bench/loader/peers.py draws SPDL's crops as torchvision's RandomResizedCrop does: inside the image,
    area 8-100 %, aspect 3/4-4/3 (rounding aside), and the centre crop when no try fits."""
    import random

    peers = load("loader.peers")
    rng = random.Random(3)
    for width, height in [(500, 375), (300, 500), (64, 64)]:
        for _ in range(500):
            x, y, w, h = peers.crop_params(width, height, rng)
            assert 0 <= x <= width - w and 0 <= y <= height - h and w > 0 and h > 0
            assert 0.07 <= w * h / (width * height) <= 1.0 and 0.7 <= w / h <= 1.4
    assert peers.crop_params(1000, 10, random.Random(0)) == (493, 0, 13, 10)  # no try fits: the centre, at 4/3


# ---------------------------------------------------------------- two commits side by side (bench/loader/against.py)


def bench_module():
    return load("loader.bench"), load("loader.against")


def test_against_names_a_commit_that_does_not_exist_in_one_line():
    proc = run_script("bench/loader/bench.py", "--against", "no-such-rev-000")
    assert proc.returncode != 0
    assert "no-such-rev-000" in one_error_line(proc) and "no such commit" in one_error_line(proc)


def test_against_table_gives_each_figure_new_over_old_with_its_spread():
    _, against = bench_module()

    def round_(rate, work, pss, workers_pss):
        account = [{"pss": pss - workers_pss, "anon": 1, "file": 2, "shmem": 0, "private": 3}]
        account += [{"pss": workers_pss / 2, "anon": 1, "file": 2, "shmem": 0, "private": 3}] * 2
        ours = {"samples_per_s": rate, "pss_mb": pss, "first_batch_s": 0.1, "pss_account": account}
        return {"ours": ours, "ours-work": {"samples_per_s": work}}

    rounds = {
        "new": [round_(900, 1000, 800, 300), round_(880, 1000, 810, 310), round_(950, 1000, 790, 290)],
        "old": [round_(800, 1000, 1000, 400), round_(780, 1000, 990, 410), round_(810, 1000, 1010, 390)],
    }
    text, medians = against.table("noise", rounds, {"new": "abc+", "old": "def"})
    assert medians["samples/s"]["new"] == 900 and medians["samples/s"]["old"] == 800
    assert medians["ours / own work"]["new"] == 0.9
    assert medians["  workers, all"]["old"] == 400
    line = next(ln for ln in text.splitlines() if ln.startswith("samples/s"))
    assert "900 (880-950)" in line and "800 (780-810)" in line and line.endswith("1.125")
    assert next(ln for ln in text.splitlines() if ln.startswith("PSS, MB")).endswith("0.800")


def test_against_removes_its_worktree_however_the_run_ends():
    import subprocess

    _, against = bench_module()
    commit = against.resolve("HEAD")
    try:
        with against.worktree(commit) as tree:
            assert (tree / "wdsdist" / "data" / "__init__.py").exists()
            made = tree
            raise RuntimeError("a contender failed")
    except RuntimeError:
        pass
    assert not made.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(made) not in listed


def test_the_library_pages_of_a_contenders_venv_are_dropped_from_the_cache(tmp_path):
    memory = load("loader.memory")
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib" / "site-packages" / "torch" / "lib").mkdir(parents=True)
    for name in ("libtorch.so", "libz.so.1", "mod.cpython-311.so"):
        (tmp_path / "lib" / "site-packages" / "torch" / "lib" / name).write_bytes(b"\0" * 8192)
    (tmp_path / "lib" / "site-packages" / "torch" / "README").write_text("not a library")
    assert memory.evict_libraries(str(tmp_path / "bin" / "python")) == 3


def test_the_pss_account_names_this_process_first_and_sums_to_its_pss():
    import os

    memory = load("loader.memory").TreeMemory()
    rows = memory.account()
    assert rows[0]["pid"] == os.getpid()
    assert rows[0]["pss"] > 0 and rows[0]["file"] > 0
    with open("/proc/self/smaps_rollup") as f:
        own = next(int(line.split()[1]) / 1024 for line in f if line.startswith("Pss:"))
    assert abs(rows[0]["pss"] - own) < 0.05 * own + 1


def test_against_interleaves_the_trees_swapping_their_order_each_round(tmp_path, monkeypatch, capsys):
    import argparse

    _, against = bench_module()
    built, calls = [], []
    monkeypatch.setattr(against, "prebuild", lambda tree: built.append(tree) or "")

    def contender(name, dataset, args, tree):
        calls.append((name, tree))
        assert (tree / "wdsdist" / "data" / "__init__.py").exists()  # the old tree is there while it runs
        rate = 900.0 if tree == against.ROOT else 800.0
        ours = {"samples_per_s": rate, "pss_mb": 700.0, "first_batch_s": 0.1, "cpu_ms_per_sample": 1.0}
        return ours if name == "ours" else {"samples_per_s": 1000.0}

    args = argparse.Namespace(against="HEAD", repeat=2, dataset="noise", workers=1, batch=8, batches=1, warmup=1,
                              json=str(tmp_path / "out" / "loader.json"))  # fmt: skip
    assert against.run(args, lambda ds: {}, contender) == 0
    new, old = against.ROOT, built[1]
    assert built[0] == new and old != new and not old.exists()  # the worktree is gone again
    assert [tree for name, tree in calls if name == "ours"] == [new, old, old, new]
    assert [name for name, _ in calls] == ["ours", "ours-work"] * 4
    out = capsys.readouterr().out
    assert next(ln for ln in out.splitlines() if ln.startswith("samples/s")).endswith("1.125")
    report = json.loads((tmp_path / "out" / "against.json").read_text())
    assert report["results"]["noise"]["ours / own work"] == {"new": 0.9, "old": 0.8, "new_rounds": [0.9, 0.9],
                                                             "old_rounds": [0.8, 0.8]}  # fmt: skip


@pytest.mark.slow
def test_a_contender_runs_the_loader_of_the_tree_it_is_given(tmp_path):
    """--against's other side: bench.py --run with --tree imports that checkout's wdsdist."""
    import shutil

    _, against = bench_module()
    with against.worktree(against.resolve("HEAD")) as tree:
        (tree / ".build").mkdir()
        for built in (ROOT / ".build").glob("jpegcrop-*.so"):
            shutil.copy2(built, tree / ".build")
        proc = run_script(
            "bench/loader/bench.py", "--run", "ours-work", "--set", "noise", "--images", "16", "--limit-seconds", "0.1",
            "--workers", "1", "--data", str(tmp_path / "data"), "--tree", str(tree),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["wdsdist"] == str(tree.resolve()) and result["samples_per_s"] > 0


def test_the_bench_with_a_policy_runs_who_applies_it_and_names_who_cannot(monkeypatch):
    """bench.py --augment: the reference pipelines join the peers, FFCV (no such policy) is named
    as left out, and timm's loader runs for randaugment alone."""
    import argparse

    bench = load("loader.bench")

    def plan(**given):
        args = argparse.Namespace(**({"only": None, "peers": True} | given))
        return bench.contenders_for(args), bench.left_out(args)

    run, out = plan(augment="trivialaugment")
    assert {"ours", "limit", "seed", "imagefolder", "streaming", "litdata", "dali", "wids", "spdl"} <= set(run)
    assert "ffcv" not in run and "timm" not in run and set(out) == {"ffcv", "timm"}
    run, out = plan(augment="randaugment")
    assert "timm" in run and set(out) == {"ffcv"}
    run, out = plan(augment="none")
    assert "ffcv" in run and "seed" not in run and "timm" not in run
    run, out = plan(augment="trivialaugment", only=["ours", "ffcv"], peers=False)
    assert run == ["ours"] and set(out) == {"ffcv"}
