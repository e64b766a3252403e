"""The contract between the shard builder (preprocessing/) and the trainer (pipeline/data/): what a
shard folder holds, in one place. Both sides import it; neither restates any of it.

DATA/ (a build's --output):
  index.json            the MDS index over every shard (what StreamingDataset reads)
  part-XXXXX/           shard.NNNNN.mds.zstd files (MDS, zstd, xxh64 of both forms in the index)
  tokenizer/            the HF tokenizer folder the samples were made with (TOKENIZER_FILES)
  build_manifest.json   `BuildManifest`: resolved settings, tokenizer identity, counts, timings
  rejects.jsonl         every skipped line or document, with file, line (or row) and reason
  eval/                 with --eval_share: the held-out documents' samples, a shard folder of its own
                        (index.json, part-XXXXX/, tokenizer/, build_manifest.json with split "eval");
                        DATA/index.json never lists its shards, so training never reads them

Samples (`columns_for`): input_ids (uint16 while the vocabulary fits, else uint32), token_type_ids
and word_starts (uint8, one per token), lang (str), and nsp_label (int) in nsp builds only: a reader
tells the two formats apart by that column (`format_of`).

The tokenizer's identity is its vocabulary fingerprint (`Vocabulary`, `read_vocabulary`): the
builder records it in the manifest and the trainer compares its own tokenizers with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from preprocessing.errors import UsageError

FORMATS = ("nsp", "packed")  # nsp: [CLS] A [SEP] B [SEP] pairs (TaCL); packed: full blocks (TACO)

INDEX = "index.json"
MANIFEST = "build_manifest.json"
TOKENIZER_DIR = "tokenizer"
REJECTS = "rejects.jsonl"
EVAL_DIR = "eval"

# What DATA/tokenizer/ may hold: the builder copies those of a --tokenizer folder that exist, and
# the trainer fetches the same names for remote data (the ones that exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)

# ---- MDS ------------------------------------------------------------------------------------------
MDS_VERSION = 2  # index.json's and each shard's "version"
COMPRESSION = "zstd"
HASH = "xxh64"  # recorded for the raw and the compressed form of every shard; verified on read
HASHES = [HASH]
SIZE_LIMIT = "64mb"
SIZE_LIMIT_BYTES = 64 << 20  # streaming's "64mb" (binary units)

REQUIRED_COLUMNS = ("input_ids", "token_type_ids", "word_starts")
NSP_COLUMN = "nsp_label"
# streaming decodes every column of a sample it reads, and its `pkl` encoding is pickle.loads: a
# crafted index.json + shard would run code in every reader. No build of ours writes one.
PICKLED_ENCODINGS = ("pkl",)


def pickled_columns(shard: dict[str, Any]) -> list[str]:
    """The columns of one MDS index entry whose encoding would unpickle on read ('name (encoding)')."""
    names, encodings = shard.get("column_names") or [], shard.get("column_encodings") or []
    return [f"{n} ({e})" for n, e in zip(names, encodings) if str(e).split(":")[0] in PICKLED_ENCODINGS]


def id_dtype_for(vocab_size: int) -> type:
    """The token-id dtype of a build: uint16 while every id fits, else uint32."""
    return np.uint16 if vocab_size <= (1 << 16) else np.uint32


def columns_for(*, fmt: str, vocab_size: int) -> dict[str, str]:
    """The MDS columns (name -> streaming encoding) of a build."""
    columns = {
        "input_ids": f"ndarray:{np.dtype(id_dtype_for(vocab_size)).name}",
        "token_type_ids": "ndarray:uint8",
        "word_starts": "ndarray:uint8",
        "lang": "str",
    }
    if fmt == "nsp":
        columns[NSP_COLUMN] = "int"
    return columns


def format_of(columns: list[str]) -> str:
    """nsp or packed, from a shard's column names."""
    return "nsp" if NSP_COLUMN in columns else "packed"


# ---- tokenizer identity ---------------------------------------------------------------------------
FINGERPRINT_SCHEME = "vocab-v1"
SPECIAL_ROLES = ("cls", "sep", "mask", "pad", "unk")


