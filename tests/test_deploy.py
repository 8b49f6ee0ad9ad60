"""Docker and cluster launch files: linted, and consistent with the code they launch.

No Docker engine, Slurm or Kubernetes runs here; these tests hold the files to what can be
checked: the real linter, the real torchrun argument parser, the entry points and the config
overrides they name.
"""

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from tests.conftest import ROOT

BIN = Path(sys.executable).parent


def dockerfile_instructions():
    lines, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([str(BIN / "hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_the_requirements_and_runs_existing_entry_points():
    ins = dockerfile_instructions()
    copies = [args for op, args in ins if op == "COPY"]
    runs = " ; ".join(args for op, args in ins if op == "RUN")
    assert "requirements.txt ./" in copies[0]  # dependencies in their own layer, from the same file
    assert "pip install -r requirements.txt" in runs
    entry = yaml.safe_load(next(args for op, args in ins if op == "ENTRYPOINT"))
    cmd = yaml.safe_load(next(args for op, args in ins if op == "CMD"))
    assert entry == ["./run"] and os.access(ROOT / "run", os.X_OK)
    assert (ROOT / cmd[0]).is_file()
    user = next(args for op, args in ins if op == "USER")
    assert user.split(":")[0] not in ("0", "root")
    env = " ".join(args for op, args in ins if op == "ENV")
    assert "WDSDIST_SYSTEM_PYTHON=1" in env and "WDSDIST_SYSTEM_PYTHON" in (ROOT / "run").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "data", "outputs", ".git"} <= set(ignored)


def _fake_bin(tmp_path, names):
    for name in names:
        tool = tmp_path / name
        tool.write_text('#!/bin/sh\necho "$(basename "$0")" "$@"\n')
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", DOCKER=str(tmp_path / "docker"))


def test_run_docker_mounts_data_and_outputs_with_gpus_and_shared_memory(tmp_path):
    env = _fake_bin(tmp_path, ["docker", "nvidia-smi"])
    out = subprocess.run(
        ["./run", "docker", "train.py", "trainer.steps=5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[:3] == ["docker", "run", "--rm"]
    assert out[out.index("--gpus") + 1] == "all"
    assert out[out.index("--shm-size") + 1] == "16g"
    mounts = [out[i + 1] for i, a in enumerate(out) if a == "-v"]
    assert mounts == [f"{ROOT}/data:/app/data", f"{ROOT}/outputs:/app/outputs"]
    if os.getuid() != 0:
        assert out[out.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    else:
        assert "--user" not in out  # never root: the image's own user
    assert out[-3:] == ["wds-distributed", "train.py", "trainer.steps=5"]
    build = subprocess.run(["./run", "build"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert build.stdout.split() == ["docker", "build", "-t", "wds-distributed", "."]


def torchrun_args_of(words):
    """The torchrun options and the script + overrides in a command split into words."""
    i = words.index("torchrun")
    args = get_args_parser().parse_args(words[i + 1 :])
    return args, [args.training_script, *args.training_script_args]


def slurm_command():
    text = (ROOT / "deploy" / "slurm.sbatch").read_text()
    command = re.search(r"^srun .*?(?<!\\)$", text.replace("\\\n", " "), re.M | re.S).group(0)
    values = {
        "SLURM_NNODES": "2",
        "GPUS_PER_NODE": "8",
        "SLURM_JOB_ID": "1234",
        "HEAD_NODE": "node001",
        "RDZV_PORT": "29500",
        "DATA_CONFIG": "imagenet",
        "TRAIN_SHARDS": "/d/train.index.json",
        "VAL_SHARDS": "/d/val.index.json",
    }
    command = re.sub(r'"\$(\w+)"|\$(\w+)', lambda m: values.get(m.group(1) or m.group(2), "X"), command)
    return shlex.split(command.replace('"$@"', ""))


def kubernetes_command():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    service = next(d for d in docs if d["kind"] == "Service")
    return job, service, job["spec"]["template"]["spec"]["containers"][0]["command"]


def test_slurm_launches_torchrun_with_a_shared_rendezvous():
    args, script = torchrun_args_of(slurm_command())
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "8", "c10d")
    assert args.rdzv_endpoint == "node001:29500" and args.rdzv_id == "1234"
    assert script[0] == "train.py" and (ROOT / script[0]).is_file()
    assert "trainer.resume=auto" in script


def test_kubernetes_indexed_job_matches_its_torchrun_and_service():
    job, service, command = kubernetes_command()
    assert command[:2] == ["./run", "torchrun"]
    args, script = torchrun_args_of(command)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert int(args.nnodes) == spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    gpus = pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(args.nproc_per_node) == gpus
    # Pod 0 of the job, through the headless service that the pods' subdomain names.
    host, port = args.rdzv_endpoint.split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])  # /dev/shm
    assert script[0] == "train.py" and (ROOT / script[0]).is_file()
    # The rendezvous id names the run directory: the Job's own uid (the downward API, expanded by
    # Kubernetes in the command), never a fixed name that a second Job would silently continue.
    var = re.fullmatch(r"\$\((\w+)\)", args.rdzv_id)
    assert var, args.rdzv_id
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env[var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    )


def compose_config(overrides):
    """The trainer's config composed with these overrides, through its own typed schema."""
    from hydra import compose, initialize_config_dir

    from wdsdist.train import config

    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize("path", ["deploy/slurm.sbatch", "deploy/kubernetes.yaml"])
def test_launch_files_say_how_to_name_the_network_interface(path):
    text = (ROOT / path).read_text()
    assert "GLOO_SOCKET_IFNAME" in text and "NCCL_SOCKET_IFNAME" in text and "127.0.1.1" in text


@pytest.mark.parametrize("source", ["slurm", "kubernetes"])
def test_launch_file_overrides_are_valid_config(source):
    script = torchrun_args_of(slurm_command() if source == "slurm" else kubernetes_command()[2])[1]
    from omegaconf import OmegaConf

    cfg = compose_config(script[1:])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # every mandatory key is given
    assert cfg.data.train_shards and cfg.data.val_shards and cfg.trainer.resume == "auto"
    # GPU nodes: never a silent fall back to training on the CPU (trainer.device=auto would).
    assert cfg.trainer.device.value == "cuda"
    with pytest.raises(Exception, match="trainer.stepz"):
        compose_config([*script[1:], "trainer.stepz=1"])  # the check can fail
