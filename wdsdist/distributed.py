"""The one place that reads torchrun's environment and talks to torch.distributed.

Everything else gets rank and world from the ``Dist`` returned by ``init`` and calls the small
collectives below, which also work (as no-ops) in a plain one-process run without torchrun.
"""

from __future__ import annotations

import os
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


def init(device: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun) and initialise the process group.

    ``device``: auto (CUDA when available), cuda or cpu. LOCAL_RANK picks the GPU; the backend
    is nccl on CUDA and gloo on CPU, initialised from env:// (MASTER_ADDR/MASTER_PORT).
    ``timeout_s``: a collective waiting this long fails. Without torchrun's variables this is a
    one-process run with no process group.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"trainer.device={device!r}: must be auto, cuda or cpu")
    if under_torchrun():
        rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    else:
        rank, world, local_rank = 0, 1, 0
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("trainer.device=cuda but CUDA is not available")
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                f"use --nproc_per_node<={torch.cuda.device_count()}"
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if under_torchrun():
        # The job's store (MASTER_ADDR:MASTER_PORT) outlives worker restarts under torchrun
        # (--max-restarts), and so do the addresses the last attempt's ranks left in it: each
        # attempt's process group keeps its keys under its own prefix, or a restarted rank
        # could dial a dead one's address.
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))
        _store[0] = store
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=dist.PrefixStore(f"wdsdist/attempt_{restart_count()}/pg", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
        if use_cuda and world > 1:
            # Small control values (stop flags, "I have a batch") go over gloo on the CPU, so
            # agreeing on them every step never waits for the GPU's queue of work.
            _control[0] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return Dist(rank, world, local_rank, dev)


_control: list[Any] = [None]  # the gloo group for control values; None: the default group
_store: list[Any] = [None]


def cleanup() -> None:
    _control[0] = _store[0] = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (--max-restarts); 0 at first."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


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


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's values into ``tensor`` on every rank, in place; returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(tensor, src=0)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place; returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def agree_max(values: list[int]) -> list[int]:
    """The maximum of each value over ranks (a few CPU integers; the control group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control[0])
    except RuntimeError as exc:  # the every-step meeting point: where a dead rank shows first
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise JobError(f"another rank stopped answering (its own error, if it had time, is above): {reason}") from None
    return tensor.tolist()


def shared_run_id() -> str | None:
    """An id every process of a torchrun job shares, also across nodes and restarts: the
    rendezvous id (``--rdzv_id``; ``--standalone`` draws one), or None when it is unset."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if run_id in ("", "none") else run_id