def special_tokens(folder: Path) -> dict[str, str]:
    """role -> token text of an HF tokenizer folder: special_tokens_map.json, then
    tokenizer_config.json, then BERT's names ([CLS], ...)."""
    sm = _json_or_empty(folder / "special_tokens_map.json")
    config = _json_or_empty(folder / "tokenizer_config.json")
    out = {}
    for role in SPECIAL_ROLES:
        value = sm.get(f"{role}_token") or config.get(f"{role}_token") or f"[{role.upper()}]"
        out[role] = value["content"] if isinstance(value, dict) else value
    return out


@dataclass(frozen=True)
class Vocabulary:
    """What decides which ids a tokenizer gives: each token's id (added tokens included), which tokens
    are added and special, the special tokens' roles, and the normalisation (lower-casing and accents
    included) as transformers applies it when it loads the folder.

    Left out, because they change no id: the post-processor (the builder assembles [CLS]/[SEP]
    itself), the decoder, padding and truncation settings, model_max_length, file layout and JSON
    formatting. Also left out: the pre-tokenizer and the model's merge rules or piece scores: two
    tokenizers that agree on all of the above but split words differently are not told apart.
    """

    where: str  # the folder it was read from
    tokens: tuple[Optional[str], ...]  # tokens[id]; None for an id no token has
    added: tuple[tuple[int, str, bool], ...]  # (id, text, special) of each added token
    specials: tuple[tuple[str, Optional[str]], ...]  # (role, token), SPECIAL_ROLES order
    normalizer: Optional[str]  # the effective normaliser, canonical JSON
    lowercase: Optional[bool]  # whether text is lower-cased (None: cannot tell)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def fingerprint(self) -> str:
        """`vocab-v1:<sha256>` over everything but `where`."""
        payload = dataclasses.asdict(self)
        del payload["where"]
        text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return f"{FINGERPRINT_SCHEME}:{hashlib.sha256(text.encode('utf-8')).hexdigest()}"


def read_vocabulary(folder: str | Path) -> Vocabulary:
    """The Vocabulary of an HF tokenizer folder: from its tokenizer.json when it has one (what the
    builder encodes with, no transformers import), else as AutoTokenizer converts it (a folder with
    only vocab.txt, as many model folders are). UsageError naming the folder when neither works."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # transformers raises OSError/ValueError/... depending on the cause
            raise UsageError(f"{folder}: cannot load a tokenizer from it ({type(e).__name__}: {e})") from e
        return vocabulary_of(hf, where=str(folder))
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for unparsable files
        raise UsageError(f"{folder / 'tokenizer.json'}: not a tokenizer ({e})") from e
    config = _json_or_empty(folder / "tokenizer_config.json")
    return _from_backend(backend, specials=special_tokens(folder), config=config, where=str(folder))


def vocabulary_of(tokenizer: Any, *, where: str = "") -> Vocabulary:
    """The Vocabulary of a loaded transformers tokenizer, as it runs (its normaliser already the one
    transformers applies)."""
    specials = {role: getattr(tokenizer, f"{role}_token", None) for role in SPECIAL_ROLES}
    if tokenizer.is_fast:
        return _from_backend(tokenizer.backend_tokenizer, specials=specials, config={}, where=where)
    added = tokenizer.get_added_vocab()
    return Vocabulary(
        where=where,
        tokens=_by_id(tokenizer.get_vocab()),
        added=tuple(sorted((i, t, t in tokenizer.all_special_tokens) for t, i in added.items())),
        specials=tuple(specials.items()),
        normalizer=None,
        lowercase=getattr(tokenizer, "do_lower_case", None),
    )


def _from_backend(backend: Any, *, specials: dict[str, Optional[str]], config: dict, where: str) -> Vocabulary:
    """From a `tokenizers.Tokenizer` and the folder's special tokens and tokenizer_config.json."""
    spec = json.loads(backend.to_str())
    normalizer = _effective_normalizer(spec.get("normalizer"), config)
    return Vocabulary(
        where=where,
        tokens=_by_id(backend.get_vocab(with_added_tokens=True)),
        added=tuple(sorted((int(t["id"]), t["content"], bool(t.get("special"))) for t in spec.get("added_tokens", []))),
        specials=tuple(specials.items()),
        normalizer=None if normalizer is None else json.dumps(normalizer, sort_keys=True, ensure_ascii=False),
        lowercase=_lowercases(normalizer),
    )


