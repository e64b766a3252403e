"""Pre-flight: every check of a training job that needs neither a process group nor a device.

Batch identity for the world size, the data (missing, empty, mixed, corrupted), the objective
against the data, the tokenizer against the model and the shards, the sequence length against the
model's positions, the environment (precision the device supports, weights-only loads allowed), and
the run folder's resume state: a resumed run keeps the math it started with, compared by content
(the shards' identity, the resolved model config), not by how a path is spelled. A bad job fails
here in seconds, before any GPU time is spent, with a UsageError naming the flag, file or value.

`run_folder` holds RUN/.train.lock (the builder's lock, preprocessing.lock) on rank 0 from before
pre-flight to the end of the run: a second training into the same --save_dir exits 2 naming the first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import distributed, objectives
from pipeline.data.shards import DataInfo, default_cache_root, inspect_data
from pipeline.training import checkpoint, log
from pipeline.training.config import TrainConfig, resume_changes, schedule_hints
from pipeline.training.ds_config import batch_shape, load_ds_json, resolve_ds_config
from pipeline.training.tokenizer_identity import check_tokenizer_identity
from pipeline.training.wandb_sink import check_available as check_report_to
from preprocessing.errors import UsageError
from preprocessing.lock import output_lock
from preprocessing.shard_format import EVAL_DIR, INDEX, vocabulary_of

RUN_LOCK = ".train.lock"


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
    identity: dict[str, Any] = field(default_factory=dict)  # what the run trains on, by content (`content_identity`)
    # The held-out shard folders by name (--eval_data, `held_out_data`); empty: no evaluation.
    eval_sets: dict[str, DataInfo] = field(default_factory=dict)
    phase: dict[str, Any] = field(default_factory=dict)  # `phase_record`: which phase of a training this run is


def prepare(cfg: TrainConfig) -> Prepared:
    """Every check that needs neither a process group nor a device. Raises UsageError naming the
    flag, file or value."""
    check_report_to(cfg.run.report_to)
    check_save_dir(cfg.run.save_dir)
    world = distributed.launch_world_size()
    ds = resolve_ds_config(
        load_ds_json(cfg.run.ds_config), schedule=cfg.schedule, world_size=world, path=cfg.run.ds_config
    )
    check_environment(cfg, ds=ds)
    cache_root = cfg.data.cache_dir or default_cache_root(cfg.run.save_dir)
    info = inspect_data(cfg.data.data, cache_root=cache_root, max_seq_len=cfg.data.max_seq_len)
    if info.verified_bytes:
        log.info(f"shards verified: {info.verified_bytes / 1e9:.3f} GB hashed (xxh64) in {info.verify_s:.1f} s")
    use_nsp = objectives.get(cfg.objective.objective).check_data(
        fmt=info.format, nsp=cfg.objective.nsp, paths=cfg.data.data
    )
    eval_info = held_out_data(cfg, info, cache_root=cache_root, world_size=world)
    tok_dir, tokenizer = load_tokenizer(cfg, info)
    bcfg = model_config(cfg, info, tokenizer=tokenizer, tokenizer_dir=tok_dir)
    identity = content_identity(info, tokenizer)
    resume_from = resume_point(cfg)
    notes = []
    if resume_from:
        notes = check_resume(
            cfg,
            ds=ds,
            world_size=world,
            checkpoint_dir=resume_from[1],
            step=resume_from[0],
            identity=identity,
            bert_config=bcfg.to_dict(),
        )
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
        identity=identity,
        eval_sets=eval_info,
        phase=phase_record(cfg),
    )


def held_out_data(cfg: TrainConfig, info: DataInfo, *, cache_root: str, world_size: int) -> dict[str, DataInfo]:
    """The held-out shard folders the run evaluates on, by name (`eval_folder_names`): --eval_data, else
    each local --data folder's eval/ (build_shards.py --eval_share); none when evaluation is off or
    there is no such folder (said once). Each must hold what the training data holds (the same format
    and vocabulary) and a sample for every rank."""
    e = cfg.eval
    if not e.eval_every:
        return {}
    paths = list(e.eval_data) or [
        str(Path(d) / EVAL_DIR) for d in cfg.data.data if "://" not in d and (Path(d) / EVAL_DIR / INDEX).is_file()
    ]
    if not paths:
        log.info(
            "no held-out data (no --eval_data, and no --data folder holds an eval/ split): no evaluation; "
            "build shards with --eval_share to have one"
        )
        return {}
    train_vocab = {s.manifest.vocab_fingerprint for s in info.sources if s.manifest}
    sets = {}
    for name, path in eval_folder_names(paths):
        held = inspect_data([path], cache_root=str(Path(cache_root) / "eval"), max_seq_len=info.max_seq_len)
        where = f"--eval_data {path}"
        if held.format != info.format:
            raise UsageError(f"{where} holds {held.format} shards but --data holds {info.format} shards: use "
                             f"held-out shards of the training data's format")  # fmt: skip
        held_vocab = {s.manifest.vocab_fingerprint for s in held.sources if s.manifest}
        if train_vocab and held_vocab and train_vocab != held_vocab:
            raise UsageError(f"{where} was built with another tokenizer than --data (vocabulary fingerprints "
                             f"differ); use the held-out split of the same build")  # fmt: skip
        if held.samples < world_size:
            raise UsageError(f"{where} holds {held.samples} samples for {world_size} ranks: every rank needs one")
        sets[name] = held
    return sets


_EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def eval_folder_names(values: list[str]) -> list[tuple[str, str]]:
    """(name, folder) of each --eval_data value, the names of its eval/NAME/... fields: NAME=DIR names
    its folder; otherwise the folder's own name (a build's eval/ split: the build's name). A name that
    several folders share is followed by each one's position (1, 2, ...)."""
    pairs = []
    for value in values:
        name, sep, folder = value.partition("=")
        if sep and folder and _EVAL_NAME.fullmatch(name):
            pairs.append((name, folder))
            continue
        path = Path(value.rstrip("/"))
        pairs.append((path.parent.name if path.name == EVAL_DIR else path.name, value))
    taken = [name for name, _ in pairs]
    return [(f"{n}_{i}" if taken.count(n) > 1 else n, f) for i, (n, f) in enumerate(pairs, 1)]


