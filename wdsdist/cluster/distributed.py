"""The one place that reads torchrun's environment and talks to torch.distributed.

Everything else gets rank and world from the ``Dist`` returned by ``init`` and calls the small
collectives below, which also work (as no-ops) in a plain one-process run without torchrun.
"""
# A long module on purpose: it is the one door to torch.distributed, so that no other module
# calls it; split, the rule "one place" would become "one of several places".

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wdsdist.errors import JobError, UserError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    local_world: int = 1  # the ranks on this node (LOCAL_WORLD_SIZE): they share its shard cache

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# init is the one place that reads torchrun's variables and starts the process groups; its
# steps (in helpers, no function over 60 lines) must run in this order: set_device before NCCL's init.
def init(device: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """Read RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (set by torchrun) and initialise the process group.

    ``device``: auto (CUDA when available; an error where an NVIDIA driver is loaded that this
    torch build cannot use), cuda or cpu. LOCAL_RANK picks the GPU; the backend
    is nccl on CUDA and gloo on CPU, initialised from env:// (MASTER_ADDR/MASTER_PORT).
    ``timeout_s``: a collective waiting this long fails. Without torchrun's variables this is a
    one-process run with no process group.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"trainer.device={device!r}: must be auto, cuda or cpu")
    if under_torchrun():
        rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        local_world = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else 1
    else:
        rank, world, local_rank, local_world = 0, 1, 0, 1
    dev = _device(device, local_rank)
    if under_torchrun():
        _start_groups(rank, world, dev, timeout_s)
    return Dist(rank, world, local_rank, dev, local_world)


def _device(device: str, local_rank: int) -> torch.device:
    """The device this rank trains on, checked usable; for CUDA, set as torch's current device."""
    driver = _read_driver_text()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if (device == "cuda" or (device == "auto" and driver is not None)) and not torch.cuda.is_available():
        # With auto: a GPU node whose driver this torch build cannot use, where training on the
        # CPU instead would show only as "on N x cpu" in the log.
        why = cuda_unusable(driver, torch.version.cuda, torch.__version__)
        _node_error(f"trainer.device={device}: {why}", local_rank)
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                f"use --nproc_per_node<={torch.cuda.device_count()}"
            )
        unsupported = arch_unsupported(
            torch.cuda.get_device_capability(local_rank), torch.cuda.get_arch_list(), torch.__version__
        )
        if unsupported:
            _node_error(f"GPU {local_rank} ({torch.cuda.get_device_name(local_rank)}): {unsupported}", local_rank)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return dev


def _start_groups(rank: int, world: int, dev: torch.device, timeout_s: float) -> None:
    """Start the default process group (nccl on CUDA, gloo on CPU) and, beside NCCL, a gloo group
    for control values; learn where every rank runs."""
    use_cuda = dev.type == "cuda"
    # Testing only: "cuda:gloo" gives the default group NCCL's device map on the CPU (gloo
    # for CUDA tensors, nothing for CPU ones), so a CPU tensor sent through it fails as it
    # would under NCCL (tests/train/test_train.py runs training so).
    backend = os.environ.get("WDSDIST_TEST_BACKEND") or ("nccl" if use_cuda else "gloo")
    # The job's store (MASTER_ADDR:MASTER_PORT) outlives worker restarts under torchrun
    # (--max-restarts), and so do the addresses the last attempt's ranks left in it: each
    # attempt's process group keeps its keys under its own prefix, or a restarted rank
    # could dial a dead one's address.
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))
    _store[0] = store
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(_group_prefix(), store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if use_cuda else None,
    )
    if backend != "gloo":
        # NCCL moves CUDA tensors only: control values (stop flags, "I have a batch",
        # pickled objects) and any other CPU tensor go over gloo, also with one rank, and
        # agreeing on them never waits for the GPU's queue of work.
        _control[0] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    # Where every rank runs, so a line about a lost peer can name its rank and node.
    _peers[:] = all_gather_object((socket.gethostname(), _own_address()))


