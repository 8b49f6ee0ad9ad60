"""./run gpu-check and ./run gpu-kit without a GPU: the rehearsal (--cpu) runs every part that
needs no CUDA and writes the report, chart and JSON; ./run picks the machine's own Python and the
kit's wheels on a GPU node; the kit's and the report's pure logic."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


def load(name: str):
    """A bench module by its path under bench/ (``gpucheck.train``): bench/ is a package."""
    return importlib.import_module(f"bench.{name}")


gpukit, train_parts, report = load("gpucheck.kit"), load("gpucheck.train"), load("gpucheck.report")
runs = load("gpucheck.runs")  # a run of train.py read from its log


# ---------------------------------------------------------------- the rehearsal


@pytest.mark.slow
def test_the_rehearsal_reports_every_part_in_markdown_json_and_a_chart(tmp_path):
    from PIL import Image

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    # A fresh process (run_script's are forked from one that read TMPDIR already).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    cmd = [sys.executable, "bench/gpucheck/check.py", "--cpu", "--out", str(out), "--compile"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [md], [png], [js] = (sorted(out.glob(f"*-gpu-check.{ext}")) for ext in ("md", "png", "json"))
    assert md.stem == png.stem == js.stem and md.name[:4].isdigit()
    results = json.loads(js.read_text())
    parts = results["parts"]
    assert list(parts) == ["data", "probe", "a", "b", "c", "d", "e", "f"]
    assert {key: part["status"] for key, part in parts.items()} == dict.fromkeys(parts, "ok")

    [a] = parts["a"]["rows"]
    assert a["status"] == "ok" and a["steady_samples_per_s"] > 0 and a["pure_compute"] > 0 and a["val_top1"] is not None
    assert parts["b"]["resumed"] is True and [r["steps"] for r in parts["b"]["rows"]] == [2, 4]
    c = {(r["model"], r["decode"], r["workers"]): r for r in parts["c"]["rows"]}
    labels = [f"gpu/{d}{s}" for s in ("", " (50% on the GPU)") for d in ("torchvision", "nvimgcodec")]
    gpus = [(label, "2") for label in labels]
    rows = [("resnet18", d, w) for d, w in [("cpu", "1"), ("cpu (compiled)", "1"), *gpus]]
    rows += [("resnet18", f"{d} + trivialaugment", w) for d, w in [("cpu", "1"), *gpus]]  # the recipe's rows
    assert sorted(c) == sorted(rows)
    assert c["resnet18", "cpu (compiled)", "1"]["first_step_s"] > 0  # --compile: the compile time beside the rate
    for (_, decode, _), row in c.items():
        if decode.startswith("cpu"):
            assert row["status"] == "ok" and row["steady_samples_per_s"] > 0 and row["workers_used"] == 1
        else:
            assert row["status"] == "skipped" and "CUDA" in row["error"]
    # (d) runs decode=gpu's rows on CPU tensors: each row's options reach the loader
    d = [(r["decode"], r["workers"], r["status"], r["batches"] > 0) for r in parts["d"]["rows"]]
    augmented = [("cpu + trivialaugment", 2, "ok", True), ("gpu/torchvision + trivialaugment", 2, "ok", True)]
    assert d == [
        ("cpu", 1, "ok", True),
        ("cpu", 2, "ok", True),
        *((label, 2, "ok", True) for label in labels),
        *augmented,
    ]
    # The rehearsal runs decode=gpu's functions on CPU tensors: the same samples, the pixels
    # within the check's bound (the float resize against the CPU path's integer weights).
    e = {(r["set"], r["decoder"]): r for r in parts["e"]["rows"]}
    assert sorted(e) == sorted((s, d) for s in ("noise", "photos") for d in ("nvimgcodec", "torchvision"))
    assert all(r["same_samples"] and r["p99_9"] <= 2 and r["max"] <= 2 for r in e.values())

    text = md.read_text()
    for key in parts:
        assert f"## ({key}) " in text
    assert f"![samples/s per configuration beside pure compute]({png.name})" in text
    assert "| resnet18 | gpu/nvimgcodec | 2 |" in text and "skipped: GPU decode needs CUDA" in text
    assert Image.open(png).text.get("Source") == md.name
    assert list(scratch.glob("wdsdist-gpu-check*")) == []  # its data and runs: a temporary folder, removed


# ---------------------------------------------------------------- ./run gpu-check on a GPU node


def wheel(folder: Path, name: str = "kitmod") -> Path:
    """A pure-Python wheel holding one module, as pip download would bring it."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