def has_tokenizer(folder: str | Path) -> bool:
    """Whether a folder holds a tokenizer read_vocabulary can read (tokenizer.json or vocab.txt)."""
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "vocab.txt"))


def vocabulary_differences(a: Vocabulary, b: Vocabulary, *, examples: int = 3) -> list[str]:
    """How b differs from a, one short phrase each (empty when their fingerprints agree): the
    first ids whose tokens differ, sizes, special tokens, added tokens, lower-casing, normalisation."""
    out = []
    if a.size != b.size:
        out.append(f"{a.size:,} vs {b.size:,} ids")
    differ = [i for i in range(min(a.size, b.size)) if a.tokens[i] != b.tokens[i]]
    if differ:
        shown = "; ".join(f"id {i} is {a.tokens[i]!r} vs {b.tokens[i]!r}" for i in differ[:examples])
        out.append(f"{len(differ):,} of {min(a.size, b.size):,} ids name other tokens ({shown})")
    roles = [f"{role} {x!r} vs {y!r}" for (role, x), (_, y) in zip(a.specials, b.specials) if x != y]
    if roles:
        out.append("special tokens " + ", ".join(roles))
    if a.added != b.added and not differ:
        out.append("added tokens differ")
    if a.lowercase != b.lowercase:
        out.append(f"lower-cases: {_yes_no(a.lowercase)} vs {_yes_no(b.lowercase)}")
    elif a.normalizer != b.normalizer:
        out.append("normalisation differs")
    return out


def _yes_no(flag: Optional[bool]) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def _by_id(vocab: dict[str, int]) -> tuple[Optional[str], ...]:
    tokens: list[Optional[str]] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tuple(tokens)


def _effective_normalizer(normalizer: Optional[dict], config: dict) -> Optional[dict]:
    """The normaliser transformers runs. BertTokenizerFast replaces a plain BertNormalizer whose
    lowercase / strip_accents / handle_chinese_chars disagree with tokenizer_config.json's
    do_lower_case / strip_accents / tokenize_chinese_chars (a folder whose config says
    do_lower_case false lower-cases nothing, whatever its tokenizer.json says)."""
    if (
        normalizer is None
        or normalizer.get("type") != "BertNormalizer"
        or config.get("tokenizer_class") not in ("BertTokenizer", "BertTokenizerFast")
    ):
        return normalizer
    wanted = {
        "lowercase": config.get("do_lower_case", True),
        "strip_accents": config.get("strip_accents"),
        "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
    }
    return {**normalizer, **wanted}


def _lowercases(node: Any) -> Optional[bool]:
    """Whether a normaliser spec lower-cases (a BertNormalizer with lowercase, or a Lowercase step)."""
    if node is None:
        return False
    if isinstance(node, dict):
        if node.get("type") == "Lowercase":
            return True
        if node.get("type") == "BertNormalizer" and node.get("lowercase"):
            return True
        return any(_lowercases(v) for v in node.values() if isinstance(v, (dict, list)))
    if isinstance(node, list):
        return any(_lowercases(v) for v in node)
    return False


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# ---- the build manifest ---------------------------------------------------------------------------
@dataclass
class TokenizerRecord:
    """The tokenizer a build used (DATA/tokenizer)."""

    path: str  # where the builder wrote it
    source: str  # --tokenizer as given, or trained:<kind>
    sha256: str  # of tokenizer.json's bytes
    vocab_size: int  # ids, added tokens included
    kind: str  # wordpiece | unigram | sentencepiece | the model type of a given tokenizer
    vocab_fingerprint: Optional[str] = None  # Vocabulary.fingerprint; None in builds made before it


@dataclass
class MdsSettings:
    compression: str = COMPRESSION
    hashes: list[str] = field(default_factory=lambda: list(HASHES))
    size_limit: str = SIZE_LIMIT