def load_tokenizer(cfg: TrainConfig, info: DataInfo) -> tuple[str, Any]:
    """(the tokenizer folder of the job, the loaded tokenizer): --tokenizer, else the shards' own,
    else --init_from's. UsageError for a missing, unloadable or non-BERT tokenizer."""
    from transformers import AutoTokenizer

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
    return tok_dir, tokenizer


def model_config(cfg: TrainConfig, info: DataInfo, *, tokenizer: Any, tokenizer_dir: str) -> Any:
    """The student's BertConfig (--init_from's, or --model_config's with the tokenizer's vocabulary),
    checked against the tokenizer (size and identity) and the shards (vocabulary, length)."""
    from pipeline.modeling.bert_config import bert_config, check_positions, check_vocab
    from pipeline.modeling.student import check_init_from

    tokenizer_origin = cfg.model.init_from
    if cfg.model.continue_from:
        from transformers import BertConfig

        folder = phase_source(cfg.model.continue_from)[1] / checkpoint.HF_SUBDIR
        source, tokenizer_origin = f"--continue_from {cfg.model.continue_from}", str(folder)
        bcfg = BertConfig.from_pretrained(folder)
    elif cfg.model.init_from:
        source = f"--init_from {cfg.model.init_from}"
        bcfg = check_init_from(cfg.model.init_from)
    else:
        source = f"--model_config {cfg.model.model_config}"
        bcfg = bert_config(cfg.model.model_config, vocab_size=len(tokenizer))
    allow_mismatch = cfg.model.allow_tokenizer_mismatch
    check_vocab(
        model_vocab=bcfg.vocab_size,
        tokenizer_size=len(tokenizer),
        tokenizer_dir=tokenizer_dir,
        # The shards' size is part of the tokenizer's identity, which the escape hatch lets differ.
        data_vocab=None if allow_mismatch else info.manifest_vocab_size,
        model_source=source,
    )
    check_tokenizer_identity(
        info,
        tokenizer_dir=tokenizer_dir,
        tokenizer_flag=cfg.model.tokenizer,
        init_from=tokenizer_origin,
        allow=allow_mismatch,
    )
    # A phase at a longer length (--continue_from onto 512-token shards) needs the positions for it.
    check_positions(max_seq_len=info.max_seq_len, config=bcfg, model_source=source)
    # The student's attention dropout is the run's knob, whatever the preset or folder says (0 by
    # default: the fused attention kernels have none); RUN/config.json and the export record it.
    bcfg.attention_probs_dropout_prob = cfg.model.attention_dropout
    return bcfg


