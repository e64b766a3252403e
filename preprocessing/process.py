"""One chunk -> one MDS part folder: read, clean, split, tokenise, make samples, write. With
--eval_share, also OUTPUT/eval/part-XXXXX: the samples of the chunk's held-out documents
(heldout.py), made apart from the others (their own blocks, NSP partners and packed stream), so
that no training sample holds a held-out document's text.

Runs inside a Ray task (or in-process). Refuses an input that changed since the build planned it,
and records a digest of the input bytes the part was made from (what --resume re-checks). Works
block by block (~block_mb of text), so memory
depends on the block size, not on the chunk or the corpus. Writes into a temporary folder and
renames it to OUTPUT/part-XXXXX when complete (after the held-out part, if any), so a part folder
is always whole and a chunk whose part_stats.json exists is finished. Returns the chunk's counts,
never data.
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
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from preprocessing.errors import UsageError
from preprocessing.heldout import EVAL, TRAIN, held_out_rule
from preprocessing.inputs import Chunk, check_unchanged, digest, reading
from preprocessing.mds import LocalMDSWriter, make_fast_writer_class
from preprocessing.readers import ChunkReader
from preprocessing.samples import Packer, TokenizedDocs, assemble_nsp, concat_docs, nsp_instances
from preprocessing.shard_format import COMPRESSION, EVAL_DIR, HASHES, REJECTS, SIZE_LIMIT, columns_for, id_dtype_for
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
    eval_share: float = 0.0


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


def block_seed(seed: int, *, chunk_index: int, block_index: int, split: str = TRAIN) -> int:
    """The NSP random stream of one block: a function of --seed and the block's identity only."""
    name = f"{seed}:{chunk_index}:{block_index}" if split == TRAIN else f"{seed}:{chunk_index}:{split}:{block_index}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def process_chunk(chunk: Chunk, *, spec: TaskSpec, tokenizer_json: str, plan: list[Chunk] | None = None) -> dict:
    """Build OUTPUT/part-XXXXX (and OUTPUT/eval/part-XXXXX with --eval_share) for `chunk`; return
    its stats (also saved as part_stats.json). `plan` is every chunk of the build, indexed by
    Chunk.index (NSP donors come from it)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task = one core; Ray runs the others
    t0, c0 = time.time(), time.process_time()
    check_unchanged(chunk.file)
    encoder = _encoder(spec.tokenizer_sha256, tokenizer_json)
    reader = ChunkReader(chunk, text_field=spec.text_field)
    state = _State()
    held_out = held_out_rule(seed=spec.seed, share=spec.eval_share)
    opened = dict(chunk=chunk, spec=spec, encoder=encoder, plan=plan or [chunk], held_out=held_out)
    splits = {TRAIN: _open_split(TRAIN, counts=state.counts, **opened)}
    if held_out is not None:
        splits[EVAL] = _open_split(EVAL, counts=Counter(), **opened)
    with ExitStack() as writers:
        for split in splits.values():
            writers.enter_context(split.writer)
        for name, block in _blocks(reader, spec=spec, state=state, held_out=held_out):
            _write_block(splits[name], block, chunk=chunk, spec=spec, encoder=encoder, reader=reader, state=state)
        for split in splits.values():
            _drop_tail(split, state=state)
    lo, hi = reader.span or (0, chunk.file.size)
    with reading(chunk.file):
        source = {"span": [lo, hi], "xxh64": digest(chunk.file.path, lo, hi)}
    check_unchanged(chunk.file)  # the digest must describe the bytes the samples came from
    stats = {
        "chunk": chunk.name,
        "index": chunk.index,
        "file": chunk.file.path,
        "start": chunk.start,
        "end": chunk.end,
        "source": source,
        "counts": {**_finish_counts(reader, state), **_written(splits[TRAIN].writer), "input_bytes": chunk.nbytes},
        "wall_s": round(time.time() - t0, 3),
        "cpu_s": round(time.process_time() - c0, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if EVAL in splits:
        stats[EVAL] = {**splits[EVAL].counts, **_written(splits[EVAL].writer)}
    _commit(splits, stats=stats, rejects=reader.rejects)
    return stats


@dataclass
class _Split:
    """One output of a chunk: its training part (OUTPUT/part-XXXXX) or its held-out one
    (OUTPUT/eval/part-XXXXX), written into `tmp` and renamed to `final` when whole."""

    name: str  # TRAIN | EVAL
    tmp: Path
    final: Path
    writer: Any  # LocalMDSWriter, or streaming's MDSWriter for --remote
    packer: Optional[Packer]
    donors: _Donors
    counts: Counter  # what this split made (the training split's are the chunk's _State counts)
    blocks: int = 0  # blocks seen so far: the index of the next block's NSP random stream


def _open_split(
    name: str,
    *,
    chunk: Chunk,
    spec: TaskSpec,
    encoder: SentenceEncoder,
    plan: list[Chunk],
    held_out: Optional[Callable[[list[str]], bool]],
    counts: Counter,
) -> _Split:
    out = Path(spec.output) / EVAL_DIR if name == EVAL else Path(spec.output)
    tmp = out / f".tmp-{chunk.name}-{uuid.uuid4().hex[:8]}"
    columns = columns_for(fmt=spec.fmt, vocab_size=spec.vocab_size)
    if spec.remote:  # streaming's own writer and uploader
        remote = spec.remote.rstrip("/") + (f"/{EVAL_DIR}" if name == EVAL else "") + f"/{chunk.name}"
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
    packer = None
    if spec.fmt == "packed":
        dtype = id_dtype_for(spec.vocab_size)
        packer = Packer(max_seq_len=spec.max_seq_len, cls_id=spec.cls_id, sep_id=spec.sep_id, dtype=dtype)
    donors = _Donors(chunk, plan=plan, spec=spec, encoder=encoder, split=name, held_out=held_out)
    return _Split(name, tmp, out / chunk.name, writer, packer, donors, counts)


def _write_block(
    split: _Split,
    block: list[_Entry],
    *,
    chunk: Chunk,
    spec: TaskSpec,
    encoder: SentenceEncoder,
    reader: ChunkReader,
    state: _State,
) -> None:
    """Tokenise one block of the split's documents and write its samples."""
    block_index, split.blocks = split.blocks, split.blocks + 1
    docs = _tokenize(block, encoder=encoder, reader=reader, state=state, id_base=_id_base(chunk), counts=split.counts)
    if docs.num_docs == 0:
        return
    if split.packer is not None:
        _write_packed(split.writer, docs, packer=split.packer, counts=split.counts)
        return
    rng = random.Random(block_seed(spec.seed, chunk_index=chunk.index, block_index=block_index, split=split.name))
    if len(np.unique(docs.doc_ids)) < 2:  # no other document to draw a random B from
        donors = split.donors(set(docs.doc_ids.tolist()))
        docs = dataclasses.replace(concat_docs([docs, donors]), num_a_docs=docs.num_docs)
        split.counts["nsp_blocks_with_donors"] += 1
    _write_nsp(split.writer, docs, spec=spec, rng=rng, counts=split.counts)