@dataclass
class Counts:
    """What a build read, wrote and skipped (the per-part counts summed).

    documents_in = documents_written + sum(documents_skipped) over the whole build; a held-out
    document counts as written (it is, into DATA/eval). The counts of what was made (sentences,
    tokens, samples, shards, bytes...) are the training folder's; `eval` holds the held-out
    folder's own (also DATA/eval/build_manifest.json's counts, where documents_in and
    documents_written are its documents), so the training folder holds documents_written -
    eval.documents_written documents."""

    documents_in: int = 0
    documents_written: int = 0
    documents_skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents
    documents_split: int = 0
    sentences: int = 0
    tokens: int = 0
    tokens_by_lang: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    tokens_in_samples: int = 0
    shards: int = 0
    bytes: int = 0
    input_bytes: int = 0
    non_utf8_replacements: int = 0
    long_line_pieces: int = 0
    problems_by_reason: dict[str, int] = field(default_factory=dict)  # reason -> problems (rejects.jsonl)
    problems_not_logged: int = 0
    # nsp builds only
    nsp_random_next: Optional[int] = None
    nsp_blocks_with_donors: Optional[int] = None  # single-document blocks whose B came from other chunks
    tokens_truncated: Optional[int] = None
    # packed builds only
    tokens_dropped_tail: Optional[int] = None
    # builds with --eval_share only
    eval: Optional[Counts] = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, without unset (None) fields (the other format's, `eval` without a split)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.eval is not None:
            out["eval"] = self.eval.to_dict()
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Counts:
        values = _known(cls, obj)
        if values.get("eval") is not None:
            values["eval"] = cls.from_dict(values["eval"])
        return cls(**values)


@dataclass
class BuildManifest:
    """build_manifest.json. Written when a build starts (status running) and when it ends (complete,
    or empty when it wrote no sample); the fields from `counts` on are set at the end. Reading
    accepts the manifests of older builders (missing fields take their defaults) and ignores keys it
    does not know."""

    status: str = "complete"  # running | complete | empty (older builders wrote no status)
    split: Optional[str] = None  # "eval" in DATA/eval (the held-out documents); None: the training folder
    config: dict[str, Any] = field(default_factory=dict)  # the builder's resolved flags, as a record
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what build_shards.py --resume compares
    tokenizer: Optional[TokenizerRecord] = None
    versions: dict[str, str] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    counts: Optional[Counts] = None
    columns: Optional[dict[str, str]] = None
    mds: Optional[MdsSettings] = None
    worker_slots: Optional[int] = None
    chunks: Optional[int] = None
    chunks_resumed: Optional[int] = None
    workers: Optional[int] = None
    peak_rss_mb_per_worker: Optional[float] = None
    wall_s: Optional[float] = None
    mb_per_s: Optional[float] = None

    @property
    def format(self) -> Optional[str]:
        return self.config.get("format")

    @property
    def max_seq_len(self) -> Optional[int]:
        value = self.config.get("max_seq_len")
        return None if value is None else int(value)

    @property
    def vocab_size(self) -> Optional[int]:
        return None if self.tokenizer is None else int(self.tokenizer.vocab_size)

    @property
    def vocab_fingerprint(self) -> Optional[str]:
        """The recorded fingerprint when this code computes it the same way, else None."""
        fp = self.tokenizer.vocab_fingerprint if self.tokenizer else None
        return fp if fp and fp.startswith(FINGERPRINT_SCHEME + ":") else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object; unset (None) fields, and the counts of the other format, are left out."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.counts is not None:
            out["counts"] = self.counts.to_dict()
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> BuildManifest:
        if not isinstance(obj, dict):
            raise ValueError(f"expected an object, got {type(obj).__name__}")
        values = _known(cls, obj)
        nested = {"tokenizer": TokenizerRecord, "mds": MdsSettings}
        for name, kind in nested.items():
            if values.get(name) is not None:
                values[name] = kind(**_known(kind, values[name]))
        if values.get("counts") is not None:
            values["counts"] = Counts.from_dict(values["counts"])
        return cls(**values)

    @classmethod
    def read(cls, path: str | Path) -> BuildManifest:
        """UsageError naming the file when it cannot be read as a manifest."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"{path}: cannot read the build manifest ({e}); rebuild the shards") from e

    def write(self, path: str | Path) -> None:
        """Atomically (a reader sees the old file or the new one, never half of one)."""
        path = Path(path)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)


def _known(cls: type, obj: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in obj.items() if k in names}
