"""Faults at cluster shape, on a cluster of network namespaces (tests/helpers/cluster.py): one
torchrun agent per node (one rank each, --nnodes=1:2, c10d rendezvous on a head namespace that
no worker node takes down with it), shards served over HTTP from a store namespace, the run
directory a folder every node sees. Each scenario faults a node (or the store, or the
rendezvous) at a known step (faults.hold_for_test) and asserts what was delivered: the sample
positions of every epoch over the job's starts, as each start's checkpoint kept them (every
sample exactly once, nothing twice but the stated padding), every rank's steps and weights, and
what the operator reads.

The lost node and the partition run in the suite; the others when WDSDIST_CHAOS=1 (./run
chaos, which also prints the table of outcomes these tests record)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import write_tiny_shards
from tests.helpers import cluster
from tests.helpers.cluster import Cluster
from tests.helpers.polling import wait_for
from tests.helpers.trace import delivery, kept

WHY = cluster.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"cluster scenarios: {WHY}")]
chaos_only = pytest.mark.skipif(not os.environ.get("WDSDIST_CHAOS"), reason="a chaos scenario: ./run chaos runs it")

COUNTS = [13, 29, 7, 21]  # 70 samples, uneven shards
N, BS, EPOCHS = sum(COUNTS), 4, 2
TIMEOUT_S = 8  # trainer.timeout_s: how soon a rank that stopped answering (no RST) is given up on
HOLD_STEP = 6  # the fault comes before this step; checkpoints every 2 steps: the job resumes at 4


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    write_tiny_shards(root / "train", COUNTS, "train", size=32)
    return root


def job_args(c: Cluster, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"data.train_shards={c.store_url}/train/train.index.json",
        "data.val_shards=null",
        "data.synthetic=null",
        "data.image_size=32",
        "data.num_classes=10",
        "model.name=squeezenet1_1",
        "trainer.workers=1",
        f"trainer.batch_size={BS}",
        "trainer.log_every=1",
        f"trainer.epochs={EPOCHS}",
        "trainer.ckpt_every=2",
        f"trainer.timeout_s={TIMEOUT_S}",
        "seed=0",
        "loader.mode=epoch",
        "loader.shuffle_buffer=10",
        f"run_dir={run_dir}",
        *extra,
    ]


class Scenario:
    """One scenario's cluster, run directory, trace and hold file, and the checks on what it delivered."""

    def __init__(self, c: Cluster, work: Path, hold: tuple[int, ...] = (1,)):
        """``hold``: the starts of the job whose ranks wait before HOLD_STEP (faults.hold_for_test)."""
        self.c, self.work = c, work
        self.run_dir, self.trace, self.hold = work / "run", work / "trace", work / "hold"
        self.trace.mkdir()
        for start in hold:
            Path(f"{self.hold}.g{start}").write_text("")
        self.env = {
            "WDSDIST_TEST_TRACE": str(self.trace),
            "WDSDIST_TEST_HOLD": str(self.hold),
            "WDSDIST_TEST_HOLD_STEP": str(HOLD_STEP),
        }

    def start(self, node: int, *extra: str, **kwargs) -> None:
        self.c.agent(node, job_args(self.c, self.run_dir, *extra), env=self.env, **kwargs)

    def held(self, ranks: int, start: int = 1) -> None:
        """Until every rank of the job's ``start``-th start waits before HOLD_STEP (the job formed,
        checkpoints up to it written)."""
        wait_for(
            f"{ranks} ranks of start {start} held before step {HOLD_STEP}",
            lambda: all(Path(f"{self.hold}.g{start}.rank-{r}").exists() for r in range(ranks)),
            180,
        )

    def held_pid(self, rank: int, start: int = 1) -> int:
        return int(Path(f"{self.hold}.g{start}.rank-{rank}").read_text())

    def release(self, start: int = 1) -> None:
        Path(f"{self.hold}.g{start}").unlink()

    def reformed(self, start: int = 2, timeout: float = 120) -> float:
        """Seconds until the job's ``start``-th start trains its first step."""
        return wait_for(
            f"start {start} of the job training",
            lambda: any((self.trace / f"start-{start}").glob("rank-*.txt")),
            timeout,
        )

    def finished(self, node: int, timeout: float = 180) -> dict:
        proc = self.c.procs[f"agent-{node}"]
        wait_for(f"node {node}'s agent ending", lambda: proc.poll() is not None, timeout)
        assert proc.returncode == 0, self.c.log(f"agent-{node}")[-4000:]
        return json.loads((self.run_dir / "summary.json").read_text())

    def fault_two_nodes(self, fault: Callable[[], None], survivor: int) -> tuple[float, dict, dict]:
        """Both nodes train; at HOLD_STEP ``fault()``; the job re-forms with ``survivor`` alone and
        finishes. The recovery's seconds, the summary, and the delivery's counts."""
        self.held(2)
        fault()
        self.release()
        recover = self.reformed()
        summary = self.finished(survivor)
        return recover, summary, self.check_delivered(summary, world=1)

    def all_failed(self, timeout: float, nodes: int = 2) -> float:
        """Until every node's agent has ended, each with a failure; the seconds it took."""
        start = time.monotonic()
        for node in range(nodes):
            proc = self.c.procs[f"agent-{node}"]
            wait_for(f"node {node}'s agent ending", lambda proc=proc: proc.poll() is not None, timeout)
            assert proc.returncode != 0, self.c.log(f"agent-{node}")[-4000:]
        return time.monotonic() - start

    def log(self) -> str:
        return (self.run_dir / "train.log").read_text()

    def check_delivered(self, summary: dict, world: int) -> dict:
        """Every epoch's samples once, nothing twice but the padding; ranks in step, same weights."""
        epochs = kept(self.trace)
        assert sorted(epochs) == list(range(EPOCHS))
        found = {e: delivery(pos, N) for e, pos in epochs.items()}
        assert all(d.exact for d in found.values()), found
        assert all(d.padding < 2 * BS * world for d in found.values())  # less than a global batch per layout
        assert len(summary["rank_steps"]) == world and len(set(summary["rank_steps"])) == 1
        assert len(set(summary["rank_params"])) == 1  # every rank ends with the same weights
        return {
            "missing": sum(d.missing for d in found.values()),
            "duplicated": sum(d.duplicated for d in found.values()),
            "padding": sum(d.padding for d in found.values()),
        }


