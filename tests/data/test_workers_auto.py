"""workers="auto": the cores this process may use (its CPU affinity) shared among the node's
ranks, less one for the training process on a GPU run, half on a CPU run, two at most with
decode=gpu; an explicit number wins; the trainer says the number and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers.config import compose_config
from wdsdist.data import LoaderConfig, UserError
from wdsdist.data import cores as cores_module
from wdsdist.data.cores import auto_workers
from wdsdist.data.options import parse_workers
from wdsdist.train.config import check
from wdsdist.train.run import loader_line


@pytest.fixture
def sixteen_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_a_gpu_run_gets_its_share_less_one_a_cpu_run_half_gpu_decode_two(sixteen_cores, monkeypatch):
    assert auto_workers(gpu=True, gpu_decode=False) == (
        15,
        "auto: 16 cores this process may use, less 1 for the training process",
    )
    assert auto_workers(gpu=False, gpu_decode=False)[0] == 8
    assert auto_workers(gpu=True, gpu_decode=True)[0] == 2
    # decode=gpu with a quarter of the JPEGs left to the workers: 2, and a quarter of 15 cores
    assert auto_workers(gpu=True, gpu_decode=True, cpu_share=0.25) == (
        6,
        "auto: 16 cores this process may use; decode=gpu: 2 to read and draw, and 4 for the 25% of the JPEGs "
        "they decode (25% of the 15 cores CPU decode would take)",
    )
    assert auto_workers(gpu=True, gpu_decode=True, cpu_share=1.0)[0] == 15  # never past CPU decode's number
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(11)))
    assert auto_workers(gpu=True, gpu_decode=True, cpu_share=1 - 0.7)[0] == 2 + 3  # 30 % of 10, not 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cfg = LoaderConfig(batch_size=8, workers="auto", decode="gpu", gpu_decode_share=0.75)
    assert cfg.workers == 6 and "4 for the 25% of the JPEGs" in cfg.workers_why
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks share the node's 16 cores
    workers, why = auto_workers(gpu=True, gpu_decode=False)
    assert (
        workers == 3
        and why == "auto: 16 cores this process may use shared by 4 ranks on this node, less 1 for the training process"
    )
    assert auto_workers(gpu=False, gpu_decode=False)[0] == 2
    assert auto_workers(gpu=True, gpu_decode=False, node_ranks=8)[0] == 1  # the caller's count wins over the env
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # more ranks than cores: still one worker each
    assert auto_workers(gpu=True, gpu_decode=True)[0] == 1 and auto_workers(gpu=False, gpu_decode=False)[0] == 1


def test_loader_config_resolves_auto_from_pin_memory_and_decode(sixteen_cores):
    gpu_run = LoaderConfig(batch_size=8, workers="auto", pin_memory=True)
    assert gpu_run.workers == 15 and "less 1 for the training process" in gpu_run.workers_why
    assert LoaderConfig(batch_size=8, workers="auto").workers == 8  # no pinned memory: a CPU run
    assert LoaderConfig(batch_size=8, workers="auto", decode="gpu").workers == 2
    given = LoaderConfig(batch_size=8, workers=3, pin_memory=True)
    assert given.workers == 3 and given.workers_why is None
    assert LoaderConfig(batch_size=8, workers="5").workers == 5


def test_bad_worker_counts_are_refused_in_one_line():
    for bad in (-1, "many", 2.5, True):
        with pytest.raises(UserError, match=r"^workers=.*: an integer >= 0 or auto$"):
            LoaderConfig(batch_size=8, workers=bad)
    assert parse_workers("auto") == "auto" and parse_workers("0") == 0


def test_a_set_cpu_affinity_is_what_auto_counts():
    """A real affinity, set in a child process (as taskset, a cgroup or Slurm would)."""
    code = (
        "import os, json; os.sched_setaffinity(0, {0})\n"
        "from wdsdist.data import LoaderConfig\n"
        "c = LoaderConfig(batch_size=8, workers='auto', pin_memory=True)\n"
        "print(json.dumps([c.workers, c.workers_why]))\n"
    )
    env = {**os.environ, "LOCAL_WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    workers, why = json.loads(out.stdout)
    assert workers == 1 and why.startswith("auto: 1 cores this process may use")
    assert cores_module.cores() == len(os.sched_getaffinity(0))  # this process's own affinity, untouched


def test_the_trainer_defaults_to_auto_and_says_the_number_and_why(sixteen_cores):
    cfg = compose_config([])
    assert cfg.trainer.workers == "auto"
    check(cfg)
    assert compose_config(["trainer.workers=3"]).trainer.workers == 3
    with pytest.raises(UserError, match=r"^trainer.workers=-2: an integer >= 0 or auto$"):
        check(compose_config(["trainer.workers=-2"]))
    line = loader_line(LoaderConfig(batch_size=64, workers="auto", pin_memory=True))
    assert line == (
        "loader: 15 workers per rank (auto: 16 cores this process may use, less 1 for the training process); "
        "JPEGs decoded on the CPU, in the workers (loader.decode=cpu)"
    )
    line = loader_line(LoaderConfig(batch_size=64, workers=1, decode="gpu"))
    assert line.startswith("loader: 1 worker per rank (trainer.workers); JPEGs decoded on the GPU")
    line = loader_line(LoaderConfig(batch_size=64, workers=1, decode="gpu", gpu_decode_share=0.75), "nvJPEG")
    assert line.endswith("by nvJPEG (loader.decode=gpu), 25% of them in the workers (loader.gpu_decode_share=0.75)"), (
        line
    )
