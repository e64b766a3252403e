"""The miniature's settings: one knob per flag, in sections that are also what the stages depend on
(a changed knob reruns the stages that read its section, and every stage after them).

What an arm trains (objective, NSP, learning rate, data mix, loader) is its train.py --config file in
configs/ (ARMS), and the micro-batch and precision are the DeepSpeed config's (configs/deepspeed_bf16.json,
or deepspeed_fp32.json under --fp32). `--config FILE` (JSON or YAML, the sections below) sits between
the defaults and the flags typed; `--quick` is `--config configs/quick.yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.evaluation.downstream.tasks import GLUE_TASKS, TAGGING_TASKS, TASK_CHOICES, TaskSpec, classify_spec
from pipeline.modeling.bert_config import PRESETS
from preprocessing import cli
from preprocessing.cli import knob
from preprocessing.errors import UsageError

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
REPO = HERE.parents[2]
QUICK = CONFIGS / "quick.yaml"
PROG = "python -m pipeline.experiments.mini"
# The pre-training runs, each a train.py --config file: the start model (MLM from scratch), TACO from
# scratch, and TaCL's two arms continued from the start.
ARMS = ("mlm", "taco", "cont_mlm", "cont_tacl")
MIN_VOCAB, MAX_VOCAB = 100, 1 << 20  # the shard builder's range for a vocabulary it trains
# Held-out samples per language that every run's own evaluation reads at each checkpoint (the first ones
# of the language's held-out shards): as many as the 64 blocks the committed runs' scorer read.
HELDOUT_SAMPLES = 64


def _fractions(text: str) -> tuple:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--curve {text!r}: expected comma-separated shares, e.g. 0.25,0.5,1"
        ) from None
    if not out or list(out) != sorted(set(out)) or out[0] <= 0:
        raise argparse.ArgumentTypeError(f"--curve {text!r}: expected increasing shares in (0, 1], e.g. 0.25,0.5,1")
    return out


def parse_tasks(text: str) -> list[TaskSpec]:
    """--tasks NAME=DIR,NAME=classify:DIR,...: NAME=DIR is a finetune.py task (a GLUE name, chnsenti, ner
    or cws); NAME=classify:DIR any label<TAB>text folder."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        spec = classify_spec(item)
        if spec is None:
            name, sep, folder = item.partition("=")
            name = name.strip().lower().replace("-", "")
            if not sep or not folder:
                raise argparse.ArgumentTypeError(
                    f"--tasks {text!r}: expected NAME=DIR[,NAME=DIR...], e.g. sst2=glue_data/SST-2"
                )
            if name not in GLUE_TASKS and name not in TAGGING_TASKS:
                raise argparse.ArgumentTypeError(f"--tasks: unknown task {name!r}; {TASK_CHOICES}")
            spec = TaskSpec(name, Path(folder))
        out.append(spec)
    if not out:
        raise argparse.ArgumentTypeError("--tasks: give at least one NAME=DIR")
    if len({t.name for t in out}) != len(out):
        raise argparse.ArgumentTypeError(f"--tasks {text!r}: a task name appears twice")
    return out


@dataclass
class TextArgs:
    """The text, its vocabulary and shards (stages data, tokenizer, shards/*)."""

    corpora: Optional[Path] = knob(
        None, "folder with en/*.txt and zh/*.txt in BERT format (e.g. ../shared/corpora)", parse=Path, required=True
    )
    en_mb: float = knob(6.0, "MB of English text for pre-training")
    zh_mb: float = knob(6.0, "MB of Chinese text for pre-training")
    heldout_docs: int = knob(40, "documents per language held out (never trained on) for evaluation")
    vocab_size: int = knob(16000, "joint en+zh WordPiece vocabulary")
    max_seq_len: int = knob(128, "tokens per pre-training sequence")
    seed: int = knob(0, "seed of the shards, every pre-training run, the held-out masks and the analysis")


