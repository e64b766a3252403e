"""The token sequences that the representation analysis runs on, with a sentence index per token.

Two sources:
- MDS shards written by `preprocessing/build_shards.py` (nsp or packed; the token ids are fixed, so
  every model analysed must share the shards' vocabulary);
- a text file (`.txt`: one sentence or paragraph a line, a blank line between documents; `.jsonl`: one
  {"text": ...} per document, its lines joined by "\n"), tokenised by each model's own tokenizer.

Sentences are the spans between structural special tokens ([CLS], [SEP], [PAD], [MASK]): in an nsp
sample `[CLS] A [SEP] B [SEP]` they are the segments A and B; in a packed sample, the pieces of
documents between [SEP]s; in a text sequence, the lines. Structural special tokens and padding get
sentence index -1 and take part in no metric. [UNK] is a real position of the text, so it is kept, and
its share is reported, because a vocabulary that does not cover the language (an English vocabulary on
Chinese) turns most of a sentence into [UNK] and makes every similarity meaningless.

Shape legend: B sequences, L tokens per sequence.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.data.padding import pad_right
from preprocessing.errors import UsageError


@dataclass
class AnalysisSequence:
    """One model input: token ids, segment ids, and the sentence index of each token (-1 = none)."""

    input_ids: list[int]
    token_type_ids: list[int]
    sentence_ids: list[int]


@dataclass
class SourceStats:
    """What reading the data kept and left out, reported in metrics.json."""

    source: str
    kind: str  # "mds" | "text"
    sequences: int = 0
    sentences: int = 0
    tokens: int = 0
    unk_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a reader of the numbers must know

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


def structural_special_ids(tokenizer) -> set[int]:
    """Ids of [CLS], [SEP], [PAD], [MASK] (and BOS/EOS where a tokenizer has them): never analysed."""
    ids = set()
    for name in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            ids.add(int(value))
    return ids


def sentence_ids_from_specials(
    input_ids: Sequence[int], *, special_ids: set[int], token_type_ids: Sequence[int] | None = None
) -> list[int]:
    """Sentence index per token: a sentence is a maximal run of non-special tokens; a special token
    or a change of segment (token type) ends it. Special tokens get -1.

    `[CLS] a b [SEP] c [SEP]` -> [-1, 0, 0, -1, 1, -1].
    """
    out: list[int] = []
    current = -1
    in_sentence = False
    prev_type = None
    for pos, tok in enumerate(input_ids):
        ttype = token_type_ids[pos] if token_type_ids is not None else 0
        if tok in special_ids:
            in_sentence = False
            out.append(-1)
        else:
            if not in_sentence or ttype != prev_type:
                current += 1
                in_sentence = True
            out.append(current)
        prev_type = ttype
    return out


def _sequence(input_ids: list[int], *, token_type_ids: list[int], special_ids: set[int]) -> AnalysisSequence:
    return AnalysisSequence(
        input_ids,
        token_type_ids,
        sentence_ids_from_specials(input_ids, special_ids=special_ids, token_type_ids=token_type_ids),
    )


def _count(stats: SourceStats, *, seq: AnalysisSequence, unk_id: int | None) -> None:
    stats.sequences += 1
    stats.sentences += len({s for s in seq.sentence_ids if s >= 0})
    stats.tokens += sum(1 for s in seq.sentence_ids if s >= 0)
    if unk_id is not None:
        stats.unk_tokens += sum(1 for t in seq.input_ids if t == unk_id)


def is_mds_dir(path: Path) -> bool:
    return path.is_dir() and (path / "index.json").is_file()


def read_mds_sequences(
    root: Path, *, special_ids: set[int], max_sequences: int, vocab_size: int, unk_id: int | None = None
) -> tuple[list[AnalysisSequence], SourceStats]:
    """The first `max_sequences` samples of a local MDS folder (its merged index.json), in order, read as
    the trainer reads them (pipeline.data: the folder checked and every shard verified against its index
    first, `.mds.zstd` shards decompressed into a temporary cache, never into the folder, every sample
    checked on read). Raises UsageError (ShardError) naming the folder or shard."""
    import tempfile

    from pipeline.data.loader import open_dataset  # heavy import (streaming, torchvision); only for shards
    from pipeline.data.shards import inspect_data

    stats = SourceStats(source=str(root), kind="mds")
    out: list[AnalysisSequence] = []
    with tempfile.TemporaryDirectory(prefix="tokencl-analyze-cache-") as cache:
        info = inspect_data([str(root)], cache_root=cache)
        if info.format == "packed":
            stats.notes.append(
                "packed shards: a sample is a stretch of one or more documents with no sentence boundaries "
                "inside them, so a 'sentence' is a whole document piece and intra-sentence is (nearly) "
                "intra-context here; analyse nsp shards or a text file for TaCL's intra-sentence similarity"
            )
        ds = open_dataset(
            info, vocab_size=vocab_size, batch_size=1, shuffle=False, seed=0, run_id=f"analyze-{os.getpid()}"
        )
        for i in range(min(ds.num_samples, max_sequences)):
            sample = ds[i]
            seq = _sequence(
                [int(t) for t in sample["input_ids"]],
                token_type_ids=[int(t) for t in sample["token_type_ids"]],
                special_ids=special_ids,
            )
            if not any(s >= 0 for s in seq.sentence_ids):
                stats.skip("no_text_tokens")
                continue
            out.append(seq)
            _count(stats, seq=seq, unk_id=unk_id)
        stats.skip("beyond_max_sequences", max(0, ds.num_samples - max_sequences))
        del ds  # its memory maps and shared memory go before the cache folder does
    return out, stats


def iter_documents(path: Path) -> Iterator[list[str]]:
    """Documents of a text file as lists of non-empty lines (.txt: blank line = document break;
    .jsonl: one {"text": ...} per line, its text split at newlines)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise UsageError(f'{path}:{lineno}: expected a JSON object with a "text" field ({e})') from e
                lines = [s.strip() for s in text.split("\n") if s.strip()]
                if lines:
                    yield lines
        return
    doc: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                doc.append(line.strip())
            elif doc:
                yield doc
                doc = []
    if doc:
        yield doc


