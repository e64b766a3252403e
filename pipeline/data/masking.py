"""BERT masking, vectorised over a batch: which positions are predicted, and what the model sees there.

Rules (docs/objectives.md): exactly round(mask_prob * maskable) tokens of a sequence are chosen (at
least one when any token is maskable; special tokens and padding never are); of the chosen, 80%
become [MASK], 10% a random non-special token, 10% stay unchanged, drawn per token. With whole-word
masking, words (a token with word_starts 1 and the tokens after it with 0, as the shard builder
stores them; for Chinese what the segmenter made of the characters) are taken in random order while
they fit the budget (a first word always does), and every token of a chosen word is predicted; that
may leave the budget a few tokens short.

Randomness is counter-based: each draw is a hash of (seed, epoch, sample id, stream, position), so a
sample's masking is a pure function of those, whatever the batch, rank, worker, world size or
resumption, and a whole batch is masked with a few array operations instead of a generator per
sample. The per-sequence functions (`choose_positions`, `apply_mask`, `mask_sequence`) are the batch
of one; they also take a numpy Generator.

Legend: B sequences, L positions (the batch's longest), W word slots per sequence (W <= L).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from preprocessing.errors import UsageError

IGNORE_INDEX = -100
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
# The streams of a sample's draws.
_CHOOSE, _ACTION, _REPLACE = 1, 2, 3


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
            raise UsageError(
                f"vocabulary of {self.vocab_size} ids holds only special tokens: nothing to replace a "
                f"masked token with; use a real tokenizer"
            )
        return pool


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit (wraps mod 2**64)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@dataclass(frozen=True)
class SampleKeys:
    """The identity of each sequence's draws: (seed, epoch, sample id) per row."""

    seed: int
    epoch_B: np.ndarray
    sample_id_B: np.ndarray

    def uniforms(self, stream: int, width: int) -> np.ndarray:
        """[B, width] float64 in [0, 1): the draws of `stream` at positions 0..width-1 of each row."""
        with np.errstate(over="ignore"):
            seed = _mix(np.asarray([self.seed], dtype=np.int64).astype(_U64) + _GOLDEN)
            row = _mix(
                _mix(seed ^ self.epoch_B.astype(np.int64).astype(_U64)) ^ self.sample_id_B.astype(np.int64).astype(_U64)
            )
            col = _mix((np.arange(width, dtype=_U64) + _U64(1)) * _GOLDEN + _U64(stream) * _U64(0xD1B54A32D192ED03))
            bits = _mix(row[:, None] ^ col[None, :])
        return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_rng(*, seed: int, epoch: int, sample_id: int) -> SampleKeys:
    """The draws of one sample's masking: a pure function of (seed, epoch, sample id)."""
    return SampleKeys(seed=seed, epoch_B=np.asarray([epoch]), sample_id_B=np.asarray([sample_id]))


Draws = Union[SampleKeys, np.random.Generator]


def _uniforms(rng: Draws, stream: int, shape: tuple[int, int]) -> np.ndarray:
    if isinstance(rng, SampleKeys):
        return rng.uniforms(stream, shape[1])
    return rng.random(shape)


def maskable_positions(input_ids: np.ndarray, *, special_ids: np.ndarray) -> np.ndarray:
    """Bool, the shape of input_ids: positions that may be chosen (not a special token; padding is one)."""
    return ~np.isin(input_ids, special_ids)


def budgets(maskable_BL: np.ndarray, mask_prob: float) -> np.ndarray:
    """[B] tokens to choose per sequence: round(mask_prob * maskable), >= 1 when any is maskable."""
    n_B = maskable_BL.sum(axis=1)
    return np.where(n_B > 0, np.maximum(1, np.round(mask_prob * n_B)), 0).astype(np.int64)


def choose_batch(
    maskable_BL: np.ndarray, *, word_starts_BL: np.ndarray | None, mask_prob: float, u_BL: np.ndarray
) -> np.ndarray:
    """Bool [B, L]: the positions to predict, from one uniform per position (u_BL).

    Token level (word_starts_BL None): the budget's lowest-u maskable positions of each row. Whole-word:
    the words of a row (word_starts 1 opens one; a non-maskable position breaks words) in the order of
    u at their word index, each taken while its tokens fit the budget.
    """
    B, L = maskable_BL.shape
    budget_B = budgets(maskable_BL, mask_prob)
    if word_starts_BL is None:
        key_BL = np.where(maskable_BL, u_BL, 2.0)
        order_BL = np.argsort(key_BL, axis=1, kind="stable")
        rank_BL = np.empty_like(order_BL)
        np.put_along_axis(rank_BL, order_BL, np.arange(L)[None, :].repeat(B, 0), axis=1)
        return (rank_BL < budget_B[:, None]) & maskable_BL
    starts_BL = (word_starts_BL != 0) | ~maskable_BL
    word_BL = np.cumsum(starts_BL, axis=1) - 1  # word index within the row, < L
    size_BW = np.zeros((B, L), np.int64)
    rows_BL = np.arange(B)[:, None].repeat(L, 1)
    np.add.at(size_BW, (rows_BL[maskable_BL], word_BL[maskable_BL]), 1)
    key_BW = np.where(size_BW > 0, u_BL, 2.0)  # the uniform at a word's index orders the words
    order_BW = np.argsort(key_BW, axis=1, kind="stable")
    sorted_size_BW = np.take_along_axis(size_BW, order_BW, axis=1)
    taken_B = np.zeros(B, np.int64)
    take_sorted_BW = np.zeros((B, L), bool)
    for j in range(int((size_BW > 0).sum(axis=1).max(initial=0))):
        s_B = sorted_size_BW[:, j]
        fits_B = (s_B > 0) & ((taken_B + s_B <= budget_B) | (taken_B == 0))
        take_sorted_BW[:, j] = fits_B
        taken_B += np.where(fits_B, s_B, 0)
    take_BW = np.zeros((B, L), bool)
    np.put_along_axis(take_BW, order_BW, take_sorted_BW, axis=1)
    return np.take_along_axis(take_BW, word_BL, axis=1) & maskable_BL


