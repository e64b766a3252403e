"""--max_time: a training-time budget, and the step where the run ends.

The budget counts the time of the optimizer steps (from the start of `train_step` to its end, data
loading included; checkpoints, metrics and evaluation between steps are not counted), carried over
across resumes in the checkpoint (TrainState.train_time_s). From the mean step time of this process
(its first step, which compiles and starts the loader, left out) it estimates the steps that still
fit, and re-fits the schedule's total to them (pipeline.training.schedule.ScheduleLR.refit): at the
start of a process (from the checkpoint's step time), at its second step, and every --control_every
steps. Every rank re-fits at the same steps from the same numbers (the ranks' largest times, one
small collective), so they agree on the rates and on the last step. The run ends at the fitted
total or at --max_steps, whichever comes first; without --max_time it ends at --max_steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from pipeline import distributed
from pipeline.training import log
from pipeline.training.schedule import ScheduleLR
from pipeline.training.state import TrainState

# The time source (seconds). A module default so that a test can replace it in a launched trainer.
clock: Callable[[], float] = time.perf_counter

_US = 1e6  # times travel between ranks as whole microseconds


class TimeBudget:
    """`total`: the step the run ends at. `start_step()` / `end_step()` around each optimizer step
    (every rank). `scheduler`: the engine's scheduler, re-fitted when it is a ScheduleLR."""

    def __init__(
        self,
        *,
        max_time_s: Optional[float],
        max_steps: int,
        state: TrainState,
        scheduler: Any,
        every: int,
        now: Optional[Callable[[], float]] = None,
    ) -> None:
        self.max_time_s, self.max_steps, self.state, self.every = max_time_s, max_steps, state, every
        self.scheduler = scheduler if isinstance(scheduler, ScheduleLR) else None
        self.now = now or clock
        self.total = max_steps
        self.steps = 0  # steps of this process
        self.first_s = self.rest_s = 0.0  # this process's first step, and the others together
        self._t0 = 0.0
        if max_time_s is not None and state.step_time_s is not None:
            self._fit(state.step_time_s)  # a resumed run: fitted at once (the budget may have changed)

    def start_step(self) -> None:
        self._t0 = self.now()

    def end_step(self) -> None:
        """Count the step's time; at the re-fit steps (a collective), fit the total to what is left."""
        dt = self.now() - self._t0
        self.steps += 1
        if self.steps == 1:
            self.first_s = dt
        else:
            self.rest_s += dt
        self.state.train_time_s += dt
        if self.max_time_s is not None and (self.steps == 2 or self.state.step % self.every == 0):
            self._agree_and_fit()

    def _agree_and_fit(self) -> None:
        rows = distributed.all_gather_ints([round(self.state.train_time_s * _US), round(self.rest_s * _US)])
        self.state.train_time_s = max(r[0] for r in rows) / _US
        rest = max(r[1] for r in rows) / _US
        if self.steps >= 2:
            step_s = rest / (self.steps - 1)
        else:  # one step in this process: the checkpoint's estimate, else this (slow) first step
            step_s = self.state.step_time_s if self.state.step_time_s is not None else self.state.train_time_s
        self.state.step_time_s = step_s
        self._fit(step_s)

    def _fit(self, step_s: float) -> None:
        left_s = self.max_time_s - self.state.train_time_s
        fits = int(left_s // step_s) if step_s > 0 else self.max_steps
        total = min(self.max_steps, self.state.step + max(0, fits))
        if total != self.total and (self.steps <= 2 or abs(total - self.total) * 100 >= self.total):
            log.info(
                f"--max_time: {self.state.train_time_s:.1f} s of {self.max_time_s:.1f} s spent at step "
                f"{self.state.step}, {step_s:.3g} s/step: the run ends at step {total}"
                + (f" (--max_steps {self.max_steps})" if total == self.max_steps else "")
            )
        self.total = total
        if self.scheduler is not None:
            self.scheduler.refit(total)