def _group_prefix() -> str:
    """Where this attempt's process group keeps its keys in the job's store. torchrun's agent
    store (TORCHELASTIC_USE_AGENT_STORE=True) outlives worker restarts, and so do the addresses
    the last attempt's ranks left in it: each attempt keeps its own prefix there. A store per
    rendezvous round (./run torchrun's default) is new at every attempt, and there the restart
    count, which differs between a node that lived through a failure and one that joined since,
    must not split the ranks between two prefixes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"wdsdist/attempt_{restart_count()}/pg"
    return "wdsdist/pg"


def _node_error(message: str, local_rank: int) -> None:
    """A fault of this node, the same in each of its processes: its local rank 0 says it once."""
    if local_rank != 0:
        raise SystemExit(2)
    raise UserError(message)


def _read_driver_text() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None


# The oldest Linux driver each CUDA major release runs on (CUDA's minor version compatibility:
# any 12.x build on a 12.0 driver); from NVIDIA's CUDA toolkit release notes, table 3.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's text ("... Kernel Module  535.104.05  ..."),
    or None when the text has none."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text) or re.search(
        r"\b(\d{3}\.\d+(?:\.\d+)?)\b", text
    )
    return found.group(1) if found else None


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def cuda_unusable(driver_text: str | None, cuda: str | None, torch_version: str) -> str:
    """Why this torch build does not see a GPU, from /proc/driver/nvidia/version's text (None:
    no driver) and the CUDA version the build was made for (None: a CPU-only build)."""
    fix = "or set trainer.device=cpu to train on the CPU"
    if cuda is None:
        return (
            f"torch {torch_version} is a CPU-only build: install a CUDA build (see docs/deploy.md: GPUs and drivers), "
            f"{fix}"
        )
    if driver_text is None:
        return f"CUDA is not available: no NVIDIA driver is loaded (/proc/driver/nvidia/version is missing); {fix}"
    have = driver_version(driver_text)
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if have is not None and need is not None and _numbers(have) < _numbers(need):
        return (
            f"the NVIDIA driver is {have} but torch {torch_version} (CUDA {cuda}) needs driver >= "
            f"{need}: update the driver, install a torch build for an older CUDA (see docs/deploy.md: GPUs and "
            f"drivers), {fix}"
        )
    shown = have or "of unknown version"
    return (
        f"the NVIDIA driver {shown} is loaded but torch {torch_version} (CUDA {cuda}) sees no GPU "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; nvidia-smi shows the driver's "
        f"view); {fix}"
    )


def arch_unsupported(capability: tuple[int, int], arch_list: list[str], torch_version: str) -> str | None:
    """None when a GPU of compute ``capability`` runs this build's kernels (``arch_list``:
    torch.cuda.get_arch_list()), else why not. A cubin (sm_XY) runs on XY and later minors of
    its major (sm_XYa only on XY); PTX (compute_XY) is compiled for any later GPU."""
    major, minor = capability
    for arch in arch_list:
        kind, _, code = arch.partition("_")
        digits = re.match(r"\d+", code)
        if not digits:
            continue
        cc = int(digits.group(0))
        exact = code[len(digits.group(0)) :] == "a"
        if kind == "sm" and cc // 10 == major and (cc % 10 == minor if exact else cc % 10 <= minor):
            return None
        if kind == "compute" and cc <= 10 * major + minor:
            return None
    return (
        f"compute capability {major}.{minor} is not among torch {torch_version}'s kernels "
        f"({' '.join(arch_list) or 'none'}): install a torch build for this GPU (see docs/deploy.md: GPUs and drivers)"
    )


def bf16_autocast(amp: bool, capability: tuple[int, int] | None) -> tuple[bool, str | None]:
    """Whether to train in bf16 autocast (``capability``: the GPU's, None on the CPU) and a note
    when trainer.amp is turned off: below compute capability 8.0 bf16 is emulated, slowly."""
    if not amp or capability is None:
        return False, None
    if capability < (8, 0):
        return False, (
            f"note: trainer.amp: bf16 autocast off on this GPU (compute capability {capability[0]}.{capability[1]} "
            f"< 8.0 has no bf16 units); training in float32"
        )
    return True, None


_control: list[Any] = [None]  # the gloo group for control values; None: the default group
_store: list[Any] = [None]
_peers: list[tuple[str, str | None]] = []  # (host name, address) of each rank, in rank order


def _own_address() -> str | None:
    """This process's address towards the job's store (MASTER_ADDR): the interface its peers
    reach it on. A UDP socket's connect sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            return s.getsockname()[0]
    except (OSError, KeyError, ValueError):
        return None


def cleanup() -> None:
    _control[0] = _store[0] = None
    _peers.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (--max-restarts); 0 at first."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def watch_store(timeout_s: float) -> dist.Store | None:
    """Another client of the job's store, whose calls give up after ``timeout_s``: for the
    watchdog's thread, so a store host that stops answering (its node cut off) costs it seconds,
    not the job's timeout. None in a one-process run or when the store cannot be reached."""
    if _store[0] is None:
        return None
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, KeyError, ValueError):
        return None


def store() -> dist.Store | None:
    """The job's key-value store (torchrun's agent store, which outlives worker restarts, or the
    one rank 0 hosts), for a few small values outside collectives; None in a one-process run."""
    return _store[0]


def first_value(key: str, proposal: str) -> str:
    """The first value ever proposed for ``key`` in this job (surviving worker restarts), or
    ``proposal`` in a one-process run."""
    s = store()
    if s is None:
        return proposal
    return s.compare_set(f"wdsdist/{key}", "", proposal).decode()