def check_environment(cfg: TrainConfig, *, ds: dict[str, Any]) -> None:
    """What the job's surroundings must allow: weights-only checkpoint loads (resume, export), the
    DeepSpeed JSON's precision on this device, and output folders that are not the model it starts
    from."""
    checkpoint.check_weights_only_env()
    if (ds.get("fp16") or {}).get("enabled"):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if not accelerator.is_fp16_supported():
            raise UsageError(
                f"--ds_config {cfg.run.ds_config}: fp16 is enabled, which DeepSpeed's {accelerator.device_name()} "
                f"accelerator does not support here; set fp16.enabled to false (bf16, or fp32: "
                f"deepspeed_configs/demo.json)"
            )
    if cfg.model.init_from:
        source = Path(cfg.model.init_from).resolve()
        for flag, folder in (("--save_dir", cfg.run.save_dir), ("--export_dir", cfg.run.export_dir)):
            if folder and Path(folder).resolve() == source:
                raise UsageError(
                    f"{flag} {folder} is the --init_from folder: the run would overwrite the model it starts from "
                    f"(its config.json and weights); choose another {flag}"
                )


def content_identity(info: DataInfo, tokenizer: Any) -> dict[str, Any]:
    """What the run trains on, by content rather than by path: for each --data source its sample
    count, the sha256 of its index.json (every shard's size and xxh64) and the vocabulary
    fingerprint its manifest records; and the fingerprint of the tokenizer the job loads."""
    sources = []
    for s in info.sources:
        index = hashlib.sha256((Path(s.local) / INDEX).read_bytes()).hexdigest()
        vocab = s.manifest.vocab_fingerprint if s.manifest else None
        sources.append({"samples": s.samples, "index_sha256": index, "vocabulary": vocab})
    return {"data": sources, "tokenizer": vocabulary_of(tokenizer).fingerprint}


def phase_source(spec: str) -> tuple[int, Path]:
    """(step, folder) of the checkpoint --continue_from names: a checkpoint folder, or a run folder's
    newest complete one that reads (weights-only, like every load). UsageError naming the flag."""
    path = Path(spec)
    if checkpoint.is_complete(path):
        step = int(json.loads((path / checkpoint.MARKER).read_text())["step"])
        checkpoint.verify_loadable(path)
        return step, path
    found = checkpoint.loadable_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise UsageError(
            f"--continue_from {spec}: neither a complete checkpoint folder nor a run folder holding one "
            f"(RUN/checkpoints/step_N with {checkpoint.MARKER}); pass the first phase's --save_dir"
        )
    return found


def phase_record(cfg: TrainConfig) -> dict[str, Any]:
    """This run's phase, for RUN/config.json and the metrics lines: its index (1 for a run that does not
    continue another), the checkpoint it continued from, and the optimizer steps before it (the earlier
    phases' together)."""
    if not cfg.model.continue_from:
        return {"index": 1, "continued_from": None, "steps_before": 0}
    step, path = phase_source(cfg.model.continue_from)
    before = (checkpoint.saved_config(path) or {}).get("phase") or {"index": 1, "steps_before": 0}
    return {
        "index": before["index"] + 1,
        "continued_from": str(path.resolve()),
        "steps_before": before["steps_before"] + step,
    }


def resume_point(cfg: TrainConfig) -> Optional[tuple[int, Path]]:
    """The checkpoint this job continues: none for --resume none (which refuses a folder that has
    one), `latest` for auto (or the newest older one that reads), last_finite's for last_finite.
    Every file it loads is opened weights-only first (a crafted one is refused)."""
    save_dir = cfg.run.save_dir
    found = checkpoint.latest_checkpoint(save_dir)
    if cfg.run.resume == "none":
        if found:
            raise UsageError(
                f"--save_dir {save_dir} already holds checkpoint {found[1].name}: pass --resume auto "
                f"to continue it, or choose a new --save_dir"
            )
        return None
    if cfg.run.resume == "last_finite":
        fallback = checkpoint.last_finite_checkpoint(save_dir)
        if fallback is None:
            raise UsageError(
                f"--resume last_finite: {checkpoint.checkpoints_dir(save_dir)} names no checkpoint saved before "
                f"the loss went non-finite (no {checkpoint.LAST_FINITE}); use --resume auto or a new --save_dir"
            )
        checkpoint.verify_loadable(fallback[1])
        return fallback
    return checkpoint.loadable_checkpoint(save_dir) if found else None


