"""Checkpoints: DeepSpeed's `save_checkpoint` / `load_checkpoint` under RUN/checkpoints/, made safe
against a job dying mid-save.

Layout: RUN/checkpoints/step_00001000/ holds DeepSpeed's files (model states with the client state,
per-rank ZeRO optimizer shards), `hf/` (the student's BertConfig and the tokenizer, so that
pipeline.export needs nothing else) and `complete.json`, written last. `run_config.json` is the run's
configuration at that step (what a resume is checked against). RUN/checkpoints/latest names the newest
complete tag. A checkpoint without `complete.json` never counts: `latest` moves, and old checkpoints are
pruned, only after every rank has finished writing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from pipeline import distributed
from preprocessing.errors import UsageError

CHECKPOINTS = "checkpoints"
MARKER = "complete.json"
LATEST = "latest"
HF_SUBDIR = "hf"
RUN_CONFIG = "run_config.json"
_TAG_RE = re.compile(r"^step_(\d{8,})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(save_dir: str | Path) -> Path:
    return Path(save_dir) / CHECKPOINTS


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def list_checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run, as (step, checkpoint dir), oldest first."""
    root = checkpoints_dir(save_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _TAG_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(save_dir: str | Path) -> Optional[tuple[int, Path]]:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = checkpoints_dir(save_dir)
    latest = root / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        m = _TAG_RE.match(tag)
        if m and is_complete(root / tag):
            return int(m.group(1)), root / tag
    done = list_checkpoints(save_dir)
    return done[-1] if done else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(
    engine: Any,
    *,
    save_dir: str | Path,
    step: int,
    client_state: dict[str, Any],
    keep: int,
    write_extras: Callable[[Path], None],
    run_config: dict[str, Any],
) -> Path:
    """Save on every rank (a collective); rank 0 then writes `write_extras(ckpt/hf)`, `run_config`
    as run_config.json, the marker and `latest`, and prunes all but the newest `keep` complete
    checkpoints. Returns the folder."""
    root = checkpoints_dir(save_dir)
    tag = tag_for(step)
    path = root / tag
    if distributed.is_main():
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # left by a save that died (never complete: saves happen once per step)
            shutil.rmtree(path)
    distributed.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    if distributed.is_main():
        write_extras(path / HF_SUBDIR)
        _write_atomic(path / RUN_CONFIG, json.dumps(run_config, indent=2, default=str) + "\n")
    # Every rank's optimizer shard is on disk before the checkpoint is declared complete.
    distributed.barrier()
    if distributed.is_main():
        _write_atomic(path / MARKER, json.dumps({"step": step, "tag": tag}) + "\n")
        _write_atomic(root / LATEST, tag + "\n")
        _prune(root, keep=keep, newest=step)
    distributed.barrier()
    return path


def _prune(root: Path, *, keep: int, newest: int) -> None:
    complete = list_checkpoints(root.parent)
    for _, p in complete[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    # Incomplete folders older than the newest checkpoint are failed saves.
    for p in root.iterdir():
        m = _TAG_RE.match(p.name)
        if m and p.is_dir() and not is_complete(p) and int(m.group(1)) < newest:
            shutil.rmtree(p, ignore_errors=True)


def load(engine: Any, path: Path) -> dict[str, Any]:
    """Load a complete checkpoint into the engine (weights, optimizer, scheduler) on every rank;
    returns the client state."""
    if not is_complete(path):
        raise UsageError(f"checkpoint {path} is incomplete (no {MARKER}); it cannot be resumed")
    loaded, client_state = engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise UsageError(f"DeepSpeed could not load checkpoint {path}")
    return client_state


def saved_config(path: Path) -> Optional[dict[str, Any]]:
    """The configuration a complete checkpoint was saved with (its run_config.json), or None for a
    checkpoint written before checkpoints carried one."""
    file = path / RUN_CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{file}: unreadable ({e}); resume from another checkpoint or start a new --save_dir") from e