@pytest.fixture
def scenario(tmp_path, served):
    with Cluster(2, tmp_path / "cluster", serve=served) as c:
        yield Scenario(c, tmp_path)


def record(name: str, outcome: str, recover_s: float | None, counts: dict | None = None, note: str = "") -> None:
    """A row of ./run chaos's table (WDSDIST_CHAOS_TABLE names the file; unset: nothing)."""
    table = os.environ.get("WDSDIST_CHAOS_TABLE")
    if table:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
        row = {
            "test": test,
            "scenario": name,
            "outcome": outcome,
            "recover_s": recover_s,
            **(counts or {}),
            "note": note,
        }
        with open(table, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def one_line_about(log: str, pattern: str) -> str:
    lines = [line for line in log.splitlines() if re.search(pattern, line)]
    assert len(lines) == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    return lines[0]


# ---------------------------------------------------------------- in the suite


def test_a_lost_node_reforms_the_job_which_resumes_elastically_and_delivers_every_sample_once(scenario):
    s = scenario
    s.start(0)
    s.start(1)
    recover, summary, counts = s.fault_two_nodes(lambda: s.c.lose("agent-1"), survivor=0)  # node 1's whole tree
    survivor = s.c.log("agent-0")
    line = one_line_about(survivor, r"^error: ")
    assert re.fullmatch(
        rf"error: rank 1 on node {re.escape(s.c.addr('n1'))} stopped answering at step {HOLD_STEP} \(.*\); torchrun "
        r"will re-form the job with the nodes that answer \(restart 1 of 3\) and it resumes from the last checkpoint",
        line,
    ), line
    assert "restart 1 of torchrun, resumed from" in s.log() and " at step 4" in s.log()
    assert "resize: 2 ranks x 1 worker -> 1 rank x 1 worker, epoch 0:" in s.log()
    record("node lost mid-epoch", "re-formed at 1 node, resumed at step 4", recover, counts)


def test_a_partitioned_node_is_given_up_on_and_writes_nothing_once_the_others_reformed(scenario):
    """Node 0 (rank 0: it writes checkpoints) is cut off. Node 1's rank gives up on it after
    trainer.timeout_s, torchrun re-forms the job without it, and node 0, unable to reach the
    rendezvous, stops; nothing of its start is written once the new start began."""
    s = scenario
    s.start(0, rdzv_conf=cluster.FAST_RDZV + ",read_timeout=10")
    s.start(1)
    recover, summary, counts = s.fault_two_nodes(lambda: s.c.cut("n0"), survivor=1)
    # The cut-off node's rank gives up on its peer too and ends; its agent then waits on a
    # rendezvous it cannot reach (torch's agent has no bound there: the scheduler ends it, or
    # it rejoins as a new node once the link is back).
    worker = s.held_pid(0)
    wait_for("the cut-off node's rank ending", lambda: cluster.ended(worker), 2 * TIMEOUT_S + 30)
    cut_off_line = one_line_about(s.c.log("agent-0"), r"^error: ")
    assert cut_off_line.startswith("error: rank 1 stalled: no progress for "), cut_off_line
    # No split brain: each checkpoint after the resume point is the new start's, latest.pt is
    # the last one, and the job file names the new start.
    import torch

    for path in sorted(s.run_dir.glob("ckpt-*.pt")):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        assert ckpt["generation"] == (1 if ckpt["step"] <= 4 else 2), (path, ckpt["generation"])
    assert os.readlink(s.run_dir / "latest.pt") == f"ckpt-{summary['rank_steps'][0]:07d}.pt"
    assert json.loads((s.run_dir / "job.json").read_text())["generation"] == 2
    line = one_line_about(s.c.log("agent-1"), r"^error: ")
    assert re.match(r"error: rank 1 lost contact with the job: no progress for \d+s \(trainer.timeout_s=8\), ", line), (
        line
    )
    assert "the job's store does not answer" in line and "torchrun will re-form the job" in line, line
    record("node partitioned mid-epoch", "re-formed at 1 node; the cut-off rank stopped", recover, counts)


# ---------------------------------------------------------------- ./run chaos


@chaos_only
def test_losing_the_node_of_rank_0_goes_on_with_a_new_rank_0_in_the_same_run_directory(scenario):
    """Rank 0 writes checkpoints and TensorBoard, and its node's agent holds the job's store."""
    s = scenario
    s.start(0)
    s.start(1)
    recover, summary, counts = s.fault_two_nodes(lambda: s.c.lose("agent-0"), survivor=1)
    line = one_line_about(s.c.log("agent-1"), r"^error: ")
    said = f"error: rank 1: rank 0 on node {s.c.addr('n0')} stopped answering at step {HOLD_STEP} ("
    assert line.startswith(said), line  # said by rank 1 (the prefix), about rank 0
    log = s.log()
    assert log.count(f"run dir {s.run_dir}: ") == 2 and "resumed from" in log and "done: " in log
    assert len(list(s.run_dir.glob("events.out.tfevents.*"))) >= 2  # the new rank 0 logs beside the old one
    record("node of rank 0 lost", "new rank 0, same run directory", recover, counts)


@chaos_only
def test_a_store_down_for_20s_mid_epoch_costs_no_sample(scenario):
    """The shard store's link down for 20 s as epoch 1 begins (its shards are read then): the
    reads retry (data.http_retry_s) and resume; nothing is skipped, no rank gives up (the
    watchdog's trainer.timeout_s is above the outage, as it must be), every sample once."""
    s = scenario
    s.env["WDSDIST_TEST_HOLD_STEP"] = "10"  # epoch 0 is 9 steps: hold before epoch 1's first
    s.start(0, "trainer.timeout_s=60")
    s.start(1, "trainer.timeout_s=60")
    s.held(2)
    s.c.cut("store")
    s.release()
    down = time.monotonic()
    wait_for("20 s of outage", lambda: time.monotonic() - down >= 20, 30)
    s.c.heal("store")
    healed, served_before = time.monotonic(), s.c.log("store").count('"GET ')
    summary = s.finished(0)
    s.finished(1)
    counts = s.check_delivered(summary, world=2)
    assert summary["skipped_shards"] == 0 and summary["skipped_samples"] == 0
    assert s.c.log("store").count('"GET ') > served_before  # epoch 1's reads came after the outage
    assert "error:" not in s.c.log("agent-0") + s.c.log("agent-1")
    record(
        "shard store down 20 s",
        "reads retried and resumed; nothing skipped",
        None,
        counts,
        note=f"finished {time.monotonic() - healed:.0f}s after the store came back",
    )


@chaos_only
def test_a_store_down_for_good_ends_the_job_with_one_line(scenario):
    s = scenario
    s.env["WDSDIST_TEST_HOLD_STEP"] = "10"
    for node in (0, 1):
        s.start(node, "trainer.timeout_s=60", "data.http_retry_s=10", "data.http_timeout=5", max_restarts=0)
    s.held(2)
    s.c.cut("store")
    s.release()
    took = s.all_failed(90)
    lines = [line for n in (0, 1) for line in s.c.log(f"agent-{n}").splitlines() if line.startswith("error: ")]
    store = f"http://{s.c.addr('store')}:{cluster.HTTP_PORT}"
    assert any(f"{store} does not answer" in line and "data.http_retry_s=10" in line for line in lines), lines
    record("shard store down for good", "every rank stopped; one line names the store", None, note=f"{took:.0f}s")


@chaos_only
def test_a_node_joining_a_running_job_reforms_it_at_two_nodes_which_resume_elastically(scenario):
    """Node 0 trains alone (--nnodes=1:2); node 1's agent starts mid-epoch. Node 0's rank is
    stopped by its agent (SIGTERM: a checkpoint at the step all agree on), and the job
    re-forms at two nodes, resuming elastically on the larger world."""
    s = scenario
    s.start(0)
    s.held(1)
    joined = time.monotonic()
    s.start(1)  # the hold ends when node 0's agent stops its rank for the new round
    recover = s.reformed()
    s.release()
    summary = s.finished(0)
    s.finished(1)
    counts = s.check_delivered(summary, world=2)
    log = s.log()
    stopped = re.search(r"stopped by SIGTERM at step (\d+) of \d+: checkpoint", log)
    assert stopped, log
    step = int(stopped.group(1))
    assert f"re-formed by torchrun, resumed from {s.run_dir}/latest.pt at step {step}" in log, log
    assert "resize: 1 rank x 1 worker -> 2 ranks x 1 worker, epoch 0:" in log
    record("node joins mid-epoch", f"re-formed at 2 nodes, resumed at step {step}", recover, counts,
           note=f"{time.monotonic() - joined:.0f}s from the join to the end")  # fmt: skip


@chaos_only
def test_a_lost_node_replaced_by_a_new_one_reforms_at_two_nodes_again(tmp_path, served):
    """A node is lost, the job goes on alone, then a replacement node joins (its agent started
    afresh: torchrun's restart count differs between the two nodes) and the job re-forms at two
    nodes: three starts, every sample once."""
    with Cluster(2, tmp_path / "cluster", serve=served) as c:
        s = Scenario(c, tmp_path, hold=(1, 2))
        s.start(0)
        s.start(1)
        s.held(2)
        s.c.lose("agent-1")
        s.release()
        s.held(1, start=2)  # re-formed alone, resumed, and waiting again before HOLD_STEP
        s.start(1)  # the replacement; the hold ends when node 0's agent stops its rank
        recover = s.reformed(start=3)
        s.release(start=2)
        summary = s.finished(0)
        s.finished(1)
        counts = s.check_delivered(summary, world=2)
        log = s.log()
        assert "restart 1 of torchrun, resumed from" in log and "resize: 2 ranks x 1 worker -> 1 rank" in log
        assert "resize: 1 rank x 1 worker -> 2 ranks x 1 worker" in log
        assert json.loads((s.run_dir / "job.json").read_text())["generation"] == 3
        record("node lost, then replaced", "re-formed at 1 node, then at 2", recover, counts)


@chaos_only
def test_losing_the_rendezvous_host_stops_every_agent_in_bounded_time(scenario):
    s = scenario
    s.start(0, "trainer.epochs=50")
    s.start(1, "trainer.epochs=50")
    s.held(2)
    s.c.lose("rendezvous")
    s.release()
    took = s.all_failed(120)
    log = s.log()
    assert "stopped by SIGTERM at step" in log  # the ranks saved where they were before they went
    for node in (0, 1):
        line = one_line_about(s.c.log(f"agent-{node}"), r"^error: ")
        assert line.startswith(f"error: torchrun: the rendezvous at {s.c.rendezvous} does not answer"), line
    record("rendezvous host lost", "every agent stopped; ranks checkpointed", None, note=f"{took:.0f}s")


@chaos_only
def test_a_slow_link_to_the_store_raises_data_wait_without_a_false_alarm(scenario):
    s = scenario
    s.c.shape("store", "256kbit")  # about 32 KB/s for both nodes: the shards take seconds per epoch
    s.start(0)
    s.start(1)
    s.held(2)
    s.release()
    summary = s.finished(0)
    s.finished(1)
    counts = s.check_delivered(summary, world=2)
    assert "error:" not in s.c.log("agent-0") + s.c.log("agent-1")
    record("slow link to the store (256 kbit/s)", "finished; no watchdog alarm", None, counts,
           note=f"data-wait {summary['data_wait']:.0%}")  # fmt: skip
