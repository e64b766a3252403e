"""The shard builder's configuration: one typed dataclass whose fields are `cli.knob`s (the flags,
a `--config` file's `build` section, `--print_config` and the `--resume` check all come from them),
and its validation (UsageError naming the flag and value; the CLI turns that into exit code 2)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from preprocessing import charsets, cli
from preprocessing.cli import knob
from preprocessing.errors import UsageError
from preprocessing.shard_format import FORMATS
from preprocessing.tokenization import SP_MODEL_TYPES, TRAINABLE

TOKENIZER = "tokenizer (one of)"
SAMPLES = "samples"
EXECUTION = "execution"


@dataclass
class BuildConfig:
    """Everything a build depends on. The knobs marked math (the default) decide which samples a
    build writes: a resumed build must agree on them (`output.fingerprint`). Those marked
    math=False may change on --resume; --input, --encoding and --chunk_mb among them because
    --resume compares what they resolve to (the files, their encodings, chunk_bytes), not their
    spelling."""

    inputs: list[str] = knob(
        help="text (BERT format), .jsonl, .parquet, a datasets save_to_disk folder, or .gz/.zst text/JSONL; "
        "repeat for more. The prefix fixes the language, else it is detected per document.",
        flag="--input",
        repeat=True,
        required=True,
        math=False,
        default_factory=list,
        metavar="[en:|zh:]PATH_OR_GLOB",
    )
    output: Optional[str] = knob(None, "the shard folder to write", required=True, math=False, metavar="DIR")
    tokenizer: Optional[str] = knob(
        None, "an HF tokenizer folder (or hub name)", metavar="DIR_OR_NAME", group=TOKENIZER
    )
    train_tokenizer: Optional[str] = knob(
        None,
        "train a joint EN+ZH vocabulary on the inputs into OUTPUT/tokenizer: wordpiece (BERT's), unigram (HF "
        "tokenizers' unigram; both keep every ideograph a token), or sentencepiece (the sentencepiece library; "
        "keeps its .model file beside the HF tokenizer)",
        choices=TRAINABLE,
        group=TOKENIZER,
    )
    # Resolved in __post_init__, so a resumed build compares (and the manifest records) the algorithm used.
    sp_model_type: Optional[str] = knob(
        None,
        "the algorithm of --train_tokenizer sentencepiece (default: unigram)",
        choices=SP_MODEL_TYPES,
        group=TOKENIZER,
    )
    vocab_size: int = knob(30522, "the size of a trained vocabulary", group=TOKENIZER)
    lowercase: bool = knob(
        True, "keep case when training a tokenizer (default: lower-case)", flag="--cased", invert=True, group=TOKENIZER
    )
    tokenizer_train_mb: float = knob(
        256.0, "text sampled across all inputs to train the tokenizer (MB)", group=TOKENIZER
    )
    format: str = knob(
        "nsp", "nsp: [CLS] A [SEP] B [SEP] pairs (TaCL); packed: full blocks (TACO)", choices=FORMATS, group=SAMPLES
    )
    max_seq_len: int = knob(128, "tokens per sample, [CLS] and [SEP]s included", group=SAMPLES)
    short_seq_prob: float = knob(0.1, "nsp: the share of pairs made shorter than max_seq_len", group=SAMPLES)
    random_next_prob: float = knob(0.5, "nsp: the share of pairs whose B is another document's", group=SAMPLES)
    seed: int = knob(12345, "the seed of the nsp pairs and of the held-out documents", group=SAMPLES)
    eval_share: float = knob(
        0.0,
        "hold out this share of the documents, in every language, for evaluation: their samples go to "
        "OUTPUT/eval (a shard folder of its own), never to training. A document is held out when a hash "
        "of --seed and its text falls in that share of the hash range, so the choice does not depend on "
        "the workers, the chunks or the order of the inputs",
        group=SAMPLES,
    )
    text_field: str = knob("text", "JSONL/Parquet/datasets column holding the text", group=SAMPLES)
    encodings: list[str] = knob(
        help="read text/JSONL inputs in this encoding (default utf-8): ENCODING for all of them, GLOB=ENCODING "
        "for those whose path or file name matches GLOB; repeatable, the last match wins "
        "(e.g. --encoding '*.gbk.txt=gb18030')",
        flag="--encoding",
        repeat=True,
        math=False,
        default_factory=list,
        metavar="[GLOB=]ENCODING",
        group=SAMPLES,
    )
    num_workers: Optional[int] = knob(
        None, "parallel Ray tasks (default, and at most: every CPU Ray sees)", math=False, group=EXECUTION
    )
    ray_address: Optional[str] = knob(
        None, "join a running cluster ('auto' or HOST:PORT); default: start Ray here", math=False, group=EXECUTION
    )
    chunk_mb: Optional[float] = knob(
        None, "input MB per task (default: total/64, between 1 and 64)", math=False, group=EXECUTION
    )
    block_mb: float = knob(4.0, "text MB processed at once inside a task; NSP draws random B from it", group=EXECUTION)
    resume: bool = knob(False, "finish an interrupted build in OUTPUT", math=False, group=EXECUTION)
    overwrite: bool = knob(False, "replace a previous build in OUTPUT", math=False, group=EXECUTION)
    remote: Optional[str] = knob(
        None, "also upload shards as they are written (s3://, gs://, ...)", metavar="URL", group=EXECUTION
    )
    progress: bool = knob(True, "no progress bar", flag="--no_progress", invert=True, math=False, group=EXECUTION)
    print_config: bool = False  # --print_config: print the resolved configuration and exit (not a knob)

    def __post_init__(self) -> None:
        if self.train_tokenizer == "sentencepiece" and self.sp_model_type is None:
            self.sp_model_type = "unigram"

    def validate(self) -> None:
        """Raise UsageError naming the offending flag and value."""
        if not self.inputs:
            raise UsageError("--input: give at least one input path or glob")
        if not self.output:
            raise UsageError("--output: required")
        if bool(self.tokenizer) == bool(self.train_tokenizer):
            raise UsageError(f"give exactly one of --tokenizer DIR_OR_NAME and --train_tokenizer {'|'.join(TRAINABLE)}")
        if self.train_tokenizer and self.train_tokenizer not in TRAINABLE:
            raise UsageError(f"--train_tokenizer {self.train_tokenizer}: choose one of {', '.join(TRAINABLE)}")
        if self.sp_model_type is not None:
            if self.sp_model_type not in SP_MODEL_TYPES:
                raise UsageError(f"--sp_model_type {self.sp_model_type}: choose one of {', '.join(SP_MODEL_TYPES)}")
            if self.train_tokenizer != "sentencepiece":
                raise UsageError(
                    f"--sp_model_type {self.sp_model_type}: only applies to --train_tokenizer "
                    "sentencepiece; drop it or train a sentencepiece tokenizer"
                )
        if self.train_tokenizer and not 100 <= self.vocab_size <= 1 << 20:
            raise UsageError(f"--vocab_size {self.vocab_size}: must be between 100 and {1 << 20}")
        if self.format not in FORMATS:
            raise UsageError(f"--format {self.format}: choose {' or '.join(FORMATS)}")
        lowest = 5 if self.format == "nsp" else 2
        if not lowest <= self.max_seq_len <= 1 << 16:
            raise UsageError(
                f"--max_seq_len {self.max_seq_len}: must be between {lowest} and {1 << 16} for --format {self.format}"
            )
        for name in ("short_seq_prob", "random_next_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"--{name} {getattr(self, name)}: must be between 0 and 1")
        if not 0.0 <= self.eval_share < 1.0:
            raise UsageError(
                f"--eval_share {self.eval_share}: must be at least 0 and below 1 (a share of the documents)"
            )
        self._validate_execution()
        if not self.text_field:
            raise UsageError("--text_field: must not be empty")
        charsets.parse_rules(self.encodings)

    def _validate_execution(self) -> None:
        if self.num_workers is not None and self.num_workers < 1:
            raise UsageError(f"--num_workers {self.num_workers}: must be at least 1")
        if self.chunk_mb is not None and self.chunk_mb <= 0:
            raise UsageError(f"--chunk_mb {self.chunk_mb}: must be positive")
        if self.block_mb <= 0:
            raise UsageError(f"--block_mb {self.block_mb}: must be positive")
        if self.tokenizer_train_mb <= 0:
            raise UsageError(f"--tokenizer_train_mb {self.tokenizer_train_mb}: must be positive")
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite exclude each other")

    def encoding_rules(self) -> list[tuple[str | None, str]]:
        return charsets.parse_rules(self.encodings)

    def to_dict(self) -> dict[str, Any]:
        """The knobs and their values (what the manifest records and --print_config prints)."""
        return {f.name: getattr(self, f.name) for f in cli.knob_fields(BuildConfig)}


SECTION = "build"
"""A --config file's section of builder knobs (`{"build": {"max_seq_len": 256, ...}}`)."""


