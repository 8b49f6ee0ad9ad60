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

from wdsdist.errors import UserError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: str = "auto", timeout_min: float = 30.0) -> Dist:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun) and initialise the process group.

    ``device``: auto (CUDA when available), cuda or cpu. LOCAL_RANK picks the GPU; the backend
    is nccl on CUDA and gloo on CPU, initialised from env:// (MASTER_ADDR/MASTER_PORT).
    Without torchrun's variables this is a one-process run with no process group.
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
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=timeout_min),
            device_id=dev if use_cuda else None,
        )
    return Dist(rank, world, local_rank, dev)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


def shared_run_id() -> str | None:
    """An id every process of a torchrun job shares, also across nodes and restarts: the
    rendezvous id (``--rdzv_id``; ``--standalone`` draws one), or None when it is unset."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if run_id in ("", "none") else run_id
