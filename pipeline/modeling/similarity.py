"""Representation metrics: how closely token vectors crowd together, layer by layer.

Pure tensor functions (no model, no files) behind `pipeline/analyze.py` and the trainer's held-out
evaluation:
- TaCL's intra-sentence self-similarity: the mean cosine between *different* tokens of one sentence,
  averaged over sentences;
- TACO's intra-context against inter-context similarity: the mean cosine between different tokens of
  one sequence, against the mean cosine between tokens of two different sequences;
- an isotropy summary: the mean cosine of random token pairs, and the share of variance in the top
  principal direction.

Which tokens take part is the caller's decision, made once: every function takes integer group ids
per token, and id -1 leaves a token out. pipeline.evaluation.representation.inputs gives -1 to special tokens
([CLS], [SEP], [PAD], ...) and to padding, so none of these numbers ever includes them.

The means are exact without an N x N similarity matrix. For unit vectors u_1..u_n with sum s,
sum_{i != j} cos(u_i, u_j) = |s|^2 - n, so a batch reduces to one D-vector per group, and the
statistics accumulate across batches (`SimilarityStats`). Sums run in float64: for tokens that are all
nearly parallel |s|^2 is close to n^2, and the subtraction would lose digits in float32.

Shape legend: B sequences, L tokens per sequence, D hidden size, N tokens (flattened), G groups,
P sampled pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

_ACC = torch.float64


def unit_rows(x_ND: torch.Tensor) -> torch.Tensor:
    """Rows scaled to length 1, in float64. A zero row stays zero (its cosines count as 0)."""
    x_ND = x_ND.to(_ACC)
    return x_ND / x_ND.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def group_unit_sums(hidden_ND: torch.Tensor, group_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of unit vectors and token count per group.

    In: hidden_ND, group_N (int, -1 = left out). Out: (sums_GD float64, counts_G int64), one row per
    distinct non-negative group id, in ascending id order.
    """
    if hidden_ND.dim() != 2 or group_N.shape != hidden_ND.shape[:1]:
        raise ValueError(
            f"expected hidden (N, D) and groups (N,), got {tuple(hidden_ND.shape)} and {tuple(group_N.shape)}"
        )
    keep_N = group_N >= 0
    ids_G, inverse_n = torch.unique(group_N[keep_N], return_inverse=True)
    unit_nD = unit_rows(hidden_ND[keep_N])
    sums_GD = torch.zeros(len(ids_G), unit_nD.shape[1], dtype=_ACC, device=unit_nD.device)
    sums_GD.index_add_(0, inverse_n, unit_nD)
    counts_G = torch.bincount(inverse_n, minlength=len(ids_G))
    return sums_GD, counts_G


