"""One optimizer step: forward, every loss term, backward, the optimizer, the guards. `pipeline/train.py`
and every benchmark run this function; only the engine differs (DeepSpeed's, or the bare benchmark's
pipeline.bench.engine, which has the same four calls).

The engine is what DeepSpeed's engine is to the step: `engine(batch, with_embeddings=, with_nsp=)`
runs the student; `engine.backward(loss)` back-propagates (divided by the accumulation steps);
`engine.step()` is called after every micro-batch and applies the optimizer on the last one of a step;
`engine.get_lr()` gives the rates of the step.

Determinism: every random draw is a function of (seed, step, micro-batch, rank, sample id): masking per
(seed, epoch, sample id) in the collator; dropout and the losses' draws re-seeded before every
micro-batch here. The step reads nothing back from the device and calls no collective of its own
(beyond the losses'): the metrics accumulate on the device (pipeline.training.metrics.Meter), and a
non-finite loss is neutralised on the device (pipeline.training.nonfinite).

Legend: B sequences per micro-batch, L positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pipeline import distributed
from pipeline.objectives import LossInputs, Objective, StepLosses
from pipeline.training.metrics import FlopsModel, Meter
from pipeline.training.nonfinite import NonfiniteGuard
from pipeline.training.state import TrainState

# A loss hook sees each micro-batch's losses before the guard and may replace them:
# hook(step, micro, losses) -> losses. Tests install them (fault injection); the product has none.
LossHook = Callable[[int, int, StepLosses], StepLosses]


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the parts (seed, step, micro-batch, rank, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class StepProgram:
    """Everything a step needs besides the engine's own state: what to compute (objective, its knobs,
    NSP, the teacher, the MLM head's rows for the FLOPs count) and how (seed, accumulation, the guard).
    Built once per run (pipeline.training.trainer.setup, or a benchmark)."""

    engine: Any
    objective: Objective
    args: Any  # the config's ObjectiveArgs
    nsp: bool
    teacher: Any  # TaCL's frozen teacher (pipeline.modeling.encoder.Encoder), or None
    guard: NonfiniteGuard
    flops: FlopsModel
    device: torch.device
    seed: int
    accum: int
    full_head: bool = False
    trace: bool = False
    hooks: Sequence[LossHook] = field(default_factory=tuple)


@dataclass
class StepResult:
    lr: float
    sample_ids: list[int]
    last_batch: Optional[dict[str, Any]] = None  # the step's last micro-batch, on the device


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A collated batch on the device: tensors copied asynchronously (the loader pinned them on CUDA),
    host values (layout, counts) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class Batches:
    """Endless micro-batches: a new epoch (and a new shuffle) when one ends."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it = iter(loader)

    def next(self) -> dict[str, torch.Tensor]:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def _no_mark(_: str) -> None:
    pass


def train_step(
    p: StepProgram,
    state: TrainState,
    batches: Batches,
    meter: Meter,
    *,
    mark: Optional[Callable[[str], None]] = None,
) -> StepResult:
    """One optimizer step: `p.accum` micro-batches, each with its backward and engine.step (the engine
    applies the optimizer on the last). A non-finite micro-batch contributes nothing (p.guard). Advances
    `state.step`. `mark(name)`, when given, is called after each phase of a micro-batch (data, forward,
    loss, backward, optimizer), for a benchmark's step-time split."""
    mark = mark or _no_mark
    rank = distributed.rank()
    lr, ids, dev = 0.0, [], None
    step = state.step + 1
    for micro in range(p.accum):
        batch = batches.next()
        if p.trace:
            ids.extend(batch["sample_ids"].tolist())
        # Dropout and the losses' draws: functions of (seed, step, micro-batch, rank); the losses'
        # generator is the same on every rank (their draws span all ranks).
        torch.manual_seed(mixed_seed(p.seed, state.step, micro, rank))
        gen = torch.Generator().manual_seed(mixed_seed(p.seed, state.step, micro, 1 << 20))
        dev = to_device(batch, p.device)
        mark("data")
        out = p.engine(dev, with_embeddings=p.objective.needs_embeddings, with_nsp=p.nsp)
        mark("forward")
        res = p.objective.losses(out, dev, nsp=p.nsp, inputs=LossInputs(args=p.args, teacher=p.teacher, generator=gen))
        for hook in p.hooks:
            res = hook(step, micro, res)
        total = p.guard.check(res.total, step=step)
        mark("loss")
        p.engine.backward(total)
        mark("backward")
        if micro == p.accum - 1:
            lr = float(p.engine.get_lr()[0])  # the rate this optimizer step uses (a host number)
        p.engine.step()
        mark("optimizer")
        # The vocabulary projection's rows: the masked ones, or every real one for the full head.
        head_rows = batch["num_tokens"] if p.full_head else batch["num_masked"]
        meter.add(
            res.values,
            ok=p.guard.ok,
            tokens=batch["num_tokens"],
            samples=batch["num_samples"],
            flops=p.flops.batch_flops(tokens=batch["num_tokens"], sum_len_sq=batch["sum_len_sq"], masked=head_rows),
        )
    state.step += 1
    meter.steps += 1
    return StepResult(lr=lr, sample_ids=ids, last_batch=dev)
