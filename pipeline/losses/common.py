"""What the losses share: how a contrastive loss is divided among ranks, the accuracy rule, the
fp32 guard, the argument checks, and the gathered-bytes account.

How a contrastive loss is shared across the ranks of `group`: rank r returns
    loss_r = (R / N) * (sum of l_i over rank r's anchors),   N = the anchors of all ranks.
DeepSpeed (like DDP) averages gradients over ranks, so the parameters follow the gradient of
mean_r loss_r = (1/N) * (sum over all anchors): the loss of one process holding the concatenated
batch. Every anchor weighs the same, whichever rank holds it (uneven counts, or a rank with no
anchor at all, included); with equal counts loss_r is the plain mean over rank r's anchors. The
metrics are the global values, the same on every rank.

Legend: B sequences, L positions, D hidden size, N anchors (this rank), C logits per anchor, R ranks.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist

from pipeline import distributed
from pipeline.losses.sampling import LAYOUT_BYTES_PER_RANK, max_pool_rows_per_rank

# The metrics reduction: 4 float64 per call.
_REDUCE_BYTES = 4 * 8

Metrics = dict[str, torch.Tensor]


def fp32_only(x: torch.Tensor):
    """An autocast context would run the GEMMs in bf16/fp16; the losses need fp32 logits."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def without_autocast(loss_fn):
    """Decorate a loss whose first argument is a tensor: it runs with autocast off on that tensor's
    device (`fp32_only`)."""

    @functools.wraps(loss_fn)
    def wrapped(x: torch.Tensor, *args, **kwargs):
        with fp32_only(x):
            return loss_fn(x, *args, **kwargs)

    return wrapped


def positive_on_top(logits_NC: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """True where the target logit is strictly above every other one (ties count as misses)."""
    positive_N = logits_NC.gather(1, target_N[:, None]).squeeze(1)
    others_NC = logits_NC.scatter(1, target_N[:, None], -math.inf)
    if others_NC.shape[1] == 1:
        return torch.ones_like(positive_N, dtype=torch.bool)
    return positive_N > others_NC.max(dim=1).values


def share_across_ranks(
    loss_N: torch.Tensor,
    *,
    correct_N: torch.Tensor,
    valid_N: torch.Tensor,
    skipped: Optional[torch.Tensor],
    gathered_bytes: int,
    group: Optional[dist.ProcessGroup],
) -> tuple[torch.Tensor, Metrics]:
    """Turn per-anchor losses into this rank's share of the global mean (module docstring). One
    collective, on the device (the denominator stays there: nothing is read back); "gathered_bytes"
    is a host number, so it comes back as a CPU tensor."""
    world_size = distributed.world_size(group)
    # where(), not a multiply: a skipped anchor's loss may be inf, and inf * 0 is NaN.
    loss_N = torch.where(valid_N, loss_N, torch.zeros_like(loss_N))
    local = torch.stack(
        [
            loss_N.detach().sum().double(),
            (correct_N & valid_N).sum().double(),
            valid_N.sum().double(),
            (skipped if skipped is not None else loss_N.new_zeros(())).double(),
        ]
    )
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
        "gathered_bytes": torch.tensor(float(gathered_bytes)),
    }
    return loss, metrics


def gather_bytes_per_call(
    *, world_size: int, tokens_per_rank: int, hidden_size: int, itemsize: int, pool_size: int
) -> int:
    """The most bytes one rank receives in one contrastive-loss call when every rank holds
    `tokens_per_rank` real tokens: the layout all-gather, the pool all-gather (vectors of `itemsize`
    bytes plus an int64 sequence id per row, padded to the busiest rank) and the metrics reduction.
    `pool_size`: TACO_POOL_SIZE for taco_loss, num_pool for tacl_loss "global", 0 for "sequence"."""
    if world_size <= 1:
        return 0
    rows = max_pool_rows_per_rank(tokens_per_rank, world_size=world_size, pool_size=pool_size)
    return LAYOUT_BYTES_PER_RANK * world_size + world_size * rows * (hidden_size * itemsize + 8) + _REDUCE_BYTES


def check_pair(
    fn: str, x_BLD: torch.Tensor, other_name: str, other_BLD: torch.Tensor, attention_mask_BL: torch.Tensor
) -> None:
    if x_BLD.dim() != 3 or not x_BLD.is_floating_point():
        raise ValueError(f"{fn}: expected a float [B, L, D] tensor, got {tuple(x_BLD.shape)} {x_BLD.dtype}")
    if other_BLD.shape != x_BLD.shape:
        raise ValueError(f"{fn}: {other_name} has shape {tuple(other_BLD.shape)}, expected {tuple(x_BLD.shape)}")
    if attention_mask_BL.shape != x_BLD.shape[:2]:
        raise ValueError(
            f"{fn}: attention_mask_BL has shape {tuple(attention_mask_BL.shape)}, expected {tuple(x_BLD.shape[:2])}"
        )


def check_mask(fn: str, name: str, mask_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> None:
    if mask_BL.dtype != torch.bool:
        raise ValueError(f"{fn}: {name} must be torch.bool, got {mask_BL.dtype}")
    if mask_BL.shape != attention_mask_BL.shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(mask_BL.shape)}, expected {tuple(attention_mask_BL.shape)}")
