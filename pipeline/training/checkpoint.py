"""Checkpoints: DeepSpeed's `save_checkpoint` / `load_checkpoint` under RUN/checkpoints/, made safe
against a job dying mid-save.

Layout: RUN/checkpoints/step_00001000/ holds DeepSpeed's files (model states with the client state,
per-rank ZeRO optimizer shards), `hf/` (the student's BertConfig and the tokenizer, so that
pipeline.export needs nothing else) and `complete.json`, written last. `run_config.json` is the run's
configuration at that step (what a resume is checked against). RUN/checkpoints/latest names the newest
complete tag. A checkpoint without `complete.json` never counts: `latest` moves, and old checkpoints are
pruned, only after every rank has finished writing. RUN/checkpoints/last_finite names the newest
checkpoint saved after an interval without a non-finite loss (the fall-back when the loss diverges,
`--resume last_finite`), and RUN/checkpoints/best the one with the lowest held-out MLM loss
(--keep_best); pruning keeps both.

Nothing in a run folder unpickles. DeepSpeed copies its `zero_to_fp32.py` / `zero_to_torch.py` into
RUN/checkpoints at every save; they unpickle with `torch.load(weights_only=False)`, so running them on
a checkpoint from elsewhere could run anything. They are removed after each save and
RUN/checkpoints/export_hf.py is written in their place: it runs pipeline/export.py (weights-only).

Loading never runs code. DeepSpeed unpickles its files with `torch.load(weights_only=False)`, so a
crafted `.pt` could run anything it names. Every load of ours, DeepSpeed's included, happens inside
`weights_only_loads()`: torch's weights-only unpickler (forced through TORCH_FORCE_WEIGHTS_ONLY_LOAD,
which overrides DeepSpeed's explicit False) with an allow-list of the few DeepSpeed types a checkpoint
of ours holds. `verify_loadable` opens every file that way first, so a refusal names the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from pipeline import distributed
from pipeline.training import log
from preprocessing.errors import UsageError

CHECKPOINTS = "checkpoints"
MARKER = "complete.json"
LATEST = "latest"
LAST_FINITE = "last_finite"
BEST = "best"  # --keep_best: the checkpoint with the lowest eval/mlm_loss (BEST_RECORD holds the value)
BEST_RECORD = "best.json"
EXPORT_SCRIPT = "export_hf.py"
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
    named = _named(checkpoints_dir(save_dir), LATEST)
    if named is not None:
        return named
    done = list_checkpoints(save_dir)
    return done[-1] if done else None


def last_finite_checkpoint(save_dir: str | Path) -> Optional[tuple[int, Path]]:
    """The complete checkpoint RUN/checkpoints/last_finite names, or None."""
    return _named(checkpoints_dir(save_dir), LAST_FINITE)


def best_checkpoint(save_dir: str | Path) -> Optional[tuple[int, Path]]:
    """The complete checkpoint RUN/checkpoints/best names (--keep_best), or None."""
    return _named(checkpoints_dir(save_dir), BEST)


def best_value(save_dir: str | Path) -> Optional[float]:
    """The eval/mlm_loss of the best checkpoint, while that checkpoint still exists."""
    if best_checkpoint(save_dir) is None:
        return None
    try:
        return float(json.loads((checkpoints_dir(save_dir) / BEST_RECORD).read_text())["eval/mlm_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_best(save_dir: str | Path, *, step: int, value: float) -> None:
    """Name the complete checkpoint of `step` as the best (rank 0; pruning keeps it)."""
    root = checkpoints_dir(save_dir)
    _write_atomic(root / BEST_RECORD, json.dumps({"step": step, "eval/mlm_loss": value}) + "\n")
    _write_atomic(root / BEST, tag_for(step) + "\n")


def _named(root: Path, pointer: str) -> Optional[tuple[int, Path]]:
    """(step, folder) of the complete checkpoint a pointer file (latest, last_finite) names, or None."""
    file = root / pointer
    if not file.is_file():
        return None
    tag = file.read_text().strip()
    m = _TAG_RE.match(tag)
    return (int(m.group(1)), root / tag) if m and is_complete(root / tag) else None


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
    # Every rank decides together: one that stopped here alone would leave the others in a collective.
    # (The gather is also the barrier after rank 0's clean-up above.)
    short = space_shortfall(root, need_bytes=previous_size(save_dir))
    if any(r[0] for r in distributed.all_gather_ints([1 if short else 0])):
        raise CheckpointSpaceError(
            f"not enough space to save checkpoint {path}: {short or 'a rank found its disk short'}; "
            f"{_kept(save_dir)}: free space (or lower --keep_checkpoints) and resume with --resume auto"
        )
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
        if distributed.is_main():
            replace_recovery_scripts(root)
            write_extras(path / HF_SUBDIR)
            _write_atomic(path / RUN_CONFIG, json.dumps(run_config, indent=2, default=str) + "\n")
    except (OSError, RuntimeError) as e:
        if not is_out_of_space(e):
            raise
        where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
        raise CheckpointSpaceError(
            f"no space left on the device (ENOSPC) while writing checkpoint {path}{where}; it stays "
            f"incomplete and is never used; {_kept(save_dir)}: free space and resume with --resume auto"
        ) from e
    # Every rank's optimizer shard is on disk before the checkpoint is declared complete.
    distributed.barrier()
    if distributed.is_main():
        skipped = client_state.get("skipped_micro_batches")
        finite = _finite_since_previous(root, step=step, skipped=skipped)
        _write_atomic(path / MARKER, json.dumps({"step": step, "tag": tag, "skipped_micro_batches": skipped}) + "\n")
        _write_atomic(root / LATEST, tag + "\n")
        if finite:
            _write_atomic(root / LAST_FINITE, tag + "\n")
        _prune(root, keep=keep, newest=step)
    distributed.barrier()
    return path


def _finite_since_previous(root: Path, *, step: int, skipped: Optional[int]) -> bool:
    """Whether no micro-batch was skipped as non-finite since the newest complete checkpoint before
    `step` (or since the run began, before the first): its skipped count (in its marker) is the
    run's count now. Unknown for a marker of an older version: False."""
    before = [p for s, p in list_checkpoints(root.parent) if s < step]
    if not before:
        return skipped == 0
    try:
        previous = json.loads((before[-1] / MARKER).read_text()).get("skipped_micro_batches")
    except (OSError, json.JSONDecodeError):
        return False
    return previous is not None and previous == skipped