def read_text_sequences(
    path: Path, *, tokenizer, max_seq_len: int, max_sequences: int, pack: bool = False
) -> tuple[list[AnalysisSequence], SourceStats]:
    """Tokenise a text file into model inputs.

    pack=False: each line is one sequence `[CLS] line [SEP]` (sentence = context).
    pack=True: consecutive lines of one document share a sequence, `[CLS] l1 [SEP] l2 [SEP] ...`, up to
    max_seq_len tokens, so a context holds several sentences. Lines longer than a sequence are cut to
    fit and counted as `truncated_lines`.
    """
    if max_seq_len < 3:
        raise UsageError(f"--max_seq_len must be >= 3 (got {max_seq_len})")
    special_ids = structural_special_ids(tokenizer)
    cls_id, sep_id, unk_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.unk_token_id
    if cls_id is None or sep_id is None:
        raise UsageError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no [CLS]/[SEP] token")
    stats = SourceStats(source=str(path), kind="text")
    out: list[AnalysisSequence] = []
    room = max_seq_len - 2

    def emit(ids: list[int]) -> None:
        seq = _sequence(ids, token_type_ids=[0] * len(ids), special_ids=special_ids)
        out.append(seq)
        _count(stats, seq=seq, unk_id=unk_id)

    for doc in iter_documents(path):
        if len(out) >= max_sequences:
            stats.skip("lines_beyond_max_sequences", len(doc))
            continue
        encoded = tokenizer(doc, add_special_tokens=False)["input_ids"]
        current: list[int] = [cls_id]
        for ids in encoded:
            if len(out) >= max_sequences:
                stats.skip("lines_beyond_max_sequences")
                continue
            if not ids:
                stats.skip("lines_without_tokens")
                continue
            if len(ids) > room:
                stats.skip("truncated_lines")
                ids = ids[:room]
            if not pack:
                emit([cls_id, *ids, sep_id])
                continue
            if len(current) + len(ids) + 1 > max_seq_len:
                emit(current)
                current = [cls_id]
            current += [*ids, sep_id]
        if pack and len(current) > 1:
            if len(out) < max_sequences:
                emit(current)
            else:
                stats.skip("lines_beyond_max_sequences", sum(1 for t in current if t == sep_id))
    if not out:
        raise UsageError(f"{path}: no text to analyse (empty file, or every line is blank)")
    return out, stats


def collate(seqs: Sequence[AnalysisSequence], *, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids_BL, token_type_ids_BL, attention_mask_BL, sentence_BL (-1 on pads)."""
    columns = {
        "input_ids": ([s.input_ids for s in seqs], pad_id),
        "token_type_ids": ([s.token_type_ids for s in seqs], 0),
        "attention_mask": ([[1] * len(s.input_ids) for s in seqs], 0),
        "sentence": ([s.sentence_ids for s in seqs], -1),
    }
    return {k: torch.from_numpy(pad_right(rows, fill=fill)) for k, (rows, fill) in columns.items()}


def first_sentence_text(seqs: Sequence[AnalysisSequence], *, tokenizer, max_tokens: int = 24) -> str:
    """The first sentence of the data with >= 4 tokens, decoded, for the default heatmap."""
    for seq in seqs:
        for sent in sorted({s for s in seq.sentence_ids if s >= 0}):
            ids = [t for t, s in zip(seq.input_ids, seq.sentence_ids) if s == sent]
            if len(ids) >= 4:
                return tokenizer.decode(ids[:max_tokens])
    raise UsageError("no sentence of >= 4 tokens in the data; pass --heatmap_text")
