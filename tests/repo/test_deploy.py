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

from tests.conftest import ROOT, one_error_line, run_script
from tests.helpers.config import compose_config

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
    # The runtime set only: the test and lint tools (requirements-dev.txt) stay out of the image.
    assert all("requirements-dev" not in args for _, args in ins)
    entry = yaml.safe_load(next(args for op, args in ins if op == "ENTRYPOINT"))
    cmd = yaml.safe_load(next(args for op, args in ins if op == "CMD"))
    assert entry == ["./run"] and os.access(ROOT / "run", os.X_OK)
    assert (ROOT / cmd[0]).is_file()
    user = next(args for op, args in ins if op == "USER")
    assert user.split(":")[0] not in ("0", "root")
    env = " ".join(args for op, args in ins if op == "ENV")
    assert "WDSDIST_SYSTEM_PYTHON=1" in env and "WDSDIST_SYSTEM_PYTHON" in (ROOT / "run").read_text()
    # .dockerignore is an allowlist: what the image runs is sent, nothing else whatever lies around
    sent = {path for path in git_files() if docker_sends(path)}
    assert {"run", "train.py", "makeshards.py", "simdist.py", "requirements.txt"} <= sent
    assert any(p.startswith("wdsdist/data/") for p in sent) and any(p.startswith("conf/") for p in sent)
    assert any(p.startswith("examples/") for p in sent) and not any(p.startswith("tests/") for p in sent)
    junk = [".venv/bin/python", ".venv-0123456789ab/lib/x.so", ".bench-venv/lib/torch.so", "data/synthetic/a.tar",
            "outputs/run/latest.pt", "site/index.html", ".build/jpegcrop.so", ".git/HEAD", "wdsdist/__pycache__/x.pyc",
            "bench/results/x.md", "notes.txt"]  # fmt: skip
    assert [path for path in junk if docker_sends(path)] == []


