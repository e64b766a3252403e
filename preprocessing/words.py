"""Word boundaries for whole-word masking: a `word_starts` flag per token.

English (and every non-ideograph token): a token starts a word unless it is a continuation piece
(`##xx` for WordPiece; no `▁`/`Ġ` marker for SentencePiece/byte-level BPE), read from a per-id
lookup table, so no per-token Python work. Chinese ideographs: a character starts a word when
rjieba's segmentation of the sentence starts a word there. Ideograph tokens map one-to-one, in
order, onto the ideographs of the text, which aligns them without asking the tokenizer for
offsets; a sentence where that does not hold (an ideograph outside the vocabulary, a tokenizer
that merges ideographs) falls back to offsets.

SentencePiece-style tokenizers (`encoder.spelled`: '▁' pieces, ideographs not isolated, so a piece
may hold several): in a Chinese sentence every token without a '▁' takes rjieba's flag at its first
character (jieba also segments the digits, Latin words and punctuation of Chinese text), found by
adding up the characters the tokens spell, or by offsets where that does not add up (an [UNK]).
In every sentence, the token after a bare '▁' piece continues the word that '▁' starts
(sentencepiece writes "▁" + "北京" when "▁北京" is not a piece).

Legend: T tokens of a batch of sentences, S sentences, C characters.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from preprocessing.text import is_cjk_codepoints
from preprocessing.tokenization import SentenceEncoder


def segment_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [s, s + n) for every (s, n): the positions of chosen segments."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shifts = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + shifts


def word_starts(
    encoder: SentenceEncoder,
    *,
    ids_T: np.ndarray,
    lengths_S: np.ndarray,
    encodings: list,
    sentences: list[str],
    zh_S: np.ndarray,
) -> np.ndarray:
    """uint8 flags (T,): 1 where a token starts a word. Sentences flagged in zh_S get rjieba
    words for their ideographs. Every sentence's first token starts a word."""
    if encoder.start_table is not None:
        ws_T = encoder.start_table[ids_T]
    else:  # no spelling rule: ask the pre-tokenizer's word ids (per-token Python, rare)
        ws_T = np.ones(len(ids_T), dtype=np.uint8)
        pos = 0
        for enc in encodings:
            w = np.array([-1 if x is None else x for x in enc.word_ids], dtype=np.int64)
            ws_T[pos + 1 : pos + len(w)] = w[1:] != w[:-1]
            pos += len(w)
    offsets_S1 = np.concatenate([[0], np.cumsum(lengths_S)])
    nonempty = lengths_S > 0
    ws_T[offsets_S1[:-1][nonempty]] = 1
    zh_idx = np.flatnonzero(zh_S & nonempty)
    if len(zh_idx):
        fn = _spelled_chinese_word_starts if encoder.spelled else _chinese_word_starts
        fn(
            encoder,
            ws_T=ws_T,
            ids_T=ids_T,
            offsets_S1=offsets_S1,
            lengths_S=lengths_S,
            sentences=sentences,
            zh_idx=zh_idx,
        )
    if encoder.spelled and encoder.marker_id is not None and len(ids_T):
        ws_T[np.flatnonzero(ids_T[:-1] == encoder.marker_id) + 1] = 0
        ws_T[offsets_S1[:-1][nonempty]] = 1  # a sentence's first token, even after the last one's '▁'
    return ws_T


def jieba_char_starts(text: str) -> np.ndarray:
    """uint8 flags (C,): 1 where rjieba starts a word in `text`."""
    import rjieba

    lens = np.fromiter(map(len, rjieba.cut(text)), dtype=np.int64)
    flags = np.zeros(len(text), dtype=np.uint8)
    if len(text):
        flags[np.concatenate([[0], np.cumsum(lens)[:-1]])] = 1
    return flags