@dataclass
class PretrainArgs:
    """Every pre-training run (stages runs/*); what each arm trains is its configs/ARM.yaml."""

    model: str = knob(
        "configs/model.json",
        "--model_config of the from-scratch runs: tiny, base, large, or a BertConfig JSON (without vocab_size: the "
        "trained vocabulary's), relative to the working folder or to this experiment's (configs/model.json: 4 x 256)",
    )
    bf16: bool = knob(
        True, "pre-train in fp32 (configs/deepspeed_fp32.json) instead of bf16", flag="--fp32", invert=True
    )
    warmup_share: float = knob(0.06, "share of each run's steps spent warming up (then linear decay to 0)")
    start_steps: int = knob(800, "steps of the MLM start model, and of the TACO run from scratch")
    continue_steps: int = knob(400, "steps of each TaCL arm (MLM alone, MLM + TaCL) from the start model")
    curve: tuple[float, ...] = knob(
        (0.25, 0.5, 1.0),
        "shares of --start_steps at which the from-scratch runs are scored downstream",
        parse=_fractions,
    )


@dataclass
class AnalysisArgs:
    """The held-out MLM scores and the representation analysis (stages analysis, start_floor)."""

    analysis_sequences: int = knob(256, "held-out sequences for the representation analysis")


@dataclass
class FinetuneArgs:
    """finetune.py's recipe, the same for every model (stages downstream/*)."""

    tasks: Optional[list] = knob(
        None,
        "NAME=DIR,... downstream tasks, required unless --start_only: finetune.py's (GLUE TSV or CoNLL folders; "
        "NAME=classify:DIR for any label<TAB>text folder)",
        parse=parse_tasks,
    )
    train_samples: int = knob(1500, "training examples per task (the first N of its train file)")
    eval_samples: Optional[int] = knob(
        1000, "dev examples per task (the first N; SST-2's and MRPC's dev sets are smaller)"
    )
    ft_epochs: float = knob(2.0, "fine-tuning epochs")
    ft_lr: float = knob(1e-4, "fine-tuning peak learning rate")
    ft_batch: int = knob(32, "fine-tuning batch")
    ft_seq_len: int = knob(64, "fine-tuning tokens per example")
    ft_seeds: str = knob("1,2,3", "fine-tuning seeds")
    ft_bf16: bool = knob(True, "fine-tune in fp32 instead of under bf16 autocast", flag="--ft_fp32", invert=True)
    reference_model: Optional[Path] = knob(
        None,
        "a pre-trained HF BERT folder fine-tuned on SST-2 as a reference row (default: all-MiniLM-L6-v2 "
        "when the pretrained extra is installed)",
        parse=Path,
    )


@dataclass
class RunArgs:
    """Where the stages go and which of them run; no stage depends on these."""

    out: Optional[Path] = knob(
        None, "output folder (stages already done there with the same settings are kept)", parse=Path, required=True
    )
    start_only: bool = knob(
        False,
        "stop after the start model: score its held-out MLM accuracy at every --curve checkpoint (OUT/START.md), "
        "to find the --start_steps that leave the floor",
    )


SECTIONS: dict[str, type] = {
    "text": TextArgs,
    "pretrain": PretrainArgs,
    "analysis": AnalysisArgs,
    "finetune": FinetuneArgs,
    "run": RunArgs,
}


