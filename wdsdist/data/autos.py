"""How ``LoaderConfig``'s ``decode="auto"`` is resolved, and how a config keeps saying how its
``auto`` values were resolved (``workers_why``, ``decode_why``) when it is changed afterwards.

``decode="auto"`` is gpu where the batches are pinned for a CUDA GPU, torch sees one and the
[gpu] extra (nvImageCodec) is installed, and no other option needs the CPU path; cpu elsewhere.
A transform given to ``Loader`` runs in the workers on decoded images, so it turns an ``auto``
that chose gpu back to cpu (``decoded_on_cpu``), with the workers sized again for it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from wdsdist.data.cores import AUTO

NVIMGCODEC = "nvidia-nvimgcodec-cu13"  # the [gpu] extra's decoder


def auto_decode(o: Any) -> tuple[str, str]:
    """``decode="auto"`` for the LoaderConfig ``o`` (these functions take one; options.py imports
    this module): "gpu" or "cpu", and why, in words."""
    import torch

    if not o.pin_memory:
        return "cpu", "auto: the batches stay on the CPU, pin_memory off"
    if not torch.cuda.is_available():
        return "cpu", "auto: torch sees no CUDA GPU"
    try:
        version = importlib.metadata.version(NVIMGCODEC)
    except importlib.metadata.PackageNotFoundError:
        return "cpu", f"auto: {NVIMGCODEC}, the [gpu] extra, is not installed"
    for name in ("cross_shuffle", "decode_downscale"):
        if getattr(o, name):
            return "cpu", f"auto: loader.{name} needs the CPU path"
    return "gpu", f"auto: a CUDA GPU and nvImageCodec {version}, the [gpu] extra"


def replaced(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace``, keeping how ``auto`` resolved ``workers`` and ``decode`` where the
    change leaves them as they are (replace makes the reasons anew, and they would be lost)."""
    new = dataclasses.replace(cfg, **changes)
    if new.workers == cfg.workers and new.workers_why is None:
        new.workers_why = cfg.workers_why
    if new.decode == cfg.decode and new.decode_why is None:
        new.decode_why = cfg.decode_why
    return new


def decoded_on_cpu(cfg: Any, why: str) -> Any:
    """A config whose ``decode="auto"`` chose gpu, decoding on the CPU instead (``why``), its
    ``workers="auto"`` sized again for that."""
    new = dataclasses.replace(cfg, decode="cpu", workers=AUTO if cfg.workers_why else cfg.workers)
    new.decode_why = f"auto: {why}"
    return new
