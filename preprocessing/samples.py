"""Training samples from tokenised documents: BERT's NSP pairs and packed blocks. Pure functions.

Legend: T tokens (flat, documents back to back), S sentences, D documents, N samples, L max_seq_len.
A document's sentences, and a sentence's tokens, are contiguous in the flat arrays, so every
segment is a (lo, hi) token range and nothing is copied until a sample is assembled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class TokenizedDocs:
    """A block of documents. ids_T/word_starts_T: tokens; sent_offsets_S1: token offset of each
    sentence (S+1); doc_sent_offsets_D1: first sentence of each document (D+1); doc_langs: D."""

    ids_T: np.ndarray
    word_starts_T: np.ndarray
    sent_offsets_S1: np.ndarray
    doc_sent_offsets_D1: np.ndarray
    doc_langs: list[str]
    doc_is_new: np.ndarray | None = None
    """(D,) bool: False for the later parts of a document cut into parts (default: all True)."""
    doc_ids: np.ndarray | None = None
    """(D,) int64: the source document of each entry; the parts of one document share it and are
    contiguous (default: every entry its own document)."""
    num_a_docs: int | None = None
    """Entries from this index on are donors (documents of other chunks): they give random B
    segments only, never an A (default: none)."""

    @property
    def num_docs(self) -> int:
        return len(self.doc_langs)

    def doc_token_offsets(self) -> np.ndarray:
        """(D+1,) token offset where each document starts."""
        return self.sent_offsets_S1[self.doc_sent_offsets_D1]

    def source_ids(self) -> np.ndarray:
        return self.doc_ids if self.doc_ids is not None else np.arange(self.num_docs, dtype=np.int64)


def concat_docs(parts: list[TokenizedDocs]) -> TokenizedDocs:
    """The blocks one after the other (offsets shifted), as one block."""
    ids, ws, langs, new, src = [], [], [], [], []
    sent, doc = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    tokens = sentences = 0
    for p in parts:
        ids.append(p.ids_T)
        ws.append(p.word_starts_T)
        sent.append(p.sent_offsets_S1[1:] + tokens)
        doc.append(p.doc_sent_offsets_D1[1:] + sentences)
        langs += p.doc_langs
        new.append(p.doc_is_new if p.doc_is_new is not None else np.ones(p.num_docs, dtype=bool))
        src.append(p.source_ids())
        tokens += int(p.sent_offsets_S1[-1])
        sentences += len(p.sent_offsets_S1) - 1
    return TokenizedDocs(
        ids_T=np.concatenate(ids) if ids else np.zeros(0, np.uint32),
        word_starts_T=np.concatenate(ws) if ws else np.zeros(0, np.uint8),
        sent_offsets_S1=np.concatenate(sent).astype(np.int64),
        doc_sent_offsets_D1=np.concatenate(doc).astype(np.int64),
        doc_langs=langs,
        doc_is_new=np.concatenate(new) if new else np.zeros(0, bool),
        doc_ids=np.concatenate(src).astype(np.int64) if src else np.zeros(0, np.int64),
    )


def _runs(ids_D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo_D, hi_D): the range of entries that share each entry's source document."""
    n = len(ids_D)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], ids_D[1:] != ids_D[:-1]]))
    ends = np.concatenate([starts[1:], [n]])
    if len(np.unique(ids_D[starts])) != len(starts):
        raise ValueError("the parts of a document must be contiguous in a block")
    return np.repeat(starts, ends - starts), np.repeat(ends, ends - starts)


class NspInstance(NamedTuple):
    """Token ranges of segment A and B after truncation, and before it (a_full, b_full), for the
    flat arrays of one TokenizedDocs block. is_random_next is the NSP label (1 = random B)."""

    a: tuple[int, int]
    b: tuple[int, int]
    is_random_next: bool
    a_doc: int
    b_doc: int
    a_full: tuple[int, int]
    b_full: tuple[int, int]


