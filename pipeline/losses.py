"""The pre-training objectives: MLM and NSP cross-entropy, and the token-level contrastive losses of
TaCL (Su et al., NAACL 2022) and TACO (Fu et al., ACL 2022), with negatives drawn across ranks.

The formulas are those of ../shared/REFERENCE.md; the README's "Losses" section says what differs
from the upstream code and why. All losses compute in fp32 whatever the input dtype, and return
(loss, metrics): an fp32 scalar to back-propagate, and a dict of detached fp32 scalars with at least
"loss", "acc" (how often the positive has the strictly highest logit) and "num_anchors".

How a contrastive loss is shared across the ranks of `group`: rank r returns
    loss_r = (R / N) * (sum of l_i over rank r's anchors),   N = the anchors of all ranks.
DeepSpeed (like DDP) averages gradients over ranks, so the parameters follow the gradient of
mean_r loss_r = (1/N) * (sum over all anchors): the loss of one process holding the concatenated
batch. Every anchor weighs the same, whichever rank holds it (uneven counts, or a rank with no
anchor at all, included); with equal counts loss_r is the plain mean over rank r's anchors. The
metrics are the global values, the same on every rank.

Legend: B sequences, L positions, D hidden size, V vocabulary, N anchors (this rank), P pool rows
(all ranks), K negatives per anchor, R ranks; `_flat` = index into this rank's B*L positions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import distributed
from pipeline.loss_sampling import (
    anchor_uniforms,
    draw_pool,
    draw_seed,
    gather_layout,
    gather_pool,
    layout_bytes,
    max_pool_rows_per_rank,
    negative_pool_indices,
    positive_positions,
)
from pipeline.taco_kernel import taco_anchor_losses

IGNORE_INDEX = -100
# TACO's pool: rows drawn from all ranks' real tokens per call (see loss_sampling). The loss costs
# two [N, D] x [D, P] GEMMs, so P sets its price: 512 rows (10 K) leave each anchor ~48 distinct
# negatives out of 50 draws, run ~6x faster than upstream's [B, L, K, D] gather at B=32, L=256, K=50
# on CPU (4096 rows would only tie with it), and gather ~0.4% of BERT-base's gradient all-reduce
# bytes at 64 ranks.
TACO_POOL_SIZE = 512
# The metrics reduction: 4 float64 per call.
_REDUCE_BYTES = 4 * 8
_TACO_ANCHORS = ("all", "masked", "unmasked")
_TACL_NEGATIVES = ("sequence", "global")

Metrics = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# Cross-entropy heads
# ---------------------------------------------------------------------------------------------------


def mlm_loss(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Masked-LM cross-entropy, mean over the labelled positions (labels != -100).

    In: logits [..., V] (any leading shape, e.g. [B, L, V] or only the masked rows [M, V]) and
    labels with the same leading shape. Only labelled rows are upcast to fp32, so a full-vocabulary
    bf16 head does not get copied whole. Out: (loss, {"loss", "acc", "num_anchors"}).
    """
    vocab = logits_NV.shape[-1]
    logits_NV = logits_NV.reshape(-1, vocab)
    labels_N = labels_N.reshape(-1)
    if logits_NV.shape[0] != labels_N.shape[0]:
        raise ValueError(f"mlm_loss: {logits_NV.shape[0]} logit rows but {labels_N.shape[0]} labels")
    labelled_N = labels_N != IGNORE_INDEX
    logits_MV = logits_NV[labelled_N].float()
    labels_M = labels_N[labelled_N]
    return _plain_cross_entropy(logits_MV, labels_M)