def _drop_tail(split: _Split, *, state: _State) -> None:
    """The end of a packed stream: the tokens short of a block are dropped, and the documents none
    of whose tokens made a block are skipped (packed_tail)."""
    if split.packer is None:
        return
    tail_tokens, tail_docs = split.packer.tail()
    split.counts["tokens_dropped_tail"] += tail_tokens
    split.counts["documents"] -= tail_docs
    state.counts["skipped_packed_tail"] += tail_docs
    state.docs_with_tokens -= tail_docs


def _written(writer) -> dict[str, int]:
    shards = writer.shards
    return {"shards": len(shards), "bytes": sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards)}


def _commit(splits: dict[str, _Split], *, stats: dict, rejects: list[dict]) -> None:
    """Rename the finished part folders into place: the held-out one first, then the training one,
    whose part_stats.json marks the chunk done (--resume)."""
    train = splits[TRAIN]
    with open(train.tmp / PART_REJECTS, "w") as f:
        for entry in rejects:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
    (train.tmp / PART_STATS).write_text(json.dumps(stats, indent=1))
    for split in sorted(splits.values(), key=lambda s: s.name == TRAIN):
        if split.final.exists():  # a retried task whose first attempt got this far: same content
            shutil.rmtree(split.final)
        split.tmp.rename(split.final)


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


