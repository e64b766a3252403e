"""The learning-rate schedule's math: the rate of every optimizer step as a pure function of the step
and the knobs, and the scheduler that DeepSpeed is given where its own schedulers cannot run it.

The DeepSpeed JSON names the shape (WarmupDecayLR: warm-up then decay; WarmupLR: warm-up then
constant) and the warm-up's form (`warmup_type`, `warmup_min_lr`); --lr, --warmup_steps, --max_steps,
--schedule and --decay_steps give the numbers (pipeline.training.config). With i the optimizer steps
taken before a step (0 for the first), T the run's total steps and W the warm-up (DeepSpeed's: at
least 2 steps when not 0), a step's rate is low + (lr - low) * f(i), low being `warmup_min_lr`:

    f(i) = i / W  (warmup_type linear; log(i + 1) / log(W) for log)   i < W
         = 1                                                          W <= i < S
         = g((i - S) / (T - S))                                       S <= i < T
         = 0                                                          T <= i

    --schedule linear, WarmupDecayLR: S = W, g(x) = 1 - x   (DeepSpeed's WarmupDecayLR, exactly)
    --schedule linear, WarmupLR:      no decay (S = T = infinity)
    --schedule wsd:                   S = max(W, T - D), g(x) = 1 - sqrt(x): warm-up, stable at --lr,
                                      then the 1-sqrt cool-down of the WSD literature over the last D
                                      steps (--decay_steps; default 20% of T)

The rate reaches 0 at step T + 1 (i = T): the last step trained runs at the decay's smallest rate,
as in DeepSpeed's WarmupDecayLR. A --max_time run re-fits T as it goes (pipeline.training.budget):
`refit_start` then keeps a decay that has begun where it began, and never starts one in the past.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

DECAYS = ("none", "linear", "wsd")
DEFAULT_DECAY_SHARE = 0.2  # WSD's cool-down when --decay_steps is unset: the last 20% of the steps


@dataclass(frozen=True)
class Shape:
    """The knobs of a schedule. `decay`: none (WarmupLR), linear (WarmupDecayLR) or wsd.
    `decay_steps`: WSD's D (None: DEFAULT_DECAY_SHARE of the total)."""

    peak: float
    low: float = 0.0
    warmup: int = 0
    log_warmup: bool = False
    decay: str = "linear"
    decay_steps: Optional[int] = None

    def __post_init__(self) -> None:
        assert self.decay in DECAYS, self.decay


def warmup_of(shape: Shape) -> int:
    """The warm-up steps W the rates follow: DeepSpeed's WarmupLR stretches a warm-up of 1 to 2 steps."""
    return 0 if shape.warmup == 0 else max(2, shape.warmup)


def decay_steps_of(shape: Shape, total: int) -> int:
    """WSD's decay length D for a run of `total` steps."""
    if shape.decay_steps is not None:
        return shape.decay_steps
    return max(1, round(DEFAULT_DECAY_SHARE * total))


def decay_start(shape: Shape, total: int) -> Optional[int]:
    """S, the steps taken when the decay begins (the rate of step S + 1 is the first below --lr); None
    for no decay."""
    if shape.decay == "none":
        return None
    if shape.decay == "linear":
        return warmup_of(shape)
    return max(warmup_of(shape), total - decay_steps_of(shape, total))


def factor(i: int, shape: Shape, *, total: int, start: Optional[int] = None) -> float:
    """f(i) of the module docstring: the share of the way from `low` to the peak of the step after
    `i` steps. `start`: the decay's start when a re-fitted run fixed it (default: decay_start)."""
    w = warmup_of(shape)
    if i < w:
        return math.log(i + 1) / math.log(w) if shape.log_warmup else i / w
    if shape.decay == "none":
        return 1.0
    s = decay_start(shape, total) if start is None else start
    if i < s:
        return 1.0
    if i >= total:
        return 0.0
    x = (i - s) / (total - s)
    return 1.0 - x if shape.decay == "linear" else 1.0 - math.sqrt(x)


def lr_at(i: int, shape: Shape, *, total: int, start: Optional[int] = None) -> float:
    """The learning rate of the step after `i` steps (see `factor`)."""
    return shape.low + (shape.peak - shape.low) * factor(i, shape, total=total, start=start)


