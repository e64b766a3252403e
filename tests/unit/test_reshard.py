"""Resharding ZeRO-1/2 optimizer state (pipeline.training.reshard) against DeepSpeed's partitioning
written out: a group's flat vector zero-padded to a multiple of 2 x world size, cut into equal slices,
each stored without its padding (the fp32 weights) or with it (the optimizer moments)."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.reshard import new_partition, partition_size, slice_mappings


def deepspeed_slices(flat: torch.Tensor, *, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(slices without padding, slices with it) of `flat` at `world` ranks, as DeepSpeed makes them."""
    alignment = 2 * world
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % alignment)])
    size = padded.numel() // world
    with_padding = list(padded.split(size))
    without = [s[: max(0, min(size, flat.numel() - r * size))] for r, s in enumerate(with_padding)]
    return without, with_padding


@pytest.mark.parametrize("total", [1, 7, 2143, 4096])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 5), (8, 3), (2, 16)])
def test_resharded_slices_are_the_slices_deepspeed_makes_at_the_new_world_size(total, before, after):
    flat = torch.arange(1, total + 1, dtype=torch.float32)
    old, _ = deepspeed_slices(flat, world=before)
    new_without, new_with = deepspeed_slices(flat, world=after)
    size = partition_size(total, world=after)
    for r in range(after):
        weights, padding = new_partition(old, rank=r, world=after, size=size, padded=False)
        moments, _ = new_partition(old, rank=r, world=after, size=size, padded=True)
        assert torch.equal(weights, new_without[r]) and torch.equal(moments, new_with[r])
        assert padding == size - new_without[r].numel()


def test_each_rank_records_the_parameter_fragments_it_holds():
    table = [("a", 0, 5), ("b", 5, 3), ("c", 8, 2)]  # (name, offset, elements): 10 in all
    at = {r: slice_mappings(table, rank=r, size=4) for r in range(3)}  # 12 = 10 + 2 padding
    assert {n: (f.start, f.numel) for n, f in at[0].items()} == {"a": (0, 4)}
    assert {n: (f.start, f.numel) for n, f in at[1].items()} == {"a": (0, 1), "b": (1, 3)}
    assert {n: (f.start, f.numel) for n, f in at[2].items()} == {"c": (0, 2)}