def nsp_loss(logits_N2: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Next-sentence-prediction cross-entropy (HF convention: label 0 = B follows A), mean over pairs.
    In: logits [N, 2], labels [N]. Out: (loss, {"loss", "acc", "num_anchors"})."""
    if logits_N2.shape[0] != labels_N.shape[0]:
        raise ValueError(f"nsp_loss: {logits_N2.shape[0]} logit rows but {labels_N.shape[0]} labels")
    return _plain_cross_entropy(logits_N2.float(), labels_N)


def _plain_cross_entropy(logits_MC: torch.Tensor, labels_M: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    count = labels_M.shape[0]
    # A sum over zero rows is 0 with a grad_fn, where a mean would be NaN.
    loss = F.cross_entropy(logits_MC, labels_M, reduction="sum") / max(count, 1)
    correct = (logits_MC.detach().argmax(-1) == labels_M).sum().float()
    metrics = {
        "loss": loss.detach(),
        "acc": correct / max(count, 1),
        "num_anchors": torch.tensor(float(count), device=logits_MC.device),
    }
    return loss, metrics


# ---------------------------------------------------------------------------------------------------
# TaCL
# ---------------------------------------------------------------------------------------------------


def tacl_loss(
    student_BLD: torch.Tensor,
    *,
    teacher_BLD: torch.Tensor,
    masked_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    temperature: float = 0.01,
    negatives: str = "sequence",
    num_pool: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, Metrics]:
    """TaCL: each masked position i of the student must pick its own teacher vector t_i.

    l_i = -log( exp(cos(s_i, t_i)/tau) / sum_j exp(cos(s_i, t_j)/tau) ), mean over masked positions.
    `negatives="sequence"` (paper): j runs over the *real* tokens of i's sequence (upstream also sums
    over [PAD]). `negatives="global"`: j also runs over a pool of `num_pool` teacher vectors drawn
    from the real tokens of all ranks in `group` (a stratified sample, see loss_sampling), minus the
    pool rows of i's own sequence (they are already among the sequence terms; so the pool never holds
    i's own position). Cosines and logits are fp32 even for bf16 inputs: at tau = 0.01 bf16 logits
    would be off by ~1. The teacher never gets a gradient.

    In: student_BLD, teacher_BLD [B, L, D]; masked_BL bool [B, L] (a subset of the real tokens);
    attention_mask_BL [B, L], nonzero for real tokens. `generator` (optional) drives the pool draw
    (torch's default generator otherwise; rank 0's draw is used on all ranks).
    Out: (loss, metrics) with "loss", "acc", "num_anchors", "num_skipped" (always 0 here),
    "gathered_bytes" (bytes this rank received in this call).
    """
    with _fp32_only(student_BLD):
        return _tacl_loss(student_BLD, teacher_BLD=teacher_BLD, masked_BL=masked_BL,
                          attention_mask_BL=attention_mask_BL, temperature=temperature, negatives=negatives,
                          num_pool=num_pool, group=group, generator=generator)


def _tacl_loss(student_BLD, *, teacher_BLD, masked_BL, attention_mask_BL, temperature, negatives, num_pool, group,
               generator):
    _check_pair("tacl_loss", student_BLD, "teacher_BLD", teacher_BLD, attention_mask_BL)
    _check_mask("tacl_loss", "masked_BL", masked_BL, attention_mask_BL)
    if temperature <= 0:
        raise ValueError(f"tacl_loss: temperature must be > 0, got {temperature}")
    if negatives not in _TACL_NEGATIVES:
        raise ValueError(f"tacl_loss: negatives must be one of {_TACL_NEGATIVES}, got {negatives!r}")
    if negatives == "global" and num_pool < 1:
        raise ValueError(f"tacl_loss: negatives='global' needs num_pool >= 1, got {num_pool}")
    if negatives == "sequence" and num_pool != 0:
        raise ValueError(f"tacl_loss: num_pool={num_pool} only applies to negatives='global'; pass 0")
    real_BL = attention_mask_BL != 0
    padded_masks = int((masked_BL & ~real_BL).sum())
    if padded_masks:
        raise ValueError(f"tacl_loss: masked_BL marks {padded_masks} padding position(s) (attention_mask 0)")
    B, L, D = student_BLD.shape
    anchor_flat_N = masked_BL.reshape(-1).nonzero().squeeze(1)
    b_N, l_N = anchor_flat_N // L, anchor_flat_N % L
    seed = draw_seed(generator) if negatives == "global" else 0
    layout = gather_layout(sequences=B, tokens=int(real_BL.sum()), anchors=len(anchor_flat_N),
                           seed=seed, group=group)
    gathered = layout_bytes(layout.world_size)

    s_BLD = F.normalize(student_BLD.float(), dim=-1)
    t_BLD = F.normalize(teacher_BLD.detach().float(), dim=-1)
    # [B, L, L] is small (8 MB at B=32, L=256) and one batched GEMM; rows of non-anchors are dropped.
    scores_BLL = torch.bmm(s_BLD, t_BLD.transpose(1, 2))
    logits_NL = scores_BLL.reshape(B * L, L)[anchor_flat_N] / temperature
    logit_parts = [logits_NL.masked_fill(~real_BL[b_N], -math.inf)]
    if negatives == "global":
        draw = draw_pool(real_BL=real_BL, layout=layout, pool_size=num_pool)
        pool = gather_pool(teacher_BLD.detach().reshape(B * L, D)[draw.flat_n], draw=draw, group=group,
                           autograd=False)
        gathered += pool.gathered_bytes
        pool_PD = F.normalize(pool.vectors_PD.float(), dim=-1)
        s_ND = s_BLD.reshape(B * L, D)[anchor_flat_N]
        logits_NP = s_ND @ pool_PD.T / temperature
        own_NP = pool.sequence_P[None, :] == (b_N + layout.sequence_offset)[:, None]
        logit_parts.append(logits_NP.masked_fill(own_NP, -math.inf))
    logits_NC = torch.cat(logit_parts, dim=1)
    loss_N = F.cross_entropy(logits_NC, l_N, reduction="none")
    correct_N = _positive_on_top(logits_NC.detach(), l_N)
    valid_N = torch.ones_like(correct_N)
    return _share_across_ranks(loss_N, correct_N=correct_N, valid_N=valid_N, skipped=0,
                               world_size=layout.world_size, gathered_bytes=gathered, group=group)


# ---------------------------------------------------------------------------------------------------
# TACO
# ---------------------------------------------------------------------------------------------------


def taco_loss(
    hidden_BLD: torch.Tensor,
    *,
    embeddings_BLD: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    anchors: str = "all",
    masked_BL: Optional[torch.Tensor] = None,
    window: int = 5,
    num_negatives: int = 50,
    temperature: float = 0.07,
    detach: bool = True,
    generator: Optional[torch.Generator] = None,
    group: Optional[dist.ProcessGroup] = None,
    pool_size: int = TACO_POOL_SIZE,
) -> tuple[torch.Tensor, Metrics]:
    """TACO: the global semantics g = hidden - embeddings of a token should be closer to a nearby
    token of its own sequence than to tokens of other sequences.

    l_t = -log( exp(g_t.g_pos/tau) / (exp(g_t.g_pos/tau) + sum_k exp(g_t.g_neg_k/tau)) ), all g
    L2-normalised, mean over anchors. Anchors: "all" real tokens (paper), "masked" or "unmasked"
    (these two need `masked_BL`). The positive: a token at offset 0 < |o| <= window // 2 (window = 5:
    -2, -1, +1, +2, as upstream; `window` must be odd), not padding, drawn afresh each call; near the
    edges a random other real token of the sequence. The K = `num_negatives` negatives: drawn with
    replacement among the pool rows of *other* sequences, the pool being `pool_size` real tokens
    drawn from all ranks in `group`; one GEMM scores anchors against the pool and the K logits are
    picked from it, chunked over anchors (never a [B, L, K, D] tensor). The pool is gathered in the
    input dtype. `detach=True` (paper): positives and negatives carry no gradient; `detach=False`:
    gradients flow into them too, across ranks.

    Draws come from `generator` (torch's default if None): one seed per call, rank 0's used by all
    ranks, so R ranks draw what one process with the concatenated batch draws.
    Anchors in a sequence with a single real token (no positive) or with no other-sequence row in
    the pool are left out and counted in "num_skipped".

    In: hidden_BLD, embeddings_BLD [B, L, D] (HF hidden_states[-1] and hidden_states[0]);
    attention_mask_BL [B, L] nonzero for real tokens; masked_BL bool [B, L].
    Out: (loss, metrics) with "loss", "acc", "num_anchors", "num_skipped", "gathered_bytes".
    """
    with _fp32_only(hidden_BLD):
        return _taco_loss(hidden_BLD, embeddings_BLD=embeddings_BLD, attention_mask_BL=attention_mask_BL,
                          anchors=anchors, masked_BL=masked_BL, window=window, num_negatives=num_negatives,
                          temperature=temperature, detach=detach, generator=generator, group=group,
                          pool_size=pool_size)


def _taco_loss(hidden_BLD, *, embeddings_BLD, attention_mask_BL, anchors, masked_BL, window, num_negatives,
               temperature, detach, generator, group, pool_size):
    _check_pair("taco_loss", hidden_BLD, "embeddings_BLD", embeddings_BLD, attention_mask_BL)
    if anchors not in _TACO_ANCHORS:
        raise ValueError(f"taco_loss: anchors must be one of {_TACO_ANCHORS}, got {anchors!r}")
    if anchors != "all":
        if masked_BL is None:
            raise ValueError(f"taco_loss: anchors={anchors!r} needs masked_BL")
        _check_mask("taco_loss", "masked_BL", masked_BL, attention_mask_BL)
    if window < 3 or window % 2 == 0:
        raise ValueError(f"taco_loss: window must be odd and >= 3 (offsets up to window // 2), got {window}")
    if num_negatives < 1:
        raise ValueError(f"taco_loss: num_negatives must be >= 1, got {num_negatives}")
    if temperature <= 0:
        raise ValueError(f"taco_loss: temperature must be > 0, got {temperature}")
    if pool_size < 1:
        raise ValueError(f"taco_loss: pool_size must be >= 1, got {pool_size}")
    B, L, D = hidden_BLD.shape
    real_BL = attention_mask_BL != 0
    if anchors == "all":
        chosen_BL = real_BL
    else:
        chosen_BL = real_BL & (masked_BL if anchors == "masked" else ~masked_BL)
    has_positive_B = real_BL.sum(1) >= 2
    anchor_BL = chosen_BL & has_positive_B[:, None]
    skipped = (chosen_BL & ~has_positive_B[:, None]).sum()
    anchor_flat_N = anchor_BL.reshape(-1).nonzero().squeeze(1)
    layout = gather_layout(sequences=B, tokens=int(real_BL.sum()), anchors=len(anchor_flat_N),
                           seed=draw_seed(generator), group=group)
    if sum(layout.sequences) < 2:
        raise ValueError(
            f"taco_loss: negatives come from other sequences, but the batch holds {sum(layout.sequences)} "
            f"sequence(s) over {layout.world_size} rank(s); use a micro-batch of >= 2 sequences"
        )

    hidden_MD, embeddings_MD = hidden_BLD.reshape(B * L, D), embeddings_BLD.reshape(B * L, D)
    draw = draw_pool(real_BL=real_BL, layout=layout, pool_size=pool_size)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        pool_rows_nD = (hidden_MD[draw.flat_n].float() - embeddings_MD[draw.flat_n].float()).to(hidden_BLD.dtype)
    pool = gather_pool(pool_rows_nD, draw=draw, group=group, autograd=not detach)
    pool_PD = F.normalize(pool.vectors_PD.float(), dim=-1)

    u_NC = anchor_uniforms(layout.seed, start=layout.anchor_offset, count=len(anchor_flat_N),
                           columns=2 + num_negatives, device=hidden_BLD.device)
    positive_flat_N = positive_positions(u_NC[:, :2], anchor_flat_N=anchor_flat_N, real_BL=real_BL,
                                         window=window)
    negative_NK, has_negatives_N = negative_pool_indices(
        u_NC[:, 2:], anchor_sequence_N=anchor_flat_N // L + layout.sequence_offset,
        pool_sequence_P=pool.sequence_P)
    loss_N, correct_N = taco_anchor_losses(hidden_MD, embeddings_MD, pool_PD, anchor_N=anchor_flat_N,
                                           positive_N=positive_flat_N, negative_NK=negative_NK,
                                           temperature=temperature, detach=detach)
    skipped = skipped + (~has_negatives_N).sum()
    gathered = layout_bytes(layout.world_size) + pool.gathered_bytes
    return _share_across_ranks(loss_N, correct_N=correct_N, valid_N=has_negatives_N, skipped=skipped,
                               world_size=layout.world_size, gathered_bytes=gathered, group=group)


# ---------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------


def _fp32_only(x: torch.Tensor):
    """An autocast context would run the GEMMs in bf16/fp16; the losses need fp32 logits."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _positive_on_top(logits_NC: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """True where the target logit is strictly above every other one (ties count as misses)."""
    positive_N = logits_NC.gather(1, target_N[:, None]).squeeze(1)
    others_NC = logits_NC.scatter(1, target_N[:, None], -math.inf)
    if others_NC.shape[1] == 1:
        return torch.ones_like(positive_N, dtype=torch.bool)
    return positive_N > others_NC.max(dim=1).values


def _share_across_ranks(
    loss_N: torch.Tensor,
    *,
    correct_N: torch.Tensor,
    valid_N: torch.Tensor,
    skipped: torch.Tensor | int,
    world_size: int,
    gathered_bytes: int,
    group: Optional[dist.ProcessGroup],
) -> tuple[torch.Tensor, Metrics]:
    """Turn per-anchor losses into this rank's share of the global mean (module docstring)."""
    # where(), not a multiply: a skipped anchor's loss may be inf, and inf * 0 is NaN.
    loss_N = torch.where(valid_N, loss_N, torch.zeros_like(loss_N))
    local = torch.stack([
        loss_N.detach().sum().double(),
        (correct_N & valid_N).sum().double(),
        valid_N.sum().double(),
        torch.as_tensor(skipped, dtype=torch.float64, device=loss_N.device),
    ])
    loss_sum, correct, count, skipped_all = distributed.sum_over_ranks(local, group=group)
    denominator = count.clamp_min(1)
    # The anchor count is data, not a function of the parameters: a constant for autograd.
    loss = loss_N.sum() * (world_size / denominator).float()
    if world_size > 1:
        gathered_bytes += _REDUCE_BYTES
    metrics = {
        "loss": (loss_sum / denominator).float(),
        "acc": (correct / denominator).float(),
        "num_anchors": count.float(),
        "num_skipped": skipped_all.float(),
        "gathered_bytes": torch.tensor(float(gathered_bytes), device=loss_N.device),
    }
    return loss, metrics


def gather_bytes_per_call(*, world_size: int, tokens_per_rank: int, hidden_size: int, itemsize: int,
                          pool_size: int) -> int:
    """The most bytes one rank receives in one contrastive-loss call when every rank holds
    `tokens_per_rank` real tokens: the layout all-gather, the pool all-gather (vectors of `itemsize`
    bytes plus an int64 sequence id per row, padded to the busiest rank) and the metrics reduction.
    `pool_size`: TACO_POOL_SIZE for taco_loss, num_pool for tacl_loss "global", 0 for "sequence"."""
    if world_size <= 1:
        return 0
    rows = max_pool_rows_per_rank(tokens_per_rank, world_size=world_size, pool_size=pool_size)
    return layout_bytes(world_size) + world_size * rows * (hidden_size * itemsize + 8) + _REDUCE_BYTES


def _check_pair(fn: str, x_BLD: torch.Tensor, other_name: str, other_BLD: torch.Tensor,
                attention_mask_BL: torch.Tensor) -> None:
    if x_BLD.dim() != 3 or not x_BLD.is_floating_point():
        raise ValueError(f"{fn}: expected a float [B, L, D] tensor, got {tuple(x_BLD.shape)} {x_BLD.dtype}")
    if other_BLD.shape != x_BLD.shape:
        raise ValueError(f"{fn}: {other_name} has shape {tuple(other_BLD.shape)}, expected {tuple(x_BLD.shape)}")
    if attention_mask_BL.shape != x_BLD.shape[:2]:
        raise ValueError(f"{fn}: attention_mask_BL has shape {tuple(attention_mask_BL.shape)}, "
                         f"expected {tuple(x_BLD.shape[:2])}")


def _check_mask(fn: str, name: str, mask_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> None:
    if mask_BL.dtype != torch.bool:
        raise ValueError(f"{fn}: {name} must be torch.bool, got {mask_BL.dtype}")
    if mask_BL.shape != attention_mask_BL.shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(mask_BL.shape)}, expected {tuple(attention_mask_BL.shape)}")