def _blocks(
    reader: ChunkReader,
    *,
    spec: TaskSpec,
    state: _State,
    held_out: Optional[Callable[[list[str]], bool]] = None,
    only: Optional[str] = None,
) -> Iterator[tuple[str, list[_Entry]]]:
    """Clean, detect language, split sentences; group documents into blocks of about
    spec.block_chars characters, one stream per split: (TRAIN, block), or (EVAL, block) of the
    documents `held_out` picks. A longer document is cut into parts at sentence boundaries. `only`:
    that split's blocks alone, the other's documents skipped before any work on them."""
    forced = reader.chunk.file.lang
    blocks: dict[str, list[_Entry]] = {TRAIN: [], EVAL: []}
    sizes = {TRAIN: 0, EVAL: 0}
    doc_id, lang, has_text, split = -1, None, False, TRAIN
    for raw in reader.documents():
        if raw.part == 0:
            doc_id, lang, has_text = doc_id + 1, None, False
            split = EVAL if held_out is not None and held_out(raw.lines) else TRAIN
        if only is not None and split != only:
            continue
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
                blocks[split].append(_Entry(doc_id, lang, part, raw.line, multipart))
                sizes[split] += sum(map(len, part))
                if sizes[split] >= spec.block_chars:
                    yield split, blocks[split]
                    blocks[split], sizes[split] = [], 0
        if raw.last and not has_text:
            reader.skip("empty", raw.line)
    for name in (TRAIN, EVAL):
        if blocks[name]:
            yield name, blocks[name]


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
    block: list[_Entry], *, encoder: SentenceEncoder, reader: ChunkReader, state: _State, id_base: int, counts: Counter
) -> TokenizedDocs:
    """Tokenise a block; drop sentences without tokens and count documents without any (into `counts`, the split's)."""
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

    c = counts
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
        c["documents"] += int(new)
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
    """Documents for the random B segments of a block that holds a single document, of the block's
    own split (a training sample never holds a held-out document's text, nor the reverse). From
    the chunks after this one in the plan (wrapping round), found once per task; failing those, the
    other documents of this chunk. Depends on the plan only, so the samples do not depend on the
    number of workers. Their counts are not this chunk's: they use a throwaway reader and state.
    Held-out donors are rarer: finding them may read a whole chunk, hashing (not cleaning) the
    documents it passes over."""

    def __init__(
        self,
        chunk: Chunk,
        *,
        plan: list[Chunk],
        spec: TaskSpec,
        encoder: SentenceEncoder,
        split: str = TRAIN,
        held_out: Optional[Callable[[list[str]], bool]] = None,
    ):
        self.chunk, self.plan, self.encoder = chunk, plan, encoder
        self.split, self.held_out = split, held_out
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
        if self.split == EVAL:
            raise UsageError(
                f"--format nsp: {self.chunk.file.where()} holds the only held-out document of the inputs, but "
                "a random B must come from another held-out document; raise --eval_share or use --format packed"
            )
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
            blocks = _blocks(reader, spec=self.spec, state=_State(), held_out=self.held_out, only=self.split)
            block = []
            for _, found in blocks:
                block = [e for e in found if _id_base(other) + e.doc_id not in exclude]
                if block or not every_block:
                    break
            blocks.close()
            if other.file.byte_ranges:
                no_start[other.file.path] = (other.start, reader.first_document_at)
            if block:
                part = _tokenize(
                    block,
                    encoder=self.encoder,
                    reader=reader,
                    state=_State(),
                    id_base=_id_base(other),
                    counts=Counter(),
                )
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
