"""The trainer's configuration: typed dataclasses, one owner per knob, paper defaults per objective.

Who owns what:
- the DeepSpeed JSON (--ds_config): micro-batch, gradient accumulation, precision, ZeRO stage,
  gradient clipping, the optimizer's type and its weight decay/betas, the schedule's shape
  (WarmupDecayLR, linear warm-up). The trainer reads these back from the engine;
- this module: model, data, objective, and the schedule's numbers (learning rate, warm-up steps,
  total steps), which it writes into the DeepSpeed config once. The JSON must not set them too.

`parse_args(argv)` gives a TrainConfig with every default resolved (REFERENCE.md's paper values for
the chosen objective); `TrainConfig.to_dict()` is what RUN/config.json records.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

OBJECTIVES = ("tacl", "taco", "mlm")
MODEL_PRESETS = ("tiny", "base", "large")

# REFERENCE.md, per objective. warmup: a fraction of max_steps (TaCL: 10%) or a step count
# (TACO: 10k steps for base; BERT: 10k). Every objective uses lr 1e-4 with linear decay.
PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    "tacl": {"lr": 1e-4, "warmup_ratio": 0.10, "warmup_steps": None, "nsp": "on"},
    "taco": {"lr": 1e-4, "warmup_ratio": None, "warmup_steps": 10_000, "nsp": "off"},
    "mlm": {"lr": 1e-4, "warmup_ratio": None, "warmup_steps": 10_000, "nsp": "auto"},
}


@dataclass
class ModelArgs:
    """Which student to build: a preset/JSON config from scratch, or a pre-trained HF folder."""

    model_config: Optional[str] = None  # tiny | base | large | path/to/config.json
    init_from: Optional[str] = None  # HF folder (BertModel or BertForPreTraining weights)
    tokenizer: Optional[str] = None  # default: DATA/tokenizer of the first --data
    mlm_head: str = "masked"  # masked (project only masked rows) | full (every row, as HF and upstream do)


@dataclass
class DataArgs:
    """The shards and how they are read and masked."""

    data: list[str] = field(default_factory=list)
    data_weights: Optional[list[float]] = None
    cache_dir: Optional[str] = None  # local cache root for remote shards (per job)
    num_workers: int = 2
    mask_prob: float = 0.15
    whole_word_masking: bool = False
    max_seq_len: Optional[int] = None  # default: the shards' build_manifest.json
    num_canonical_nodes: Optional[int] = None  # streaming's; default: physical nodes of the first run


@dataclass
class ObjectiveArgs:
    """The objective and its loss settings (REFERENCE.md's values as defaults)."""

    objective: str = "mlm"
    nsp: str = "auto"  # on | off | auto (= on for nsp shards)
    tacl_temperature: float = 0.01
    tacl_negatives: str = "sequence"  # sequence (paper) | global (adds a cross-rank pool)
    tacl_num_pool: int = 0
    taco_temperature: float = 0.07
    taco_window: int = 5
    taco_num_negatives: int = 50
    taco_anchors: str = "all"  # all | masked | unmasked
    taco_lambda: float = 1.0
    taco_detach: bool = True


@dataclass
class ScheduleArgs:
    """The numbers of the learning-rate schedule (its shape lives in the DeepSpeed JSON)."""

    max_steps: int = 0
    lr: float = 1e-4
    warmup_steps: int = 0


@dataclass
class RunArgs:
    """Where things go, how often, and how the job behaves on failures."""

    ds_config: str = ""
    save_dir: str = ""
    resume: str = "none"  # none | auto
    export_dir: Optional[str] = None
    save_every: int = 1000
    keep_checkpoints: int = 3
    seed: int = 0
    dist_timeout_s: float = 600.0
    log_every: int = 10
    max_nonfinite: int = 5  # consecutive skipped (NaN/inf) micro-batches before aborting
    trace_samples: bool = False  # write RUN/sample_trace.jsonl: the sample ids of every step
    peak_tflops: Optional[float] = None  # overrides the device table used for MFU
    progress_bar: bool = True  # tqdm on rank 0 (default: when stderr is a terminal)
    stop_after_step: Optional[int] = None
    # Fault injection for tests of the NaN guard: the loss of rank `debug_nan_rank` is made NaN at these
    # steps, on the first `debug_nan_attempts` micro-batches of each.
    debug_nan_steps: tuple[int, ...] = ()
    debug_nan_rank: int = 0
    debug_nan_attempts: int = 1  # save and exit 0 at this step; the schedule still spans max_steps


@dataclass
class TrainConfig:
    model: ModelArgs
    data: DataArgs
    objective: ObjectiveArgs
    schedule: ScheduleArgs
    run: RunArgs
    notes: list[str] = field(default_factory=list)  # defaults that were adjusted, said once at start

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def use_nsp(self) -> Optional[bool]:
        """True/False once resolved against the data (see resolve_nsp); None while 'auto'."""
        return {"on": True, "off": False}.get(self.objective.nsp)


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive weights, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline/train.py",
        description="Pre-train a BERT student with DeepSpeed ZeRO-2 (objectives: tacl, taco, mlm).",
    )
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON (micro-batch, accumulation, precision, ZeRO)")
    p.add_argument("--objective", required=True, choices=OBJECTIVES)
    p.add_argument("--data", required=True, action="append", help="shard folder or remote URL; repeatable")
    p.add_argument("--data_weights", type=_float_list, help="mixing weights, one per --data, e.g. 0.5,0.5")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model_config", help="tiny | base | large | path to a BertConfig JSON")
    src.add_argument("--init_from", help="pre-trained Hugging Face BERT folder (TaCL's setting)")
    p.add_argument("--tokenizer", help="HF tokenizer folder (default: DATA/tokenizer)")
    p.add_argument("--mlm_head", choices=("masked", "full"), default="masked",
                   help="masked: the vocabulary projection runs on masked rows only (default); full: on every "
                        "row as HF's BertForMaskedLM does (an ablation; same loss, more FLOPs)")
    p.add_argument("--max_steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--save_dir", required=True)
    p.add_argument("--resume", choices=("none", "auto"), default="none")
    p.add_argument("--export_dir", help="write the final student as a Hugging Face folder")
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--keep_checkpoints", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist_timeout_s", type=float, default=600.0,
                   help="a collective waits at most this long (a dead rank fails the others)")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--max_nonfinite", type=int, default=5, help="abort after N NaN/inf losses in a row")
    p.add_argument("--trace_samples", action="store_true", help="log every step's sample ids")
    p.add_argument("--peak_tflops", type=float, help="device peak for MFU (default: built-in table)")
    p.add_argument("--progress_bar", choices=("auto", "on", "off"), default="auto",
                   help="tqdm on rank 0; auto = only when stderr is a terminal (a bar in a batch log "
                        "would share lines with the log lines)")
    p.add_argument("--stop_after_step", type=int,
                   help="save and exit 0 after this step (a chunk of a longer run; the schedule still spans --max_steps)")
    # Schedule numbers: None means the objective's paper default.
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup_steps", type=int)
    # Data and masking.
    p.add_argument("--cache_dir", help="local cache root for remote shards")
    p.add_argument("--num_workers", type=int, default=2, help="data-loader workers per rank")
    p.add_argument("--mask_prob", type=float, default=0.15)
    p.add_argument("--whole_word_masking", action="store_true", help="mask whole words (stored word_starts)")
    p.add_argument("--max_seq_len", type=int, help="only needed for shards without build_manifest.json")
    p.add_argument("--num_canonical_nodes", type=int)
    # Objective settings.
    p.add_argument("--nsp", choices=("auto", "on", "off"),
                   help="next-sentence prediction (default: on for tacl, off for taco, auto for mlm)")
    p.add_argument("--tacl_temperature", type=float, default=0.01)
    p.add_argument("--tacl_negatives", choices=("sequence", "global"), default="sequence")
    p.add_argument("--tacl_num_pool", type=int, default=0)
    p.add_argument("--taco_temperature", type=float, default=0.07)
    p.add_argument("--taco_window", type=int, default=5)
    p.add_argument("--taco_num_negatives", type=int, default=50)
    p.add_argument("--taco_anchors", choices=("all", "masked", "unmasked"), default="all")
    p.add_argument("--taco_lambda", type=float, default=1.0)
    p.add_argument("--taco_no_detach", action="store_true", help="let gradients flow into positives/negatives")
    p.add_argument("--debug_nan_steps", type=lambda t: tuple(int(x) for x in t.split(",") if x), default=(),
                   help=argparse.SUPPRESS)
    p.add_argument("--debug_nan_rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--debug_nan_attempts", type=int, default=1, help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank; the environment carries the same value.
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Parse the command line into a resolved TrainConfig. Flag errors exit 2 (argparse); value
    errors raise ValueError naming the flag."""
    a = build_parser().parse_args(argv)
    cfg = TrainConfig(
        model=ModelArgs(model_config=a.model_config, init_from=a.init_from, tokenizer=a.tokenizer,
                        mlm_head=a.mlm_head),
        data=DataArgs(data=list(a.data), data_weights=a.data_weights, cache_dir=a.cache_dir,
                      num_workers=a.num_workers, mask_prob=a.mask_prob,
                      whole_word_masking=a.whole_word_masking, max_seq_len=a.max_seq_len,
                      num_canonical_nodes=a.num_canonical_nodes),
        objective=ObjectiveArgs(objective=a.objective, nsp=a.nsp or PAPER_DEFAULTS[a.objective]["nsp"],
                                tacl_temperature=a.tacl_temperature, tacl_negatives=a.tacl_negatives,
                                tacl_num_pool=a.tacl_num_pool, taco_temperature=a.taco_temperature,
                                taco_window=a.taco_window, taco_num_negatives=a.taco_num_negatives,
                                taco_anchors=a.taco_anchors, taco_lambda=a.taco_lambda,
                                taco_detach=not a.taco_no_detach),
        schedule=ScheduleArgs(max_steps=a.max_steps),
        run=RunArgs(ds_config=a.ds_config, save_dir=a.save_dir, resume=a.resume, export_dir=a.export_dir,
                    save_every=a.save_every, keep_checkpoints=a.keep_checkpoints, seed=a.seed,
                    dist_timeout_s=a.dist_timeout_s, log_every=a.log_every, max_nonfinite=a.max_nonfinite,
                    trace_samples=a.trace_samples, peak_tflops=a.peak_tflops, stop_after_step=a.stop_after_step,
                    progress_bar={"on": True, "off": False}.get(a.progress_bar, sys.stderr.isatty()),
                    debug_nan_steps=a.debug_nan_steps, debug_nan_rank=a.debug_nan_rank,
                    debug_nan_attempts=a.debug_nan_attempts),
    )
    resolve_schedule(cfg, lr=a.lr, warmup_steps=a.warmup_steps)
    validate(cfg)
    return cfg


def resolve_schedule(cfg: TrainConfig, *, lr: Optional[float], warmup_steps: Optional[int]) -> None:
    """Fill lr and warm-up from the objective's paper defaults where not given.

    A paper warm-up longer than the run (TACO's 10k steps in a 30-step demo) would keep the learning
    rate near zero for the whole run: it is capped at 10% of max_steps, and the cap is noted.
    """
    d = PAPER_DEFAULTS[cfg.objective.objective]
    s = cfg.schedule
    s.lr = d["lr"] if lr is None else lr
    if warmup_steps is not None:
        s.warmup_steps = warmup_steps
    elif d["warmup_ratio"] is not None:
        s.warmup_steps = int(round(d["warmup_ratio"] * s.max_steps))
    else:
        s.warmup_steps = d["warmup_steps"]
        if s.warmup_steps >= s.max_steps:
            capped = int(round(0.1 * s.max_steps))
            cfg.notes.append(f"warm-up: the {cfg.objective.objective} default of {s.warmup_steps} steps is not "
                             f"shorter than --max_steps {s.max_steps}; using {capped} (10%); pass "
                             f"--warmup_steps to choose")
            s.warmup_steps = capped


def validate(cfg: TrainConfig) -> None:
    """Checks on values alone (no files): ValueError naming the flag and the value."""
    s, r, d, o = cfg.schedule, cfg.run, cfg.data, cfg.objective
    if s.max_steps < 1:
        raise ValueError(f"--max_steps must be >= 1, got {s.max_steps}")
    if s.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {s.lr}")
    if not 0 <= s.warmup_steps < s.max_steps:
        raise ValueError(f"--warmup_steps must be in [0, --max_steps={s.max_steps}), got {s.warmup_steps}")
    if r.stop_after_step is not None and not 1 <= r.stop_after_step <= s.max_steps:
        raise ValueError(f"--stop_after_step must be in [1, --max_steps={s.max_steps}], got {r.stop_after_step}")
    if r.save_every < 1:
        raise ValueError(f"--save_every must be >= 1, got {r.save_every}")
    if r.keep_checkpoints < 1:
        raise ValueError(f"--keep_checkpoints must be >= 1, got {r.keep_checkpoints}")
    if r.log_every < 1:
        raise ValueError(f"--log_every must be >= 1, got {r.log_every}")
    if r.max_nonfinite < 1:
        raise ValueError(f"--max_nonfinite must be >= 1, got {r.max_nonfinite}")
    if r.dist_timeout_s <= 0:
        raise ValueError(f"--dist_timeout_s must be > 0, got {r.dist_timeout_s}")
    if not 0 < d.mask_prob < 1:
        raise ValueError(f"--mask_prob must be in (0, 1), got {d.mask_prob}")
    if d.num_workers < 0:
        raise ValueError(f"--num_workers must be >= 0, got {d.num_workers}")
    if d.data_weights is not None and len(d.data_weights) != len(d.data):
        raise ValueError(f"--data_weights has {len(d.data_weights)} value(s) for {len(d.data)} --data folder(s): "
                         f"give one weight per --data")
    if d.max_seq_len is not None and d.max_seq_len < 2:
        raise ValueError(f"--max_seq_len must be >= 2, got {d.max_seq_len}")
    if cfg.model.model_config is not None and cfg.model.model_config not in MODEL_PRESETS:
        if not Path(cfg.model.model_config).is_file():
            raise ValueError(f"--model_config {cfg.model.model_config!r} is neither one of {MODEL_PRESETS} "
                             f"nor an existing JSON file")
    if o.tacl_negatives == "global" and o.tacl_num_pool < 1:
        raise ValueError("--tacl_negatives global needs --tacl_num_pool >= 1")
    if o.tacl_negatives == "sequence" and o.tacl_num_pool:
        raise ValueError(f"--tacl_num_pool {o.tacl_num_pool} only applies to --tacl_negatives global")
    if o.objective == "taco" and o.nsp == "on":
        raise ValueError("--nsp on with --objective taco: TACO trains MLM + TC on packed blocks, without NSP")


def load_ds_json(path: str) -> dict[str, Any]:
    """The DeepSpeed config file as a dict, with a clear error for a missing or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--ds_config {path}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--ds_config {path}: not valid JSON (line {e.lineno}: {e.msg})")


# Knobs this module owns; a DeepSpeed JSON that sets them would set them twice.
_OWNED_OPTIMIZER_PARAMS = ("lr",)
_OWNED_SCHEDULER_PARAMS = ("warmup_max_lr", "warmup_num_steps", "total_num_steps")


def resolve_ds_config(ds: dict[str, Any], *, schedule: ScheduleArgs, world_size: int, path: str) -> dict[str, Any]:
    """Check the DeepSpeed JSON and fill in the schedule's numbers. Returns a new dict.

    Raises ValueError when the JSON lacks a micro-batch, when its batch sizes cannot hold for
    `world_size` (train_batch_size = micro * accumulation * world size), or when it sets a knob
    this config owns (lr, warm-up, total steps).
    """
    ds = json.loads(json.dumps(ds))  # a deep copy
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    for name, v in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum),
                    ("train_batch_size", total)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"--ds_config {path}: {name} must be a positive integer, got {v!r}")
    if micro is None:
        raise ValueError(f"--ds_config {path}: set train_micro_batch_size_per_gpu (and gradient_accumulation_steps); "
                         f"the global batch then follows the world size")
    if total is not None:
        per_step = micro * world_size * (accum or 1)
        if accum is not None and total != per_step or accum is None and total % (micro * world_size):
            raise ValueError(
                f"--ds_config {path}: train_batch_size={total} does not equal train_micro_batch_size_per_gpu={micro} "
                f"x gradient_accumulation_steps={accum if accum is not None else '?'} x world size {world_size}; "
                f"drop train_batch_size from the JSON (it follows the world size) or launch {total // max(micro * (accum or 1), 1)} "
                f"processes")
    opt = ds.get("optimizer")
    if opt is not None:
        params = opt.setdefault("params", {})
        for k in _OWNED_OPTIMIZER_PARAMS:
            if k in params:
                raise ValueError(f"--ds_config {path}: optimizer.params.{k} is set in the JSON; the learning rate "
                                 f"belongs to --lr (objective default {schedule.lr}); remove it from the JSON")
        params["lr"] = schedule.lr
    sched = ds.get("scheduler")
    if sched is not None:
        params = sched.setdefault("params", {})
        for k in _OWNED_SCHEDULER_PARAMS:
            if k in params:
                raise ValueError(f"--ds_config {path}: scheduler.params.{k} is set in the JSON; it belongs to "
                                 f"--lr/--warmup_steps/--max_steps; remove it from the JSON")
        params["warmup_max_lr"] = schedule.lr
        # DeepSpeed needs >= 1 warm-up step; one step at min lr is what 0 would mean anyway.
        params["warmup_num_steps"] = max(1, schedule.warmup_steps)
        params["total_num_steps"] = schedule.max_steps
    return ds