@contextlib.contextmanager
def run_folder(cfg: TrainConfig) -> Iterator[None]:
    """The job's place, for the whole job (pre-flight and training): a world of one process when no
    launcher described one (a plain `python pipeline/train.py`), and on rank 0 the run folder's lock,
    RUN/.train.lock, taken before any process group and released however the job ends. A second
    training into the folder exits 2 there, naming the first one's pid and host (its other ranks wait
    for a rank 0 that is gone: the launcher, or --dist_timeout_s, ends them)."""
    if not distributed.launched():
        distributed.single_process_env()
        log.info("no launcher (RANK is unset): training as one process; start several with deepspeed, torchrun or srun")
    if distributed.launch_rank() != 0:
        yield
        return
    check_save_dir(cfg.run.save_dir)
    folder = Path(cfg.run.save_dir)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with output_lock(folder, flag="--save_dir", what="training", name=RUN_LOCK, say=log.warning):
            yield
    finally:
        if created and not any(folder.iterdir()):  # pre-flight refused the job: leave no empty folder
            folder.rmdir()


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


def check_resume(
    cfg: TrainConfig,
    *,
    ds: dict[str, Any],
    world_size: int,
    checkpoint_dir: Path,
    step: Optional[int] = None,
    identity: Optional[dict[str, Any]] = None,
    bert_config: Optional[dict[str, Any]] = None,
) -> list[str]:
    """Refuse to resume a checkpoint with settings that change what the run computes (model, objective
    and its knobs, data and weights, tokenizer, seed, schedule, the DeepSpeed JSON's micro-batch and
    precision, the global batch: `_batch_changes`; another number of ranks is allowed). The data and
    tokenizer are compared by `identity` (content_identity) and the model by its resolved
    `bert_config` where the checkpoint records them, so a folder rebuilt or a config file edited in
    place is a change and another path to the same content is not. Returns a line per allowed change
    (intervals, export dir, world size, ...) to record. `step`: the checkpoint's (a WSD run may then
    move a decay that has not begun)."""
    where = f"--resume {cfg.run.resume} from {checkpoint_dir}"
    saved = checkpoint.saved_config(checkpoint_dir)
    if saved is None:
        if cfg.run.resume_unchecked:
            return [f"resume: {checkpoint_dir} records no configuration; resumed unchecked (--resume_unchecked)"]
        raise UsageError(
            f"{where}: the checkpoint records no configuration (no {checkpoint.RUN_CONFIG}, no config in its client "
            f"state), so nothing about this job can be checked against it; pass --resume_unchecked to resume it "
            f"anyway, or start a new --save_dir"
        )
    math, allowed = resume_changes(saved, cfg, step=step)
    engine = saved.get("engine") or {}
    if "global_batch" in engine:
        # The batch is compared as the global batch the JSON makes at each world size (_batch_changes).
        math.update(_deepspeed_changes(saved.get("deepspeed"), ds, skip=_BATCH_KEYS))
        _batch_changes(math, allowed, engine=engine, ds=ds, world_size=world_size, allow=cfg.run.allow_batch_change)
    else:
        math.update(_deepspeed_changes(saved.get("deepspeed"), ds))
        if engine.get("world_size") not in (None, world_size):
            raise UsageError(
                f"{where}: the run was trained on {engine['world_size']} rank(s), this launch has {world_size}, "
                f"and the checkpoint does not record its global batch; resume with {engine['world_size']} ranks, "
                f"or start a new --save_dir"
            )
    _compare_content(math, allowed, saved=saved, identity=identity, bert_config=bert_config)
    if math:
        listing = "; ".join(f"{key}: saved {before!r}, now {after!r}" for key, (before, after) in sorted(math.items()))
        hints = schedule_hints(math, cfg, step=step)
        if _GLOBAL_BATCH in math:
            hints.append(_batch_hint(math[_GLOBAL_BATCH][0], ds=ds, world_size=world_size))
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise UsageError(
            f"{where}: these settings differ from the run's and would change what it computes: "
            f"{listing}{hint}; resume with the saved values or start a new --save_dir"
        )
    return [f"resume: {key} {before!r} -> {after!r}" for key, (before, after) in sorted(allowed.items())]


# The DeepSpeed JSON's batch keys: compared as the global batch they make (micro x accumulation x
# ranks), so that a resume on another number of ranks may keep it by another accumulation.
_BATCH_KEYS = (("train_batch_size",), ("gradient_accumulation_steps",))
_GLOBAL_BATCH = "global batch (micro x accumulation x ranks)"


