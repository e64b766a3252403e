"""One chunk -> one MDS part folder: read, clean, split, tokenise, make samples, write.

Runs inside a Ray task (or in-process). Refuses an input that changed since the build planned it,
and records a digest of the input bytes the part was made from (what --resume re-checks). Works
block by block (~block_mb of text), so memory
depends on the block size, not on the chunk or the corpus. Writes into a temporary folder and
renames it to OUTPUT/part-XXXXX when complete, so a part folder is always whole. Returns the
chunk's counts, never data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import resource
import shutil
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from preprocessing.errors import UsageError
from preprocessing.inputs import Chunk, check_unchanged, digest, reading
from preprocessing.mds import LocalMDSWriter, make_fast_writer_class
from preprocessing.readers import ChunkReader
from preprocessing.samples import Packer, TokenizedDocs, assemble_nsp, concat_docs, nsp_instances
from preprocessing.shard_format import COMPRESSION, HASHES, REJECTS, SIZE_LIMIT, columns_for, id_dtype_for
from preprocessing.text import clean_text, detect_language, split_sentences
from preprocessing.tokenization import SentenceEncoder
from preprocessing.words import word_starts

PART_STATS = "part_stats.json"
PART_REJECTS = REJECTS  # each part's own; the build concatenates them into DATA/rejects.jsonl
DONOR_DOCS = 32
DONOR_CHARS = 1 << 16
"""A block with a single document draws its random B segments from donors: the documents of the
next chunks of the plan, in order, from the first DONOR_CHARS characters of each, until DONOR_DOCS
documents or DONOR_CHARS characters are gathered."""
ENCODE_BATCH_CHARS = 1 << 20
"""Sentences go to the tokenizer in batches of about this many characters: the Rust Encoding
objects cost ~100 bytes per token, so a whole block at once would cost hundreds of MB."""


@dataclass(frozen=True)
class TaskSpec:
    """What every chunk task shares (the tokenizer's text travels separately, via the object store)."""

    output: str
    remote: str | None
    fmt: str
    max_seq_len: int
    short_seq_prob: float
    random_next_prob: float
    seed: int
    text_field: str
    block_chars: int
    tokenizer_sha256: str
    cls_id: int
    sep_id: int
    vocab_size: int


@dataclass
class _Entry:
    """A document (or, for a document longer than a block, one part of it) ready to tokenise."""

    doc_id: int
    lang: str
    sentences: list[str]
    line: int
    multipart: bool


_ENCODERS: dict[str, SentenceEncoder] = {}


def _encoder(sha: str, tokenizer_json: str) -> SentenceEncoder:
    """One encoder per tokenizer per worker process: Ray reuses workers across tasks."""
    if sha not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[sha] = SentenceEncoder(tokenizer_json)
    return _ENCODERS[sha]


def block_seed(seed: int, *, chunk_index: int, block_index: int) -> int:
    """The NSP random stream of one block: a function of --seed and the block's identity only."""
    digest = hashlib.sha256(f"{seed}:{chunk_index}:{block_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def process_chunk(chunk: Chunk, *, spec: TaskSpec, tokenizer_json: str, plan: list[Chunk] | None = None) -> dict:
    """Build OUTPUT/part-XXXXX for `chunk`; return its stats (also saved as part_stats.json).
    `plan` is every chunk of the build, indexed by Chunk.index (NSP donors come from it)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task = one core; Ray runs the others
    t0, c0 = time.time(), time.process_time()
    check_unchanged(chunk.file)
    encoder = _encoder(spec.tokenizer_sha256, tokenizer_json)
    out = Path(spec.output)
    tmp = out / f".tmp-{chunk.name}-{uuid.uuid4().hex[:8]}"
    remote = f"{spec.remote.rstrip('/')}/{chunk.name}" if spec.remote else None
    reader = ChunkReader(chunk, text_field=spec.text_field)
    state = _State()
    columns = columns_for(fmt=spec.fmt, vocab_size=spec.vocab_size)
    if remote:  # streaming's own writer and uploader
        writer = make_fast_writer_class()(
            out=(str(tmp), remote),
            keep_local=True,
            columns=columns,
            compression=COMPRESSION,
            hashes=HASHES,
            size_limit=SIZE_LIMIT,
        )
    else:
        writer = LocalMDSWriter(out=str(tmp), columns=columns)
    with writer:
        packer = (
            Packer(
                max_seq_len=spec.max_seq_len,
                cls_id=spec.cls_id,
                sep_id=spec.sep_id,
                dtype=id_dtype_for(spec.vocab_size),
            )
            if spec.fmt == "packed"
            else None
        )
        donors = _Donors(chunk, plan=plan or [chunk], spec=spec, encoder=encoder)
        for block_index, block in enumerate(_blocks(reader, spec=spec, state=state)):
            docs = _tokenize(block, encoder=encoder, reader=reader, state=state, id_base=_id_base(chunk))
            if docs.num_docs == 0:
                continue
            if packer is not None:
                _write_packed(writer, docs, packer=packer, counts=state.counts)
            else:
                rng = random.Random(block_seed(spec.seed, chunk_index=chunk.index, block_index=block_index))
                if len(np.unique(docs.doc_ids)) < 2:  # no other document to draw a random B from
                    docs = dataclasses.replace(
                        concat_docs([docs, donors(set(docs.doc_ids.tolist()))]), num_a_docs=docs.num_docs
                    )
                    state.counts["nsp_blocks_with_donors"] += 1
                _write_nsp(writer, docs, spec=spec, rng=rng, counts=state.counts)
        if packer is not None:
            tail_tokens, tail_docs = packer.tail()
            state.counts["tokens_dropped_tail"] += tail_tokens
            state.counts["skipped_packed_tail"] += tail_docs
            state.docs_with_tokens -= tail_docs
    lo, hi = reader.span or (0, chunk.file.size)
    with reading(chunk.file):
        source = {"span": [lo, hi], "xxh64": digest(chunk.file.path, lo, hi)}
    check_unchanged(chunk.file)  # the digest must describe the bytes the samples came from
    shards = writer.shards
    counts = _finish_counts(reader, state)
    counts["shards"] = len(shards)
    counts["bytes"] = sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards)
    counts["input_bytes"] = chunk.nbytes
    stats = {
        "chunk": chunk.name,
        "index": chunk.index,
        "file": chunk.file.path,
        "start": chunk.start,
        "end": chunk.end,
        "source": source,
        "counts": dict(counts),
        "wall_s": round(time.time() - t0, 3),
        "cpu_s": round(time.process_time() - c0, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    with open(tmp / PART_REJECTS, "w") as f:
        for entry in reader.rejects:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
    (tmp / PART_STATS).write_text(json.dumps(stats, indent=1))
    final = out / chunk.name
    if final.exists():  # a retried task whose first attempt got this far: same content
        shutil.rmtree(final)
    tmp.rename(final)
    return stats


def _write_packed(writer, docs: TokenizedDocs, *, packer: Packer, counts: Counter) -> None:
    ids_NL, ws_NL, langs = packer.add(docs)
    types_L = np.zeros(ids_NL.shape[1], dtype=np.uint8)
    for i in range(len(ids_NL)):
        writer.write({"input_ids": ids_NL[i], "token_type_ids": types_L, "word_starts": ws_NL[i], "lang": langs[i]})
    counts["samples"] += len(ids_NL)
    counts["tokens_in_samples"] += ids_NL.size


def _write_nsp(writer, docs: TokenizedDocs, *, spec: TaskSpec, rng: random.Random, counts: Counter) -> None:
    dtype = id_dtype_for(spec.vocab_size)
    for inst in nsp_instances(
        docs,
        rng=rng,
        max_seq_len=spec.max_seq_len,
        short_seq_prob=spec.short_seq_prob,
        random_next_prob=spec.random_next_prob,
    ):
        ids, types, ws = assemble_nsp(docs, inst, cls_id=spec.cls_id, sep_id=spec.sep_id, dtype=dtype)
        writer.write(
            {
                "input_ids": ids,
                "token_type_ids": types,
                "word_starts": ws,
                "nsp_label": int(inst.is_random_next),
                "lang": docs.doc_langs[inst.a_doc],
            }
        )
        counts["samples"] += 1
        counts["nsp_random_next"] += int(inst.is_random_next)
        counts["tokens_in_samples"] += len(ids)
        kept = inst.a[1] - inst.a[0] + inst.b[1] - inst.b[0]
        counts["tokens_truncated"] += inst.a_full[1] - inst.a_full[0] + inst.b_full[1] - inst.b_full[0] - kept


class _State:
    """Per-chunk counters that span blocks."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.docs_with_tokens = 0
        self.split_docs_seen: set[int] = set()  # multi-part docs already counted as written
        self.split_docs: set[int] = set()


def _blocks(reader: ChunkReader, *, spec: TaskSpec, state: _State) -> Iterator[list[_Entry]]:
    """Clean, detect language, split sentences; group documents into blocks of about
    spec.block_chars characters. A longer document is cut into parts at sentence boundaries."""
    forced = reader.chunk.file.lang
    block: list[_Entry] = []
    size, doc_id, lang, has_text = 0, -1, None, False
    for raw in reader.documents():
        if raw.part == 0:
            doc_id, lang, has_text = doc_id + 1, None, False
        lines = [line for line in map(clean_text, raw.lines) if line]
        if lines:
            lang = lang or forced or detect_language(_head(lines))
            sentences = [s for line in lines for s in split_sentences(line, lang)]
            parts = _cut(sentences, spec.block_chars)
            multipart = len(parts) > 1 or not (raw.part == 0 and raw.last)
            if multipart and doc_id not in state.split_docs:
                state.counts["documents_split"] += 1
                state.split_docs.add(doc_id)
            has_text = True
            for part in parts:
                block.append(_Entry(doc_id, lang, part, raw.line, multipart))
                size += sum(map(len, part))
                if size >= spec.block_chars:
                    yield block
                    block, size = [], 0
        if raw.last and not has_text:
            reader.skip("empty", raw.line)
    if block:
        yield block


def _head(lines: list[str], chars: int = 2000) -> str:
    head, n = [], 0
    for line in lines:
        head.append(line)
        n += len(line)
        if n >= chars:
            break
    return " ".join(head)


def _cut(sentences: list[str], limit: int) -> list[list[str]]:
    parts, current, n = [], [], 0
    for s in sentences:
        if current and n + len(s) > limit:
            parts.append(current)
            current, n = [], 0
        current.append(s)
        n += len(s)
    parts.append(current)
    return parts


def _id_base(chunk: Chunk) -> int:
    """Source document ids are unique across chunks: chunk index in the high bits."""
    return chunk.index << 32


def _tokenize(
    block: list[_Entry], *, encoder: SentenceEncoder, reader: ChunkReader, state: _State, id_base: int
) -> TokenizedDocs:
    """Tokenise a block; drop sentences without tokens and count documents without any."""
    sentences = [s for e in block for s in e.sentences]
    per_entry = np.array([len(e.sentences) for e in block], dtype=np.int64)
    zh_S = np.repeat(np.array([e.lang == "zh" for e in block], dtype=bool), per_entry)
    ids_parts, ws_parts, len_parts = [], [], []
    lo = 0
    while lo < len(sentences):
        hi, n = lo, 0
        while hi < len(sentences) and (n < ENCODE_BATCH_CHARS or hi == lo):
            n += len(sentences[hi])
            hi += 1
        ids, lengths, encodings = encoder.encode(sentences[lo:hi])
        ws = word_starts(
            encoder, ids_T=ids, lengths_S=lengths, encodings=encodings, sentences=sentences[lo:hi], zh_S=zh_S[lo:hi]
        )
        ids_parts.append(ids)
        ws_parts.append(ws)
        len_parts.append(lengths)
        del encodings
        lo = hi
    ids_T = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.uint32)
    ws_T = np.concatenate(ws_parts) if ws_parts else np.zeros(0, np.uint8)
    lengths_S = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    keep_S = lengths_S > 0
    kept_per_entry = np.add.reduceat(keep_S.astype(np.int64), np.concatenate([[0], np.cumsum(per_entry)[:-1]]))

    c = state.counts
    doc_langs, kept_counts, is_new, doc_ids = [], [], [], []
    for entry, kept in zip(block, kept_per_entry):
        if kept == 0:
            if not entry.multipart:
                reader.skip("no_tokens", entry.line)
            continue
        doc_langs.append(entry.lang)
        doc_ids.append(id_base + entry.doc_id)
        kept_counts.append(int(kept))
        new = not entry.multipart or entry.doc_id not in state.split_docs_seen
        if entry.multipart:
            state.split_docs_seen.add(entry.doc_id)
        state.docs_with_tokens += int(new)
        is_new.append(new)
    lengths_kept = lengths_S[keep_S]
    c["sentences"] += int(keep_S.sum())
    c["tokens"] += int(ids_T.size)
    for lang in ("en", "zh"):
        mask = zh_S if lang == "zh" else ~zh_S
        c[f"tokens_{lang}"] += int(lengths_S[mask].sum())
    return TokenizedDocs(
        ids_T=ids_T,
        word_starts_T=ws_T,
        sent_offsets_S1=np.concatenate([[0], np.cumsum(lengths_kept)]).astype(np.int64),
        doc_sent_offsets_D1=np.concatenate([[0], np.cumsum(kept_counts)]).astype(np.int64),
        doc_langs=doc_langs,
        doc_is_new=np.array(is_new, dtype=bool),
        doc_ids=np.array(doc_ids, dtype=np.int64),
    )


class _Donors:
    """Documents for the random B segments of a block that holds a single document. From the
    chunks after this one in the plan (wrapping round), found once per task; failing those, the
    other documents of this chunk. Depends on the plan only, so the samples do not depend on the
    number of workers. Their counts are not this chunk's: they use a throwaway reader and state."""

    def __init__(self, chunk: Chunk, *, plan: list[Chunk], spec: TaskSpec, encoder: SentenceEncoder):
        self.chunk, self.plan, self.encoder = chunk, plan, encoder
        self.spec = dataclasses.replace(spec, block_chars=DONOR_CHARS)
        self._others: TokenizedDocs | None = None

    def __call__(self, exclude: set[int]) -> TokenizedDocs:
        if self._others is None:
            i, n = self.chunk.index, len(self.plan)
            self._others = self._gather([self.plan[(i + k) % n] for k in range(1, n)], exclude=set())
        if self._others.num_docs:
            return self._others
        own = self._gather([self.chunk], exclude=exclude, every_block=True)
        if own.num_docs:
            return own
        raise UsageError(
            f"--format nsp: {self.chunk.file.where()} holds the only document of the inputs, but "
            "a random B must come from another document; add documents or use --format packed"
        )

    def _gather(self, candidates: list[Chunk], *, exclude: set[int], every_block: bool = False) -> TokenizedDocs:
        """Donors from the first block of each candidate (every block until one is found, with
        every_block), skipping documents in `exclude`."""
        parts: list[TokenizedDocs] = []
        docs = chars = 0
        # Per file, (a, b): after byte a, no document starts before byte b (the first document of
        # the chunk that starts at a is at b), so a chunk in [a, b) holds none; the candidates wrap
        # round to the start of the file, where this says nothing.
        no_start: dict[str, tuple[int, int]] = {}
        for other in candidates:
            a, b = no_start.get(other.file.path, (0, -1))
            if other.file.byte_ranges and a <= other.start and other.end <= b:
                continue  # inside a long document of an earlier chunk: nothing starts here
            reader = ChunkReader(other, text_field=self.spec.text_field)
            blocks = _blocks(reader, spec=self.spec, state=_State())
            block = []
            for found in blocks:
                block = [e for e in found if _id_base(other) + e.doc_id not in exclude]
                if block or not every_block:
                    break
            blocks.close()
            if other.file.byte_ranges:
                no_start[other.file.path] = (other.start, reader.first_document_at)
            if block:
                part = _tokenize(block, encoder=self.encoder, reader=reader, state=_State(), id_base=_id_base(other))
                parts.append(part)
                docs += part.num_docs
                chars += sum(sum(map(len, e.sentences)) for e in block)
            if docs >= DONOR_DOCS or chars >= DONOR_CHARS:
                break
        return concat_docs(parts)


def _finish_counts(reader: ChunkReader, state: _State) -> Counter:
    """Merge reader and processing counts into the manifest's vocabulary; a multi-part document
    none of whose parts had a token is skipped as no_tokens."""
    counts = Counter(state.counts)
    counts["skipped_no_tokens"] += len(state.split_docs - state.split_docs_seen)
    counts.update(reader.counts)
    counts["documents_written"] = state.docs_with_tokens
    return counts
