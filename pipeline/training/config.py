"""The trainer's configuration: typed dataclasses, one declaration per knob, paper defaults per objective.

Who owns what:
- the DeepSpeed JSON (--ds_config): micro-batch, gradient accumulation, precision, ZeRO stage,
  gradient clipping, the optimizer's type and its weight decay/betas, the schedule's shape
  (WarmupDecayLR, linear warm-up). The trainer reads these back from the engine
  (pipeline.training.ds_config);
- this module: model, data, objective, and the schedule's numbers (learning rate, warm-up steps,
  total steps), which are written into the DeepSpeed config once. The JSON must not set them too.

Every knob is a `preprocessing.cli.knob` field: its default and help live there, and the command line is
generated from them. `parse_args(argv)` resolves defaults, then a `--config` file (a run's
RUN/config.json replays that run), then the flags typed, then the objective's paper defaults for
what is still unset; `TrainConfig.to_dict()` is what RUN/config.json records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import objectives
from pipeline.modeling.bert_config import PRESETS
from pipeline.training import schedule as lr_schedule
from preprocessing import cli
from preprocessing.errors import UsageError

MODEL_PRESETS = tuple(PRESETS)


def _positive_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 or v == float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected positive, finite weights, got {text!r}")
    return values


REPORT_TARGETS = ("tensorboard", "wandb")


def _report_targets(text: str) -> tuple[str, ...]:
    """--report_to: a comma-separated subset of REPORT_TARGETS, or none (metrics.jsonl is always written)."""
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if names == ("none",):
        return ()
    unknown = [n for n in names if n not in REPORT_TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(REPORT_TARGETS)} or none, got {text!r}"
        )
    return names


@dataclass
class ModelArgs:
    """Which student to build: a preset/JSON config from scratch, or a pre-trained HF folder."""

    model_config: Optional[str] = cli.knob(None, "tiny | base | large | path to a BertConfig JSON (from scratch)")
    init_from: Optional[str] = cli.knob(None, "pre-trained Hugging Face BERT folder to start from (TaCL's setting)")
    continue_from: Optional[str] = cli.knob(
        None,
        "start a new phase from a run (its --save_dir: the latest complete checkpoint) or a checkpoint folder: its "
        "weights and optimizer state carry over; the data, schedule and steps are this run's (e.g. phase 2 at a "
        "longer --max_seq_len)",
    )
    tokenizer: Optional[str] = cli.knob(None, "HF tokenizer folder (default: DATA/tokenizer)")
    allow_tokenizer_mismatch: bool = cli.knob(
        False,
        "train even when --tokenizer (or --init_from's tokenizer) is not the one the shards were built with; "
        "the pre-flight error then becomes a warning",
    )
    mlm_head: str = cli.knob(
        "masked",
        "masked: the vocabulary projection runs on masked rows only; full: on every "
        "row as HF's BertForMaskedLM does (an ablation: same loss, more FLOPs)",
        choices=("masked", "full"),
    )
    compile: str = cli.knob(
        "auto", "torch.compile the encoder layers; auto = on CUDA", choices=("auto", "on", "off"), math=False
    )
    attention_dropout: float = cli.knob(
        0.0,
        "attention-probability dropout of the student, for the presets and --init_from models alike (0: the "
        "fused attention kernels run in training, as MosaicBERT does; the hidden dropout stays the model's)",
    )


@dataclass
class DataArgs:
    """The shards and how they are read and masked."""

    data: list[str] = cli.knob(
        help="shard folder or remote URL; repeat the flag for several", repeat=True, required=True, default_factory=list
    )
    data_weights: Optional[list[float]] = cli.knob(
        None, "mixing weights, one per --data, e.g. 0.5,0.5", parse=_positive_floats
    )
    cache_dir: Optional[str] = cli.knob(
        None, "local cache root (per job) for remote shards and the decompressed copies of local ones", math=False
    )
    num_workers: Optional[int] = cli.knob(
        None, "data-loader workers per rank (default: the cores per rank, less one, at most 8)", math=False
    )
    nsp_padding: str = cli.knob(
        "remove",
        "batches of unequal sequences (NSP pairs, packed blocks cut into documents): remove = one unpadded token "
        "stream split by cu_seqlens (varlen attention); keep = right-padded [B, L] (the reference path)",
        choices=("remove", "keep"),
        math=False,
    )
    packed_attention: str = cli.knob(
        "document",
        "packed blocks: document = attention, positions and TACO's positives and negatives stay inside each "
        "document (the blocks are cut after each [SEP]); sequence = across the whole block, as both papers "
        "do (an ablation)",
        choices=("document", "sequence"),
    )
    mask_prob: float = cli.knob(0.15, "share of the maskable tokens chosen for MLM")
    whole_word_masking: bool = cli.knob(False, "mask whole words (the shards' stored word_starts)")
    max_seq_len: Optional[int] = cli.knob(None, "only needed for shards without build_manifest.json")
    num_canonical_nodes: Optional[int] = cli.knob(
        None, "streaming's canonical nodes (default: the physical nodes of the first run)"
    )


@dataclass
class _ObjectiveChoice:
    objective: Optional[str] = cli.knob(None, "what to train", choices=objectives.names, required=True)
    nsp: Optional[str] = cli.knob(
        None,
        "next-sentence prediction (default: the objective's; auto = on for nsp shards)",
        choices=("auto", "on", "off"),
    )


# The objective and its loss settings: each objective declares its own knobs (pipeline.objectives),
# with the papers' values as defaults (docs/objectives.md). One flat section, as RUN/config.json holds it.
ObjectiveArgs = dataclass(
    type(
        "ObjectiveArgs",
        (*(o.knobs for o in map(objectives.get, objectives.names()) if o.knobs), _ObjectiveChoice),
        {"__doc__": "The objective and its loss settings (the papers' values as defaults, docs/objectives.md)."},
    )
)


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """--max_time: seconds, or a number with a unit s, m, h or d (90m, 24h, 1.5d); as seconds."""
    t = text.strip().lower()
    scale = _DURATION_UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds or a number with s, m, h or d (e.g. 24h), got {text!r}"
        ) from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive duration, got {text!r}")
    return value


@dataclass
class ScheduleArgs:
    """The numbers of the learning-rate schedule, and WSD's decay (the warm-up's form and whether it
    decays live in the DeepSpeed JSON; pipeline.training.schedule has the formulas)."""

    max_steps: int = cli.knob(0, "optimizer steps (with --max_time: at most this many)", required=True)
    lr: Optional[float] = cli.knob(None, "peak learning rate (default: the objective's paper value)")
    warmup_steps: Optional[int] = cli.knob(
        None, "linear warm-up steps (default: the objective's paper value, at most 10% of --max_steps)"
    )
    schedule: str = cli.knob(
        "linear",
        "after the warm-up: linear = the JSON's scheduler (WarmupDecayLR: linear decay to 0 at the last step; "
        "WarmupLR: constant); wsd = constant at --lr, then a 1-sqrt decay to 0 over the last --decay_steps "
        "(warm-up-stable-decay; needs WarmupDecayLR in the JSON)",
        choices=("linear", "wsd"),
    )
    decay_steps: Optional[int] = cli.knob(
        None,
        "wsd: the decay's length in steps (default: 20% of the run's steps); it starts at --max_steps minus "
        "this, so a resumed run given another --max_steps before then moves it (to start it now: --max_steps "
        "STEP+decay_steps)",
    )
    max_time: Optional[float] = cli.knob(
        None,
        "training-time budget: seconds, or 90m, 24h, 1.5d. The steps' time (not checkpoints or evaluation) "
        "counts, carried over across resumes; the schedule's total is fitted to the steps that fit, "
        "re-estimated as the run goes, and the run ends (saved, exported) when it is spent or at --max_steps, "
        "whichever comes first",
        parse=_duration,
        math=False,
    )


@dataclass
class RunArgs:
    """Where things go, how often, and how the job behaves on failures."""

    ds_config: str = cli.knob(
        "", "DeepSpeed JSON (micro-batch, accumulation, precision, ZeRO)", required=True, math=False
    )
    save_dir: str = cli.knob("", "run folder: checkpoints, metrics, config", required=True, math=False)
    resume: str = cli.knob(
        "none",
        "auto: continue from the run's latest complete checkpoint; last_finite: from the last one saved before "
        "the loss went non-finite (RUN/checkpoints/last_finite)",
        choices=("none", "auto", "last_finite"),
        math=False,
    )
    extend_schedule: bool = cli.knob(
        False,
        "on resume, allow a larger --max_steps than the run started with "
        "(the decay is recomputed for the new total; a WSD run whose decay has not begun needs no flag)",
        math=False,
    )
    allow_schedule_change: bool = cli.knob(
        False,
        "on resume, allow another --lr, --warmup_steps, --max_steps, --schedule or --decay_steps than the "
        "run's (the schedule is recomputed at the resumed step): e.g. a lower rate after the loss diverged",
        math=False,
    )
    allow_batch_change: bool = cli.knob(
        False,
        "on resume, allow another global batch (micro x accumulation x ranks) than the run's: e.g. on fewer "
        "nodes when the DeepSpeed JSON's train_batch_size cannot keep it",
        math=False,
    )
    resume_unchecked: bool = cli.knob(
        False,
        "resume a checkpoint that records no configuration (neither run_config.json nor one in its client "
        "state), so nothing about this job can be checked against it",
        math=False,
    )
    export_dir: Optional[str] = cli.knob(None, "write the final student as a Hugging Face folder", math=False)
    save_every: int = cli.knob(1000, "checkpoint every N steps", math=False)
    keep_checkpoints: int = cli.knob(3, "complete checkpoints kept", math=False)
    seed: int = cli.knob(0, "seed of every random draw (initialisation, masking, dropout, losses)")
    dist_timeout_s: float = cli.knob(
        600.0, "a collective waits at most this long (a dead rank fails the others)", math=False
    )
    log_every: int = cli.knob(10, "metrics line every N steps", math=False)
    control_every: int = cli.knob(
        10,
        "every N steps (and at log steps) the ranks agree on pre-emption and on the "
        "non-finite limit: one small collective",
        math=False,
    )
    max_nonfinite: int = cli.knob(5, "abort after N NaN/inf losses in a row", math=False)
    trace_samples: bool = cli.knob(False, "write RUN/sample_trace.jsonl: the sample ids of every step", math=False)
    peak_tflops: Optional[float] = cli.knob(None, "device peak for MFU (default: built-in table)", math=False)
    report_to: tuple[str, ...] = cli.knob(
        ("tensorboard",),
        "where rank 0 sends the metrics besides RUN/metrics.jsonl: tensorboard, wandb (the wandb extra), both "
        "comma-separated, or none",
        parse=_report_targets,
        math=False,
        metavar="LIST",
    )
    progress_bar: str = cli.knob(
        "auto",
        "tqdm on rank 0; auto = only when stderr is a terminal (a bar in a batch "
        "log would share lines with the log lines)",
        choices=("auto", "on", "off"),
        math=False,
    )
    stop_after_step: Optional[int] = cli.knob(
        None,
        "save and exit 0 after this step (a chunk of a longer run; the schedule still spans --max_steps)",
        math=False,
    )


@dataclass
class EvalArgs:
    """Held-out evaluation during training (pipeline.training.evaluation). It never changes what the
    run trains, so a resumed run may change any of it."""

    eval_data: list[str] = cli.knob(
        help="held-out shard folder, [NAME=]DIR (repeatable; default: each --data folder's eval/, which "
        "build_shards.py --eval_share writes). With several, eval/... is over all of them and each also has its "
        "own eval/NAME/... (NAME: as given, else the folder's name)",
        repeat=True,
        default_factory=list,
        math=False,
    )
    eval_every: int = cli.knob(1000, "evaluate every N steps and at the last step (0: never)", math=False)
    eval_samples: int = cli.knob(
        1024,
        "held-out samples per evaluation and --eval_data folder: its first N, the same masked positions each time",
        math=False,
    )
    eval_health_every: int = cli.knob(
        5,
        "every K-th evaluation also measures the representation health figures (intra-sentence, intra- and "
        "inter-context similarity, their gap; 0: never)",
        math=False,
    )
    keep_best: bool = cli.knob(
        False,
        "keep the checkpoint with the lowest eval/mlm_loss beside the latest ones (RUN/checkpoints/best)",
        math=False,
    )


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "data": DataArgs,
    "objective": ObjectiveArgs,
    "schedule": ScheduleArgs,
    "run": RunArgs,
    "eval": EvalArgs,
}
# What the trainer records in RUN/config.json beside the sections (pipeline.training.trainer.resolved_record):
# facts of the run, not settings; a replayed file skips them.
RECORD_KEYS = (
    "deepspeed",
    "engine",
    "data_format",
    "nsp",
    "tokenizer",
    "max_seq_len",
    "samples",
    "bert_config",
    "identity",
    "phase",
)


@dataclass
class TrainConfig:
    model: ModelArgs
    data: DataArgs
    objective: ObjectiveArgs
    schedule: ScheduleArgs
    run: RunArgs
    eval: EvalArgs
    notes: list[str] = field(default_factory=list)  # defaults that were adjusted, said once at start
    print_config: bool = False  # --print_config: print the resolved configuration and exit

    def to_dict(self) -> dict[str, Any]:
        """The sections as JSON holds them (tuples become lists): what RUN/config.json records."""
        return json.loads(json.dumps({key: dataclasses.asdict(getattr(self, key)) for key in SECTIONS}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline/train.py",
        description="Pre-train a BERT student with DeepSpeed ZeRO-2 (objectives: tacl, taco, mlm). Flags override a "
        "--config file, which overrides the defaults shown.",
    )
    p.add_argument(
        "--config",
        help="JSON or YAML file of sections model/data/objective/schedule/run (a run's "
        "RUN/config.json replays that run); flags given here override it",
    )
    p.add_argument("--print_config", action="store_true", help="print the resolved configuration as JSON and exit")
    for key, cls in SECTIONS.items():
        cli.add_arguments(p.add_argument_group(key), cls)
    # The deepspeed launcher appends --local_rank; the environment carries the same value.
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


MODEL_SOURCES = ("model_config", "init_from", "continue_from")
ONE_SOURCE = (
    "give exactly one of --model_config (from scratch), --init_from (a pre-trained folder) and --continue_from "
    "(a new phase of a run)"
)


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Parse the command line into a resolved TrainConfig. Malformed flags exit 2 (argparse); bad values
    raise UsageError naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    file_values = cli.load_config_file(ns.config) if ns.config else {}
    source = f"--config {ns.config}"
    cli_values = {key: cli.set_values(ns, cls) for key, cls in SECTIONS.items()}
    # The model's source is one of three flags: one typed here replaces the file's others.
    model_file = dict(file_values.get("model", {}))
    for typed in MODEL_SOURCES:
        if cli_values["model"].get(typed) is not None:
            for other in MODEL_SOURCES:
                if other != typed:
                    model_file.pop(other, None)
    if "model" in file_values:
        file_values = {**file_values, "model": model_file}
    parts = cli.merge_sections(
        SECTIONS, file_values=file_values, cli_values=cli_values, source=source, ignored=RECORD_KEYS
    )
    # What argparse would have refused had no --config file been possible: its usage error, exit 2.
    missing = cli.missing_required(parts)
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (as flags or in a --config file)")
    if sum(getattr(parts["model"], k) is not None for k in MODEL_SOURCES) != 1:
        parser.error(ONE_SOURCE)
    cfg = TrainConfig(**parts, print_config=ns.print_config)
    resolve_defaults(cfg)
    validate(cfg)
    return cfg


def resolve_defaults(cfg: TrainConfig) -> None:
    """Fill nsp, lr and warm-up from the objective's paper defaults where unset.

    A paper warm-up longer than the run (TACO's 10k steps in a 30-step demo) would keep the learning
    rate near zero for the whole run: it is capped at 10% of max_steps, and the cap is noted.
    """
    d = objectives.get(cfg.objective.objective).defaults
    o, s = cfg.objective, cfg.schedule
    if o.nsp is None:
        o.nsp = d.nsp
    if s.lr is None:
        s.lr = d.lr
    if s.warmup_steps is not None:
        return
    if d.warmup_ratio is not None:
        s.warmup_steps = int(round(d.warmup_ratio * s.max_steps))
        return
    s.warmup_steps = d.warmup_steps
    if s.warmup_steps >= s.max_steps:
        capped = int(round(0.1 * s.max_steps))
        cfg.notes.append(
            f"warm-up: the {o.objective} default of {s.warmup_steps} steps is not shorter than "
            f"--max_steps {s.max_steps}; using {capped} (10%); pass --warmup_steps to choose"
        )
        s.warmup_steps = capped


def validate(cfg: TrainConfig) -> None:
    """Checks on values alone (no files but --model_config's): UsageError naming the flag and the value."""
    m, d, o, s, r = cfg.model, cfg.data, cfg.objective, cfg.schedule, cfg.run
    given = {k: getattr(m, k) for k in MODEL_SOURCES if getattr(m, k) is not None}
    if len(given) != 1:
        raise UsageError(ONE_SOURCE + (f"; got {given}" if given else ""))
    if s.max_steps < 1:
        raise UsageError(f"--max_steps must be >= 1, got {s.max_steps}")
    if not s.lr > 0:
        raise UsageError(f"--lr must be > 0, got {s.lr}")
    if not 0 <= s.warmup_steps < s.max_steps:
        raise UsageError(f"--warmup_steps must be in [0, --max_steps={s.max_steps}), got {s.warmup_steps}")
    _validate_schedule(s)
    if r.stop_after_step is not None and not 1 <= r.stop_after_step <= s.max_steps:
        raise UsageError(f"--stop_after_step must be in [1, --max_steps={s.max_steps}], got {r.stop_after_step}")
    for flag, value in (
        ("--save_every", r.save_every),
        ("--keep_checkpoints", r.keep_checkpoints),
        ("--log_every", r.log_every),
        ("--max_nonfinite", r.max_nonfinite),
        ("--control_every", r.control_every),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    e = cfg.eval
    for flag, value in (("--eval_every", e.eval_every), ("--eval_health_every", e.eval_health_every)):
        if value < 0:
            raise UsageError(f"{flag} must be >= 0 (0: never), got {value}")
    if e.eval_samples < 1:
        raise UsageError(f"--eval_samples must be >= 1, got {e.eval_samples}")
    if e.keep_best and not e.eval_every:
        raise UsageError("--keep_best needs evaluations: set --eval_every to a positive number of steps")
    if set(r.report_to) - set(REPORT_TARGETS):  # a --config file's value skips the flag's parser
        raise UsageError(f"--report_to {','.join(r.report_to)}: expected names among {', '.join(REPORT_TARGETS)}")
    if not r.dist_timeout_s > 0:
        raise UsageError(f"--dist_timeout_s must be > 0, got {r.dist_timeout_s}")
    if not 0 <= m.attention_dropout < 1:
        raise UsageError(f"--attention_dropout must be in [0, 1), got {m.attention_dropout}")
    if not 0 < d.mask_prob < 1:
        raise UsageError(f"--mask_prob must be in (0, 1), got {d.mask_prob}")
    if d.num_workers is not None and d.num_workers < 0:
        raise UsageError(f"--num_workers must be >= 0, got {d.num_workers}")
    if d.data_weights is not None:
        if len(d.data_weights) != len(d.data):
            raise UsageError(
                f"--data_weights has {len(d.data_weights)} value(s) for {len(d.data)} --data folder(s): "
                f"give one weight per --data"
            )
        if any(not 0 < w < float("inf") for w in d.data_weights):
            raise UsageError(f"--data_weights must be positive and finite, got {d.data_weights}")
    if d.max_seq_len is not None and d.max_seq_len < 2:
        raise UsageError(f"--max_seq_len must be >= 2, got {d.max_seq_len}")
    if m.model_config is not None and m.model_config not in MODEL_PRESETS and not Path(m.model_config).is_file():
        raise UsageError(
            f"--model_config {m.model_config!r} is neither one of {MODEL_PRESETS} nor an existing JSON file"
        )
    for name in objectives.names():
        objectives.get(name).check_knobs(o)
    objectives.get(o.objective).check_selected(o)


def _validate_schedule(s: ScheduleArgs) -> None:
    if s.decay_steps is not None and s.schedule != "wsd":
        raise UsageError(f"--decay_steps {s.decay_steps} is WSD's decay: pass --schedule wsd too, or drop it")
    if s.decay_steps is not None and not 1 <= s.decay_steps <= s.max_steps - s.warmup_steps:
        raise UsageError(
            f"--decay_steps must be in [1, --max_steps - --warmup_steps = {s.max_steps - s.warmup_steps}] "
            f"(the decay follows the warm-up), got {s.decay_steps}"
        )
    if s.max_time is not None and not 0 < s.max_time < float("inf"):  # a --config file's value skips the parser
        raise UsageError(f"--max_time must be a positive number of seconds, got {s.max_time}")


def describe_json(cfg: TrainConfig) -> str:
    """The resolved configuration, as --print_config shows it (replayable with --config)."""
    return json.dumps(cfg.to_dict(), indent=2)


# Knobs that name files or folders: another spelling of the same place is not a change.
PATH_KNOBS = ("data.data", "model.model_config", "model.init_from", "model.continue_from", "model.tokenizer")
SCHEDULE_KNOBS = (
    "schedule.lr",
    "schedule.warmup_steps",
    "schedule.max_steps",
    "schedule.schedule",
    "schedule.decay_steps",
)
_DECAY_END = ("schedule.max_steps", "schedule.decay_steps")  # where the decay starts and ends


def resume_changes(
    saved: dict[str, Any], cfg: TrainConfig, *, step: Optional[int] = None
) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(changes that alter the math, changes that do not) between a checkpoint's configuration and this
    one, `step` being the checkpoint's. Paths are compared resolved (`DIR/`, `a/../DIR` and a relative
    path are DIR). Allowed besides: another --max_steps or --decay_steps where the steps taken keep
    their rates (a WSD decay that begins after `step` both before and after the change; any --max_time
    run, whose total is re-fitted as it goes and whose begun decay keeps its start); a longer --max_steps with
    --extend_schedule; any change of the schedule's knobs with --allow_schedule_change (all then
    listed with the allowed changes)."""
    now = cfg.to_dict()
    math = cli.math_changes(saved, now, SECTIONS)
    allowed = cli.operational_changes(saved, now, SECTIONS)
    for key in PATH_KNOBS:
        if key in math and _place(math[key][0]) == _place(math[key][1]):
            del math[key]
    if _keeps_steps_taken(math, saved, cfg, step=step):
        allowed.update({key: math.pop(key) for key in _DECAY_END if key in math})
    before_steps = math.get("schedule.max_steps", (None,))[0]
    if cfg.run.extend_schedule and isinstance(before_steps, int) and cfg.schedule.max_steps > before_steps:
        math.pop("schedule.max_steps")
    if cfg.run.allow_schedule_change:
        allowed.update({key: math.pop(key) for key in SCHEDULE_KNOBS if key in math})
    return math, allowed


def _keeps_steps_taken(math: dict[str, tuple], saved: dict[str, Any], cfg: TrainConfig, *, step: Optional[int]) -> bool:
    """Whether the changes of --max_steps / --decay_steps in `math` leave the rates of the `step` steps
    taken as they were: nothing else of the schedule changed, and the run is fitted to --max_time (before
    or now), or is WSD with a decay that begins at or after step - 1 under both settings (the step
    at the decay's start still runs at --lr)."""
    if not any(k in math for k in _DECAY_END) or any(k in math for k in SCHEDULE_KNOBS if k not in _DECAY_END):
        return False
    if saved.get("schedule", {}).get("max_time") is not None or cfg.schedule.max_time is not None:
        return True
    if cfg.schedule.schedule != "wsd" or step is None:
        return False
    return min(_wsd_start(cfg.schedule, math, saved=True), _wsd_start(cfg.schedule)) >= step - 1


def _wsd_start(s: ScheduleArgs, math: Optional[dict[str, tuple]] = None, *, saved: bool = False) -> int:
    """The steps taken when the WSD decay of `s` begins, or of the saved run (its values in `math`)."""
    total, decay = s.max_steps, s.decay_steps
    if saved:
        total = math.get("schedule.max_steps", (total,))[0]
        decay = math.get("schedule.decay_steps", (decay,))[0]
    shape = lr_schedule.Shape(peak=s.lr, warmup=s.warmup_steps, decay="wsd", decay_steps=decay)
    return lr_schedule.decay_start(shape, total)


def schedule_hints(math: dict[str, tuple], cfg: TrainConfig, *, step: Optional[int]) -> list[str]:
    """What would allow the schedule's changes in `math` (refused on resume at `step`), for the error."""
    hints = []
    s = cfg.schedule
    if s.schedule == "wsd" and step is not None and any(k in math for k in _DECAY_END):
        began = _wsd_start(s, math, saved=True)
        if began < step - 1:
            hints.append(f"the run's WSD decay had begun (at {began} steps, before the checkpoint's {step})")
        else:
            d = lr_schedule.decay_steps_of(
                lr_schedule.Shape(peak=s.lr, decay="wsd", decay_steps=s.decay_steps), s.max_steps
            )
            hints.append(
                f"the decay would begin before the checkpoint's step {step}; to begin it now pass "
                f"--max_steps {step + d} --decay_steps {d}"
            )
    elif "schedule.max_steps" in math:
        hints.append("a longer --max_steps needs --extend_schedule")
    if any(key.startswith("schedule.") for key in math):
        hints.append(
            "--allow_schedule_change allows another --lr, --warmup_steps, --max_steps, --schedule or --decay_steps"
        )
    return hints


def _place(value: Any) -> Any:
    """A path knob's value as the place it names: resolved against this working directory (model
    presets and URLs as they are), lists element by element."""
    if isinstance(value, (list, tuple)):
        return [_place(v) for v in value]
    if not isinstance(value, str) or value in MODEL_PRESETS:
        return value
    if "://" in value:
        return value.rstrip("/")
    return str(Path(value).expanduser().resolve())


def run_settings(resolved: dict[str, Any]) -> dict[str, Any]:
    """What a run computes, from its resolved record (RUN/config.json): every knob that changes the
    math, the engine's batch and precision, the model's config and the data's identity; not the
    knobs a resume may change (intervals, folders, reporting). Two processes with equal settings
    train the same run."""
    out: dict[str, Any] = {}
    for key, cls in SECTIONS.items():
        for f in cli.knob_fields(cls):
            if f.metadata["math"]:
                out[f"{key}.{f.name}"] = resolved.get(key, {}).get(f.name)
    for key in ("engine", "bert_config", "identity"):
        out[key] = resolved.get(key)
    return out