@pytest.fixture
def node(tmp_path):
    """A copy of ./run with a stand-in bench/gpucheck/check.py that reports what it was started with,
    and a python3 on PATH that imports torch (this environment's), as on a GPU node."""
    repo = tmp_path / "repo"
    (repo / "bench" / "gpucheck").mkdir(parents=True)
    shutil.copy2(ROOT / "run", repo / "run")
    (repo / "bench" / "gpucheck" / "check.py").write_text(
        "import json, os, sys\nimport kitmod\n"
        "keys = ('PYTHONPATH', 'WDSDIST_BUILD', 'LD_LIBRARY_PATH')\n"
        "print(json.dumps({'argv': sys.argv[1:], 'kitmod': kitmod.VALUE, 'prefix': sys.prefix,"
        " **{k: os.environ.get(k) for k in keys}}))\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return repo


def run_node(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "WDSDIST_BUILD")}
    env |= {"PATH": f"{repo.parent / 'bin'}:{os.environ['PATH']}", "WDSDIST_GPU_SITE": str(repo.parent / "site")}
    return subprocess.run(["./run", "gpu-check", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def test_gpu_check_runs_on_the_machines_python_with_the_kit_and_makes_no_venv(node):
    kit = node / "my-kit"
    (kit / "build").mkdir(parents=True)
    wheel(kit)
    proc = run_node(node, "--kit", "my-kit", "--out", "x")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["--kit", "my-kit", "--out", "x"] and seen["kitmod"] == 42
    assert seen["prefix"] == sys.prefix  # the python3 found on PATH, not an environment of ./run's
    assert seen["PYTHONPATH"].split(":") == [str(node), str(node.parent / "site")]
    assert seen["WDSDIST_BUILD"] == str(kit / "build") and seen["LD_LIBRARY_PATH"] == str(kit / "build")
    assert not list(node.glob(".venv*"))


def test_gpu_check_without_the_kit_says_how_to_make_it(node):
    proc = run_node(node)
    assert proc.returncode == 2
    assert "no wheels in --kit gpu-kit (make it with ./run gpu-kit" in proc.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------- the kit's and the report's logic


def test_the_kit_takes_the_pins_of_requirements_txt_and_builds_antlr_from_its_sdist():
    requirements = (ROOT / "requirements.txt").read_text()
    pins = gpukit.pins(requirements)
    wheels, sdist = gpukit.wanted(requirements, "4.9.3")
    assert wheels == [f"{name}=={pins[name]}" for name in ("hydra-core", "omegaconf", "webdataset", "braceexpand")]
    assert sdist == "antlr4-python3-runtime==4.9.3"
    assert gpukit.pins("Hydra_Core == 1.3.8  # why\n-r other.txt\ntorch>=2\n") == {"hydra-core": "1.3.8"}
    with pytest.raises(SystemExit, match="pins no version of webdataset, braceexpand"):
        gpukit.wanted("hydra-core==1\nomegaconf==2\n", "4.9.3")


def test_the_kit_finds_the_libjpeg_that_jpegcrop_links():
    ldd = (
        "\tlinux-vdso.so.1 (0x00007ffd)\n"
        "\tlibjpeg.so.62 => /lib/x86_64-linux-gnu/libjpeg.so.62 (0x00007f12)\n"
        "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f34)\n"
    )
    assert gpukit.libjpeg_in(ldd) == Path("/lib/x86_64-linux-gnu/libjpeg.so.62")
    ldconfig = (
        "\tlibjpeg.so.62 (libc6,x86-64) => /usr/lib/libjpeg.so.62\n\tlibjpeg.so (libc6,x86-64) => /usr/lib/libjpeg.so\n"
    )
    assert gpukit.libjpeg_in(ldconfig) == Path("/usr/lib/libjpeg.so.62")
    assert gpukit.libjpeg_in("\tlibjpeg.so.62 => not found\n") is None


LOG = """run dir /tmp/r: resnet18 on 1 x cuda, 60 steps of 256 per rank (global 256), lr 0.1, loader.mode=repeat
plan: 32 shards, 4000 samples over 1 ranks x 15 workers; batches per rank per pass 15..16
step 20/60 loss 2.3 acc 10.0% lr 0.1 1000 samples/s data-wait 50% eta 3s
step 40/60 loss 2.3 acc 10.0% lr 0.1 2000 samples/s data-wait 10% eta 1s
step 60/60 loss 2.3 acc 10.0% lr 0 4000 samples/s data-wait 0% eta 0s
"""


def test_the_steady_rate_is_the_windows_after_the_warm_up_samples_over_their_time():
    lines = runs.windows(LOG)
    assert lines == [(20, 1000.0, 0.5), (40, 2000.0, 0.1), (60, 4000.0, 0.0)]
    assert runs.PLAN_WORKERS.search(LOG).group(1) == "15"
    # After step 20: 2 windows of 20 x 256 samples, in 2.56 s and 1.28 s.
    got = runs.steady(lines, 20, 256)
    assert got["steady_samples_per_s"] == pytest.approx(2 * 5120 / 3.84)
    assert got["steady_data_wait"] == pytest.approx(0.1 * 2.56 / 3.84)
    # A run resumed at step 10 has its first window from there: 10 x 256 samples in 2.56 s.
    assert runs.steady(lines, 10, 256, start=10)["steady_samples_per_s"] == pytest.approx(12800 / 6.4)
    assert runs.steady(lines, 60, 256)["steady_samples_per_s"] is None


def test_part_c_reads_the_host_time_by_phase_from_the_trainers_last_line():
    from wdsdist.train.trainer import decode_line

    host = {
        "decoder": "nvImageCodec 0.9",
        "decode_ms": 25.384,
        "decode_cpu_ms": 3.019,
        "resize_ms": 1.03,
        "augment_ms": 0.412,
    }
    line = decode_line({"gpu": 900, "cpu": 124, "failed": 0}, host | {"hand_over_ms": 0.154})
    said = runs.HOST_LINE.search(f"step 60 ...\n{line}\ndone")
    assert said
    phases = dict(zip(runs.HOST_PHASES, map(float, said.groups()), strict=True))
    assert phases == {"decode": 25.38, "decode_cpu": 3.02, "resize": 1.03, "augment": 0.41, "hand_over": 0.15}
    assert report.host_ms(phases) == "25.38 (3.02) / 1.03 / 0.41 / 0.15"
    # One thread, 256 images a batch at 8,458 a second: 33 batches, each 26.82 ms of the thread's time
    busy = train_parts.decode_busy({"host_ms": phases, "steady_samples_per_s": 8458.0}, 1, 256)
    assert busy == pytest.approx(26.82e-3 * 8458 / 256)
    assert train_parts.decode_busy({"host_ms": phases, "steady_samples_per_s": 8458.0}, 2, 256) == busy / 2
    assert train_parts.decode_busy({"host_ms": None, "steady_samples_per_s": 8458.0}, 1, 256) is None


def test_the_probe_times_a_setting_and_two_decoders_at_once_with_the_cpu_they_took(monkeypatch):
    pytest.importorskip("nvidia.nvimgcodec")
    decoder = load("gpucheck.decoder")
    monkeypatch.setattr(decoder, "TIMED", 12)
    # Without CUDA: nvImageCodec's CPU backend, the first setting and the decoders at once
    first, at_once, loaded = decoder.timing()
    assert first["setting"] == decoder.SETTINGS[0][0] and first["ok"] and first["p99_9"] <= 2
    assert at_once["ok"] and at_once["images"] == decoder.AT_ONCE * 12 and at_once["refused"] == 0
    assert all(r["cpu_ms"] > 0 and r["wall_ms"] > 0 for r in (first, at_once))
    assert loaded["setting"] == "nvjpeg loaded"
    lines = report.timing_table({"timing": [first | {"mode": "timing"}, at_once | {"mode": "timing"}]})
    per_s = [line.split(" | ")[6] for line in lines[-2:]]
    assert per_s == [report.num(1000 * n / r["wall_ms"]) for n, r in ((12, first), (24, at_once))]


def test_a_failed_part_is_reported_with_its_error_and_the_others_stand():
    results = {
        "command": "./run gpu-check",
        "date": "2026-01-01",
        "parts": {
            "d": {
                "title": "the loader alone",
                "status": "ok",
                "rows": [
                    {
                        "decode": "cpu",
                        "workers": 1,
                        "status": "ok",
                        "samples_per_s": 450.0,
                        "batches": 9,
                        "timed_s": 30.2,
                        "steady": False,
                    },
                    {"decode": "gpu", "workers": 2, "status": "failed", "error": "TypeError: no decode"},
                ],
            },
            "e": {"title": "pixels", "status": "failed", "error": "RuntimeError: nvjpeg", "rows": []},
        },
    }
    text = report.markdown(results, "c.png")
    assert "| cpu | 1 | 450 | 9 | 30.2 s (not steady) | - |" in text
    assert "| gpu | 2 | - | - | - | - | failed: TypeError: no decode |" in text
    assert "Status: failed (RuntimeError: nvjpeg)" in text and "- (e) failed: RuntimeError: nvjpeg" in text
    assert [label for label, *_ in report.bars(results)] == ["(d) loader cpu x1", "(d) loader gpu x2"]


def test_a_rehearsals_report_goes_under_outputs_and_a_gpus_among_the_dated_reports(tmp_path):
    check = load("gpucheck.check")
    assert check.report_folder(check.parse_args(["--cpu"])) == ROOT / "outputs" / "gpu-check"
    assert check.report_folder(check.parse_args([])) == ROOT / "bench" / "results"
    assert check.report_folder(check.parse_args(["--cpu", "--out", str(tmp_path)])) == tmp_path


def test_the_rows_asked_for_on_the_command_line_and_a_wrong_one_refused_at_once(capsys):
    check = load("gpucheck.check")
    args = ["--models", "resnet18", "--decoders", "nvimgcodec", "--gpu-workers", "2", "auto"]
    sizes = check.sized(check.parse_args([*args, "--decode-threads", "1", "2", "--decode-shares", "1", "0.75"]))
    assert (sizes.models, sizes.gpu_decoders, sizes.cpu_rows) == (("resnet18",), ("nvimgcodec",), False)
    rows = load("gpucheck.loader").gpu_rows(sizes)
    assert len(rows) == 8 and rows[-1] == (
        "gpu/nvimgcodec (2 threads, 75% on the GPU)",
        "auto",
        {"decode": "gpu", "gpu_decoder": "nvimgcodec", "gpu_decode_threads": 2, "gpu_decode_share": 0.75},
    )
    for wrong, said in (
        (["--decode-shares", "1.5"], "'1.5': a share between 0 and 1"),
        (["--gpu-workers", "x"], "'x'"),
    ):
        with pytest.raises(SystemExit):
            check.parse_args(wrong)
        assert said in capsys.readouterr().err


def test_part_d_times_a_row_until_its_rate_is_steady():
    loader = load("gpucheck.loader")
    now = [0.0]

    def batches(costs):
        """A batch of 10 samples taking each of ``costs`` seconds in turn, on a clock of its own."""
        it = iter(costs)

        def next_batch() -> int:
            now[0] += next(it)
            return 10

        return next_batch

    # Workers still starting: from 0.1 s a batch to 0.02 s (500 samples/s) over the first 100
    ramp = batches([0.1 - 0.0008 * i for i in range(100)] + [0.02] * 10_000)
    got = loader.steady_rate(ramp, window_s=1.0, most_s=100.0, clock=lambda: now[0])
    assert got["steady"] and abs(got["samples_per_s"] - 500) < 10
    assert got["windows"][0] < 110 and got["timed_s"] > 6  # the slow start was timed, and outwaited
    # A rate that never settles is reported as such at the limit
    now[0] = 0.0
    swings = batches(([0.01] * 20 + [0.2] * 2) * 10_000)  # windows of 1000, 1000, 50, 50, ... samples/s
    got = loader.steady_rate(swings, window_s=0.1, most_s=5.0, clock=lambda: now[0])
    assert not got["steady"] and 5.0 <= got["timed_s"] < 5.5


def test_a_gpu_run_of_parts_that_decode_on_the_gpu_installs_the_probes_release_first():
    check = load("gpucheck.check")
    for argv, parts, timed in (
        (["--only", "c", "f"], {"data", "probe", "c", "f"}, False),  # the release, its settings untimed
        (["--only", "probe", "c"], {"data", "probe", "c"}, True),
        (["--only", "a", "b"], {"data", "a", "b"}, False),  # no GPU decode: no probe
        (["--cpu", "--only", "c"], {"data", "c"}, False),  # a rehearsal probes nothing
    ):
        args = check.parse_args(argv)
        assert check.wanted_parts(args) == parts, argv
        assert (args.only is None or "probe" in args.only) == timed
    assert check.wanted_parts(check.parse_args([])) == {key for key, _, _ in check.PARTS}


def test_the_probe_names_the_fastest_setting_with_libjpegs_pixels_and_skips_rows_without_pixels(monkeypatch):
    decoder = load("gpucheck.decoder")
    said = {
        "timing": [{"setting": "hw", "ok": True, "wall_ms": 5.0, "p99_9": 0.0}],
        "timing-own-nvjpeg": [
            {"setting": "hw", "ok": True, "wall_ms": 9.0, "p99_9": 0.0},
            {"setting": "hybrid", "ok": True, "wall_ms": 7.0, "p99_9": 3.0},  # pixels too far
            {"setting": "cuda", "ok": False, "error": "RuntimeError: no decoder"},
            {"setting": "2 at once", "ok": True, "wall_ms": 1.0, "images": 512},  # no pixels of its own
        ],
    }

    def run(cmd, **_):
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(said[cmd[-1]]) + "\n", stderr="")

    monkeypatch.setattr(decoder.subprocess, "run", run)

    class Check:
        def left(self):
            return 300.0

        def say(self, text):
            pass

    part = {"verdict": "nvImageCodec 0.9 is used"}
    decoder.settings(Check(), part, {"site": "/nowhere"})
    assert part["best"] == "hw" and part["verdict"].endswith("fastest alone: hw (9.0 ms per 256 crops)")
    assert len(part["timing"]) == 5


def test_keep_brings_each_runs_output_and_log_beside_the_report(tmp_path):
    check = load("gpucheck.check")
    runs = tmp_path / "work" / "runs"
    (runs / "c-resnet18-cpu-auto").mkdir(parents=True)
    (runs / "c-resnet18-cpu-auto.out").write_text("out\n")
    (runs / "c-resnet18-cpu-auto" / "train.log").write_text("log\n")
    (runs / "c-resnet18-cpu-auto" / "ckpt.pt").write_bytes(b"x" * 10)  # not a log: left behind
    check.keep_logs(tmp_path / "work", tmp_path / "logs")
    kept = sorted(str(p.relative_to(tmp_path / "logs")) for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert kept == ["c-resnet18-cpu-auto.out", "c-resnet18-cpu-auto/train.log"]
    assert (tmp_path / "logs" / "c-resnet18-cpu-auto" / "train.log").read_text() == "log\n"


def test_the_probe_decodes_regions_whole_images_and_progressive_jpegs_and_fails_regions_turned_off(monkeypatch):
    pytest.importorskip("nvidia.nvimgcodec")
    decoder = load("gpucheck.decoder")
    assert decoder.MODES == ("regions", "whole", "progressive")
    for mode, images in (("regions", 10), ("whole", 10), ("progressive", 8)):  # on the CPU: its CPU backend
        got = decoder.measure(mode, 8)
        assert got["ok"] and got["refused"] == 0 and got["images"] == images and got["p99_9"] <= 2, mode
    jpeg = decoder.progressive(load("gpucheck.loader").photo_sample(0))
    assert b"\xff\xc2" in jpeg and b"\xff\xc0" not in jpeg  # SOF2, no baseline frame
    from wdsdist.data.decode import codecs

    class RefusesEveryRegion(codecs.NvImageCodec):  # as nvJPEG before 13.2 did: whole images from then on
        def decode(self, datas, regions):
            self.regions = False
            return super().decode(datas, regions)

    monkeypatch.setattr(codecs, "NvImageCodec", RefusesEveryRegion)
    got = decoder.measure("regions", 8)
    assert not got["ok"] and got["refused"] == 0  # every image decoded, but not as a region: it does not work
