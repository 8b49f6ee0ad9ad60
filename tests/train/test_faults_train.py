"""Faults in a training job: bad data on one rank, a killed rank, SIGTERM, a stalled rank (the
checkpoints on disk, torn, corrupt or hostile: tests/train/test_faults_checkpoints.py). Real train.py
runs (gloo, CPU), kept tiny: SqueezeNet on 32-pixel images, one loader worker, no evaluation
unless it is the point. Under torchrun where its agent is the point (restarts, signals to the job,
a stalled rank's timeout); bad data is the ranks' own work, so those ranks are forked with
torchrun's environment (tests/helpers/training.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import ROOT, jpeg, one_error_line, run_script, write_tiny_shards
from tests.helpers.training import fast_args as args
from tests.helpers.training import free_port, load, ranks
from tests.helpers.training import shards as shards  # noqa: F401  (the module's fixture, reused)

pytestmark = pytest.mark.slow  # real training processes


def start_torchrun(
    nproc: int, *train_args: str, launcher: tuple[str, ...] = (), env: dict | None = None
) -> subprocess.Popen:
    """torchrun in its own session (so a test can signal the whole job), stderr into stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *launcher,
        "train.py",
        *train_args,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120.0):
    """Poll until ``predicate()`` is true (returns its value); fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the job ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {what} within {timeout}s")


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end within {timeout}s:\n{out}")
    return proc.returncode, out


def rank_pids(agent: int) -> dict[int, int]:
    """torchrun's worker processes (its children) by their RANK."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
        if ppid == agent and rank is not None:
            pids[int(rank)] = int(entry)
    return pids


def session_pids(sid: int, settle: float = 10.0) -> list[int]:
    """Processes of a session (a job and everything it started) still alive once the kernel has
    had ``settle`` seconds to deliver the signals that end them."""
    deadline = time.monotonic() + settle
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                alive.append(int(entry))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def log_has(run_dir: Path, text: str) -> bool:
    log = run_dir / "train.log"
    return log.exists() and text in log.read_text()


