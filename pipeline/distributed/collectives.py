"""Gathers and reductions for the contrastive losses.

Row counts differ per rank (masked tokens, sampled pool rows), so every gather takes the per-rank
sizes, pads each rank's rows to the largest count, all-gathers, and strips the padding. Without a
process group they return their input unchanged (autograd intact).

Gradient convention of the autograd gather (`autograd=True`): its backward sums, over all ranks, the
gradients that every rank's loss sends to this rank's rows (a reduce-scatter with SUM; gloo emulates it
with all-to-all). Rank r's rows therefore receive d(sum_s loss_s)/d(rows_r). DeepSpeed and DDP average
parameter gradients over ranks, so the parameters receive the gradient of mean_s(loss_s): the losses
scale each rank's loss so that this mean is the global objective.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from pipeline.distributed.group import _collective_device, host_group, is_distributed, rank, world_size


def all_gather_ints(values: Sequence[int], *, group: Optional[dist.ProcessGroup] = None) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), in rank order: one small collective of
    host integers (over the host group: no device work, no device read).

    In: a list of k Python ints. Out: R lists of k ints (R = world size of `group`; [values] alone
    without a process group).
    """
    if not is_distributed(group):
        return [list(values)]
    local_k = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(world_size(group) * len(values), dtype=torch.int64)
    _all_gather_flat(out, local_k, group=host_group(group))
    return out.view(world_size(group), len(values)).tolist()


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, *, group: Optional[dist.ProcessGroup]) -> None:
    """`out` [R * n, ...] <- every rank's `x` [n, ...], in rank order: one collective into one tensor
    (all_gather_single where torch has it, its older name otherwise)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def all_gather_uneven(
    x_N: torch.Tensor,
    *,
    sizes: Sequence[int],
    group: Optional[dist.ProcessGroup] = None,
    autograd: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's rows along dim 0 in rank order, when the row counts differ.

    In: `x_N` [n_r, ...] on rank r, with n_r == sizes[r] (all ranks pass the same `sizes`, e.g. from
    `all_gather_ints`). Out: [sum(sizes), ...]. `autograd=False` gathers detached rows (pools of
    vectors that carry no gradient); `autograd=True` lets gradients flow back to the ranks that sent
    the rows (see the convention above). Without a process group: `x_N` itself.
    """
    if not is_distributed(group):
        return x_N
    if len(sizes) != world_size(group) or x_N.shape[0] != sizes[rank(group)]:
        raise AssertionError(f"sizes {list(sizes)} do not match rank {rank(group)}'s {x_N.shape[0]} rows")
    longest = max(sizes)
    if not autograd:
        x_N = x_N.detach()
    pad_rows = longest - x_N.shape[0]
    # Collectives need equal shapes on every rank: pad with zero rows (their gradient is dropped).
    padded = torch.cat([x_N, x_N.new_zeros((pad_rows, *x_N.shape[1:]))]) if pad_rows else x_N
    padded = padded.contiguous()
    if autograd:
        parts = _all_gather_with_grad(padded, group)
    else:
        out = padded.new_empty((len(sizes) * longest, *padded.shape[1:]))
        _all_gather_flat(out, padded, group=group)
        parts = out.split(longest)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _all_gather_with_grad(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        # torch 2.14 marks it deprecated in favour of a private module (_functional_collectives);
        # the public function still works and its backward (SUM over ranks) is what we rely on.
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        return all_gather(x, group=group if group is not None else dist.group.WORLD)


def uneven_gather_bytes(sizes: Sequence[int], *, row_bytes: int) -> int:
    """Bytes one rank receives from `all_gather_uneven(sizes=...)`: every rank's rows, padded to the
    largest count (0 without a process group, where nothing moves)."""
    if len(sizes) <= 1:
        return 0
    return len(sizes) * max(sizes) * row_bytes


def sum_over_ranks(x: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The element-wise sum of `x` over the ranks of `group`, detached (for counts and metrics), on
    x's device (it travels on the backend's device: nccl reduces only CUDA tensors, gloo CPU ones)."""
    if not is_distributed(group):
        return x.detach().clone()
    buffer = x.detach().to(_collective_device(group), copy=True)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.to(x.device)


def mean_over_ranks(x: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The element-wise mean of `x` over the ranks of `group`, detached (for logging metrics)."""
    return sum_over_ranks(x, group=group) / world_size(group)