def math_knobs() -> list[str]:
    """The knobs whose values decide the samples (marked math): what --resume compares."""
    return [f.name for f in cli.knob_fields(BuildConfig) if f.metadata["math"]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_shards.py",
        description="Turn English/Chinese corpora into MDS shards for BERT pre-training (Ray-parallel). Flags "
        "override a --config file, which overrides the defaults shown.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"JSON or YAML file with a section {SECTION!r} of the flags below (without their dashes); "
        "flags given here override it",
    )
    p.add_argument("--print_config", action="store_true", help="print the resolved configuration as JSON and exit")
    cli.add_arguments(p, BuildConfig)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> BuildConfig:
    """Defaults, then a --config file, then the flags typed; validated. argparse exits 2 on malformed
    flags and on --input/--output missing from both; validation raises UsageError."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    file_values = cli.load_config_file(ns.config) if ns.config else {}
    parts = cli.merge_sections(
        {SECTION: BuildConfig},
        file_values=file_values,
        cli_values={SECTION: cli.set_values(ns, BuildConfig)},
        source=f"--config {ns.config}",
    )
    missing = cli.missing_required(parts)
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (as flags or in a --config file)")
    cfg = dataclasses.replace(parts[SECTION], print_config=ns.print_config)
    cfg.validate()
    return cfg


def describe_json(cfg: BuildConfig) -> str:
    """The resolved configuration, as --print_config shows it (replayable with --config)."""
    return json.dumps({SECTION: cfg.to_dict()}, indent=2)