def nsp_instances(
    docs: TokenizedDocs,
    *,
    rng: random.Random,
    max_seq_len: int,
    short_seq_prob: float = 0.1,
    random_next_prob: float = 0.5,
) -> Iterator[NspInstance]:
    """BERT's create_instances_from_document over every document of the block, in order.

    Per document a target length (max_seq_len - 3, or with probability short_seq_prob a random
    one in [2, max_seq_len - 3]); sentences are gathered until the target is reached, A takes a
    random number of them, and B is the rest (label 0) or, with probability random_next_prob or
    when A took everything, a run of sentences of another document (label 1; the unused sentences
    go back). That document is drawn uniformly from the block's entries (donors included) of
    another source document, so a random B never comes from A's own document, as BERT intends
    (BERT's 10 tries and then a fallback to A's document would label A's continuation random).
    The pair is then truncated to max_seq_len - 3 tokens, one token at a time from the longer
    side, at its front or back at random. Raises ValueError when a random B is needed and the
    block has no other document (the caller adds donors first).
    """
    max_tokens = max_seq_len - 3
    sent = docs.sent_offsets_S1
    doc_sents = docs.doc_sent_offsets_D1
    run_lo_D, run_hi_D = _runs(docs.source_ids())
    num_a = docs.num_a_docs if docs.num_a_docs is not None else docs.num_docs
    for d in range(num_a):
        first, last = int(doc_sents[d]), int(doc_sents[d + 1])
        target = max_tokens
        if rng.random() < short_seq_prob:
            target = rng.randint(2, max_tokens)
        chunk_start, length = first, 0
        i = first
        while i < last:
            length += int(sent[i + 1] - sent[i])
            if i == last - 1 or length >= target:
                n = i + 1 - chunk_start  # sentences in the current chunk
                a_end = chunk_start + (rng.randint(1, n - 1) if n >= 2 else 1)
                a = (int(sent[chunk_start]), int(sent[a_end]))
                if n == 1 or rng.random() < random_next_prob:
                    run = (int(run_lo_D[d]), int(run_hi_D[d]))
                    b, b_doc = _random_b(docs, d=d, own_run=run, target_tokens=target - (a[1] - a[0]), rng=rng)
                    is_random = True
                    i -= (i + 1) - a_end  # the sentences A did not use go back
                else:
                    b, b_doc, is_random = (a[1], int(sent[i + 1])), d, False
                a_cut, b_cut = _truncate_pair(a, b, max_tokens=max_tokens, rng=rng)
                yield NspInstance(a_cut, b_cut, is_random, d, b_doc, a, b)
                chunk_start, length = i + 1, 0
            i += 1


def _random_b(
    docs: TokenizedDocs, *, d: int, own_run: tuple[int, int], target_tokens: int, rng: random.Random
) -> tuple[tuple[int, int], int]:
    """(B's token range, its document): a run of sentences from a random sentence on, until it holds
    `target_tokens` tokens or its document ends, in an entry drawn uniformly among the block's entries
    outside `own_run` (the entries [lo, hi) of A's source document, d's)."""
    sent, doc_sents, num_docs = docs.sent_offsets_S1, docs.doc_sent_offsets_D1, docs.num_docs
    lo, hi = own_run
    if num_docs == hi - lo:
        raise ValueError(f"document {d}: a random B needs another document in the block")
    r = rng.randint(0, num_docs - (hi - lo) - 1)
    r += (hi - lo) if r >= lo else 0  # skip A's own document
    r_first, r_last = int(doc_sents[r]), int(doc_sents[r + 1])
    j = rng.randint(r_first, r_last - 1)
    b_lo = int(sent[j])
    while j < r_last:
        j += 1
        if sent[j] - b_lo >= target_tokens:
            break
    return (b_lo, int(sent[j])), r


def _truncate_pair(
    a: tuple[int, int], b: tuple[int, int], *, max_tokens: int, rng: random.Random
) -> tuple[tuple[int, int], tuple[int, int]]:
    """BERT's truncate_seq_pair on token ranges."""
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    while (a_hi - a_lo) + (b_hi - b_lo) > max_tokens:
        if (a_hi - a_lo) > (b_hi - b_lo):
            if rng.random() < 0.5:
                a_lo += 1
            else:
                a_hi -= 1
        else:
            if rng.random() < 0.5:
                b_lo += 1
            else:
                b_hi -= 1
    return (a_lo, a_hi), (b_lo, b_hi)