def apply_batch(
    input_ids_BL: np.ndarray,
    chosen_BL: np.ndarray,
    *,
    mask_token_id: int,
    replacement_pool: np.ndarray,
    u_action_BL: np.ndarray,
    u_replace_BL: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """80/10/10 on the chosen positions. Returns (masked_ids_BL int64, labels_BL int64: the original id
    where chosen, IGNORE_INDEX elsewhere)."""
    ids_BL = input_ids_BL.astype(np.int64, copy=False)
    labels_BL = np.where(chosen_BL, ids_BL, IGNORE_INDEX)
    random_BL = replacement_pool[
        np.minimum((u_replace_BL * len(replacement_pool)).astype(np.int64), len(replacement_pool) - 1)
    ]
    masked_BL = np.where(
        chosen_BL & (u_action_BL < 0.8), mask_token_id, np.where(chosen_BL & (u_action_BL < 0.9), random_BL, ids_BL)
    )
    return masked_BL, labels_BL


def mask_batch(
    input_ids_BL: np.ndarray,
    *,
    real_BL: np.ndarray,
    word_starts_BL: np.ndarray | None,
    spec: MaskingSpec,
    replacement_pool: np.ndarray,
    keys: SampleKeys,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose and mask a padded batch (real_BL: True at real tokens). Returns (masked_ids_BL, labels_BL)."""
    shape = input_ids_BL.shape
    maskable_BL = maskable_positions(input_ids_BL, special_ids=np.asarray(spec.special_ids)) & real_BL
    chosen_BL = choose_batch(
        maskable_BL,
        word_starts_BL=word_starts_BL if spec.whole_word else None,
        mask_prob=spec.mask_prob,
        u_BL=_uniforms(keys, _CHOOSE, shape),
    )
    return apply_batch(
        input_ids_BL,
        chosen_BL,
        mask_token_id=spec.mask_token_id,
        replacement_pool=replacement_pool,
        u_action_BL=_uniforms(keys, _ACTION, shape),
        u_replace_BL=_uniforms(keys, _REPLACE, shape),
    )


def choose_positions(
    maskable_L: np.ndarray, *, word_starts_L: np.ndarray | None, mask_prob: float, rng: Draws
) -> np.ndarray:
    """Bool [L]: the positions to predict of one sequence (`choose_batch` on a batch of one)."""
    return choose_batch(
        maskable_L[None],
        word_starts_BL=None if word_starts_L is None else word_starts_L[None],
        mask_prob=mask_prob,
        u_BL=_uniforms(rng, _CHOOSE, (1, len(maskable_L))),
    )[0]


def apply_mask(
    input_ids_L: np.ndarray, chosen_L: np.ndarray, *, mask_token_id: int, replacement_pool: np.ndarray, rng: Draws
) -> tuple[np.ndarray, np.ndarray]:
    """80/10/10 on one sequence's chosen positions. Returns (masked_ids_L, labels_L with IGNORE_INDEX)."""
    shape = (1, len(input_ids_L))
    masked, labels = apply_batch(
        np.asarray(input_ids_L)[None],
        chosen_L[None],
        mask_token_id=mask_token_id,
        replacement_pool=replacement_pool,
        u_action_BL=_uniforms(rng, _ACTION, shape),
        u_replace_BL=_uniforms(rng, _REPLACE, shape),
    )
    return masked[0], labels[0]


def mask_sequence(
    input_ids_L: np.ndarray,
    *,
    word_starts_L: np.ndarray | None,
    spec: MaskingSpec,
    replacement_pool: np.ndarray,
    rng: Draws,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose and mask one sequence. Returns (masked_ids_L int64, labels_L int64 with -100)."""
    ids = np.asarray(input_ids_L)
    maskable_L = maskable_positions(ids, special_ids=np.asarray(spec.special_ids))
    chosen_L = choose_positions(
        maskable_L, word_starts_L=word_starts_L if spec.whole_word else None, mask_prob=spec.mask_prob, rng=rng
    )
    return apply_mask(ids, chosen_L, mask_token_id=spec.mask_token_id, replacement_pool=replacement_pool, rng=rng)
