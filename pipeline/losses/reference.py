"""The upstream formulations of both losses, written once: the tests check our losses against them and
the loss benchmark times them. They are deliberately the papers' code paths, quirks included, not ours.

Legend: B sequences, L positions, D hidden size, K negatives per position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def upstream_tacl(
    student_BLD: torch.Tensor, teacher_BLD: torch.Tensor, masked_BL: torch.Tensor, *, temperature: float = 0.01
) -> torch.Tensor:
    """TaCL as upstream computes it (yxuansu/TaCL pretraining/bert_contrastive.py): cosine over
    temperature against every position of the sequence, [PAD] included. masked_BL: 1.0 at the anchors
    (any float or bool tensor); the loss is the mean over them."""
    B, L, _ = student_BLD.shape
    s = student_BLD / student_BLD.norm(dim=2, keepdim=True)
    t = teacher_BLD / teacher_BLD.norm(dim=2, keepdim=True)
    logprobs = F.log_softmax((s @ t.transpose(1, 2) / temperature).view(-1, L), dim=-1)
    gold = torch.arange(L, device=student_BLD.device).expand(B, L).reshape(-1, 1)
    weights_BL = masked_BL.to(logprobs.dtype)
    loss = -logprobs.gather(-1, gold).view(B, L) * weights_BL
    return loss.sum() / weights_BL.sum()


def upstream_taco(
    hidden_BLD: torch.Tensor,
    embeddings_BLD: torch.Tensor,
    *,
    num_negatives: int,
    window: int = 5,
    temperature: float = 0.07,
) -> torch.Tensor:
    """TACO as upstream computes it (FUZHIYI/TACO scripts/sampler.py): no padding, negatives from other
    rows of this micro-batch, gathered into a [B, L, K, D] tensor."""
    B, L, D = hidden_BLD.shape
    device = hidden_BLD.device
    g_BLD = F.normalize(hidden_BLD - embeddings_BLD, dim=-1)
    context_BLD = g_BLD.detach()
    rows_BLK = (
        torch.randint(B - 1, (B, L, num_negatives), device=device) + torch.arange(B, device=device)[:, None, None] + 1
    ) % B
    cols_BLK = torch.randint(L, (B, L, num_negatives), device=device)
    negatives_BLKD = context_BLD[rows_BLK, cols_BLK]
    half = window // 2
    offsets_BL = (torch.randint(window - 1, (B, L), device=device) + half + 1) % window - half
    cols_BL = torch.arange(L, device=device)[None, :] + offsets_BL
    fallback_BL = (torch.randint(L - 1, (B, L), device=device) + torch.arange(L, device=device) + 1) % L
    cols_BL = torch.where((cols_BL < 0) | (cols_BL >= L), fallback_BL, cols_BL)
    positive_BLD = context_BLD[torch.arange(B, device=device)[:, None], cols_BL]
    positive_BL = (g_BLD * positive_BLD).sum(-1) / temperature
    negative_BLK = torch.einsum("bld,blkd->blk", g_BLD, negatives_BLKD) / temperature
    logits = torch.cat([positive_BL[..., None], negative_BLK], dim=-1).reshape(B * L, num_negatives + 1)
    return F.cross_entropy(logits, torch.zeros(B * L, dtype=torch.long, device=device))
