"""How many worker processes a rank's loader gets when asked for ``workers="auto"``.

The cores this process may run on (its CPU affinity: a container's or Slurm's cgroup, or
``taskset``) are the node's to share among its ranks (the caller's ``node_ranks``, else torchrun's
``LOCAL_WORLD_SIZE``). Of a rank's share:
  - on a GPU run (batches go to a GPU: ``pin_memory``), all but one core: the training process
    needs one to launch the GPU's work, and every other core decodes;
  - with ``decode="gpu"`` at most two: workers only read bytes and draw crops, which one or two
    keep ahead of the GPU; more would only take memory (decode/gpu.py). Where the workers decode
    a share of the JPEGs themselves (``gpu_decode_share`` below 1), that share of the cores a GPU
    run's CPU decode would take, on top;
  - on a CPU run half: the model's own compute runs on the same cores, in the training
    process's threads, and a worker that takes a core from it slows every step.
At least one always. An explicit number is taken as given.
"""

from __future__ import annotations

import math
import os

AUTO = "auto"
GPU_DECODE_WORKERS = 2  # decode=gpu: reading and drawing keep up on this many (see above)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_on_node(node_ranks: int) -> int:
    """The ranks that share this node: ``node_ranks`` when the caller gave more than one, else
    torchrun's LOCAL_WORLD_SIZE (1 outside torchrun, or where it is not a number)."""
    if node_ranks > 1:
        return node_ranks
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def auto_workers(*, gpu: bool, gpu_decode: bool, node_ranks: int = 1, cpu_share: float = 0.0) -> tuple[int, str]:
    """The workers for ``workers="auto"`` and why, in words for a start-up line; ``cpu_share``:
    under decode=gpu, the share of the JPEGs the workers decode themselves."""
    n, ranks = cores(), ranks_on_node(node_ranks)
    share = max(1, n // ranks)
    mine = f"{n} cores this process may use" + (f" shared by {ranks} ranks on this node" if ranks > 1 else "")
    if gpu_decode and cpu_share > 0:
        decoding = math.ceil(round((share - 1) * cpu_share, 6))  # 1 - 0.7 is 0.30000000000000004
        workers = max(1, min(share - 1, GPU_DECODE_WORKERS + decoding))
        why = (
            f"{mine}; decode=gpu: {GPU_DECODE_WORKERS} to read and draw, and {decoding} for the {cpu_share:.0%} "
            f"of the JPEGs they decode ({cpu_share:.0%} of the {share - 1} cores CPU decode would take)"
        )
    elif gpu_decode:
        workers = max(1, min(GPU_DECODE_WORKERS, share - 1))
        why = f"{mine}; decode=gpu: workers only read and draw, {GPU_DECODE_WORKERS} at most"
    elif gpu:
        workers = max(1, share - 1)
        why = f"{mine}, less 1 for the training process"
    else:
        workers = max(1, share // 2)
        why = f"{mine}, half of them: the model trains on the CPU too"
    return workers, f"auto: {why}"