def control_group() -> Any:
    """The group for CPU tensors and pickled objects: gloo's side group when the default backend
    cannot move CPU tensors (NCCL), else None (the default group)."""
    return _control[0]


def group_for(device: torch.device) -> Any:
    """The process group that can move tensors on ``device`` (for DDP's process_group too)."""
    return None if device.type == "cuda" else _control[0]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _active():
        dist.barrier(group=_control[0])


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control[0])
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_control[0])
    return out


def broadcast_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's values into ``tensor`` on every rank, in place; returns it."""
    if _active():
        dist.broadcast(tensor, src=0, group=group_for(tensor.device))
    return tensor


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values into each of ``tensors`` on every rank, in place: one broadcast per device
    and dtype (BatchNorm's buffers: float statistics and int64 counters), not one per tensor."""
    if not _active():
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for same in groups.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        broadcast_tensor(flat)
        for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
            tensor.copy_(part.view_as(tensor))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place; returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group_for(tensor.device))
    return tensor


# What gloo says when a peer process is gone (exited, killed, its node lost or cut off) or stopped
# answering; anything else is a fault of this process and is raised as itself.
_PEER_GONE = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Timed out waiting|Socket Timeout|Connection refused"
    r"|No route to host|Connection timed out"
)
_PEER_ADDRESS = re.compile(r"\[([0-9.]+|[0-9a-fA-F:]+)\]:\d+")


def after_loss() -> str:
    """What happens to the job after a rank is lost, for the line that says so."""
    if not under_torchrun():
        return "the job ends; rerun with trainer.resume=auto to go on from the last checkpoint"
    count, most = restart_count(), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if count < most:
        return (
            f"torchrun will re-form the job with the nodes that answer (restart {count + 1} of {most}) "
            f"and it resumes from the last checkpoint"
        )
    return (
        f"torchrun has no restarts left (--max-restarts={most}): the job ends; rerun with trainer.resume=auto "
        f"to go on from the last checkpoint"
    )


def _who(address: str | None) -> str:
    """The ranks at ``address`` and their node, from the start's map; "another rank" if unknown."""
    ranks = [r for r, (_, addr) in enumerate(_peers) if address is not None and addr == address]
    if not ranks:
        return "another rank" + (f" (at {address})" if address else "")
    hosts = {_peers[r][0] for r in ranks}
    same_host = len({host for host, _ in _peers}) == 1  # nodes that share a host name (namespaces)
    node = address if same_host or len(hosts) != 1 else f"{hosts.pop()} ({address})"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on node {node}"


def peer_lost(exc: BaseException, step: int) -> JobError | None:
    """A collective's error read as a lost peer: one line naming the rank and node (when gloo
    names its address), the step, and what happens next; None for any other error (this
    process's own fault, raised as itself with its traceback)."""
    text = str(exc).strip()
    if not _PEER_GONE.search(text):
        return None
    reason = re.sub(r"^\[[^\]]*\] ", "", text.splitlines()[0])  # gloo's source position
    reason = reason.split(". This is typically")[0].rstrip(".")
    address = _PEER_ADDRESS.search(reason)
    who = _who(address.group(1) if address else None)
    return JobError(f"{who} stopped answering at step {step + 1} ({reason}); {after_loss()}")


def agree_max(values: list[int]) -> list[int]:
    """The maximum of each value over ranks (a few CPU integers; the control group)."""
    if not _active():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control[0])
    return tensor.tolist()


class Agreement:
    """``agree_max`` started now and read later (``result``), so the all-reduce runs while the
    caller trains a step: what every rank proposed one step ago, the same on every rank."""

    def __init__(self, values: list[int]):
        self.values = torch.tensor(values, dtype=torch.int64)
        self.work = None
        if _active():
            self.work = dist.all_reduce(self.values, op=dist.ReduceOp.MAX, group=_control[0], async_op=True)

    def result(self) -> list[int]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.values.tolist()


def shared_run_id() -> str | None:
    """An id every process of a torchrun job shares, also across nodes and restarts: the
    rendezvous id (``--rdzv_id``; ``--standalone`` draws one), or None when it is unset."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if run_id in ("", "none") else run_id


def on_all_ranks(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raised UserError on any rank, every rank stops together
    and rank 0 prints the distinct messages once (instead of one copy per rank)."""
    try:
        result, error = fn(), None
    except UserError as exc:
        result, error = None, str(exc)
    errors = all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    if _active() and dist.get_rank() != 0:
        raise SystemExit(2)
    by_message: dict[str, list[int]] = {}
    for rank, message in failed:
        by_message.setdefault(message, []).append(rank)
    if len(by_message) == 1 and len(failed) == len(errors):
        raise UserError(failed[0][1])
    parts = []
    for message, ranks in list(by_message.items())[:3]:
        who = ", ".join(map(str, ranks[:4])) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {who}: {message}")
    raise UserError("; ".join(parts))
