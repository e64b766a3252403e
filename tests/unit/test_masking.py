"""Masking: the 15% / 80-10-10 rule, never special tokens or padding, whole words (English word
pieces and Chinese segmenter words), and determinism per (seed, epoch, sample id)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.masking import (
    IGNORE_INDEX,
    MaskingSpec,
    apply_mask,
    choose_positions,
    mask_sequence,
    maskable_positions,
    sample_rng,
)

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = (PAD, UNK, CLS, SEP, MASK)
V = 100


def spec(**kw) -> MaskingSpec:
    return MaskingSpec(mask_token_id=MASK, special_ids=SPECIALS, vocab_size=V, **kw)


def seq(n_words: int, rng: np.random.Generator, *, pad: int = 0) -> np.ndarray:
    ids = rng.integers(5, V, size=n_words)
    return np.concatenate([[CLS], ids, [SEP], [PAD] * pad]).astype(np.int64)


def test_never_special_or_padding_and_exact_count():
    rng = np.random.default_rng(0)
    s = spec()
    pool = s.replacement_pool()
    for i in range(200):
        ids = seq(int(rng.integers(1, 60)), rng, pad=int(rng.integers(0, 10)))
        # A [SEP] in the middle too, as in NSP pairs.
        ids[len(ids) // 2] = SEP if len(ids) > 6 and ids[len(ids) // 2] != PAD else ids[len(ids) // 2]
        masked, labels = mask_sequence(
            ids, word_starts_L=None, spec=s, replacement_pool=pool, rng=sample_rng(seed=1, epoch=0, sample_id=i)
        )
        chosen = labels != IGNORE_INDEX
        maskable = ~np.isin(ids, SPECIALS)
        assert not (chosen & ~maskable).any(), "a special token or padding was chosen"
        assert chosen.sum() == max(1, round(0.15 * maskable.sum()))
        # Unchosen positions are untouched; labels hold the original ids.
        assert (masked[~chosen] == ids[~chosen]).all()
        assert (labels[chosen] == ids[chosen]).all()


def test_80_10_10_proportions():
    rng = np.random.default_rng(0)
    s = spec()
    pool = s.replacement_pool()
    counts = np.zeros(3)
    for i in range(3000):
        ids = seq(100, rng)
        masked, labels = mask_sequence(
            ids, word_starts_L=None, spec=s, replacement_pool=pool, rng=sample_rng(seed=0, epoch=0, sample_id=i)
        )
        chosen = labels != IGNORE_INDEX
        m = masked[chosen]
        counts += [(m == MASK).sum(), ((m != MASK) & (m != ids[chosen])).sum(), (m == ids[chosen]).sum()]
    total = counts.sum()
    # "random" can draw the original id (1 chance in 95): that lands in "unchanged".
    expected = np.array([0.8, 0.1 * 94 / 95, 0.1 + 0.1 / 95])
    assert np.allclose(counts / total, expected, atol=0.01), counts / total
    # A random replacement is never a special token.
    assert set(pool.tolist()).isdisjoint(SPECIALS)


def test_whole_word_masking_takes_every_piece_of_a_word():
    # Words of 1-3 pieces: word_starts 1 opens a word. Specials are words of their own.
    rng = np.random.default_rng(3)
    s = spec(whole_word=True)
    pool = s.replacement_pool()
    for i in range(300):
        lengths = rng.integers(1, 4, size=int(rng.integers(2, 40)))
        starts = np.concatenate([[1]] + [[1] + [0] * (n - 1) for n in lengths] + [[1]])
        ids = np.concatenate([[CLS], rng.integers(5, V, size=int(lengths.sum())), [SEP]]).astype(np.int64)
        masked, labels = mask_sequence(
            ids, word_starts_L=starts, spec=s, replacement_pool=pool, rng=sample_rng(seed=2, epoch=0, sample_id=i)
        )
        chosen = labels != IGNORE_INDEX
        word = np.cumsum(starts) - 1
        for w in np.unique(word[chosen]):
            assert chosen[word == w].all(), f"word {w} only partly chosen"
        budget = max(1, round(0.15 * lengths.sum()))
        assert 1 <= chosen.sum() <= max(budget, 3)
        assert not chosen[0] and not chosen[-1]


def test_whole_word_masking_chinese_words_from_the_segmenter():
    # One token per Chinese character; word_starts as the builder stores them from rjieba.
    import tempfile
    from pathlib import Path

    from transformers import BertTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        chars = list("我们喜欢北京天安门今天天气很好")
        (Path(d) / "vocab.txt").write_text(
            "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(chars)])
        )
        tok = BertTokenizerFast(vocab_file=str(Path(d) / "vocab.txt"))
    words = ["我们", "喜欢", "北京", "天安门"]
    ids = tok("".join(words))["input_ids"]
    assert len(ids) == 2 + sum(len(w) for w in words)  # [CLS] + one token per character + [SEP]
    starts = [1] + [1 if i == 0 else 0 for w in words for i in range(len(w))] + [1]
    s = MaskingSpec(
        mask_token_id=tok.mask_token_id,
        special_ids=tuple(tok.all_special_ids),
        vocab_size=len(tok),
        whole_word=True,
        mask_prob=0.3,
    )
    seen = set()
    for i in range(200):
        _, labels = mask_sequence(
            np.asarray(ids),
            word_starts_L=np.asarray(starts),
            spec=s,
            replacement_pool=s.replacement_pool(),
            rng=sample_rng(seed=0, epoch=0, sample_id=i),
        )
        chosen = tuple(np.flatnonzero(labels != IGNORE_INDEX))
        seen.add(chosen)
    spans = {(1, 2), (3, 4), (5, 6), (7, 8, 9)}  # the positions of each word
    for c in seen:
        covered = set(c)
        assert all(set(sp) <= covered or not (set(sp) & covered) for sp in spans), c
    # Every word gets chosen sometimes, "天安门" with its three characters together.
    assert any(set((7, 8, 9)) <= set(c) for c in seen)


def test_determinism_per_seed_epoch_sample():
    ids = seq(50, np.random.default_rng(0))
    s = spec()
    pool = s.replacement_pool()

    def run(**kw):
        return mask_sequence(ids, word_starts_L=None, spec=s, replacement_pool=pool, rng=sample_rng(**kw))[0]

    a = run(seed=0, epoch=0, sample_id=7)
    assert (a == run(seed=0, epoch=0, sample_id=7)).all()
    # Another epoch, sample or seed masks differently (dynamic masking).
    assert not (a == run(seed=0, epoch=1, sample_id=7)).all()
    assert not (a == run(seed=0, epoch=0, sample_id=8)).all()
    assert not (a == run(seed=1, epoch=0, sample_id=7)).all()


def test_nothing_maskable_means_nothing_chosen():
    ids = np.array([CLS, SEP, PAD, PAD])
    chosen = choose_positions(
        maskable_positions(ids, special_ids=np.asarray(SPECIALS)),
        word_starts_L=None,
        mask_prob=0.15,
        rng=np.random.default_rng(0),
    )
    assert not chosen.any()
    masked, labels = apply_mask(
        ids, chosen, mask_token_id=MASK, replacement_pool=np.arange(5, V), rng=np.random.default_rng(0)
    )
    assert (masked == ids).all() and (labels == IGNORE_INDEX).all()


def test_vocabulary_of_specials_only_is_refused():
    with pytest.raises(ValueError, match="only special tokens"):
        MaskingSpec(mask_token_id=MASK, special_ids=SPECIALS, vocab_size=5).replacement_pool()
