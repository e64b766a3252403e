"""What a run is at, and what a resumed run restores beyond DeepSpeed's own weights, optimizer and
scheduler: the step, the loader's position, the skipped micro-batches, the time the steps took
(--max_time), every rank's RNG states and the TaCL teacher's fingerprint. They travel in the
checkpoint's client state; `save` and `resume` are the two ends.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pipeline import distributed
from pipeline.training import checkpoint, log
from preprocessing.errors import UsageError


@dataclass
class TrainState:
    """The optimizer steps taken, and the non-finite micro-batches neutralised over all ranks as of the
    last control step (and when this process started). The loader keeps its own position. The time
    the steps took and the latest mean step time: what a --max_time budget has spent
    (pipeline.training.budget)."""

    step: int = 0
    skipped: int = 0
    skipped_at_start: int = 0
    train_time_s: float = 0.0
    step_time_s: Optional[float] = None


def rng_states() -> dict[str, Any]:
    # Builtins and tensors only: a checkpoint must load weights-only (pipeline.training.checkpoint).
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    state: TrainState,
    *,
    engine: Any,
    loader: Any,
    teacher: Any,
    teacher_print: Optional[str],
    resolved: dict[str, Any],
    tokenizer: Any,
    save_dir: Path,
    keep: int,
) -> Path:
    """A checkpoint at state.step (every rank calls it: a collective). `teacher`: TaCL's (an Encoder),
    whose weights must still be those it started with (`teacher_print`)."""
    config = engine.module.config

    def write_extras(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    if teacher is not None:
        from pipeline.modeling.teacher import fingerprint

        # The frozen teacher must be exactly the initial encoder at every checkpoint.
        assert fingerprint(teacher.bert) == teacher_print, "the TaCL teacher's weights changed during training"
    client = {
        "step": state.step,
        "loader": loader.state_dict(),
        "skipped_micro_batches": state.skipped,
        "rng": distributed.all_gather_object(rng_states()),
        "world_size": distributed.world_size(),
        "teacher_fingerprint": teacher_print,
        "config": resolved,
        "train_time_s": state.train_time_s,
        "step_time_s": state.step_time_s,
    }
    return checkpoint.save(
        engine,
        save_dir=save_dir,
        step=state.step,
        client_state=client,
        keep=keep,
        write_extras=write_extras,
        run_config=resolved,
    )


def resume(
    state: TrainState, path: Path, *, engine: Any, loader: Any, teacher_print: Optional[str], source: str
) -> None:
    """Load the checkpoint at `path` into the engine, the loader and `state` (every rank). `source`: the
    flag the teacher was rebuilt from, for the error when it differs."""
    client = checkpoint.load(engine, path)
    state.step, state.skipped = int(client["step"]), int(client.get("skipped_micro_batches", 0))
    loader.load_state_dict(client["loader"])
    state.train_time_s, state.step_time_s = float(client.get("train_time_s", 0.0)), client.get("step_time_s")
    if client.get("world_size") == distributed.world_size():
        set_rng_states(client["rng"][distributed.rank()])
    if teacher_print is not None and client.get("teacher_fingerprint") not in (None, teacher_print):
        raise UsageError(
            f"the TaCL teacher rebuilt from {source} differs from the one this run started with; resume with "
            f"the same --init_from/--model_config/--seed"
        )
    log.info(f"resumed from {path} at step {state.step}")
