"""TACO (Fu et al., ACL 2022): a token's global semantics g = hidden - embeddings should be closer to
a nearby token of its own sequence than to tokens of other sequences.

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

Draws come from `generator` (torch's default if None): one seed per call; seed it identically on
every rank, so R ranks draw what one process with the concatenated batch draws.
Anchors in a sequence with a single real token (no positive) or with no other-sequence row in
the pool are left out and counted in "num_skipped".

The formula is also in docs/objectives.md; how the loss is shared across ranks, in pipeline.losses.common;
the draws, in pipeline.losses.sampling; the per-anchor kernel, in pipeline.losses.taco_kernel.

Legend: B sequences, L positions, D hidden size, N anchors (this rank), P pool rows (all ranks),
K negatives per anchor; `_flat` = index into this rank's B*L positions.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.losses.common import Metrics, check_mask, check_pair, share_across_ranks, without_autocast
from pipeline.losses.sampling import (
    anchor_uniforms,
    draw_pool,
    draw_seed,
    gather_layout,
    gather_pool,
    layout_bytes,
    negative_pool_indices,
    positive_positions,
)
from pipeline.losses.taco_kernel import taco_anchor_losses

# TACO's pool: rows drawn from all ranks' real tokens per call (see pipeline.losses.sampling). The loss costs
# two [N, D] x [D, P] GEMMs, so P sets its price: 512 rows (10 K) leave each anchor ~48 distinct
# negatives out of 50 draws, run ~6x faster than upstream's [B, L, K, D] gather at B=32, L=256, K=50
# on CPU (4096 rows would only tie with it), and gather ~0.4% of BERT-base's gradient all-reduce
# bytes at 64 ranks.
TACO_POOL_SIZE = 512
_TACO_ANCHORS = ("all", "masked", "unmasked")


@without_autocast
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
    anchor_flat_N: Optional[torch.Tensor] = None,
    real_flat_T: Optional[torch.Tensor] = None,
    uniform: bool = False,
    equal_tokens: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """TACO's loss (defined in the module docstring) over this rank's batch, shared across `group`'s ranks.

    In: hidden_BLD, embeddings_BLD [B, L, D] (HF hidden_states[-1] and hidden_states[0]);
    attention_mask_BL [B, L] nonzero for real tokens; masked_BL bool [B, L]. Optional, from the
    collator, so that nothing is read back from the device: `anchor_flat_N` (the anchors' flat
    positions, ascending, in the chosen `anchors` set) and `real_flat_T` (the real tokens'), int64;
    `uniform` and `equal_tokens`: promises about every rank's layout (see _layout).
    Out: (loss, metrics) with "loss", "acc", "num_anchors", "num_skipped", "gathered_bytes".
    """
    _check_args(
        hidden_BLD, embeddings_BLD=embeddings_BLD, attention_mask_BL=attention_mask_BL, anchors=anchors,
        masked_BL=masked_BL, window=window, num_negatives=num_negatives, temperature=temperature, pool_size=pool_size,
    )  # fmt: skip
    B, L, D = hidden_BLD.shape
    real_BL = attention_mask_BL != 0
    anchor_flat_N, positive_ok_N, skipped, real_flat_T = _positions(
        real_BL, anchors=anchors, masked_BL=masked_BL, anchor_flat_N=anchor_flat_N, real_flat_T=real_flat_T
    )
    layout = _layout(B, L=L, real_flat_T=real_flat_T, anchor_flat_N=anchor_flat_N, generator=generator, group=group,
                     uniform=uniform, equal_tokens=equal_tokens)  # fmt: skip

    hidden_MD, embeddings_MD = hidden_BLD.reshape(B * L, D), embeddings_BLD.reshape(B * L, D)
    pool = _pool(hidden_MD, embeddings_MD, real_flat_T=real_flat_T, width=L, layout=layout, pool_size=pool_size,
                 detach=detach, group=group)  # fmt: skip
    pool_PD = F.normalize(pool.vectors_PD.float(), dim=-1)

    positive_flat_N, negative_NK, has_negatives_N = _draws(
        layout, anchor_flat_N=anchor_flat_N, real_BL=real_BL, pool=pool, window=window, num_negatives=num_negatives
    )
    loss_N, correct_N = taco_anchor_losses(
        hidden_MD, embeddings_MD, pool_PD, anchor_N=anchor_flat_N, positive_N=positive_flat_N,
        negative_NK=negative_NK, temperature=temperature, detach=detach,
    )  # fmt: skip
    valid_N, skipped = _valid(has_negatives_N, positive_ok_N=positive_ok_N, skipped=skipped)
    gathered = layout_bytes(layout) + pool.gathered_bytes
    return share_across_ranks(
        loss_N, correct_N=correct_N, valid_N=valid_N, skipped=skipped, gathered_bytes=gathered, group=group
    )


def _check_args(
    hidden_BLD, *, embeddings_BLD, attention_mask_BL, anchors, masked_BL, window, num_negatives, temperature, pool_size
) -> None:
    check_pair("taco_loss", hidden_BLD, "embeddings_BLD", embeddings_BLD, attention_mask_BL)
    if anchors not in _TACO_ANCHORS:
        raise ValueError(f"taco_loss: anchors must be one of {_TACO_ANCHORS}, got {anchors!r}")
    if anchors != "all":
        if masked_BL is None:
            raise ValueError(f"taco_loss: anchors={anchors!r} needs masked_BL")
        check_mask("taco_loss", "masked_BL", masked_BL, attention_mask_BL)
    if window < 3 or window % 2 == 0:
        raise ValueError(f"taco_loss: window must be odd and >= 3 (offsets up to window // 2), got {window}")
    if num_negatives < 1:
        raise ValueError(f"taco_loss: num_negatives must be >= 1, got {num_negatives}")
    if temperature <= 0:
        raise ValueError(f"taco_loss: temperature must be > 0, got {temperature}")
    if pool_size < 1:
        raise ValueError(f"taco_loss: pool_size must be >= 1, got {pool_size}")


def _positions(
    real_BL: torch.Tensor,
    *,
    anchors: str,
    masked_BL: Optional[torch.Tensor],
    anchor_flat_N: Optional[torch.Tensor],
    real_flat_T: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(anchor_flat_N, positive_ok_N or None, anchors skipped for want of a positive, real_flat_T). Found
    on the device for a direct call; the collator's anchors stay as they are, those without a positive
    marked."""
    L = real_BL.shape[1]
    if real_flat_T is None:
        real_flat_T = real_BL.reshape(-1).nonzero().squeeze(1)
    has_positive_B = real_BL.sum(1) >= 2
    if anchor_flat_N is not None:
        positive_ok_N = has_positive_B.index_select(0, anchor_flat_N // L)
        return anchor_flat_N, positive_ok_N, (~positive_ok_N).sum(), real_flat_T
    chosen_BL = real_BL if anchors == "all" else real_BL & (masked_BL if anchors == "masked" else ~masked_BL)
    anchor_BL = chosen_BL & has_positive_B[:, None]
    skipped = (chosen_BL & ~has_positive_B[:, None]).sum()
    return anchor_BL.reshape(-1).nonzero().squeeze(1), None, skipped, real_flat_T


def _layout(B, *, L, real_flat_T, anchor_flat_N, generator, group, uniform, equal_tokens):
    """Every rank's sequences, real tokens and anchors, and this call's seed (sampling.gather_layout);
    raises if all ranks together hold fewer than 2 sequences (no negatives). `uniform=True`: the
    caller's promise that every rank holds B sequences of L real tokens and every token is an anchor
    (packed blocks): then no layout travels between ranks. `equal_tokens=True`: the promise that every
    rank holds the same number of real tokens and anchors in sequences of any length (packed blocks
    cut into their documents, every token an anchor): no layout travels either."""
    layout = gather_layout(
        sequences=B, tokens=real_flat_T.shape[0], anchors=anchor_flat_N.shape[0], seed=draw_seed(generator),
        group=group, tokens_per_sequence=L if uniform else None, equal_tokens=equal_tokens,
    )  # fmt: skip
    if sum(layout.sequences) < 2:
        raise ValueError(
            f"taco_loss: negatives come from other sequences, but the batch holds {sum(layout.sequences)} "
            f"sequence(s) over {layout.world_size} rank(s); use a micro-batch of >= 2 sequences"
        )
    return layout


def _pool(hidden_MD, embeddings_MD, *, real_flat_T, width, layout, pool_size, detach, group):
    """The pool of g = hidden - embeddings rows drawn from every rank (sampling.draw_pool), gathered in
    the input dtype; rows carry gradients back across ranks unless `detach`."""
    draw = draw_pool(real_flat_T=real_flat_T, width=width, layout=layout, pool_size=pool_size)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        rows_nD = (
            hidden_MD.index_select(0, draw.flat_n).float() - embeddings_MD.index_select(0, draw.flat_n).float()
        ).to(hidden_MD.dtype)
    return gather_pool(rows_nD, draw=draw, group=group, autograd=not detach)


def _draws(layout, *, anchor_flat_N, real_BL, pool, window, num_negatives):
    """(positive_flat_N, negative_NK pool indices, has_negatives_N): each anchor's row of the global
    per-anchor stream, its positive from the first two columns, its K negatives from the rest."""
    L = real_BL.shape[1]
    u_NC = anchor_uniforms(
        layout.seed, start=layout.anchor_offset, count=anchor_flat_N.shape[0], columns=2 + num_negatives,
        device=real_BL.device,
    )  # fmt: skip
    positive_flat_N = positive_positions(u_NC[:, :2], anchor_flat_N=anchor_flat_N, real_BL=real_BL, window=window)
    negative_NK, has_negatives_N = negative_pool_indices(
        u_NC[:, 2:], anchor_sequence_N=anchor_flat_N // L + layout.sequence_offset, pool_sequence_P=pool.sequence_P
    )
    return positive_flat_N, negative_NK, has_negatives_N


def _valid(has_negatives_N, *, positive_ok_N, skipped):
    """(valid_N, skipped): an anchor counts if it has a positive and a negative; the skipped count grows by
    the anchors without a negative."""
    valid_N = has_negatives_N if positive_ok_N is None else has_negatives_N & positive_ok_N
    no_negative_N = ~has_negatives_N
    if positive_ok_N is not None:
        no_negative_N = no_negative_N & positive_ok_N  # an anchor without a positive is counted once
    return valid_N, skipped + no_negative_N.sum()