def replace_recovery_scripts(root: Path) -> None:
    """Remove DeepSpeed's zero_to_*.py from RUN/checkpoints (and from any checkpoint folder: where
    other DeepSpeed versions put them); they unpickle with weights_only=False. EXPORT_SCRIPT, which
    consolidates weights-only, takes their place."""
    for script in [*root.glob("zero_to_*.py"), *root.glob("step_*/zero_to_*.py")]:
        script.unlink(missing_ok=True)
    if not (root / EXPORT_SCRIPT).is_file():
        _write_atomic(root / EXPORT_SCRIPT, _EXPORT_SCRIPT.format(repo=str(Path(__file__).resolve().parents[2])))


_EXPORT_SCRIPT = '''#!/usr/bin/env python
"""Consolidate a checkpoint of this folder into a Hugging Face folder (fp32 weights, config, tokenizer):

    python export_hf.py OUT_DIR [step_XXXXXXXX]    (default: the checkpoint `latest` names)

It runs {repo}/pipeline/export.py --checkpoint THIS_FOLDER/step_XXXXXXXX --out OUT_DIR, which loads
every file weights-only (tensors and DeepSpeed's plain data types; a file holding anything else is
refused). DeepSpeed's zero_to_fp32.py was removed from here: it unpickles with weights_only=False.
"""
import subprocess
import sys
from pathlib import Path

if len(sys.argv) not in (2, 3):
    sys.exit(__doc__)
here = Path(__file__).resolve().parent
tag = sys.argv[2] if len(sys.argv) == 3 else (here / "latest").read_text().strip()
export = Path({repo!r}) / "pipeline" / "export.py"
sys.exit(subprocess.call([sys.executable, str(export), "--checkpoint", str(here / tag), "--out", sys.argv[1]]))
'''


class CheckpointSpaceError(UsageError):
    """The disk cannot hold the next checkpoint (checked before writing, or ENOSPC while writing)."""


def previous_size(save_dir: str | Path) -> int:
    """Bytes of the newest complete checkpoint: what the next one needs (0 before the first)."""
    from pipeline.training.reshard import RESHARDED_PREFIX

    found = latest_checkpoint(save_dir)
    if found is None:
        return 0
    # Not a copy resharded for another world size (pipeline.training.reshard), left by a job that died.
    files = [f for f in found[1].rglob("*") if RESHARDED_PREFIX not in f.relative_to(found[1]).parts[0]]
    return sum(f.stat().st_size for f in files if f.is_file())


def space_shortfall(folder: Path, *, need_bytes: int) -> str:
    """'' when the file system of `folder` has `need_bytes` free, else what is short, in words."""
    while not folder.exists() and folder != folder.parent:  # not created yet (on another node's rank 0)
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free >= need_bytes:
        return ""
    return f"it needs about {need_bytes / 1e9:.3f} GB (the size of the last one), {free / 1e9:.3f} GB are free there"


