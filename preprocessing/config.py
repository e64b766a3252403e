"""The shard builder's configuration: one typed dataclass, the command line that fills it, and
its validation (ValueError naming the flag and value; the CLI turns that into exit code 2)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields

from preprocessing import charsets
from preprocessing.errors import UsageError
from preprocessing.shard_format import FORMATS
from preprocessing.tokenization import SP_MODEL_TYPES, TRAINABLE


@dataclass
class BuildConfig:
    """Everything a build depends on. Fields that change the samples (see `OUTPUT_KEYS`) must
    match when a build is resumed."""

    inputs: list[str]
    output: str
    tokenizer: str | None = None
    train_tokenizer: str | None = None
    sp_model_type: str | None = None  # --train_tokenizer sentencepiece only (default unigram)
    vocab_size: int = 30522
    lowercase: bool = True
    tokenizer_train_mb: float = 256.0
    format: str = "nsp"
    max_seq_len: int = 128
    short_seq_prob: float = 0.1
    random_next_prob: float = 0.5
    seed: int = 12345
    text_field: str = "text"
    encodings: list[str] = field(default_factory=list)
    num_workers: int | None = None
    ray_address: str | None = None
    chunk_mb: float | None = None
    block_mb: float = 4.0
    resume: bool = False
    overwrite: bool = False
    remote: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # Resolved here, so a resumed build compares (and the manifest records) the algorithm used.
        if self.train_tokenizer == "sentencepiece" and self.sp_model_type is None:
            self.sp_model_type = "unigram"

    def validate(self) -> None:
        """Raise ValueError naming the offending flag and value."""
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
        if not self.text_field:
            raise UsageError("--text_field: must not be empty")
        charsets.parse_rules(self.encodings)

    def encoding_rules(self) -> list[tuple[str | None, str]]:
        return charsets.parse_rules(self.encodings)

    def to_dict(self) -> dict:
        return asdict(self)


# The fields that decide which samples a build writes; a resumed build must agree on them.
OUTPUT_KEYS = (
    "format",
    "max_seq_len",
    "short_seq_prob",
    "random_next_prob",
    "seed",
    "text_field",
    "block_mb",
    "remote",
    "train_tokenizer",
    "sp_model_type",
    "vocab_size",
    "lowercase",
    "tokenizer_train_mb",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_shards.py",
        description="Turn English/Chinese corpora into MDS shards for BERT pre-training (Ray-parallel).",
    )
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="[en:|zh:]PATH_OR_GLOB",
        help="text (BERT format), .jsonl, .parquet, a datasets save_to_disk folder, or "
        ".gz/.zst text/JSONL; repeat for more. The prefix fixes the language, "
        "else it is detected per document.",
    )
    p.add_argument("--output", required=True, metavar="DIR")
    tok = p.add_argument_group("tokenizer (one of)")
    tok.add_argument("--tokenizer", metavar="DIR_OR_NAME", help="an HF tokenizer folder (or hub name)")
    tok.add_argument(
        "--train_tokenizer",
        choices=TRAINABLE,
        help="train a joint EN+ZH vocabulary on the inputs into OUTPUT/tokenizer: "
        "wordpiece (BERT's), unigram (HF tokenizers' unigram; both keep every "
        "ideograph a token), or sentencepiece (the sentencepiece library; keeps "
        "its .model file beside the HF tokenizer)",
    )
    tok.add_argument(
        "--sp_model_type",
        choices=SP_MODEL_TYPES,
        default=None,
        help="the algorithm of --train_tokenizer sentencepiece (default: unigram)",
    )
    tok.add_argument("--vocab_size", type=int, default=BuildConfig.vocab_size)
    tok.add_argument(
        "--cased",
        dest="lowercase",
        action="store_false",
        help="keep case when training a tokenizer (default: lower-case)",
    )
    tok.add_argument(
        "--tokenizer_train_mb",
        type=float,
        default=BuildConfig.tokenizer_train_mb,
        help="text sampled across all inputs to train the tokenizer (MB)",
    )
    s = p.add_argument_group("samples")
    s.add_argument(
        "--format",
        choices=FORMATS,
        default=BuildConfig.format,
        help="nsp: [CLS] A [SEP] B [SEP] pairs (TaCL); packed: full blocks (TACO)",
    )
    s.add_argument("--max_seq_len", type=int, default=BuildConfig.max_seq_len)
    s.add_argument("--short_seq_prob", type=float, default=BuildConfig.short_seq_prob)
    s.add_argument("--random_next_prob", type=float, default=BuildConfig.random_next_prob)
    s.add_argument("--seed", type=int, default=BuildConfig.seed)
    s.add_argument(
        "--text_field", default=BuildConfig.text_field, help="JSONL/Parquet/datasets column holding the text"
    )
    s.add_argument(
        "--encoding",
        dest="encodings",
        action="append",
        default=[],
        metavar="[GLOB=]ENCODING",
        help="read text/JSONL inputs in this encoding (default utf-8): ENCODING for all of "
        "them, GLOB=ENCODING for those whose path or file name matches GLOB; repeatable, "
        "the last match wins (e.g. --encoding '*.gbk.txt=gb18030')",
    )
    r = p.add_argument_group("execution")
    r.add_argument(
        "--num_workers", type=int, default=None, help="parallel Ray tasks (default, and at most: every CPU Ray sees)"
    )
    r.add_argument(
        "--ray_address", default=None, help="join a running cluster ('auto' or HOST:PORT); default: start Ray here"
    )
    r.add_argument(
        "--chunk_mb", type=float, default=None, help="input MB per task (default: total/64, between 1 and 64)"
    )
    r.add_argument(
        "--block_mb",
        type=float,
        default=BuildConfig.block_mb,
        help="text MB processed at once inside a task; NSP draws random B from it",
    )
    r.add_argument("--resume", action="store_true", help="finish an interrupted build in OUTPUT")
    r.add_argument("--overwrite", action="store_true", help="replace a previous build in OUTPUT")
    r.add_argument(
        "--remote", default=None, metavar="URL", help="also upload shards as they are written (s3://, gs://, ...)"
    )
    r.add_argument("--no_progress", dest="progress", action="store_false")
    return p


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """Parse and validate the command line; argparse exits 2 on malformed flags, validation
    raises ValueError."""
    ns = build_parser().parse_args(argv)
    names = {f.name for f in fields(BuildConfig)}
    cfg = BuildConfig(**{k: v for k, v in vars(ns).items() if k in names})
    cfg.validate()
    return cfg
