"""Fault injection for the trainer tests: `pipeline/train.py`'s main with loss hooks
(pipeline.training.step.LossHook) built from flags of its own, which it takes off the command line:

    --fault_nan_steps 3,4,5 --fault_nan_rank R [--fault_nan_attempts N]
        rank R's loss is NaN at those steps, on the first N micro-batches of each (default 1).
    --fault_step_time_s S
        the --max_time budget's clock (pipeline.training.budget.clock) advances S seconds at every
        reading: every optimizer step then takes S seconds by the budget's account.

Launched in place of pipeline/train.py (tests.support.trainer.deepspeed_cmd does so when a --fault_
flag is present); the product itself carries no fault injection.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def take_flags(argv: list[str], *, prefix: str = "--fault_") -> tuple[dict[str, str], list[str]]:
    """({name: value} of the flags named `prefix`*, the remaining arguments)."""
    faults, rest, i = {}, [], 0
    while i < len(argv):
        if argv[i].startswith(prefix):
            faults[argv[i][len(prefix) :]] = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    return faults, rest


def nan_hook(*, steps: set[int], rank: int, attempts: int):
    from pipeline import distributed
    from pipeline.objectives import StepLosses

    def hook(step: int, micro: int, losses: StepLosses) -> StepLosses:
        if step not in steps or distributed.rank() != rank or micro >= attempts:
            return losses
        nan = float("nan")
        return StepLosses(total=losses.total * nan, values={**losses.values, "loss": losses.values["loss"] * nan})

    return hook


def ticking_clock(tick: float):
    now = [0.0]

    def clock() -> float:
        now[0] += tick
        return now[0]

    return clock


def main() -> int:
    sys.path.insert(0, str(REPO))
    faults, rest = take_flags(sys.argv[1:])
    hooks = []
    if "nan_steps" in faults:
        steps = {int(s) for s in faults["nan_steps"].split(",")}
        hooks.append(nan_hook(steps=steps, rank=int(faults["nan_rank"]), attempts=int(faults.get("nan_attempts", 1))))
    if "step_time_s" in faults:
        from pipeline.training import budget

        budget.clock = ticking_clock(float(faults["step_time_s"]))
    from pipeline.train import main as train_main

    return train_main(rest, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
