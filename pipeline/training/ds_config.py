"""The DeepSpeed JSON (--ds_config): read it, check it, and write the schedule's numbers into it.

The JSON owns micro-batch, gradient accumulation, precision, ZeRO, clipping, the optimizer's type and
the schedule's shape (its warm-up scheduler); pipeline.training.config owns the learning rate, warm-up
and total steps, which are filled in here once. A JSON that sets one of those too would set it twice,
and is refused. `client_scheduler` gives DeepSpeed pipeline.training.schedule's scheduler where
DeepSpeed's own cannot give the run's rates.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pipeline.training.schedule import ScheduleLR, shape_from_json
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
    _check_scheduler_type(sched, schedule=schedule, path=path)
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


def _check_scheduler_type(sched: Optional[dict[str, Any]], *, schedule: ScheduleArgs, path: str) -> None:
    """--schedule wsd refines the JSON's WarmupDecayLR, and --max_time re-fits a warm-up scheduler:
    other scheduler types are not ours to change."""
    kind = (sched or {}).get("type")
    if schedule.schedule == "wsd" and kind != "WarmupDecayLR":
        raise UsageError(
            f"--ds_config {path}: --schedule wsd needs the JSON's scheduler to be WarmupDecayLR (its warm-up "
            f"settings are kept; the decay becomes WSD's), not {kind or 'none'}; set scheduler.type to WarmupDecayLR"
        )
    if schedule.max_time is not None and sched is not None and kind not in ("WarmupLR", "WarmupDecayLR"):
        raise UsageError(
            f"--ds_config {path}: --max_time fits a WarmupLR or WarmupDecayLR schedule to the time budget, not the "
            f"JSON's {kind}; use one of those or drop --max_time"
        )


def client_scheduler(ds: dict[str, Any], *, schedule: ScheduleArgs) -> tuple[dict[str, Any], Optional[Callable]]:
    """(the config DeepSpeed is given, a scheduler factory for deepspeed.initialize or None).

    DeepSpeed runs the JSON's WarmupLR / WarmupDecayLR itself, except where they cannot give the
    run's rates (pipeline.training.schedule.ScheduleLR then replaces them, with the same shape):
    --warmup_steps 0 (their warm-up lasts at least 2 steps from warmup_min_lr, 0 by default, so the
    first steps would train at lr 0), --schedule wsd (not one of DeepSpeed's), and --max_time (the
    total is re-fitted as the run goes)."""
    sched = ds.get("scheduler")
    wsd, fitted = schedule.schedule == "wsd", schedule.max_time is not None
    if not sched or not (schedule.warmup_steps == 0 or wsd or fitted):
        return ds, None
    shape = shape_from_json(sched, peak=schedule.lr, wsd=wsd, decay_steps=schedule.decay_steps)

    def build(optimizer):
        return ScheduleLR(optimizer, shape, total=schedule.max_steps, fitted=fitted)

    return {k: v for k, v in ds.items() if k != "scheduler"}, build