def git_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def docker_sends(path: str) -> bool:
    """Whether the build context holds ``path``, by .dockerignore's rules as Docker reads them: each
    pattern matched against the path and its parents, the last match deciding ("!" includes)."""
    import fnmatch

    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        deep = pattern.startswith("**/")
        for candidate in candidates:
            name = candidate.rsplit("/", 1)[-1] if deep else candidate
            if fnmatch.fnmatch(name, pattern[3:] if deep else pattern):
                sent = include
                break
    return sent


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
    # The invoking uid:gid in every case, root's too: the mounted folders are the invoker's.
    assert out[out.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    assert out[-3:] == ["wds-distributed", "train.py", "trainer.steps=5"]
    build = subprocess.run(["./run", "build"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert build.stdout.split() == ["docker", "build", "-t", "wds-distributed", "."]


def test_run_build_and_docker_take_engine_flags_from_the_environment(tmp_path):
    env = _fake_bin(tmp_path, ["docker"])
    env.update(DOCKER_RUN_FLAGS="--network host -e X=1", DOCKER_BUILD_FLAGS="--network host --pull")

    def run(*args):
        return subprocess.run(["./run", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True)

    out = run("docker", "simdist.py", "--network").stdout.split()
    # Engine flags before the image; the container's command after it, untouched.
    image = out.index("wds-distributed")
    assert out[image - 4 : image] == ["--network", "host", "-e", "X=1"]
    assert out[image + 1 :] == ["simdist.py", "--network"]
    built = run("build", "--build-arg", "BASE_IMAGE=stand-in").stdout.split()
    assert built == ["docker", "build", "-t", "wds-distributed", "--network", "host", "--pull"] + [
        "--build-arg",
        "BASE_IMAGE=stand-in",
        ".",
    ]
    assert "DOCKER_RUN_FLAGS" in run("help").stdout


def test_dockerfile_builds_on_any_base_and_leaves_the_compiler_behind():
    ins = dockerfile_instructions()
    assert ins[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")
    stages = [args.split() for op, args in ins if op == "FROM"]
    assert stages[0][0] == "${BASE_IMAGE}" and all(s[0] in ("${BASE_IMAGE}", "runtime") for s in stages)
    last = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    final = " ; ".join(args for op, args in ins[last:] if op == "RUN")
    assert "gcc" not in final and "-dev" not in final
    copied = [args for op, args in ins[last:] if op == "COPY" and args.startswith("--from=jpegcrop")]
    assert copied and copied[0].split()[1] == "/app/.build"
    # The jpegcrop stage has wdsdist/ alone (no checkout around it): told where to build, it builds
    # where the final stage copies from, and the final image looks there.
    env = " ".join(args for op, args in ins if op == "ENV")
    assert "WDSDIST_BUILD=/app/.build" in env.split()
    # python3 -m pip: the stand-in base has no command named pip
    assert "python3 -m pip install" in " ; ".join(args for op, args in ins if op == "RUN")


CHECK_IMAGE = ROOT / "deploy" / "check-image.sh"


def test_check_image_script_parses_and_is_not_part_of_the_suite():
    assert os.access(CHECK_IMAGE, os.X_OK)
    subprocess.run(["bash", "-n", str(CHECK_IMAGE)], check=True)
    assert "deploy/check-image.sh" in (ROOT / "run").read_text()


FAKE_ENGINE = """#!/usr/bin/env bash
# A stand-in for the docker command: logs its calls; an engine that answers and builds, whose
# containers write nothing (so the check must fail on what did not land in outputs/).
echo "$*" >> "$FAKE_CALLS"
case "$1" in
  image) echo 123456789 ;;
  run) [[ "$*" == *wdsdist.tools.jpegcheck* ]] && echo "jpegcrop loaded: /app/.build/jpegcrop.so"
       [[ "$*" == *simdist.py* ]] && echo "SUCCESS: same batches in all ranks"
       [[ "$*" == *train.py* ]] && echo "$FAKE_NOTE" ;;
esac
exit 0
"""


@pytest.mark.parametrize(
    "note, failure",
    [
        ("", "no TensorBoard events in outputs/check-image-"),
        ("note: no C compiler (cc) to build jpegcrop.c; decoding whole JPEGs (slower)", "jpegcrop is not usable"),
    ],
)
def test_check_image_drives_run_and_fails_in_one_line(tmp_path, note, failure):
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(FAKE_ENGINE)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", DOCKER_HOST="unix:///fake.sock")
    env.update(WDSDIST_CHECK_DIR=str(tmp_path / "state"), FAKE_CALLS=str(calls), FAKE_NOTE=note)
    proc = subprocess.run([str(CHECK_IMAGE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("check-image: FAIL: ") and failure in last, proc.stderr
    made = calls.read_text().splitlines()
    assert "build -t wds-distributed --build-arg BASE_IMAGE=python:3.11-slim-bookworm ." in made
    runs = [c.split("wds-distributed ", 1)[1] for c in made if c.startswith("run ") and "--entrypoint" not in c]
    assert [r.split()[:3] for r in runs] == [
        ["train.py", "trainer.steps=20", runs[0].split()[2]],
        ["simdist.py", "--nbatches", "auto"],
        ["makeshards.py", "--synthetic", "300"],
        ["torchrun", "--nproc-per-node", "2"],
    ][: len(runs)] and len(runs) == 4
    assert all(f"--user {os.getuid()}:{os.getgid()}" in c for c in made if c.startswith("run "))


# ---------------------------------------------------------------- unwritable data and output folders
# The container runs as the invoking uid; a mounted folder owned by another uid used to end in a
# PermissionError traceback. Tests run as root here, which ignores permission bits: so the
# folders below cannot be made at all (a regular file stands in the way), or os.access is faked.


def test_unwritable_folder_names_its_owner_and_the_fix(tmp_path, monkeypatch):
    from wdsdist.errors import UserError
    from wdsdist.tools import outfolder

    owner = tmp_path.stat().st_uid
    monkeypatch.setattr(outfolder.os, "getuid", lambda: owner + 1)
    monkeypatch.setattr(outfolder.os, "access", lambda path, mode: False)
    with pytest.raises(UserError) as err:
        outfolder.make_output_folder(str(tmp_path / "outputs"), "outputs")
    msg = str(err.value)
    assert msg.startswith(f"outputs: cannot write to {tmp_path}/outputs/")
    assert f"is owned by uid {owner}, you are uid {owner + 1}" in msg and "fix: sudo chown -R" in msg


@pytest.mark.parametrize("key", ["outputs", "data.train_shards"])
def test_trainer_says_which_folder_it_cannot_write(tmp_path, key):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    args = [f"outputs={tmp_path / 'outputs'}", "data.synthetic.train_samples=8", "data.val_shards=null"]
    if key == "outputs":
        args[0] = f"outputs={blocker / 'outputs'}"
        args.append(f"data.train_shards={tmp_path / 'data' / 'train.index.json'}")
    else:
        args.append(f"data.train_shards={blocker / 'synthetic' / 'train.index.json'}")
    proc = run_script("train.py", "data=synthetic", *args, "trainer.steps=1")
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith(f"error: {key}: cannot write to {blocker}/") and f"{blocker} is a file" in line, line
    assert not (tmp_path / "outputs").exists()


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
