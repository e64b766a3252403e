"""What a non-finite loss does to a step, decided on the device: its micro-batch contributes nothing.

The host never asks whether a loss was finite. The loss that reaches backward is zero where it was
not, and a gradient hook on every trainable parameter zeroes that micro-batch's gradients before
DeepSpeed reduces them (a NaN loss back-propagates NaN through the graph even when multiplied by
zero, so zeroing the loss alone would not do). Device counters keep the streak of non-finite
micro-batches; the host reads them only at control steps, where every rank decides together whether
--max_nonfinite in a row was reached (pipeline.training.trainer).
"""

from __future__ import annotations

import torch


class NonfiniteGuard:
    """Per-rank device state: the current streak, its worst since the last read, the step of the last
    non-finite micro-batch, and how many there were. `install` hooks the parameters once."""

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.streak, self.worst, self.last_step, self.count = zero.clone(), zero.clone(), zero.clone(), zero.clone()
        self.ok = torch.ones((), dtype=torch.bool, device=device)  # the micro-batch being back-propagated

    def install(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self._gate)

    def _gate(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(self.ok, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def check(self, loss: torch.Tensor, *, step: int) -> torch.Tensor:
        """Record one micro-batch's loss (step: the 1-based step it belongs to); returns the loss to
        back-propagate (zero where it was not finite) and arms the gradient gate for it."""
        finite = torch.isfinite(loss)
        bad = (~finite).to(torch.int64)
        self.ok = finite
        self.streak = (self.streak + 1) * bad
        self.worst = torch.maximum(self.worst, self.streak)
        self.last_step = torch.where(finite, self.last_step, step)
        self.count = self.count + bad
        return torch.where(finite, loss, torch.zeros_like(loss))

    def read(self) -> list[int]:
        """[worst streak since the last read, last non-finite step, total count] on the host (a device
        read: call it at control steps only); the worst streak restarts from the current one."""
        values = torch.stack([self.worst, self.last_step, self.count]).tolist()
        self.worst = self.streak.clone()
        return values