def _chinese_word_starts(
    encoder: SentenceEncoder,
    *,
    ws_T: np.ndarray,
    ids_T: np.ndarray,
    offsets_S1: np.ndarray,
    lengths_S: np.ndarray,
    sentences: list[str],
    zh_idx: np.ndarray,
) -> None:
    import rjieba

    texts = [sentences[i] for i in zh_idx]
    cps_C = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    char_lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    cjk_C = is_cjk_codepoints(cps_C)
    # rjieba's words tile each sentence, so word lengths summed over the batch give start offsets
    # in the concatenated text.
    word_lens = np.fromiter(chain.from_iterable(map(len, rjieba.cut(t)) for t in texts), dtype=np.int64)
    assert word_lens.sum() == len(cps_C), "rjieba's words must tile the text"
    starts_C = np.zeros(len(cps_C), dtype=np.uint8)
    starts_C[np.concatenate([[0], np.cumsum(word_lens)[:-1]])] = 1

    tok_pos = segment_ranges(offsets_S1[zh_idx], lengths_S[zh_idx])
    cjk_tok = encoder.cjk_table[ids_T[tok_pos]]
    char_off = np.concatenate([[0], np.cumsum(char_lens)[:-1]])
    tok_off = np.concatenate([[0], np.cumsum(lengths_S[zh_idx])[:-1]])
    ok_S = np.add.reduceat(cjk_C, char_off) == np.add.reduceat(cjk_tok, tok_off)
    char_ok = np.repeat(ok_S, char_lens)
    tok_ok = np.repeat(ok_S, lengths_S[zh_idx])
    ws_T[tok_pos[cjk_tok & tok_ok]] = starts_C[cjk_C & char_ok]

    for k in np.flatnonzero(~ok_S):
        sentence = texts[k]
        local = starts_C[char_off[k] : char_off[k] + char_lens[k]]
        local_cjk = cjk_C[char_off[k] : char_off[k] + char_lens[k]]
        enc = encoder.tok.encode(sentence, add_special_tokens=False)
        base = offsets_S1[zh_idx[k]]
        for j, (tid, (lo, hi)) in enumerate(zip(enc.ids, enc.offsets)):
            # Only a token that is one ideograph, or [UNK] standing for one, takes rjieba's flag.
            if j and hi - lo == 1 and (encoder.cjk_table[tid] or tid == encoder.unk_id) and local_cjk[lo]:
                ws_T[base + j] = local[lo]


def spelled_char_positions(
    encoder: SentenceEncoder, *, ids_t: np.ndarray, n_tok: np.ndarray, char_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For a `spelled` tokenizer: (char_t, ok_S). ids_t: the tokens of S sentences, n_tok (S,) of
    them each; char_lens (S,): the sentences' lengths. ok_S: the sentence's tokens spell exactly
    its length in characters, plus the one '▁' sentencepiece puts in front. char_t (T,): the
    position of each token's first character in its sentence (that '▁' at -1), meaningful where
    ok_S holds. (The builder's sentences are already NFKC'd and space-collapsed, so the normaliser
    rarely changes a length, and when it does the sum disagrees.)"""
    span_t = encoder.spelled_len[ids_t]
    tok_off = np.concatenate([[0], np.cumsum(n_tok)[:-1]])
    prefix_S = encoder.lead_table[ids_t[tok_off]].astype(np.int64)
    before_t = np.cumsum(span_t) - span_t  # exact in int64, so an UNKNOWN_SPAN cancels out below
    sent_t = np.repeat(np.arange(len(n_tok)), n_tok)
    char_t = before_t - before_t[tok_off][sent_t] - prefix_S[sent_t]
    ok_S = np.add.reduceat(span_t, tok_off) == char_lens + prefix_S
    return char_t, ok_S


def _spelled_chinese_word_starts(
    encoder: SentenceEncoder,
    *,
    ws_T: np.ndarray,
    ids_T: np.ndarray,
    offsets_S1: np.ndarray,
    lengths_S: np.ndarray,
    sentences: list[str],
    zh_idx: np.ndarray,
) -> None:
    """Chinese sentences of a `spelled` tokenizer: every token without a leading '▁' gets rjieba's
    flag at its first character, found by spelled_char_positions, or by offsets in a sentence
    whose tokens do not add up to it (one with an [UNK])."""
    import rjieba

    texts = [sentences[i] for i in zh_idx]
    char_lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    word_lens = np.fromiter(chain.from_iterable(map(len, rjieba.cut(t)) for t in texts), dtype=np.int64)
    assert word_lens.sum() == char_lens.sum(), "rjieba's words must tile the text"
    starts_C = np.zeros(int(char_lens.sum()), dtype=np.uint8)
    starts_C[np.concatenate([[0], np.cumsum(word_lens)[:-1]])] = 1
    char_off = np.concatenate([[0], np.cumsum(char_lens)[:-1]])

    n_tok = lengths_S[zh_idx]
    tok_pos = segment_ranges(offsets_S1[zh_idx], n_tok)
    ids = ids_T[tok_pos]
    char_t, ok_S = spelled_char_positions(encoder, ids_t=ids, n_tok=n_tok, char_lens=char_lens)
    sent_t = np.repeat(np.arange(len(texts)), n_tok)
    take = ok_S[sent_t] & ~encoder.lead_table[ids]
    ws_T[tok_pos[take]] = starts_C[(char_off[sent_t] + char_t)[take]]

    for k in np.flatnonzero(~ok_S):
        local = starts_C[char_off[k] : char_off[k] + char_lens[k]]
        enc = encoder.tok.encode(texts[k], add_special_tokens=False)
        base = offsets_S1[zh_idx[k]]
        for j, (tid, (lo, _)) in enumerate(zip(enc.ids, enc.offsets)):
            if j and not encoder.lead_table[tid] and lo < len(local):
                ws_T[base + j] = local[lo]