def assemble_nsp(
    docs: TokenizedDocs, inst: NspInstance, *, cls_id: int, sep_id: int, dtype: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids_L, token_type_ids_L, word_starts_L) of `[CLS] A [SEP] B [SEP]`. Special tokens
    and the first token of A and of B (possibly cut mid-word by truncation) start words."""
    (a_lo, a_hi), (b_lo, b_hi) = inst.a, inst.b
    la, lb = a_hi - a_lo, b_hi - b_lo
    ids = np.empty(la + lb + 3, dtype=dtype)
    ids[0], ids[la + 1], ids[-1] = cls_id, sep_id, sep_id
    ids[1 : la + 1] = docs.ids_T[a_lo:a_hi]
    ids[la + 2 : -1] = docs.ids_T[b_lo:b_hi]
    ws = np.ones(la + lb + 3, dtype=np.uint8)
    ws[2 : la + 1] = docs.word_starts_T[a_lo + 1 : a_hi]
    ws[la + 3 : -1] = docs.word_starts_T[b_lo + 1 : b_hi]
    types = np.zeros(la + lb + 3, dtype=np.uint8)
    types[la + 2 :] = 1
    return ids, types, ws


LANG_CODES = {"en": 0, "zh": 1}
LANG_NAMES = ("en", "zh")


class Packer:
    """Packs the token stream (each document's tokens, then [SEP]) into blocks of exactly L
    tokens: [CLS] + the next L - 1 stream tokens. The stream continues across add() calls; the
    remainder shorter than a block stays in the carry and is dropped at the end."""

    def __init__(self, *, max_seq_len: int, cls_id: int, sep_id: int, dtype: type):
        self.width = max_seq_len - 1
        self.cls_id, self.sep_id, self.dtype = cls_id, sep_id, dtype
        self.ids = np.zeros(0, dtype=dtype)
        self.ws = np.zeros(0, dtype=np.uint8)
        self.lang = np.zeros(0, dtype=np.uint8)
        self.doc_start = np.zeros(0, dtype=bool)

    def add(self, docs: TokenizedDocs) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Append a block's documents; return the completed blocks: input_ids_NL,
        word_starts_NL (the token after [CLS] always starts a word) and each block's language
        (the majority of its tokens)."""
        doc_off = docs.doc_token_offsets()
        ends = doc_off[1:]
        counts = np.diff(doc_off) + 1
        codes = np.array([LANG_CODES[x] for x in docs.doc_langs], dtype=np.uint8)
        starts = np.zeros(len(docs.ids_T) + docs.num_docs, dtype=bool)
        new = docs.doc_is_new if docs.doc_is_new is not None else np.ones(docs.num_docs, dtype=bool)
        starts[(doc_off[:-1] + np.arange(docs.num_docs))[new]] = True
        self.ids = np.concatenate([self.ids, np.insert(docs.ids_T.astype(self.dtype), ends, self.sep_id)])
        self.ws = np.concatenate([self.ws, np.insert(docs.word_starts_T, ends, 1)])
        self.lang = np.concatenate([self.lang, np.repeat(codes, counts)])
        self.doc_start = np.concatenate([self.doc_start, starts])
        n = len(self.ids) // self.width
        used = n * self.width
        body_ids = self.ids[:used].reshape(n, self.width)
        body_ws = self.ws[:used].reshape(n, self.width)
        ids_NL = np.empty((n, self.width + 1), dtype=self.dtype)
        ids_NL[:, 0] = self.cls_id
        ids_NL[:, 1:] = body_ids
        ws_NL = np.ones((n, self.width + 1), dtype=np.uint8)
        ws_NL[:, 2:] = body_ws[:, 1:]
        zh_share = self.lang[:used].reshape(n, self.width).mean(axis=1) if n else np.zeros(0)
        langs = [LANG_NAMES[int(s > 0.5)] for s in zh_share]
        self.ids, self.ws = self.ids[used:], self.ws[used:]
        self.lang, self.doc_start = self.lang[used:], self.doc_start[used:]
        return ids_NL, ws_NL, langs

    def tail(self) -> tuple[int, int]:
        """(tokens, documents) left in the carry: what the end of the stream drops. A document
        counts when none of its tokens made it into a block."""
        return len(self.ids), int(self.doc_start.sum())
