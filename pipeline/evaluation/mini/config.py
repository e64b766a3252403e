"""The experiment's settings: one knob per flag of pipeline/reproduce_mini.py.

Every arm shares the same learning rate, schedule shape, batch, seed and steps; they are fixed here,
before any run, and written into the report. `--quick` swaps in tiny sizes (`QUICK`), same pipeline.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

from pipeline.cli import knob
from pipeline.evaluation.downstream.tasks import GLUE_TASKS, TAGGING_TASKS
from preprocessing.errors import UsageError

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared"
MIN_VOCAB, MAX_VOCAB = 100, 1 << 20  # the shard builder's range for a vocabulary it trains


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


def default_tasks(downstream: Path) -> list[tuple[str, Path]]:
    """The shared folder's real tasks: SST-2 and MRPC (English), MSRA NER and ChnSentiCorp (Chinese)."""
    return [
        ("sst2", downstream / "glue" / "SST-2"),
        ("mrpc", downstream / "glue" / "MRPC"),
        ("ner", downstream / "zh_ner"),
        ("chnsenti", downstream / "zh_senti"),
    ]


def parse_tasks(text: str) -> list[tuple[str, Path]]:
    """--tasks NAME=DIR,NAME=DIR: NAME is a finetune.py task (a GLUE name, chnsenti, ner or cws)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, folder = item.partition("=")
        name = name.strip().lower().replace("-", "")
        if not sep or not folder:
            raise argparse.ArgumentTypeError(
                f"--tasks {text!r}: expected NAME=DIR[,NAME=DIR...], e.g. sst2=glue_data/SST-2"
            )
        if name not in GLUE_TASKS and name not in TAGGING_TASKS:
            raise argparse.ArgumentTypeError(
                f"--tasks: unknown task {name!r}; choose from {sorted(GLUE_TASKS) + list(TAGGING_TASKS)}"
            )
        out.append((name, Path(folder)))
    if not out:
        raise argparse.ArgumentTypeError("--tasks: give at least one NAME=DIR")
    if len({n for n, _ in out}) != len(out):
        raise argparse.ArgumentTypeError(f"--tasks {text!r}: a task name appears twice")
    return out


@dataclass
class MiniConfig:
    """The miniature's settings; the defaults are the full experiment the README reports (70-90 minutes on 2 cores)."""

    out: Optional[Path] = knob(
        None, "output folder (stages already done there with the same settings are kept)", parse=Path, required=True
    )
    corpora: Path = knob(SHARED / "corpora", "folder with en/*.txt and zh/*.txt in BERT format", parse=Path)
    tasks: Optional[list] = knob(
        None,
        "NAME=DIR,... downstream tasks (GLUE-format or CoNLL-format folders; default: SST-2, MRPC, MSRA NER "
        "and ChnSentiCorp from ../shared/downstream)",
        parse=parse_tasks,
    )
    quick: bool = knob(False, "tiny settings: the same pipeline in a few minutes (tests)")
    start_only: bool = knob(
        False,
        "stop after the start model: score its held-out MLM accuracy at every --curve checkpoint (OUT/START.md), "
        "to find the --start_steps that leave the floor",
    )
    # Text and tokenizer.
    en_mb: float = knob(6.0, "MB of English text for pre-training")
    zh_mb: float = knob(6.0, "MB of Chinese text for pre-training")
    heldout_docs: int = knob(40, "documents per language held out (never trained on) for evaluation")
    vocab_size: int = knob(16000, "joint en+zh WordPiece vocabulary")
    # Model and pre-training (every arm).
    layers: int = knob(4, "encoder layers")
    hidden: int = knob(256, "hidden size (heads of 64, feed-forward 4x)")
    max_seq_len: int = knob(128, "tokens per sequence")
    micro_batch: int = knob(32, "sequences per step")
    lr: float = knob(1e-3, "peak learning rate of every run")
    warmup_share: float = knob(0.06, "share of each run's steps spent warming up (then linear decay to 0)")
    start_steps: int = knob(800, "steps of the MLM start model, and of the TACO run from scratch")
    continue_steps: int = knob(400, "steps of each TaCL arm (MLM alone, MLM + TaCL) from the start model")
    curve: tuple = knob(
        (0.25, 0.5, 1.0),
        "shares of --start_steps at which the from-scratch runs are scored downstream",
        parse=_fractions,
    )
    bf16: bool = knob(True, "pre-train in fp32 instead of bf16 (with fp32 master weights)", flag="--fp32", invert=True)
    seed: int = knob(0, "seed of every pre-training run")
    # Downstream.
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
    analysis_sequences: int = knob(256, "held-out sequences for the representation analysis")
    reference_model: Optional[Path] = knob(
        None,
        "a pre-trained HF BERT folder fine-tuned on SST-2 as a reference row (default: all-MiniLM-L6-v2 "
        "when the pretrained extra is installed)",
        parse=Path,
    )

    def validate(self) -> None:
        """UsageError naming the flag of any value that cannot be meant, before any stage runs."""
        for flag in ("en_mb", "zh_mb", "lr", "ft_epochs", "ft_lr"):
            if not 0 < getattr(self, flag) < math.inf:
                raise UsageError(f"--{flag} must be > 0 and finite (got {getattr(self, flag)})")
        for flag in (
            "heldout_docs",
            "layers",
            "hidden",
            "max_seq_len",
            "micro_batch",
            "start_steps",
            "continue_steps",
            "train_samples",
            "eval_samples",
            "ft_batch",
            "ft_seq_len",
            "analysis_sequences",
        ):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise UsageError(f"--{flag} must be >= 1 (got {getattr(self, flag)})")
        if not MIN_VOCAB <= self.vocab_size <= MAX_VOCAB:
            raise UsageError(f"--vocab_size {self.vocab_size}: must be between {MIN_VOCAB} and {MAX_VOCAB}")
        if self.hidden % 64 and self.hidden >= 64:
            raise UsageError(f"--hidden {self.hidden}: must be a multiple of 64 (heads of 64)")
        if not 0 <= self.warmup_share < 1:
            raise UsageError(f"--warmup_share must be in [0, 1) (got {self.warmup_share})")
        steps = [f * self.start_steps for f in self.curve]
        if any(abs(s - round(s)) > 1e-9 or s < 1 for s in steps) or self.curve[-1] != 1.0:
            raise UsageError(
                f"--curve {','.join(map(str, self.curve))}: each share of --start_steps {self.start_steps} must be a "
                f"whole step, in increasing order, ending at 1"
            )
        if len(self.seeds) < 2:
            raise UsageError(f"--ft_seeds {self.ft_seeds!r}: give at least 2 seeds, so that a spread exists")
        repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if repeated:
            raise UsageError(
                f"--ft_seeds {self.ft_seeds}: seed(s) {repeated} repeated; a repeated seed is the same run again and "
                f"would shrink the reported spread; give distinct seeds"
            )
        for lang in ("en", "zh"):
            if not sorted((self.corpora / lang).glob("*.txt")):
                raise UsageError(
                    f"--corpora {self.corpora}: no {lang}/*.txt (BERT-format text: a sentence or paragraph a "
                    f"line, a blank line after each document)"
                )
        for name, folder in [] if self.start_only else self.task_list:
            if not folder.is_dir():
                raise UsageError(f"--tasks: {name}={folder}: no such folder")

    @property
    def seeds(self) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in self.ft_seeds.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--ft_seeds {self.ft_seeds!r}: expected comma-separated integers") from None

    @property
    def task_list(self) -> list[tuple[str, Path]]:
        return self.tasks if self.tasks is not None else default_tasks(SHARED / "downstream")

    def curve_steps(self) -> list[int]:
        """The from-scratch checkpoints scored downstream, e.g. [200, 400, 800]."""
        return [round(f * self.start_steps) for f in self.curve]

    def save_every(self) -> int:
        """A checkpoint interval that hits every curve step."""
        return math.gcd(*self.curve_steps())

    def heads(self) -> int:
        return max(1, self.hidden // 64)

    def bert_config(self, vocab_size: int) -> dict:
        """The BertConfig of every from-scratch model (the start model and TACO), for the trained
        vocabulary's real size (WordPiece may add a few pieces to --vocab_size)."""
        return {
            "model_type": "bert",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads(),
            "intermediate_size": 4 * self.hidden,
            "max_position_embeddings": max(512, self.max_seq_len),
            "type_vocab_size": 2,
            "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1,
            "layer_norm_eps": 1e-12,
            "initializer_range": 0.02,
        }


# --quick: the same stages on a few hundred KB of text, a 2-layer model and tens of steps.
QUICK = dict(
    en_mb=0.25,
    zh_mb=0.25,
    heldout_docs=6,
    vocab_size=3000,
    layers=2,
    hidden=64,
    max_seq_len=64,
    micro_batch=8,
    start_steps=24,
    continue_steps=12,
    curve=(0.5, 1.0),
    bf16=False,
    ft_bf16=False,
    train_samples=48,
    eval_samples=48,
    ft_epochs=1.0,
    ft_batch=16,
    ft_seq_len=64,
    analysis_sequences=16,
)


def effective(cfg: MiniConfig) -> MiniConfig:
    """cfg with QUICK's sizes under --quick, except where a flag was set away from its full-run default."""
    if not cfg.quick:
        return cfg
    defaults = {f.name: f.default for f in fields(MiniConfig)}
    assert set(QUICK) <= set(defaults)
    return replace(cfg, **{k: v for k, v in QUICK.items() if getattr(cfg, k) == defaults[k]})


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

    changes = {}
    if cfg.bf16 and pretrain_on_cpu:
        changes["bf16"] = False
    if cfg.ft_bf16:
        changes["ft_bf16"] = False
    if not changes:
        return cfg, []
    what = " and ".join({"bf16": "pre-training", "ft_bf16": "fine-tuning"}[k] for k in changes)
    note = (
        f"{what} in fp32, not bf16: {slow_bf16_reason('cpu', native=False)}; the scores will differ from a "
        "bf16 run's (the report's settings say which ran)"
    )
    return replace(cfg, **changes), [note]
