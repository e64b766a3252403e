"""The DeepSpeed JSON (--ds_config): read it, check it, and write the schedule's numbers into it.

The JSON owns micro-batch, gradient accumulation, precision, ZeRO, clipping and the optimizer's type;
pipeline.training.config owns the learning rate, warm-up and total steps, which are filled in here
once. A JSON that sets one of those too would set it twice, and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from preprocessing.errors import UsageError

if TYPE_CHECKING:
    from pipeline.training.config import ScheduleArgs


def load_ds_json(path: str) -> dict[str, Any]:
    """The DeepSpeed config file as a dict, with a clear error for a missing or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--ds_config {path}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--ds_config {path}: not valid JSON (line {e.lineno}: {e.msg})") from e


# Knobs this module owns; a DeepSpeed JSON that sets them would set them twice.
_OWNED_OPTIMIZER_PARAMS = ("lr",)
_OWNED_SCHEDULER_PARAMS = ("warmup_max_lr", "warmup_num_steps", "total_num_steps")


def resolve_ds_config(ds: dict[str, Any], *, schedule: ScheduleArgs, world_size: int, path: str) -> dict[str, Any]:
    """Check the DeepSpeed JSON and fill in the schedule's numbers. Returns a new dict.

    Raises UsageError when the JSON lacks a micro-batch, when its batch sizes cannot hold for
    `world_size` (train_batch_size = micro * accumulation * world size), or when it sets a knob
    this config owns (lr, warm-up, total steps).
    """
    ds = json.loads(json.dumps(ds))  # a deep copy
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    for name, v in (
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", accum),
        ("train_batch_size", total),
    ):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise UsageError(f"--ds_config {path}: {name} must be a positive integer, got {v!r}")
    if micro is None:
        raise UsageError(
            f"--ds_config {path}: set train_micro_batch_size_per_gpu (and gradient_accumulation_steps); "
            f"the global batch then follows the world size"
        )
    if total is not None:
        per_step = micro * world_size * (accum or 1)
        if accum is not None and total != per_step or accum is None and total % (micro * world_size):
            raise UsageError(
                f"--ds_config {path}: train_batch_size={total} does not equal train_micro_batch_size_per_gpu={micro} "
                f"x gradient_accumulation_steps={accum if accum is not None else '?'} x world size {world_size}; "
                f"drop train_batch_size from the JSON (it follows the world size) or launch "
                f"{total // max(micro * (accum or 1), 1)} processes"
            )
    opt = ds.get("optimizer")
    if opt is not None:
        params = opt.setdefault("params", {})
        for k in _OWNED_OPTIMIZER_PARAMS:
            if k in params:
                raise UsageError(
                    f"--ds_config {path}: optimizer.params.{k} is set in the JSON; the learning rate "
                    f"belongs to --lr (objective default {schedule.lr}); remove it from the JSON"
                )
        params["lr"] = schedule.lr
    sched = ds.get("scheduler")
    if sched is not None:
        params = sched.setdefault("params", {})
        for k in _OWNED_SCHEDULER_PARAMS:
            if k in params:
                raise UsageError(
                    f"--ds_config {path}: scheduler.params.{k} is set in the JSON; it belongs to "
                    f"--lr/--warmup_steps/--max_steps; remove it from the JSON"
                )
        params["warmup_max_lr"] = schedule.lr
        params["warmup_num_steps"] = schedule.warmup_steps
        params["total_num_steps"] = schedule.max_steps
    return ds


def batch_shape(ds: dict[str, Any], *, world_size: int) -> tuple[int, int, int]:
    """(micro-batch per rank, gradient accumulation, global batch) of a resolved DeepSpeed config at
    `world_size` ranks, as DeepSpeed derives them: the accumulation from train_batch_size when the
    JSON sets that instead (so the global batch stays when the world size changes), else 1."""
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    if accum is None:
        accum = total // (micro * world_size) if total is not None else 1
    return micro, accum, micro * accum * world_size


def client_scheduler(ds: dict[str, Any], *, schedule: ScheduleArgs) -> tuple[dict[str, Any], Optional[Callable]]:
    """(the config DeepSpeed is given, a scheduler factory for deepspeed.initialize or None).

    DeepSpeed's WarmupLR / WarmupDecayLR warm up for at least 2 steps from warmup_min_lr (0 by
    default), so --warmup_steps 0 would still train its first steps at lr 0. For 0 the same shapes
    without the warm-up replace them: constant, or linear from --lr at the first step to 0 at
    --max_steps. Any other warm-up is DeepSpeed's own."""
    sched = ds.get("scheduler")
    if schedule.warmup_steps != 0 or not sched or sched.get("type") not in ("WarmupLR", "WarmupDecayLR"):
        return ds, None
    total, decay = schedule.max_steps, sched["type"] == "WarmupDecayLR"

    def factor(step: int) -> float:
        return max(0.0, (total - step) / total) if decay else 1.0

    def build(optimizer):
        import torch

        class NoWarmup(torch.optim.lr_scheduler.LambdaLR):
            def load_state_dict(self, state: dict[str, Any]) -> None:
                if "last_batch_iteration" not in state:
                    base_lrs = self.base_lrs
                    super().load_state_dict(state)
                    # This job's --lr, not the saved one (they differ after --allow_schedule_change).
                    self.base_lrs = base_lrs
                    return
                # Saved by DeepSpeed's own scheduler (a run started before --warmup_steps 0 meant
                # this): continue at its step, on this schedule, and say so.
                from pipeline.training import log

                self.last_epoch = int(state["last_batch_iteration"]) + 1
                for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
                    group["lr"] = lr
                self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
                log.warning(
                    f"the checkpoint's learning-rate schedule is DeepSpeed's {sched['type']} (its warm-up "
                    f"ran at least 2 steps); continuing at step {self.last_epoch} without a warm-up"
                )

        return NoWarmup(optimizer, factor)

    return {k: v for k, v in ds.items() if k != "scheduler"}, build
