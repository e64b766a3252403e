"""What a resumed run restores beyond DeepSpeed's own weights, optimizer and scheduler: the step, the
loader's position, the skipped micro-batches, every rank's RNG states and the TaCL teacher's
fingerprint. They travel in the checkpoint's client state; `save` and `resume` are the two ends.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline import distributed
from pipeline.training import checkpoint, log
from preprocessing.errors import UsageError

if TYPE_CHECKING:
    from pipeline.training.trainer import Run


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


def save(run: Run) -> Path:
    """A checkpoint at run.step (every rank calls it: a collective)."""
    tok, config = run.prep.tokenizer, run.engine.module.config

    def write_extras(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        tok.save_pretrained(folder)

    if run.teacher is not None:
        from pipeline.modeling.teacher import fingerprint

        # The frozen teacher must be exactly the initial encoder at every checkpoint.
        assert fingerprint(run.teacher.bert) == run.teacher_print, "the TaCL teacher's weights changed during training"
    client = {
        "step": run.step,
        "loader": run.loader.state_dict(),
        "skipped_micro_batches": run.skipped,
        "rng": distributed.all_gather_object(rng_states()),
        "world_size": distributed.world_size(),
        "teacher_fingerprint": run.teacher_print,
        "config": run.resolved,
    }
    return checkpoint.save(
        run.engine,
        save_dir=run.save_dir,
        step=run.step,
        client_state=client,
        keep=run.prep.cfg.run.keep_checkpoints,
        write_extras=write_extras,
        run_config=run.resolved,
    )


def resume(run: Run, path: Path) -> None:
    """Load the checkpoint at `path` into the engine and the run (every rank)."""
    client = checkpoint.load(run.engine, path)
    run.step, run.skipped = int(client["step"]), int(client.get("skipped_micro_batches", 0))
    run.loader.load_state_dict(client["loader"])
    if client.get("world_size") == distributed.world_size():
        set_rng_states(client["rng"][distributed.rank()])
    if run.teacher_print is not None and client.get("teacher_fingerprint") not in (None, run.teacher_print):
        cfg = run.prep.cfg
        raise UsageError(
            f"the TaCL teacher rebuilt from {cfg.model.init_from or cfg.model.model_config} differs "
            f"from the one this run started with; resume with the same --init_from/--model_config/--seed"
        )
    log.info(f"resumed from {path} at step {run.step}")