def is_out_of_space(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, as an OSError or as the RuntimeError torch.save turns it into."""
    import errno

    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    # torch.save's writer reports a short write as "unexpected pos" (or "file write failed").
    text = str(e)
    return any(m in text for m in ("No space left on device", "file write failed", "unexpected pos"))


def _kept(save_dir: str | Path) -> str:
    found = latest_checkpoint(save_dir)
    return f"the last complete checkpoint, {found[1]}, is kept" if found else "no checkpoint was saved before"


def _prune(root: Path, *, keep: int, newest: int) -> None:
    """Keep the newest `keep` complete checkpoints up to `newest`, and the ones last_finite and best name.
    Checkpoints after `newest` belong to a trajectory the run abandoned when it resumed from an
    earlier checkpoint (--resume last_finite): removed, so that they never count as newer."""
    kept = {last_finite_checkpoint(root.parent), best_checkpoint(root.parent)}
    complete = list_checkpoints(root.parent)
    for step, p in complete:
        if step > newest:
            log.info(f"removing checkpoint {p.name}: this run resumed from an earlier one and saved step {newest}")
            shutil.rmtree(p, ignore_errors=True)
    current = [c for c in complete if c[0] <= newest]
    for c in current[:-keep]:
        if c not in kept:
            shutil.rmtree(c[1], ignore_errors=True)
    # Incomplete folders older than the newest checkpoint are failed saves.
    for p in root.iterdir():
        m = _TAG_RE.match(p.name)
        if m and p.is_dir() and not is_complete(p) and int(m.group(1)) < newest:
            shutil.rmtree(p, ignore_errors=True)


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_TORCH_TRUE = ("1", "y", "yes", "true")  # what torch.load counts as set
_GLOBAL_RE = re.compile(r"GLOBAL (\S+)")


class CheckpointRefused(UsageError):
    """A checkpoint file holds a type that no checkpoint of ours holds: loading it could run code."""


class CheckpointUnreadable(UsageError):
    """A checkpoint file cannot be read at all (truncated, not a torch file)."""


def _allowed_types() -> list[Any]:
    # The only non-tensor, non-builtin types DeepSpeed's ZeRO-2 files hold (its optimizer state:
    # the loss scaler, the ZeRO stage, parameter fragment addresses); plain data classes. Our own
    # client state is builtins and tensors only (pipeline.training.state keeps numpy out of it).
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside unpickles tensors, builtins and `_allowed_types` only, whatever its
    caller passes (DeepSpeed passes weights_only=False)."""
    import torch

    check_weights_only_env()
    before = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(_allowed_types()):
            yield
    finally:
        if before is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = before


def check_weights_only_env() -> None:
    """UsageError when the environment forbids weights-only loads: torch refuses every load while
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD and TORCH_FORCE_WEIGHTS_ONLY_LOAD (which our loads set) are both
    on, and every good checkpoint would then look unreadable."""
    value = os.environ.get(_FORCE_NO_WEIGHTS_ONLY, "")
    if value.lower() in _TORCH_TRUE:
        raise UsageError(
            f"{_FORCE_NO_WEIGHTS_ONLY}={value} is set in the environment: it forbids the weights-only loads every "
            f"checkpoint load of this pipeline makes (a checkpoint must not run code); unset it"
        )


def verify_loadable(path: Path) -> None:
    """Open every .pt file of checkpoint folder `path` weights-only (tensors memory-mapped, not read)
    before anything else unpickles it. Raises CheckpointRefused naming the file and the type it would
    have loaded, or CheckpointUnreadable for a truncated or foreign file."""
    import torch

    for f in sorted(path.glob("*.pt")):
        try:
            with weights_only_loads():
                torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
        except pickle.UnpicklingError as e:
            m = _GLOBAL_RE.search(str(e))
            if m is None:  # not a refused type: a file that is not a pickle at all
                raise CheckpointUnreadable(f"checkpoint file {f} is unreadable ({_first_line(e)})") from e
            what = m.group(1)
            raise CheckpointRefused(
                f"checkpoint file {f} holds {what}, which no checkpoint written by this pipeline holds: "
                f"refusing to load it (unpickling it could run code). Load only checkpoints you trust, "
                f"written by pipeline/train.py"
            ) from None
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            raise CheckpointUnreadable(f"checkpoint file {f} is unreadable ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    # torch's messages run on for sentences; the first one says what happened.
    return line.split(". ")[0][:200]


def loadable_checkpoint(save_dir: str | Path) -> Optional[tuple[int, Path]]:
    """What `--resume auto` continues from: the checkpoint `latest_checkpoint` picks, or, when one of
    its files is unreadable (a truncated write that still got its marker, a disk error), the newest
    older complete checkpoint that reads, with a warning. A refused (crafted) file is never skipped."""
    found = latest_checkpoint(save_dir)
    if found is None:
        return None
    candidates = [c for c in reversed(list_checkpoints(save_dir)) if c[0] <= found[0]]
    error: Optional[CheckpointUnreadable] = None
    for step, path in candidates:
        try:
            verify_loadable(path)
        except CheckpointUnreadable as e:
            log.warning(f"{e}; trying the previous complete checkpoint")
            error = error or e
            continue
        if error is not None:
            log.warning(f"resuming from {path.name} instead (step {step})")
        return step, path
    assert error is not None
    raise CheckpointUnreadable(f"{error}; no older complete checkpoint reads either: start a new --save_dir")


def load(engine: Any, path: Path, *, scheduler: bool = True) -> dict[str, Any]:
    """Load a complete checkpoint into the engine (weights, optimizer, and the scheduler unless not
    `scheduler`: a new phase keeps its own) on every rank; returns the client state. Weights-only,
    files verified first. A checkpoint written by another number of ranks is loaded from a copy of its
    ZeRO state split for this one (pipeline.training.reshard)."""
    if not is_complete(path):
        raise UsageError(f"checkpoint {path} is incomplete (no {MARKER}); it cannot be resumed")
    from pipeline.training import reshard

    verify_loadable(path)
    folder = path
    world = distributed.world_size()
    if reshard.saved_world(path) not in (None, world):
        # Written by another number of ranks: DeepSpeed loads only ZeRO state split for this one.
        folder = reshard.resharded(path, world=world, sizes=reshard.engine_partition_sizes(engine))
    with weights_only_loads():
        loaded, client_state = engine.load_checkpoint(
            str(folder.parent), tag=folder.name, load_optimizer_states=True, load_lr_scheduler_states=scheduler
        )
    if loaded is None:
        raise UsageError(f"DeepSpeed could not load checkpoint {path}")
    if folder != path:
        reshard.remove(folder)
    _apply_scheduler_lr(engine)
    return client_state


def _apply_scheduler_lr(engine: Any) -> None:
    """Set the optimizer's rates to what this job's scheduler gives at the loaded step. The loaded
    optimizer state carries the rate of the run's own schedule for its next step: the same number
    when the schedule is unchanged, the old one for a step after --allow_schedule_change."""
    import warnings

    sched = getattr(engine, "lr_scheduler", None)
    if sched is None or not hasattr(sched, "get_lr"):
        return
    with warnings.catch_warnings():  # torch's schedulers warn when get_lr is called outside step()
        warnings.simplefilter("ignore")
        rates = sched.get_lr()
    for group, lr in zip(sched.optimizer.param_groups, rates):
        group["lr"] = lr


def saved_config(path: Path) -> Optional[dict[str, Any]]:
    """The configuration a complete checkpoint was saved with: its run_config.json, else the copy in
    its client state (the model states file, opened weights-only), else None."""
    file = path / RUN_CONFIG
    if not file.is_file():
        return _client_config(path)
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{file}: unreadable ({e}); resume from another checkpoint or start a new --save_dir") from e


def _client_config(path: Path) -> Optional[dict[str, Any]]:
    import torch

    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    if not files:
        return None
    try:
        with weights_only_loads():  # tensors memory-mapped, not read
            states = torch.load(files[0], map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(files[0]))
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointUnreadable(f"checkpoint file {files[0]} is unreadable ({_first_line(e)})") from e
    config = states.get("config") if isinstance(states, dict) else None
    # As run_config.json holds it: JSON's types (the BertConfig's int label ids become strings).
    return json.loads(json.dumps(config, default=str)) if isinstance(config, dict) else None


def fallback_advice(save_dir: str | Path, *, lr: float) -> str:
    """What to do after the loss stayed non-finite: the flags that resume from the last checkpoint
    saved before it did, at a lower rate, or, without one, a new start."""
    found = last_finite_checkpoint(save_dir)
    if found is None:
        return (
            f"No checkpoint was saved before the loss went non-finite: start again in a new --save_dir with a "
            f"lower --lr (e.g. {lr / 10:g}), or check the data"
        )
    return (
        f"The last checkpoint saved before it went non-finite is {found[1]} (step {found[0]}, "
        f"{checkpoints_dir(save_dir) / LAST_FINITE}{_losses(save_dir, found[0])}); resume from it at a lower rate: "
        f"rerun the same command with --resume last_finite --lr {lr / 10:g} --allow_schedule_change"
    )


def _losses(save_dir: str | Path, step: int) -> str:
    """ ", loss L at that step, F at step 1" from RUN/metrics.jsonl, to tell a fall-back whose weights
    had already diverged (finite but huge losses) from a sound one; "" where the file lacks them."""
    try:
        lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
        losses = {r["step"]: r.get("loss") for r in map(json.loads, lines) if isinstance(r, dict) and "step" in r}
    except (OSError, ValueError):
        return ""
    at, first = losses.get(step), losses.get(min(losses, default=0))
    if not isinstance(at, float) or not isinstance(first, float):
        return ""
    return f", loss {at:.4g} at that step, {first:.4g} at step {min(losses)}"