# ---------------------------------------------------------------- 1, 2: bad and missing data


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> dict:
    """8 shards of 16 in an index: rank 1 of 2 gets the odd ones, and every one of them is bad:
    1 truncated mid-member, 3 garbage bytes, 5 with two undecodable images, 7 deleted."""
    root = tmp_path_factory.mktemp("bad")
    index = write_tiny_shards(root, [16] * 8, "mixed", size=32)
    shard = [root / f"mixed-{i:06d}.tar" for i in range(8)]
    data = shard[1].read_bytes()
    shard[1].write_bytes(data[: len(data) // 2 + 100])
    shard[3].write_bytes(os.urandom(len(data) // 4))
    import webdataset as wds

    with wds.TarWriter(str(shard[5])) as w:
        for i in range(16):
            image = b"\xff\xd8 not a jpeg" if i in (3, 9) else jpeg(500 + i, 32)[0]
            w.write({"__key__": f"five{i:03d}", "jpg": image, "cls": str(i % 10)})
    shard[7].unlink()
    return {"index": str(index), "names": [s.name for s in shard]}


def test_bad_data_on_one_rank_is_skipped_counted_and_ranks_stay_in_step(shards, bad_shards, tmp_path):
    # Epoch mode: the index promises 8 batches per rank per epoch; rank 1 reads about 2 of good
    # data. Its losses are filled (max_bad raised: their share is the point here, not the limit),
    # so it delivers the plan's batches, no epoch ends early, and both finish at step 5.
    run = tmp_path / "run"
    # split=shards: the bad shards all land on rank 1 (the default split=samples spreads them)
    extra = ("loader.mode=epoch", "loader.split=shards", "trainer.steps=5", "trainer.log_every=1", "data.max_bad=1")
    proc = ranks(2, *args(shards, run, *extra, train_spec=bad_shards["index"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rank_steps"] == [5, 5]
    assert summary["rank_params"][0] == summary["rank_params"][1]
    assert summary["skipped_samples"] >= 2 and summary["skipped_shards"] >= 3
    for name in ("mixed-000001.tar", "mixed-000003.tar", "mixed-000007.tar", "mixed-000005.tar: sample 'five003'"):
        assert name in proc.stderr  # one warning line each, from rank 1's worker
    log = (run / "train.log").read_text()
    assert "ends early" not in log
    assert " skipped " in log and " shards" in log  # the progress lines carry the counts

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    assert events.Scalars("data/bad_samples")[-1].value >= 2
    assert events.Scalars("data/bad_shards")[-1].value >= 3


def test_bad_data_in_strict_mode_stops_the_job_naming_the_shard(shards, bad_shards, tmp_path):
    proc = ranks(2, *args(shards, tmp_path / "run", "data.strict=true", train_spec=bad_shards["index"]))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1: ")]
    assert errors, proc.stderr
    assert any(name in errors[0] for name in bad_shards["names"][1::2]), errors[0]


@pytest.fixture(scope="module")
def label_and_garbage_shards(tmp_path_factory) -> str:
    """x-000000..x-000004: two good shards, one with a label outside num_classes=10 (key
    'wrong007'), two of garbage bytes."""
    root = tmp_path_factory.mktemp("labels")
    write_tiny_shards(root, [16, 16, 16, 1, 1], "x", size=32)
    import webdataset as wds

    with wds.TarWriter(str(root / "x-000001.tar")) as w:
        for i in range(16):
            w.write({"__key__": f"wrong{i:03d}", "jpg": jpeg(300 + i, 32)[0], "cls": "10" if i == 7 else str(i % 10)})
    for i in (3, 4):
        (root / f"x-{i:06d}.tar").write_bytes(os.urandom(3000))
    return f'"{root}/x-{{000000..000004}}.tar"'  # quoted for Hydra


def test_a_bad_label_is_a_skipped_sample_and_bad_shards_count_once_however_often_read(
    shards, label_and_garbage_shards, tmp_path
):
    # Repeat mode, 47 good samples a pass: 20 steps of 8 read every shard 3 or 4 times.
    run = tmp_path / "run"
    proc = run_script("train.py", *args(shards, run, "trainer.steps=20", train_spec=label_and_garbage_shards))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_shards"] == 2  # x-000003 and x-000004, not one per pass
    assert summary["skipped_shard_reads"] >= 6 and summary["skipped_samples"] >= 3  # 'wrong007', once a pass
    assert "x-000001.tar: sample 'wrong007': label 10 is outside 0..9 (num_classes=10)" in proc.stderr
    done = proc.stdout.strip().splitlines()[-1]
    reads = summary["skipped_shard_reads"]
    assert f"skipped {summary['skipped_samples']} samples and 2 shards ({reads} failed reads of them)" in done
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    assert events.Scalars("data/bad_shards")[-1].value == 2
    assert events.Scalars("data/bad_shard_reads")[-1].value == reads


def test_a_bad_label_in_strict_mode_is_one_line_naming_the_shard_and_key(shards, label_and_garbage_shards, tmp_path):
    spec = label_and_garbage_shards.replace("000004", "000002")  # the good and the bad-label shards
    proc = run_script("train.py", *args(shards, tmp_path / "run", "data.strict=true", train_spec=spec))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert re.fullmatch(
        r"error: rank 0: epoch 0: 1 samples lost, past data\.strict: .*/x-000001\.tar: sample 'wrong007': "
        r"label 10 is outside 0\.\.9 \(num_classes=10\); every rank stops at step \d+ \(.*\)",
        line,
    ), line


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ['data.train_shards="{root}/nothing-{{000000..000003}}.tar"'],
            "data.train_shards: shard spec '{root}/nothing-{{000000..000003}}.tar' matches no file",
        ),
        (  # 2: a missing shard in strict mode
            ['data.train_shards="{root}/train/train-{{000000..000004}}.tar"', "data.strict=true"],
            "data.train_shards: shard spec '{root}/train/train-{{000000..000004}}.tar': 1 of 5 shards do not exist, "
            "first {root}/train/train-000004.tar",
        ),
        (  # 8: pipe: URLs run a shell command; the switch refuses them
            ["data.train_shards=pipe:cat {root}/train/train-000000.tar", "data.allow_pipe=false"],
            "data.train_shards: pipe:cat {root}/train/train-000000.tar: pipe: URLs are refused (allow_pipe is false)",
        ),
        (  # 4 shards of 24 over 1 rank x 1 worker in batches of 8: 12 batches an epoch
            ["loader.mode=epoch", "loader.split=shards", "loader.nbatches=100"],
            "loader.nbatches=100 is more than 1 ranks can deliver (rank 0: 12 batches with loader.dsrepeat=1); "
            "use loader.nbatches<=12 or use loader.dsrepeat=9",
        ),
        (  # the same with split=samples (the epoch default): 12 batches per rank, no dsrepeat
            ["loader.mode=epoch", "loader.nbatches=100"],
            "loader.nbatches=100 is more than every rank delivers with loader.split=samples (12 batches of 8 per rank "
            "per epoch, from 96 samples): use loader.nbatches<=12",
        ),
    ],
)
def test_bad_shards_or_layout_for_train_is_one_line_naming_the_key(shards, tmp_path, extra, message):
    root = Path(shards["train"]).parent.parent
    proc = run_script("train.py", *args(shards, tmp_path / "run", *[e.format(root=root) for e in extra]))
    assert proc.returncode == 2
    assert one_error_line(proc) == "error: " + message.format(root=root)


# ---------------------------------------------------------------- 3: a rank dies


def test_end_epoch_starts_the_next_epoch_whole(tiny_shards):
    # What every rank does when another ran out early: the next epoch is whole, and a checkpoint
    # taken in between points at its start.
    from wdsdist.data.delivery.pipeline import make_loader
    from wdsdist.data.options import LoaderConfig

    cfg = LoaderConfig(batch_size=4, workers=0, mode="epoch", image_size=8, shuffle_buffer=0)
    loader = make_loader(str(tiny_shards([8, 8])), 0, 1, cfg)
    first = next(iter(loader))
    assert int(first["id"][0, 0]) == 0
    loader.end_epoch()
    assert loader.state_dict()["point"] == {"epoch": 1, "workers": {}} and loader.state_dict()["batches"] == 0
    epoch = list(loader)
    assert len(epoch) == 4 and {int(b["id"][0, 0]) for b in epoch} == {1}


def test_a_killed_rank_restarts_the_job_which_resumes_and_finishes(shards, tmp_path):
    # No run_dir and no --rdzv_id: the run directory's name is kept in torchrun's store, so the
    # restarted workers find it; after a restart they resume from its latest checkpoint.
    outputs = tmp_path / "outputs"
    train_args = args(
        shards, tmp_path, "run_dir=null", f"outputs={outputs}", "trainer.steps=12", "trainer.ckpt_every=2"
    )
    proc = start_torchrun(2, *train_args, launcher=("--max-restarts=1",))
    latest = wait_for(lambda: next(outputs.glob("*/latest.pt"), None), "a checkpoint", proc)
    run = latest.parent
    saved = load(latest)["step"]
    pids = wait_for(lambda: rank_pids(proc.pid) if len(rank_pids(proc.pid)) == 2 else None, "two ranks", proc)
    os.kill(pids[1], signal.SIGKILL)
    rc, out = finish(proc)
    assert rc == 0, out
    assert [p.name for p in outputs.iterdir()] == [run.name]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["rank_steps"] == [12, 12]
    assert summary["rank_params"][0] == summary["rank_params"][1]
    assert summary["resumed_from_step"] >= saved
    log = (run / "train.log").read_text()
    assert f"restart 1 of torchrun, resumed from {run / 'latest.pt'} at step {summary['resumed_from_step']}" in log
    assert not list(run.glob("*.tmp*"))


# ---------------------------------------------------------------- 4: preemption


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_and_resume_continues(shards, tmp_path):
    run = tmp_path / "run"
    proc = start_torchrun(2, *args(shards, run, "trainer.steps=1000"))
    wait_for(lambda: log_has(run, "step 2/1000"), "step 2 in the log", proc)
    # As a terminal or Slurm does: the whole job (agent, ranks, loader workers); the agent also
    # forwards it to the ranks.
    os.killpg(proc.pid, signal.SIGTERM)
    rc, out = finish(proc)
    assert rc != 0, out
    assert not session_pids(proc.pid)  # the loader workers, which ignore SIGTERM, ended with their rank
    stopped = re.search(r"stopped by SIGTERM at step (\d+) of 1000: checkpoint (\S+);", (run / "train.log").read_text())
    assert stopped, out
    step = int(stopped.group(1))
    assert stopped.group(2) == str(run / f"ckpt-{step:07d}.pt")
    assert os.readlink(run / "latest.pt") == f"ckpt-{step:07d}.pt"
    ckpt = load(run / "latest.pt")
    assert ckpt["step"] == step and [s["rank"] for s in ckpt["loader"]["ranks"]] == [0, 1]
    assert not list(run.glob("*.tmp*"))

    # The resume is the ranks' own work: forked with torchrun's environment (tests/helpers/training.py)
    proc = ranks(2, *args(shards, run, "trainer.resume=auto", f"trainer.steps={step + 2}"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["rank_steps"] == [step + 2] * 2
    assert summary["rank_params"][0] == summary["rank_params"][1]


# ---------------------------------------------------------------- 6: a stalled rank


def test_a_stalled_rank_fails_the_job_within_the_timeout_naming_it(shards, tmp_path):
    stall = {"WDSDIST_TEST_STALL_RANK": "1", "WDSDIST_TEST_STALL_STEP": "3"}  # faults.stall_for_test
    proc = start_torchrun(2, *args(shards, tmp_path / "run", "trainer.steps=1000", "trainer.timeout_s=10"), env=stall)
    rc, out = finish(proc, timeout=90)  # the bound is the point: without the watchdog this never ends
    assert rc != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert not session_pids(proc.pid)  # no rank and no loader worker left behind
    assert errors[0].startswith("error: rank 1 stalled: no progress for "), errors[0]
    assert errors[0].endswith(
        "(trainer.timeout_s=10), waiting for its next batch at step 3; rank 0 waits for it; torchrun has no restarts "
        "left (--max-restarts=0): the job ends; rerun with trainer.resume=auto to go on from the last checkpoint"
    ), errors[0]


def test_the_stall_message_names_the_ranks_behind():
    from wdsdist.cluster.faults import stall_message

    states = {0: (40, 7, "step"), 1: (31, 7, "data"), 2: (33, 7, "data"), 3: (52, 7, "step")}
    assert stall_message(states, 4, 60.4, 60) == (
        "ranks 1, 2 stalled: no progress for 60s (trainer.timeout_s=60), waiting for its next batch at step 8; "
        "ranks 0, 3 wait for them"
    )
    states = {0: (9, 3, "checkpoint"), 1: (8, 3, "data")}  # rank 0 still writes; rank 1 has moved on
    assert stall_message(states, 2, 30, 30).startswith(
        "rank 0 stalled: no progress for 30s (trainer.timeout_s=30), writing"
    )
    assert stall_message({0: (5, 2, "step"), 1: (6, 2, "step")}, 2, 9, 9).startswith("every rank stalled: ")
    assert stall_message({0: (5, 2, "step")}, 2, 9, 9).startswith("rank 1 never reached the training loop: ")


def test_a_failed_rendezvous_is_one_line_naming_the_endpoint():
    """./run torchrun (wdsdist.cluster.launch) says a lost rendezvous host in one line."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from wdsdist.cluster.launch import endpoint, rendezvous_line

    try:
        raise RendezvousConnectionError("The connection to the C10d store has failed.") from RuntimeError("Broken pipe")
    except RendezvousConnectionError as exc:
        line = rendezvous_line(exc, ["--nnodes=1:2", "--rdzv-endpoint", "head:29400", "train.py"])
    assert line.startswith(
        "error: torchrun: the rendezvous at head:29400 does not answer (Broken pipe); this node stops"
    )
    assert "\n" not in line and line.endswith("(trainer.resume=auto continues it)")
    timeout = rendezvous_line(RendezvousTimeoutError("late"), ["--rdzv_endpoint=h:1"])
    assert timeout.startswith("error: torchrun: the rendezvous at h:1 did not gather the nodes in time")
    assert endpoint(["train.py", "x=1"]) == ""


def test_a_watchdog_shorter_than_a_store_outage_the_reads_ride_out_is_noted():
    from wdsdist.train.run import outage_note

    assert outage_note(8, 60, 60, "http://store:8080/train.index.json") == (
        "note: trainer.timeout_s=8 is below data.http_timeout + data.http_retry_s (120 s): a rank riding out a "
        "store outage that long is given up on first"
    )
    assert outage_note(1800, 60, 60, "s3://bucket/train-{0..9}.tar") is None  # the defaults
    assert outage_note(8, 60, 60, "/data/train.index.json") is None  # local shards: no outage to ride out
    assert outage_note(8, 60, 0, "http://store/x.tar") is None  # no retries
