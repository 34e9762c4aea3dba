"""What to audit: a model, its batches, and how one step runs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import nn

from .errors import DetauditError

SCHEDULER_INTERVALS = ("step", "epoch")
Batches = Union[Iterable[Any], Callable[[int], Iterable[Any]]]


@dataclass
class Probe:
    """One fresh set-up of a model to audit; built again (after seeding) for every repeat.

    `batches` is an iterable re-iterated every epoch (a DataLoader) or a callable
    `epoch -> iterable`. `step(model, batch)` returns a loss tensor or a dict of loss
    tensors when the model is in train mode, and the model's outputs in eval mode
    (detaudit calls `model.train()` / `model.eval()` before the steps; the step can read
    `model.training`). Backward, gradient scaling, accumulation, clipping and the
    optimizer and scheduler steps are driven by detaudit so that it can record them.
    `scheduler_interval` says when the scheduler steps, as in the training it stands for:
    ``"step"`` after every optimizer step, ``"epoch"`` once after each epoch's last step
    (a StepLR or MultiStepLR counted in epochs).
    """

    model: nn.Module
    batches: Batches
    step: Callable[[nn.Module, Any], Any]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    scheduler_interval: str = "step"

    def __post_init__(self) -> None:
        if self.scheduler_interval not in SCHEDULER_INTERVALS:
            raise DetauditError(
                f"the probe's scheduler_interval is {self.scheduler_interval!r}: use 'step' "
                "(the scheduler steps after every optimizer step) or 'epoch' (after each "
                "epoch's last step)")

    def epoch_batches(self, epoch: int) -> Iterable[Any]:
        """The batches of one epoch."""
        if callable(self.batches) and not hasattr(self.batches, "__iter__"):
            return self.batches(epoch)
        return self.batches