def self_similarity_from_sums(sums_GD: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """Mean cosine over the pairs of different tokens of each group, from `group_unit_sums`.

    Groups of fewer than two tokens have no pair; they are dropped. Out: sim_G' (float64).
    """
    multi_G = counts_G >= 2
    n_G = counts_G[multi_G].to(_ACC)
    return ((sums_GD[multi_G] ** 2).sum(-1) - n_G) / (n_G * (n_G - 1))


def group_self_similarity(hidden_ND: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """Mean cosine between different tokens of the same group, one value per group of >= 2 tokens.

    In: hidden_ND, group_N (int, -1 = left out). Out: sim_G (float64), ascending group id.
    """
    return self_similarity_from_sums(*group_unit_sums(hidden_ND, group_N))


def _per_sequence_groups(group_BL: torch.Tensor) -> torch.Tensor:
    """Make group ids unique across the batch: sentence 0 of row 0 and of row 1 are different
    sentences. Out: group_N (flattened), -1 kept."""
    stride = int(group_BL.max().clamp_min(0)) + 1
    rows_BL = torch.arange(group_BL.shape[0], device=group_BL.device)[:, None].expand_as(group_BL)
    return torch.where(group_BL >= 0, rows_BL * stride + group_BL, -1).reshape(-1)


def intra_sentence_similarity(hidden_BLD: torch.Tensor, *, sentence_BL: torch.Tensor) -> torch.Tensor:
    """TaCL's self-similarity of each sentence: the mean cosine between its different tokens.

    In: hidden_BLD, sentence_BL (int sentence index within its row; -1 = special token or padding).
    Out: sim_S (float64), one value per sentence with at least two tokens.
    """
    return group_self_similarity(hidden_BLD.flatten(0, 1), _per_sequence_groups(sentence_BL))


def inter_group_similarity(sums_GD: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """Mean, over ordered pairs of different groups (a, b), of the mean cosine between a token of a
    and a token of b. Each group pair weighs the same, whatever the group sizes.

    With m_g = sums_g / n_g (the mean unit vector of group g), the pair mean is m_a . m_b, and the
    sum over a != b is |sum_g m_g|^2 - sum_g |m_g|^2. Out: a float64 scalar (nan for < 2 groups).
    """
    nonempty_G = counts_G > 0
    mean_GD = sums_GD[nonempty_G] / counts_G[nonempty_G, None].to(_ACC)
    g = mean_GD.shape[0]
    if g < 2:
        return torch.tensor(float("nan"), dtype=_ACC)
    total = (mean_GD.sum(0) ** 2).sum() - (mean_GD**2).sum()
    return total / (g * (g - 1))


def context_similarity(hidden_BLD: torch.Tensor, *, token_mask_BL: torch.Tensor) -> dict[str, float]:
    """TACO's intra-context and inter-context similarity of one batch.

    intra: mean over sequences of the mean cosine between different tokens of the sequence.
    inter: mean over ordered pairs of different sequences of the mean cosine between their tokens.
    In: hidden_BLD, token_mask_BL (bool, False = special token or padding).
    Out: {"intra": float, "inter": float, "gap": intra - inter}.
    """
    rows_BL = torch.arange(hidden_BLD.shape[0], device=hidden_BLD.device)[:, None].expand_as(token_mask_BL)
    group_N = torch.where(token_mask_BL, rows_BL, -1).reshape(-1)
    sums_GD, counts_G = group_unit_sums(hidden_BLD.flatten(0, 1), group_N)
    intra = self_similarity_from_sums(sums_GD, counts_G).mean().item()
    inter = inter_group_similarity(sums_GD, counts_G).item()
    return {"intra": intra, "inter": inter, "gap": intra - inter}


def random_pair_cosine(x_ND: torch.Tensor, *, num_pairs: int, generator: torch.Generator) -> float:
    """Mean cosine of `num_pairs` token pairs (i, j), i != j, drawn uniformly with replacement.

    Near 0 for isotropic vectors; near 1 when all vectors share one direction (anisotropy).
    """
    n = x_ND.shape[0]
    if n < 2:
        raise ValueError(f"random_pair_cosine needs at least 2 vectors, got {n}")
    i_P = torch.randint(0, n, (num_pairs,), generator=generator)
    # Adding 1..n-1 (mod n) draws j uniformly among the other n - 1 tokens.
    j_P = (i_P + torch.randint(1, n, (num_pairs,), generator=generator)) % n
    unit_ND = unit_rows(x_ND)
    return (unit_ND[i_P.to(x_ND.device)] * unit_ND[j_P.to(x_ND.device)]).sum(-1).mean().item()


def top_direction_variance_share(x_ND: torch.Tensor) -> float:
    """Share of the total variance along the first principal direction (centred PCA): s_1^2 / sum s_k^2.

    1/D for isotropic vectors, 1.0 when all vectors lie on one line through their mean.
    """
    if x_ND.shape[0] < 2:
        raise ValueError(f"top_direction_variance_share needs at least 2 vectors, got {x_ND.shape[0]}")
    centred_ND = x_ND.to(_ACC) - x_ND.to(_ACC).mean(0, keepdim=True)
    s_K = torch.linalg.svdvals(centred_ND)
    total = (s_K**2).sum()
    return (s_K[0] ** 2 / total).item() if total > 0 else float("nan")


def token_similarity_matrix(hidden_LD: torch.Tensor) -> torch.Tensor:
    """Token-by-token cosine matrix of one sentence, for the heatmap. Out: sim_LL (float32)."""
    unit_LD = unit_rows(hidden_LD)
    return (unit_LD @ unit_LD.T).float()


@dataclass
class SimilarityStats:
    """Running sums for one layer over many batches; `result()` gives the means.

    Sentences and sequences each weigh the same; see `intra_sentence_similarity`, `context_similarity`.
    """

    sentence_sim_sum: float = 0.0
    num_sentences: int = 0
    context_sim_sum: float = 0.0
    num_contexts: int = 0
    num_tokens: int = 0
    # For the inter-context mean: sum of per-sequence mean unit vectors, and sum of their squared norms.
    context_mean_sum_D: Optional[torch.Tensor] = field(default=None, repr=False)
    context_mean_sq_sum: float = 0.0
    num_nonempty_contexts: int = 0

    def update(self, hidden_BLD: torch.Tensor, *, sentence_BL: torch.Tensor) -> None:
        """Add one batch. sentence_BL: sentence index per token, -1 for special tokens and padding;
        the tokens with an index >= 0 form the row's context."""
        sent_S = intra_sentence_similarity(hidden_BLD, sentence_BL=sentence_BL)
        self.sentence_sim_sum += sent_S.sum().item()
        self.num_sentences += sent_S.numel()

        rows_BL = torch.arange(hidden_BLD.shape[0], device=hidden_BLD.device)[:, None].expand_as(sentence_BL)
        context_N = torch.where(sentence_BL >= 0, rows_BL, -1).reshape(-1)
        sums_GD, counts_G = group_unit_sums(hidden_BLD.flatten(0, 1), context_N)
        ctx_G = self_similarity_from_sums(sums_GD, counts_G)
        self.context_sim_sum += ctx_G.sum().item()
        self.num_contexts += ctx_G.numel()
        self.num_tokens += int(counts_G.sum())
        mean_GD = sums_GD / counts_G[:, None].to(_ACC)
        batch_sum_D = mean_GD.sum(0).cpu()
        self.context_mean_sum_D = (
            batch_sum_D if self.context_mean_sum_D is None else self.context_mean_sum_D + batch_sum_D
        )
        self.context_mean_sq_sum += (mean_GD**2).sum().item()
        self.num_nonempty_contexts += mean_GD.shape[0]

    def result(self) -> dict[str, float]:
        """{"intra_sentence", "intra_context", "inter_context", "gap", counts}; nan where undefined."""
        nan = float("nan")
        g = self.num_nonempty_contexts
        inter = nan
        if g >= 2:
            inter = ((self.context_mean_sum_D**2).sum().item() - self.context_mean_sq_sum) / (g * (g - 1))
        intra_ctx = self.context_sim_sum / self.num_contexts if self.num_contexts else nan
        return {
            "intra_sentence": self.sentence_sim_sum / self.num_sentences if self.num_sentences else nan,
            "intra_context": intra_ctx,
            "inter_context": inter,
            "gap": intra_ctx - inter,
            "num_sentences": self.num_sentences,
            "num_contexts": self.num_contexts,
            "num_tokens": self.num_tokens,
        }


def sentence_ids(
    input_ids_BL: torch.Tensor, *, token_type_ids_BL: torch.Tensor, special_BL: torch.Tensor
) -> torch.Tensor:
    """Sentence index per token of a padded batch, as pipeline.evaluation's text readers number them: a
    sentence is a maximal run of non-special tokens, ended by a special token or a change of segment.
    In: ids and token types [B, L], special_BL bool (special tokens and padding). Out: [B, L] int64,
    -1 at special tokens and padding; `[CLS] a b [SEP] c [SEP]` -> [-1, 0, 0, -1, 1, -1]."""
    word_BL = ~special_BL
    previous_BL = torch.zeros_like(word_BL)
    previous_BL[:, 1:] = word_BL[:, :-1]
    changed_BL = torch.zeros_like(word_BL)
    changed_BL[:, 1:] = token_type_ids_BL[:, 1:] != token_type_ids_BL[:, :-1]
    start_BL = word_BL & (~previous_BL | changed_BL)
    ids_BL = start_BL.long().cumsum(1) - 1
    return torch.where(word_BL, ids_BL, torch.full_like(ids_BL, -1))