@dataclass
class MiniConfig:
    """The experiment's settings; the defaults are the full experiment (70-90 minutes on 2 cores)."""

    text: TextArgs
    pretrain: PretrainArgs = field(default_factory=PretrainArgs)
    analysis: AnalysisArgs = field(default_factory=AnalysisArgs)
    finetune: FinetuneArgs = field(default_factory=FinetuneArgs)
    run: RunArgs = field(default_factory=RunArgs)
    config_file: Optional[str] = None  # the --config (or --quick) file the settings came from

    @property
    def out(self) -> Path:
        return self.run.out

    @property
    def seeds(self) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in self.finetune.ft_seeds.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--ft_seeds {self.finetune.ft_seeds!r}: expected comma-separated integers") from None

    def curve_steps(self) -> list[int]:
        """The from-scratch checkpoints scored downstream, e.g. [200, 400, 800]."""
        return [round(f * self.pretrain.start_steps) for f in self.pretrain.curve]

    def save_every(self) -> int:
        """A checkpoint interval that hits every curve step."""
        return math.gcd(*self.curve_steps())

    @property
    def ds_config(self) -> Path:
        """The DeepSpeed config of every pre-training run: micro-batch, precision, optimizer, schedule shape."""
        return CONFIGS / f"deepspeed_{'bf16' if self.pretrain.bf16 else 'fp32'}.json"

    def model_config(self) -> str:
        """--model as train.py's --model_config: a preset name, or the JSON file's path."""
        model = self.pretrain.model
        if model in PRESETS or Path(model).is_file():
            return model
        if (HERE / model).is_file():
            return str(HERE / model)
        raise UsageError(f"--model {model!r}: neither one of {list(PRESETS)} nor a BertConfig JSON file")

    def micro_batch(self) -> int:
        return json.loads(self.ds_config.read_text())["train_micro_batch_size_per_gpu"]

    def record(self) -> dict:
        """The settings as the report writes them (paths as text), sections first."""
        out = json.loads(json.dumps({k: dataclasses.asdict(getattr(self, k)) for k in SECTIONS}, default=str))
        out["finetune"]["tasks"] = [list(map(str, t)) for t in self.finetune.tasks or []]
        out["config_file"] = self.config_file
        return out

    def validate(self) -> None:
        """UsageError naming the flag of any value that cannot be meant, before any stage runs."""
        t, p, a, f = self.text, self.pretrain, self.analysis, self.finetune
        for flag, value in (("en_mb", t.en_mb), ("zh_mb", t.zh_mb), ("ft_epochs", f.ft_epochs), ("ft_lr", f.ft_lr)):
            if not 0 < value < math.inf:
                raise UsageError(f"--{flag} must be > 0 and finite (got {value})")
        for flag, value in (
            ("heldout_docs", t.heldout_docs),
            ("max_seq_len", t.max_seq_len),
            ("start_steps", p.start_steps),
            ("continue_steps", p.continue_steps),
            ("analysis_sequences", a.analysis_sequences),
            ("train_samples", f.train_samples),
            ("eval_samples", f.eval_samples),
            ("ft_batch", f.ft_batch),
            ("ft_seq_len", f.ft_seq_len),
        ):
            if value is not None and value < 1:
                raise UsageError(f"--{flag} must be >= 1 (got {value})")
        if not MIN_VOCAB <= t.vocab_size <= MAX_VOCAB:
            raise UsageError(f"--vocab_size {t.vocab_size}: must be between {MIN_VOCAB} and {MAX_VOCAB}")
        if not 0 <= p.warmup_share < 1:
            raise UsageError(f"--warmup_share must be in [0, 1) (got {p.warmup_share})")
        self._validate_curve()
        self._validate_seeds()
        self._validate_paths()

    def _validate_curve(self) -> None:
        curve = list(self.pretrain.curve)
        steps = [f * self.pretrain.start_steps for f in curve]
        bad = any(abs(s - round(s)) > 1e-9 or s < 1 for s in steps) or curve != sorted(set(curve))
        if bad or curve[-1:] != [1.0]:
            raise UsageError(
                f"--curve {','.join(map(str, self.pretrain.curve))}: each share of --start_steps "
                f"{self.pretrain.start_steps} must be a whole step, in increasing order, ending at 1"
            )

    def _validate_seeds(self) -> None:
        seeds, text = self.seeds, self.finetune.ft_seeds
        if len(seeds) < 2:
            raise UsageError(f"--ft_seeds {text!r}: give at least 2 seeds, so that a spread exists")
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:
            raise UsageError(
                f"--ft_seeds {text}: seed(s) {repeated} repeated; a repeated seed is the same run again and "
                f"would shrink the reported spread; give distinct seeds"
            )

    def _validate_paths(self) -> None:
        for lang in ("en", "zh"):
            if not sorted((self.text.corpora / lang).glob("*.txt")):
                raise UsageError(
                    f"--corpora {self.text.corpora}: no {lang}/*.txt (BERT-format text: a sentence or paragraph "
                    f"a line, a blank line after each document)"
                )
        self.model_config()
        if self.run.start_only:
            return
        if not self.finetune.tasks:
            raise UsageError("--tasks is required (NAME=DIR,...), unless --start_only")
        for name, folder, _ in self.finetune.tasks:
            if not folder.is_dir():
                raise UsageError(f"--tasks: {name}={folder}: no such folder")


