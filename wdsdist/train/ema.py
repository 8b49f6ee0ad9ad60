"""An exponential moving average of the weights (trainer.ema), the model timm's and torchvision's
recipes evaluate and ship.

Every ``every`` steps each weight w of the EMA becomes ``d * w + (1 - d) * w_model`` (a lerp),
with ``d = min(decay, (1 + n) / (10 + n))`` after n updates while ``warmup`` is on (timm's ramp,
so an early EMA is not the random initial weights). Buffers are averaged too, as torchvision's
reference does (``use_buffers=True``); integer buffers (BatchNorm's batch count) are copied.

Every rank keeps its own EMA and updates it from weights that DDP keeps equal on every rank, so
the EMA's weights are the same everywhere; BatchNorm's running statistics differ between ranks, and
rank 0's are shared before each evaluation, as for the model. A checkpoint holds rank 0's EMA and
its update count, so a resume (on any number of ranks) continues the same average.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class Ema:
    """The EMA of ``model``'s weights, updated by ``maybe_update(model, step)`` after each step."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup: bool = True):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.every, self.warmup = decay, every, warmup
        self.updates = 0

    def decay_now(self) -> float:
        """The decay of the next update."""
        if self.warmup:
            return min(self.decay, (1 + self.updates) / (10 + self.updates))
        return self.decay

    def maybe_update(self, model: nn.Module, step: int) -> None:
        """After the optimizer step that made ``step`` steps: an update every ``every`` steps."""
        if step % self.every == 0:
            self.update(model)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        weight = 1.0 - self.decay_now()
        ours, theirs = [], []
        for mine, current in zip(_tensors(self.model), _tensors(model), strict=True):
            if mine.is_floating_point():
                ours.append(mine)
                theirs.append(current.detach())
            else:
                mine.copy_(current)
        if ours:
            torch._foreach_lerp_(ours, theirs, weight)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, then buffers, in a fixed order (the model's and its copy's match)."""
    return [*model.parameters(), *model.buffers()]
