"""TaCL (Su et al., NAACL 2022): each masked student position must pick its own teacher vector.

The formula is in docs/objectives.md; how the loss is shared across ranks, in pipeline.losses.common.

Legend: B sequences, L positions, D hidden size, N anchors (this rank), P pool rows (all ranks);
`_flat` = index into this rank's B*L positions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.losses.common import (
    Metrics,
    check_mask,
    check_pair,
    positive_on_top,
    share_across_ranks,
    without_autocast,
)
from pipeline.losses.sampling import draw_pool, draw_seed, gather_layout, gather_pool, layout_bytes

_TACL_NEGATIVES = ("sequence", "global")


@without_autocast
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
    anchor_flat_N: Optional[torch.Tensor] = None,
    real_flat_T: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """TaCL: each masked position i of the student must pick its own teacher vector t_i.

    l_i = -log( exp(cos(s_i, t_i)/tau) / sum_j exp(cos(s_i, t_j)/tau) ), mean over masked positions.
    `negatives="sequence"` (paper): j runs over the *real* tokens of i's sequence (upstream also sums
    over [PAD]). `negatives="global"`: j also runs over a pool of `num_pool` teacher vectors drawn from the
    real tokens of all ranks in `group` (a stratified sample, see pipeline.losses.sampling), minus the pool
    rows of i's own sequence (they are already among the sequence terms; so the pool never holds i's own
    position). Cosines and logits are fp32 even for bf16 inputs: at tau = 0.01 bf16 logits would be off
    by ~1. The teacher never gets a gradient.

    In: student_BLD, teacher_BLD [B, L, D]; masked_BL bool [B, L] (a subset of the real tokens);
    attention_mask_BL [B, L], nonzero for real tokens. `generator` (optional) drives the pool draw
    (torch's default generator otherwise; seed it identically on every rank). `anchor_flat_N` and
    `real_flat_T` (optional, int64): the flat positions of masked_BL's and attention_mask_BL's True
    entries, ascending, as the collator computed them; given, nothing is read back from the device
    (and masked_BL is trusted to lie within the real tokens).
    Out: (loss, metrics) with "loss", "acc", "num_anchors", "num_skipped" (always 0 here),
    "gathered_bytes" (bytes this rank received in this call).
    """
    _check_args(student_BLD, teacher_BLD=teacher_BLD, masked_BL=masked_BL, attention_mask_BL=attention_mask_BL,
                temperature=temperature, negatives=negatives, num_pool=num_pool)  # fmt: skip
    real_BL = attention_mask_BL != 0
    if anchor_flat_N is None:  # a direct call: find the anchors (and check them) on the device
        anchor_flat_N = _anchors(masked_BL, real_BL=real_BL)
    l_N = anchor_flat_N % student_BLD.shape[1]  # the positive's column: i's own position
    gathered = 0

    s_BLD = F.normalize(student_BLD.float(), dim=-1)
    logit_parts = [_sequence_logits(s_BLD, teacher_BLD, real_BL=real_BL, anchor_flat_N=anchor_flat_N,
                                    temperature=temperature)]  # fmt: skip
    if negatives == "global":
        if real_flat_T is None:
            real_flat_T = real_BL.reshape(-1).nonzero().squeeze(1)
        logits_NP, gathered = _pool_logits(
            s_BLD, teacher_BLD, anchor_flat_N=anchor_flat_N, real_flat_T=real_flat_T, num_pool=num_pool,
            temperature=temperature, generator=generator, group=group,
        )  # fmt: skip
        logit_parts.append(logits_NP)
    logits_NC = torch.cat(logit_parts, dim=1)
    loss_N = F.cross_entropy(logits_NC, l_N, reduction="none")
    correct_N = positive_on_top(logits_NC.detach(), l_N)
    valid_N = torch.ones_like(correct_N)
    return share_across_ranks(
        loss_N, correct_N=correct_N, valid_N=valid_N, skipped=None, gathered_bytes=gathered, group=group
    )


def _check_args(student_BLD, *, teacher_BLD, masked_BL, attention_mask_BL, temperature, negatives, num_pool) -> None:
    check_pair("tacl_loss", student_BLD, "teacher_BLD", teacher_BLD, attention_mask_BL)
    check_mask("tacl_loss", "masked_BL", masked_BL, attention_mask_BL)
    if temperature <= 0:
        raise ValueError(f"tacl_loss: temperature must be > 0, got {temperature}")
    if negatives not in _TACL_NEGATIVES:
        raise ValueError(f"tacl_loss: negatives must be one of {_TACL_NEGATIVES}, got {negatives!r}")
    if negatives == "global" and num_pool < 1:
        raise ValueError(f"tacl_loss: negatives='global' needs num_pool >= 1, got {num_pool}")
    if negatives == "sequence" and num_pool != 0:
        raise ValueError(f"tacl_loss: num_pool={num_pool} only applies to negatives='global'; pass 0")


def _anchors(masked_BL: torch.Tensor, *, real_BL: torch.Tensor) -> torch.Tensor:
    """The flat positions of masked_BL's True entries, ascending; raises if one of them is padding."""
    padded_masks = int((masked_BL & ~real_BL).sum())
    if padded_masks:
        raise ValueError(f"tacl_loss: masked_BL marks {padded_masks} padding position(s) (attention_mask 0)")
    return masked_BL.reshape(-1).nonzero().squeeze(1)


def _sequence_logits(s_BLD, teacher_BLD, *, real_BL, anchor_flat_N, temperature):
    """[N, L] logits of the anchors against every teacher vector of their own sequence, -inf on padding.
    s_BLD: the normalised student."""
    B, L, D = s_BLD.shape
    t_BLD = F.normalize(teacher_BLD.detach().float(), dim=-1)
    # [B, L, L] is small (8 MB at B=32, L=256) and one batched GEMM; rows of non-anchors are dropped.
    scores_BLL = torch.bmm(s_BLD, t_BLD.transpose(1, 2))
    logits_NL = scores_BLL.reshape(B * L, L).index_select(0, anchor_flat_N) / temperature
    return logits_NL.masked_fill(~real_BL[anchor_flat_N // L], -math.inf)


def _pool_logits(s_BLD, teacher_BLD, *, anchor_flat_N, real_flat_T, num_pool, temperature, generator, group):
    """([N, P] logits of the anchors against a pool of teacher vectors drawn from every rank, -inf on
    the anchor's own sequence; the bytes gathered). s_BLD: the normalised student."""
    B, L, D = s_BLD.shape
    layout = gather_layout(
        sequences=B, tokens=real_flat_T.shape[0], anchors=anchor_flat_N.shape[0], seed=draw_seed(generator),
        group=group,
    )  # fmt: skip
    draw = draw_pool(real_flat_T=real_flat_T, width=L, layout=layout, pool_size=num_pool)
    pool = gather_pool(
        teacher_BLD.detach().reshape(B * L, D).index_select(0, draw.flat_n), draw=draw, group=group, autograd=False
    )
    pool_PD = F.normalize(pool.vectors_PD.float(), dim=-1)
    logits_NP = s_BLD.reshape(B * L, D).index_select(0, anchor_flat_N) @ pool_PD.T / temperature
    own_NP = pool.sequence_P[None, :] == (anchor_flat_N // L + layout.sequence_offset)[:, None]
    return logits_NP.masked_fill(own_NP, -math.inf), layout_bytes(layout) + pool.gathered_bytes
