"""BERT masking as pure functions on one sequence: which positions are predicted, and what the
model sees there.

Rules (docs/objectives.md): 15% of the maskable tokens are chosen (special tokens and padding never are);
of the chosen, 80% become [MASK], 10% a random token, 10% stay unchanged. With whole-word masking,
words are chosen (a word = a token with word_starts 1 and the tokens after it with 0, as the shard
builder stores them; for Chinese a word is what the segmenter made of its characters) and every
token of a chosen word is predicted. The 80/10/10 draw is per token, as in Google's BERT.

Exactly round(mask_prob * maskable) tokens are chosen (at least one when any token is maskable), so
every sequence has anchors for the contrastive losses and the MLM head's size is predictable.
Whole-word selection adds words while the budget allows, which may leave it a few tokens short.

Randomness comes from a numpy Generator the caller seeds; the collator seeds one per sample from
(seed, epoch, sample id), so a sample's masking does not depend on the rank, the worker, the world
size or a resumption.

Legend: L positions of one sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MaskingSpec:
    """Everything masking needs to know about the vocabulary."""

    mask_token_id: int
    special_ids: tuple[int, ...]  # never chosen ([PAD], [CLS], [SEP], [MASK], [UNK], ...)
    vocab_size: int  # random replacements come from the non-special ids below this
    mask_prob: float = 0.15
    whole_word: bool = False

    def replacement_pool(self) -> np.ndarray:
        """The ids a '10% random' position may become: every non-special id."""
        pool = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64), np.asarray(self.special_ids, np.int64))
        if len(pool) == 0:
            raise ValueError(f"vocabulary of {self.vocab_size} ids holds only special tokens")
        return pool


def maskable_positions(input_ids_L: np.ndarray, *, special_ids: np.ndarray) -> np.ndarray:
    """Bool [L]: positions that may be chosen (not a special token; padding is a special token)."""
    return ~np.isin(input_ids_L, special_ids)


def choose_positions(
    maskable_L: np.ndarray,
    *,
    word_starts_L: np.ndarray | None,
    mask_prob: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Bool [L]: the positions to predict.

    Token level (word_starts_L None): exactly k = round(mask_prob * maskable) positions, k >= 1
    when any position is maskable. Whole-word: the maskable positions are grouped into words by
    `word_starts_L` (1 opens a word); words are taken in random order while their tokens fit in the
    budget k (a first word always fits, so a sequence with a maskable token always gets one).
    """
    candidates = np.flatnonzero(maskable_L)
    chosen_L = np.zeros(maskable_L.shape, dtype=bool)
    if len(candidates) == 0:
        return chosen_L
    budget = max(1, int(round(mask_prob * len(candidates))))
    if word_starts_L is None:
        chosen_L[rng.choice(candidates, size=budget, replace=False)] = True
        return chosen_L
    # Word ids over all positions; a non-maskable position (special token) breaks words.
    starts_L = (word_starts_L != 0) | ~maskable_L
    word_L = np.cumsum(starts_L) - 1
    words = np.unique(word_L[candidates])
    taken = 0
    for w in rng.permutation(words):
        members = candidates[word_L[candidates] == w]
        if taken and taken + len(members) > budget:
            continue
        chosen_L[members] = True
        taken += len(members)
        if taken >= budget:
            break
    return chosen_L


def apply_mask(
    input_ids_L: np.ndarray,
    chosen_L: np.ndarray,
    *,
    mask_token_id: int,
    replacement_pool: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """80/10/10 on the chosen positions. Returns (masked_ids_L, labels_L); labels_L holds the
    original id at chosen positions and IGNORE_INDEX elsewhere."""
    masked_L = input_ids_L.astype(np.int64, copy=True)
    labels_L = np.full(input_ids_L.shape, IGNORE_INDEX, dtype=np.int64)
    pos = np.flatnonzero(chosen_L)
    labels_L[pos] = input_ids_L[pos]
    u = rng.random(len(pos))
    to_mask = pos[u < 0.8]
    to_random = pos[(u >= 0.8) & (u < 0.9)]
    masked_L[to_mask] = mask_token_id
    masked_L[to_random] = replacement_pool[rng.integers(0, len(replacement_pool), size=len(to_random))]
    return masked_L, labels_L


def mask_sequence(
    input_ids_L: np.ndarray,
    *,
    word_starts_L: np.ndarray | None,
    spec: MaskingSpec,
    replacement_pool: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose and mask one sequence. Returns (masked_ids_L int64, labels_L int64 with -100)."""
    maskable_L = maskable_positions(input_ids_L, special_ids=np.asarray(spec.special_ids))
    chosen_L = choose_positions(maskable_L, word_starts_L=word_starts_L if spec.whole_word else None,
                                mask_prob=spec.mask_prob, rng=rng)
    return apply_mask(input_ids_L, chosen_L, mask_token_id=spec.mask_token_id,
                      replacement_pool=replacement_pool, rng=rng)


def sample_rng(*, seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The generator for one sample's masking: a pure function of (seed, epoch, sample id)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, sample_id])))
