"""The gathers and reductions of pipeline.distributed: 2 gloo ranks against the single-process
computation on the concatenated data, and the no-process-group path."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline import distributed
from tests.conftest import free_port

WORLD = 2
# Rows per rank for the uneven gathers: rank 1 sends nothing in the second case.
ROW_CASES = [(3, 5), (4, 0)]
D = 3


def rank_rows(case: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * case + rank)
    return torch.randn(ROW_CASES[case][rank], D, generator=g)


def weights(case: int, rank: int) -> torch.Tensor:
    """Rank r's loss is sum(weights_r * gathered): each rank weighs the gathered rows differently."""
    g = torch.Generator().manual_seed(1000 + 100 * case + rank)
    return torch.randn(sum(ROW_CASES[case]), D, generator=g)


def _worker(rank: int, port: int, outdir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    out = {"ints": distributed.all_gather_ints([rank, 10 + rank, -rank], group=None)}
    for case, sizes in enumerate(ROW_CASES):
        x = rank_rows(case, rank).requires_grad_(True)
        plain = distributed.all_gather_uneven(x, sizes=sizes)
        gathered = distributed.all_gather_uneven(x, sizes=sizes, autograd=True)
        (weights(case, rank) * gathered).sum().backward()
        out[f"case{case}"] = dict(
            plain=plain, plain_requires_grad=plain.requires_grad, gathered=gathered.detach(), grad=x.grad
        )
    value = torch.tensor([1.0 + rank, 2.0 * rank])
    out["sum"] = distributed.sum_over_ranks(value)
    out["mean"] = distributed.mean_over_ranks(value, group=dist.new_group([0, 1]))
    out["value_untouched"] = value
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("gathers_2ranks")
    mp.spawn(_worker, args=(free_port(), str(outdir)), nprocs=WORLD, join=True)
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.multiproc
def test_all_gather_ints(two_ranks):
    for r in range(WORLD):
        assert two_ranks[r]["ints"] == [[0, 10, 0], [1, 11, -1]]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", range(len(ROW_CASES)))
def test_uneven_gather_equals_concatenation_and_its_gradient_sums_over_ranks(two_ranks, case):
    concatenated = torch.cat([rank_rows(case, r) for r in range(WORLD)])
    for r in range(WORLD):
        result = two_ranks[r][f"case{case}"]
        torch.testing.assert_close(result["plain"], concatenated)
        torch.testing.assert_close(result["gathered"], concatenated)
        assert not result["plain_requires_grad"]
    # One process holding the concatenated rows and the sum of all ranks' losses.
    leaf = concatenated.clone().requires_grad_(True)
    sum(weights(case, r) * leaf for r in range(WORLD)).sum().backward()
    start = 0
    for r, n in enumerate(ROW_CASES[case]):
        torch.testing.assert_close(two_ranks[r][f"case{case}"]["grad"], leaf.grad[start : start + n])
        start += n


@pytest.mark.multiproc
def test_sum_and_mean_over_ranks(two_ranks):
    for r in range(WORLD):
        torch.testing.assert_close(two_ranks[r]["sum"], torch.tensor([3.0, 2.0]))
        torch.testing.assert_close(two_ranks[r]["mean"], torch.tensor([1.5, 1.0]))
        torch.testing.assert_close(two_ranks[r]["value_untouched"], torch.tensor([1.0 + r, 2.0 * r]))


def test_without_process_group_everything_is_local():
    x = torch.randn(4, 2, requires_grad=True)
    assert distributed.all_gather_uneven(x, sizes=[4], autograd=True) is x
    assert distributed.all_gather_ints([7, 8]) == [[7, 8]]
    torch.testing.assert_close(distributed.sum_over_ranks(x), x.detach())
    torch.testing.assert_close(distributed.mean_over_ranks(x), x.detach())
    assert not distributed.mean_over_ranks(x).requires_grad


def test_uneven_gather_bytes_pads_to_the_busiest_rank():
    assert distributed.uneven_gather_bytes([3, 5], row_bytes=10) == 2 * 5 * 10
    assert distributed.uneven_gather_bytes([4], row_bytes=10) == 0
