"""The CUDA paths, checked without a GPU: the decisions are pure functions of what the machine
reports (driver text, compute capability, the build's kernels), and the collectives are run
on CPU ranks over gloo. Training under NCCL's device map is in tests/train/test_train.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import run_script
from wdsdist.cluster import distributed
from wdsdist.cluster.distributed import arch_unsupported, bf16_autocast, cuda_unusable, driver_version
from wdsdist.errors import JobError, UserError

PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n"
)
OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 16:27:33 UTC 2025\nGCC version:  gcc version 12.3.0\n"
)
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1 + CUDA 13.0


# ---------------------------------------------------------------- 2: the driver and the GPU


def test_the_driver_version_is_read_from_both_kernel_modules():
    assert driver_version(PROPRIETARY) == "535.104.05"
    assert driver_version(OPEN) == "580.82.07"
    assert driver_version("garbage") is None


def test_a_driver_too_old_for_the_wheel_is_named_with_the_minimum():
    why = cuda_unusable(PROPRIETARY, "13.0", "2.14.1+cu130")
    assert why.startswith(
        "the NVIDIA driver is 535.104.05 but torch 2.14.1+cu130 (CUDA 13.0) needs driver >= 580.65.06: "
    ), why
    assert why.endswith("or set trainer.device=cpu to train on the CPU")
    # The same driver runs a CUDA 12 build: the reason is another one.
    assert "needs driver" not in cuda_unusable(PROPRIETARY, "12.8", "2.14.1+cu128")
    assert "sees no GPU" in cuda_unusable(OPEN, "13.0", "2.14.1+cu130")
    assert "CPU-only build" in cuda_unusable(OPEN, None, "2.14.1+cpu")
    assert "no NVIDIA driver is loaded" in cuda_unusable(None, "13.0", "2.14.1+cu130")


def test_auto_on_a_gpu_node_whose_driver_torch_cannot_use_stops_instead_of_training_on_the_cpu(monkeypatch):
    monkeypatch.setattr(distributed, "_read_driver_text", lambda: PROPRIETARY)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match=r"^trainer.device=auto: the NVIDIA driver is 535.104.05 but .*>= 580.65.06"):
        distributed.init("auto")
    assert distributed.init("cpu").device.type == "cpu"  # asked for the CPU: no question
    monkeypatch.setattr(distributed, "_read_driver_text", lambda: None)
    assert distributed.init("auto").device.type == "cpu"  # no driver: a CPU machine
    # Under torchrun the node's other processes leave quietly: one line per node.
    monkeypatch.setattr(distributed, "_read_driver_text", lambda: PROPRIETARY)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        distributed.init("auto")
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    "capability,archs,runs",
    [
        ((7, 0), ARCHS, False),  # V100: "no kernel image is available"
        ((7, 5), ARCHS, True),  # T4
        ((8, 9), ARCHS, True),  # L4: sm_86 cubins run on later minors of 8
        ((9, 0), ARCHS, True),  # H100
        ((12, 1), ARCHS, True),
        ((11, 0), ARCHS, False),
        ((10, 0), ["sm_80", "compute_90"], True),  # PTX is compiled for later GPUs
        ((9, 1), ["sm_90a"], False),  # arch-specific cubins run on their own capability only
    ],
)
def test_a_gpu_the_wheel_has_no_kernels_for_is_one_line(capability, archs, runs):
    why = arch_unsupported(capability, archs, "2.14.1+cu130")
    if runs:
        assert why is None
    else:
        assert why == (
            f"compute capability {capability[0]}.{capability[1]} is not among torch 2.14.1+cu130's kernels "
            f"({' '.join(archs)}): install a torch build for this GPU (see docs/deploy.md: GPUs and drivers)"
        )


# ---------------------------------------------------------------- 7: bf16 autocast


def test_bf16_autocast_is_off_below_compute_capability_8_with_one_note():
    on, note = bf16_autocast(True, (7, 5))
    assert not on and note == (
        "note: trainer.amp: bf16 autocast off on this GPU (compute capability 7.5 < 8.0 has no bf16 units); "
        "training in float32"
    )
    assert bf16_autocast(True, (8, 0)) == (True, None)
    assert bf16_autocast(True, (9, 0)) == (True, None)
    assert bf16_autocast(False, (9, 0)) == (False, None)
    assert bf16_autocast(True, None) == (False, None)  # the CPU


# ---------------------------------------------------------------- 1: what "another rank stopped" means


@pytest.mark.parametrize(
    "message,gone",
    [
        ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:50920. This is typically", True),
        ("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:5852: Connection reset by peer.", True),
        ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", True),
        ("No backend type associated with device type cpu", False),
        ("CUDA error: an illegal memory access was encountered", False),
    ],
)
def test_only_a_lost_peer_is_reported_as_another_rank_stopping(monkeypatch, message, gone):
    monkeypatch.setattr(distributed, "_peers", [("a", "127.0.0.1"), ("b", "127.0.0.2")])
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    lost = distributed.peer_lost(RuntimeError(message), 6)
    if not gone:
        assert lost is None  # this rank's own fault: raised as itself, with its traceback
        return
    assert isinstance(lost, JobError)
    who = "rank 0 on node a (127.0.0.1)" if "127.0.0.1" in message else "another rank"
    assert str(lost).startswith(f"{who} stopped answering at step 7 (")
    assert "This is typically" not in str(lost) and "pair.cc" not in str(lost)
    assert str(lost).endswith("; the job ends; rerun with trainer.resume=auto to go on from the last checkpoint")


def test_a_lost_peer_line_says_what_torchrun_does_next(monkeypatch):
    monkeypatch.setattr(distributed, "_peers", [("n", "10.0.0.1"), ("n", "10.0.0.2"), ("n", "10.0.0.2")])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    text = "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:50920. This is typically caused"
    assert str(distributed.peer_lost(RuntimeError(text), 11)) == (
        "ranks 1, 2 on node 10.0.0.2 stopped answering at step 12 (Connection closed by peer [10.0.0.2]:50920); "
        "torchrun will re-form the job with the nodes that answer (restart 2 of 3) and it resumes from the last "
        "checkpoint"
    )  # the same host name on every node (namespaces): the address alone names the node
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert str(distributed.peer_lost(RuntimeError(text), 11)).endswith(
        "torchrun has no restarts left (--max-restarts=3): the job ends; rerun with trainer.resume=auto to go on "
        "from the last checkpoint"
    )


# ---------------------------------------------------------------- 4: evaluation without host reads


def reference_sums(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple:
    """What evaluation computed before: bincount and a boolean mask."""
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double()
    total = torch.bincount(labels, minlength=num_classes)
    correct = torch.bincount(labels[logits.argmax(1) == labels], minlength=num_classes)
    return loss, total, correct


def test_eval_sums_equal_bincounts_and_need_no_values_on_the_host():
    from wdsdist.train.evaluate import eval_sums

    g = torch.Generator().manual_seed(0)
    num_classes = 7
    sums = [torch.zeros((), dtype=torch.float64), torch.zeros(num_classes, dtype=torch.int64)]
    sums.append(torch.zeros(num_classes, dtype=torch.int64))
    expected = [torch.zeros_like(s) for s in sums]
    for n, dtype in [(13, torch.float32), (1, torch.float32), (32, torch.bfloat16), (5, torch.float32)]:
        labels = torch.randint(0, num_classes - 1, (n,), generator=g)  # the last class never occurs
        logits = torch.randn(n, num_classes, generator=g).to(dtype)
        logits[: n // 2, labels[: n // 2]] += 5  # some right, some wrong
        eval_sums(logits, labels, *sums)
        for e, r in zip(expected, reference_sums(logits, labels, num_classes), strict=True):
            e += r
    assert torch.equal(sums[1], expected[1]) and torch.equal(sums[2], expected[2])
    assert sums[1][-1] == 0 and int(sums[2].sum()) > 0
    assert torch.allclose(sums[0], expected[0], rtol=1e-12)
    # Meta tensors have shapes and no values: an operation that must read values to know its
    # output's shape (bincount, boolean masks, .item()) fails on them, as it stalls a GPU.
    meta = [torch.zeros_like(s, device="meta") for s in sums]
    eval_sums(torch.empty(8, num_classes, device="meta"), torch.empty(8, dtype=torch.int64, device="meta"), *meta)
    assert [m.shape for m in meta] == [s.shape for s in sums]


# ---------------------------------------------------------------- 5: the fallback batch is pinned


def test_a_batch_stacked_without_a_free_shared_buffer_is_pinned_when_pin_memory_is_set(monkeypatch):
    from wdsdist.data.delivery import batches
    from wdsdist.data.delivery.sharedbatches import SharedBatches

    pinned = []
    monkeypatch.setattr(batches, "pin", lambda t: pinned.append(t) or t.clone())  # pin_memory needs CUDA
    shared = SharedBatches(1, 1, (2, 3, 4, 4))  # never restarted: no buffer is free
    rows = [(torch.full((3, 4, 4), i, dtype=torch.uint8), i, (0, 0, i), (0, 0), None) for i in range(2)]

    [batch] = batches.finish_batches([batches.collate(rows, shared)], shared, pin_memory=True)
    assert len(pinned) == 1 and torch.equal(pinned[0], batch["image"])
    assert batch["image"].shape == (2, 3, 4, 4) and batch["label"].tolist() == [0, 1]

    list(batches.finish_batches([batches.collate(rows, shared)], shared, pin_memory=False))
    list(batches.finish_batches([batches.collate(rows, None)], None, pin_memory=True))  # the DataLoader pins these
    assert len(pinned) == 1


# ---------------------------------------------------------------- 6: BatchNorm's buffers in one broadcast


# Each rank, forked from the tests' preloaded Python with torchrun's environment (tests/preloaded.py):
# a fork of a process that ran torch may deadlock, and that one has run none of it.
BROADCAST_RANK = """
import os, sys
import torch
import torch.distributed as dist
from wdsdist.cluster import distributed

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2)
try:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.BatchNorm1d(5))
    for _ in range(rank + 1):  # rank-dependent statistics and counters
        model[1](torch.randn(2, 4, 3, 3))
        model[2](torch.randn(3, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    distributed.broadcast_tensors(list(model.buffers()))
    torch.save({"before": before, "after": model.state_dict()}, sys.argv[2].format(rank=rank))
finally:
    dist.destroy_process_group()
"""


def test_batchnorm_buffers_that_differ_become_rank_0s_on_every_rank(tmp_path):
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    store, out = str(tmp_path / "store"), str(tmp_path / "rank{rank}.pt")
    proc = run_script("-c", BROADCAST_RANK, store, out, env={"OMP_NUM_THREADS": "1"}, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(o, weights_only=True) for o in outs)
    buffers = [k for k in r0["before"] if "running" in k or "num_batches" in k]
    assert len(buffers) == 6
    assert all(not torch.equal(r0["before"][k], r1["before"][k]) for k in buffers)  # they differed
    for k in buffers:
        assert torch.equal(r1["after"][k], r0["before"][k]) and torch.equal(r0["after"][k], r0["before"][k]), k
    assert torch.equal(r1["after"]["0.weight"], r1["before"]["0.weight"])  # parameters are not buffers


def test_the_trainer_sends_batchnorm_buffers_in_one_broadcast_per_dtype(monkeypatch):
    from torchvision.models import resnet18

    from wdsdist.train.evaluate import share_buffers

    calls = []
    monkeypatch.setattr(distributed, "_active", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group=None: calls.append((tensor.dtype, tensor.numel())))
    model = resnet18()
    buffers = list(model.buffers())
    share_buffers(model)
    assert len(buffers) == 60  # 20 BatchNorms
    floats = sum(b.numel() for b in buffers if b.is_floating_point())
    assert sorted(calls, key=str) == [(torch.float32, floats), (torch.int64, 20)]


def test_cpu_tensors_go_through_the_cpu_group_and_cuda_tensors_through_the_default_one(monkeypatch):
    side = object()
    monkeypatch.setattr(distributed, "_control", [side])
    assert distributed.group_for(torch.device("cpu")) is side
    assert distributed.group_for(torch.device("cuda", 3)) is None
    assert distributed.control_group() is side