def refit_start(shape: Shape, *, total: int, taken: int, start: Optional[int]) -> Optional[int]:
    """The decay's start after the total is re-fitted to `total` with `taken` steps done: a WSD decay
    that has begun (start <= taken) keeps its start and stretches or shrinks to the new end; one that
    has not begins where the new total puts it, but not before `taken` (the steps done keep their
    rates). The linear decay starts after the warm-up whatever the total."""
    if shape.decay != "wsd":
        return decay_start(shape, total)
    if start is not None and start <= taken:
        return start
    return max(taken, decay_start(shape, total))


def shape_from_json(sched: Optional[dict[str, Any]], *, peak: float, wsd: bool = False, decay_steps=None) -> Shape:
    """The shape a resolved DeepSpeed JSON's `scheduler` block names (WarmupLR or WarmupDecayLR; none:
    a constant `peak`), with --schedule wsd's decay in place of WarmupDecayLR's when `wsd`. The JSON's
    own numbers (filled in by pipeline.training.ds_config) win over `peak`."""
    if not sched:
        return Shape(peak=peak, decay="none")
    p = sched.get("params", {})
    assert sched.get("type") in ("WarmupLR", "WarmupDecayLR"), sched.get("type")
    decay = "none" if sched["type"] == "WarmupLR" else "wsd" if wsd else "linear"
    return Shape(
        peak=float(p.get("warmup_max_lr", peak)),
        low=float(p.get("warmup_min_lr", 0.0)),
        warmup=int(p.get("warmup_num_steps", 0)),
        log_warmup=p.get("warmup_type", "log") != "linear",  # DeepSpeed's default is log
        decay=decay,
        decay_steps=decay_steps if wsd else None,
    )


class ScheduleLR:
    """The scheduler DeepSpeed (or the bare engine) steps once per optimizer step: sets every param
    group's rate to `lr_at(taken)`. `total` is --max_steps, or the --max_time budget's fit (`refit`).
    Its state is the steps taken and, for a re-fitted run (`fitted`), the fitted total and decay
    start; it also reads the states of DeepSpeed's own schedulers and of torch's LambdaLR."""

    def __init__(self, optimizer: Any, shape: Shape, *, total: int, fitted: bool = False) -> None:
        self.optimizer, self.shape, self.fitted = optimizer, shape, fitted
        self.cap, self.total, self.taken = total, total, 0
        self.start = decay_start(shape, total)
        self._apply()

    def rate(self) -> float:
        return lr_at(self.taken, self.shape, total=self.total, start=self.start)

    def get_lr(self) -> list[float]:
        return [self.rate()] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, *_: Any, **__: Any) -> None:
        self.taken += 1
        self._apply()

    def refit(self, total: int) -> None:
        """A new total (at most --max_steps): the rates from the next step on follow it."""
        self.total = min(self.cap, total)
        self.start = refit_start(self.shape, total=self.total, taken=self.taken, start=self.start)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        # last_batch_iteration as DeepSpeed's schedulers count: they can load this state too.
        return {
            "steps_taken": self.taken,
            "last_batch_iteration": self.taken - 1,
            "total": self.total,
            "decay_start": self.start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "steps_taken" in state:
            self.taken = int(state["steps_taken"])
            if self.fitted and state.get("total") is not None:
                # The fit continues (the budget re-fits it at once from the time spent).
                self.total = min(self.cap, int(state["total"]))
                saved = state.get("decay_start")
                self.start = refit_start(self.shape, total=self.total, taken=self.taken, start=saved)
        elif "last_epoch" in state:  # torch's LambdaLR (--warmup_steps 0 before this scheduler)
            self.taken = int(state["last_epoch"])
        else:
            # DeepSpeed's own scheduler (a run started without this one): continue at its step.
            from pipeline.training import log

            self.taken = int(state["last_batch_iteration"]) + 1
            log.warning(
                f"the checkpoint's learning-rate schedule is DeepSpeed's own; continuing at step {self.taken} "
                f"on this job's schedule (DeepSpeed's warm-up runs at least 2 steps)"
            )
        self._apply()

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
