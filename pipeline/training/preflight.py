"""Pre-flight: every check of a training job that needs neither a process group nor a device.

Batch identity for the world size, the data (missing, empty, mixed, corrupted), the objective
against the data, the tokenizer against the model and the shards, the sequence length against the
model's positions, and the run folder's resume state (a resumed run keeps the math it started
with). A bad job fails here in seconds, before any GPU time is spent, with a UsageError naming the
flag, file or value.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import distributed, objectives
from pipeline.data.shards import DataInfo, default_cache_root, inspect_data
from pipeline.training import checkpoint, log
from pipeline.training.config import TrainConfig, resume_changes
from pipeline.training.ds_config import load_ds_json, resolve_ds_config
from pipeline.training.tokenizer_identity import check_tokenizer_identity
from pipeline.training.wandb_sink import check_available as check_report_to
from preprocessing.errors import UsageError


@dataclass
class Prepared:
    """What `prepare` checked and resolved; `pipeline.training.trainer.train` runs it."""

    cfg: TrainConfig
    ds_config: dict[str, Any]
    data: DataInfo
    use_nsp: bool
    tokenizer: Any
    tokenizer_dir: str
    bert_config: Any
    world_size: int
    resume_from: Optional[tuple[int, Path]]
    resume_notes: list[str] = field(default_factory=list)  # allowed setting changes of a resumed run


def prepare(cfg: TrainConfig) -> Prepared:
    """Every check that needs neither a process group nor a device. Raises UsageError naming the
    flag, file or value."""
    from transformers import AutoTokenizer

    from pipeline.modeling.bert_config import bert_config, check_positions, check_vocab
    from pipeline.modeling.student import check_init_from

    check_report_to(cfg.run.report_to)
    check_save_dir(cfg.run.save_dir)
    world = distributed.launch_world_size()
    ds = resolve_ds_config(
        load_ds_json(cfg.run.ds_config), schedule=cfg.schedule, world_size=world, path=cfg.run.ds_config
    )
    cache_root = cfg.data.cache_dir or default_cache_root(cfg.run.save_dir)
    info = inspect_data(cfg.data.data, cache_root=cache_root, max_seq_len=cfg.data.max_seq_len)
    if info.verified_bytes:
        log.info(f"shards verified: {info.verified_bytes / 1e9:.3f} GB hashed (xxh64) in {info.verify_s:.1f} s")
    use_nsp = objectives.get(cfg.objective.objective).check_data(
        fmt=info.format, nsp=cfg.objective.nsp, paths=cfg.data.data
    )
    tok_dir = cfg.model.tokenizer or info.tokenizer_dir
    if tok_dir is None and cfg.model.init_from and (Path(cfg.model.init_from) / "vocab.txt").is_file():
        tok_dir = cfg.model.init_from
    if tok_dir is None:
        raise UsageError("no tokenizer: pass --tokenizer DIR (the shards' own DATA/tokenizer was not found)")
    if not Path(tok_dir).is_dir():
        raise UsageError(f"--tokenizer {tok_dir}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable folders
        raise UsageError(f"--tokenizer {tok_dir}: cannot load a tokenizer ({type(e).__name__}: {e})") from e
    for name in ("mask_token_id", "pad_token_id", "cls_token_id", "sep_token_id"):
        if getattr(tokenizer, name) is None:
            raise UsageError(
                f"--tokenizer {tok_dir}: no {name.replace('_id', '')}; a BERT tokenizer needs [PAD] [CLS] [SEP] [MASK]"
            )
    if cfg.model.init_from:
        source = f"--init_from {cfg.model.init_from}"
        bcfg = check_init_from(cfg.model.init_from)
    else:
        source = f"--model_config {cfg.model.model_config}"
        bcfg = bert_config(cfg.model.model_config, vocab_size=len(tokenizer))
    allow_mismatch = cfg.model.allow_tokenizer_mismatch
    check_vocab(
        model_vocab=bcfg.vocab_size,
        tokenizer_size=len(tokenizer),
        tokenizer_dir=tok_dir,
        # The shards' size is part of the tokenizer's identity, which the escape hatch lets differ.
        data_vocab=None if allow_mismatch else info.manifest_vocab_size,
        model_source=source,
    )
    check_tokenizer_identity(
        info,
        tokenizer_dir=tok_dir,
        tokenizer_flag=cfg.model.tokenizer,
        init_from=cfg.model.init_from,
        allow=allow_mismatch,
    )
    check_positions(max_seq_len=info.max_seq_len, config=bcfg, model_source=source)
    # The student's attention dropout is the run's knob, whatever the preset or folder says (0 by
    # default: the fused attention kernels have none); RUN/config.json and the export record it.
    bcfg.attention_probs_dropout_prob = cfg.model.attention_dropout
    found = checkpoint.latest_checkpoint(cfg.run.save_dir)
    if found and cfg.run.resume == "none":
        raise UsageError(
            f"--save_dir {cfg.run.save_dir} already holds checkpoint {found[1].name}: pass --resume auto "
            f"to continue it, or choose a new --save_dir"
        )
    # A checkpoint file is opened weights-only before anything unpickles it (a crafted one is refused).
    resume_from = checkpoint.loadable_checkpoint(cfg.run.save_dir) if found and cfg.run.resume == "auto" else None
    notes = check_resume(cfg, ds=ds, world_size=world, checkpoint_dir=resume_from[1]) if resume_from else []
    return Prepared(
        cfg=cfg,
        ds_config=ds,
        data=info,
        use_nsp=use_nsp,
        tokenizer=tokenizer,
        tokenizer_dir=tok_dir,
        bert_config=bcfg,
        world_size=world,
        resume_from=resume_from,
        resume_notes=notes,
    )


def check_save_dir(save_dir: str) -> None:
    """--save_dir must be a folder this process can write (or create): found now, not at the first
    checkpoint an hour in. A probe file is created and removed."""
    path = Path(save_dir)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise UsageError(f"--save_dir {save_dir} {what}; pass a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".tokencl-probe-"):
            pass
    except OSError as e:
        raise UsageError(
            f"--save_dir {save_dir}: cannot write in {existing} ({e.strerror}); pass a writable folder"
        ) from None


def check_resume(cfg: TrainConfig, *, ds: dict[str, Any], world_size: int, checkpoint_dir: Path) -> list[str]:
    """Refuse to resume a checkpoint with settings that change what the run computes (model, objective
    and its knobs, data and weights, tokenizer, seed, schedule, the DeepSpeed JSON's batch and precision,
    the world size). Returns a line per allowed change (intervals, export dir, ...) to record."""
    saved = checkpoint.saved_config(checkpoint_dir)
    if saved is None:  # a checkpoint of an older version: nothing to compare with
        return []
    where = f"--resume auto from {checkpoint_dir}"
    saved_world = saved.get("engine", {}).get("world_size")
    if saved_world is not None and saved_world != world_size:
        raise UsageError(
            f"{where}: the run was trained on {saved_world} rank(s), this launch has {world_size}; "
            f"resume with {saved_world} ranks (the optimizer shards and the data order are per rank), "
            f"or start a new --save_dir"
        )
    math, allowed = resume_changes(saved, cfg)
    math.update(_deepspeed_changes(saved.get("deepspeed"), ds))
    if math:
        listing = "; ".join(f"{key}: saved {before!r}, now {after!r}" for key, (before, after) in sorted(math.items()))
        hint = " (a longer --max_steps needs --extend_schedule)" if "schedule.max_steps" in math else ""
        raise UsageError(
            f"{where}: these settings differ from the run's and would change what it computes: "
            f"{listing}{hint}; resume with the saved values or start a new --save_dir"
        )
    return [f"resume: {key} {before!r} -> {after!r}" for key, (before, after) in sorted(allowed.items())]


# Filled from --lr/--warmup_steps/--max_steps (compared as those knobs), not owned by the JSON.
_SCHEDULE_FILLED = {
    ("optimizer", "params", "lr"),
    ("scheduler", "params", "warmup_max_lr"),
    ("scheduler", "params", "warmup_num_steps"),
    ("scheduler", "params", "total_num_steps"),
}


# DeepSpeed settings that change speed, memory or logging but not the numbers a step computes.
_DEEPSPEED_OPERATIONAL = (
    "steps_per_print",
    "wall_clock_breakdown",
    "comms_logger",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "timers",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.allgather_partitions",
    "zero_optimization.reduce_scatter",
)


def _deepspeed_changes(saved: Optional[dict], now: dict) -> dict[str, tuple]:
    if saved is None:
        return {}
    flat_saved, flat_now = _flatten(saved), _flatten(now)
    changed = {}
    for k in sorted(set(flat_saved) | set(flat_now)):
        name = ".".join(k)
        if k in _SCHEDULE_FILLED or name.startswith(_DEEPSPEED_OPERATIONAL) or flat_saved.get(k) == flat_now.get(k):
            continue
        changed[f"deepspeed.{name}"] = (flat_saved.get(k), flat_now.get(k))
    return changed


def _flatten(d: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out