def _batch_changes(
    math: dict[str, tuple],
    allowed: dict[str, tuple],
    *,
    engine: dict[str, Any],
    ds: dict[str, Any],
    world_size: int,
    allow: bool,
) -> None:
    """The rule for the batch of a resumed run: the number of ranks and the accumulation may change
    (a ZeRO-1/2 checkpoint is resharded at load, pipeline.training.reshard); the global batch may not,
    unless `allow` (--allow_batch_change). The micro-batch per rank is compared with the JSON."""
    _, accum, batch = batch_shape(ds, world_size=world_size)
    if engine.get("global_batch") != batch:
        (allowed if allow else math)[_GLOBAL_BATCH] = (engine.get("global_batch"), batch)
    if engine.get("world_size") not in (None, world_size):
        allowed["world size"] = (engine["world_size"], world_size)
    if engine.get("gradient_accumulation_steps") not in (None, accum):
        allowed["gradient accumulation"] = (engine["gradient_accumulation_steps"], accum)


def _batch_hint(saved_batch: Any, *, ds: dict[str, Any], world_size: int) -> str:
    micro = ds["train_micro_batch_size_per_gpu"]
    keep = (
        f"set train_batch_size {saved_batch} in --ds_config in place of gradient_accumulation_steps (DeepSpeed "
        f"then keeps it by the accumulation)"
        if isinstance(saved_batch, int) and saved_batch % (micro * world_size) == 0
        else f"a global batch of {saved_batch} cannot be made of micro-batches of {micro} on {world_size} ranks"
    )
    return f"{keep}; --allow_batch_change continues with the new global batch"


# BertConfig keys that record where and how a config was saved, not the model.
_BERT_CONFIG_RECORD = {"transformers_version", "architectures", "torch_dtype", "dtype"}


def _compare_content(
    math: dict[str, tuple],
    allowed: dict[str, tuple],
    *,
    saved: dict[str, Any],
    identity: Optional[dict[str, Any]],
    bert_config: Optional[dict[str, Any]],
) -> None:
    """Where the checkpoint records the content (the shards' and tokenizer's identity, the resolved
    model config), that decides, in place of the paths: differences join `math`, and a path that
    changed to the same content moves to `allowed`."""
    recorded = saved.get("identity")
    if identity is not None and recorded:
        before, now = recorded.get("data", []), identity["data"]
        if len(before) == len(now):
            for i, (a, b) in enumerate(zip(before, now)):
                for key in ("samples", "index_sha256", "vocabulary"):
                    if a.get(key) != b.get(key):
                        math[f"data[{i}].{key} ({cfg_path(saved, i)})"] = (a.get(key), b.get(key))
            if "data.data" in math:
                allowed["data.data"] = math.pop("data.data")
        if recorded.get("tokenizer") != identity["tokenizer"]:
            math["tokenizer vocabulary"] = (recorded.get("tokenizer"), identity["tokenizer"])
        elif "model.tokenizer" in math:
            allowed["model.tokenizer"] = math.pop("model.tokenizer")
    recorded = saved.get("bert_config")
    if bert_config is not None and recorded:
        now = json.loads(json.dumps(bert_config, default=str))
        keys = sorted(k for k in set(recorded) | set(now) if k not in _BERT_CONFIG_RECORD and not k.startswith("_"))
        changed = {f"bert_config.{k}": (recorded.get(k), now.get(k)) for k in keys if recorded.get(k) != now.get(k)}
        math.update(changed)
        if not changed:
            for key in ("model.model_config", "model.init_from"):
                if key in math:
                    allowed[key] = math.pop(key)


def cfg_path(saved: dict[str, Any], i: int) -> str:
    """The i-th --data of a saved configuration, as it was given."""
    paths = saved.get("data", {}).get("data") or []
    return paths[i] if i < len(paths) else "?"


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


def _deepspeed_changes(saved: Optional[dict], now: dict, *, skip: tuple[tuple[str, ...], ...] = ()) -> dict[str, tuple]:
    if saved is None:
        return {}
    flat_saved, flat_now = _flatten(saved), _flatten(now)
    changed = {}
    for k in sorted(set(flat_saved) | set(flat_now)):
        name = ".".join(k)
        if k in _SCHEDULE_FILLED or k in skip or name.startswith(_DEEPSPEED_OPERATIONAL):
            continue
        if flat_saved.get(k) == flat_now.get(k):
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