def build_parser() -> argparse.ArgumentParser:
    from pipeline.experiments.mini import __doc__ as doc

    p = argparse.ArgumentParser(prog=PROG, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    files = p.add_mutually_exclusive_group()
    files.add_argument("--config", help="JSON or YAML file of sections text/pretrain/analysis/finetune/run")
    files.add_argument("--quick", action="store_true", help=f"the same stages in a few minutes: --config {QUICK.name}")
    for key, cls in SECTIONS.items():
        cli.add_arguments(p.add_argument_group(key), cls)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> MiniConfig:
    """The settings from the defaults, then --config (or --quick), then the flags typed. A required knob
    left unset is argparse's usage error (exit 2); bad values are UsageErrors raised by validate()."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    path = str(QUICK) if ns.quick else ns.config
    file_values = cli.load_config_file(path) if path else {}
    cli_values = {key: cli.set_values(ns, cls) for key, cls in SECTIONS.items()}
    parts = cli.merge_sections(SECTIONS, file_values=file_values, cli_values=cli_values, source=f"--config {path}")
    missing = cli.missing_required(parts)
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (as flags or in a --config file)")
    tasks = parts["finetune"].tasks
    if tasks and not isinstance(tasks[0], TaskSpec):  # a --config file's list of NAME=DIR strings
        try:
            parts["finetune"].tasks = parse_tasks(",".join(map(str, tasks)))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--config {path}: finetune.{e}") from None
    if path and Path(path).resolve().is_relative_to(REPO):  # as the repository's root names it (the reports)
        path = str(Path(path).resolve().relative_to(REPO))
    return MiniConfig(**parts, config_file=path)


def native_precision(
    cfg: MiniConfig, *, bf16_native: bool, pretrain_on_cpu: bool = True
) -> tuple[MiniConfig, list[str]]:
    """cfg with bf16 turned to fp32 where this CPU has no native bf16 (pipeline.hardware), and the
    notes that say so. Fine-tuning always runs on the CPU; pre-training does unless DS_ACCELERATOR
    names another device. Without AVX-512, bf16 runs about 25x slower than fp32, which no 90-minute
    budget survives; the numbers then differ from a bf16 run's, and the report's settings say fp32."""
    if bf16_native:
        return cfg, []
    from pipeline.hardware import slow_bf16_reason  # torch: not at import, so --help and flag errors stay fast

    pretrain = cfg.pretrain.bf16 and pretrain_on_cpu
    finetune = cfg.finetune.ft_bf16
    if not (pretrain or finetune):
        return cfg, []
    what = " and ".join(name for name, on in (("pre-training", pretrain), ("fine-tuning", finetune)) if on)
    note = (
        f"{what} in fp32, not bf16: {slow_bf16_reason('cpu', native=False)}; the scores will differ from a "
        "bf16 run's (the report's settings say which ran)"
    )
    return (
        dataclasses.replace(
            cfg,
            pretrain=dataclasses.replace(cfg.pretrain, bf16=cfg.pretrain.bf16 and not pretrain),
            finetune=dataclasses.replace(cfg.finetune, ft_bf16=False),
        ),
        [note],
    )
