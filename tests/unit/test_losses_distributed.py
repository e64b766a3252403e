"""2 gloo ranks against one process holding the concatenated batch, with the same draws.

Each scenario feeds hidden = x @ W (W shared, like a model's parameters) into a loss. Claims:
- every rank's metrics equal the single process's, and the mean over ranks of the returned losses
  equals the single process's loss (uneven anchor counts included);
- rank r's input gradient, divided by R, equals the single process's gradient on r's slice, and the
  rank-averaged gradient of W (what DeepSpeed applies) equals the single process's: for TaCL
  "global", TACO detach=True and TACO detach=False, whose gradients cross ranks;
- the teacher never gets a gradient, and the bytes each rank reports are the bytes it received.
One spawn runs every scenario (process start-up dominates the cost).
"""

import datetime
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.losses import TACO_POOL_SIZE, tacl_loss, taco_loss
from pipeline.losses import sampling as loss_sampling
from tests.conftest import free_port

WORLD = 2
GENERATOR_SEED = 1234


@dataclass(frozen=True)
class Scenario:
    kind: str  # "tacl" | "taco"
    sizes: tuple  # sequences per rank
    loss_kwargs: dict = field(default_factory=dict)
    rank1_unmasked: bool = False
    one_token_sequence: bool = False
    dtype: torch.dtype = torch.float32
    explicit_group: bool = False
    L: int = 8
    D: int = 16
    lengths: tuple = ()  # every sequence's real tokens (default: drawn)


SCENARIOS = {
    "tacl_global": Scenario("tacl", (3, 2), dict(negatives="global", num_pool=9, temperature=0.1)),
    "tacl_global_rank1_unmasked": Scenario(
        "tacl", (2, 2), dict(negatives="global", num_pool=6, temperature=0.1), rank1_unmasked=True, explicit_group=True
    ),
    "tacl_sequence_rank1_unmasked": Scenario("tacl", (2, 3), dict(temperature=0.1), rank1_unmasked=True),
    "tacl_global_one_sequence_per_rank": Scenario(
        "tacl", (1, 1), dict(negatives="global", num_pool=4, temperature=0.1)
    ),
    "taco_detach": Scenario(
        "taco", (3, 2), dict(num_negatives=6, pool_size=11, temperature=0.1), one_token_sequence=True
    ),
    "taco_no_detach": Scenario(
        "taco",
        (3, 2),
        dict(num_negatives=6, pool_size=11, temperature=0.1, detach=False),
        one_token_sequence=True,
        explicit_group=True,
    ),
    "taco_no_detach_one_sequence_per_rank": Scenario(
        "taco", (1, 1), dict(num_negatives=5, temperature=0.1, detach=False)
    ),
    "taco_no_detach_masked_rank1_unmasked": Scenario(
        "taco",
        (2, 3),
        dict(anchors="masked", num_negatives=4, pool_size=10, temperature=0.1, detach=False),
        rank1_unmasked=True,
    ),
    "taco_bf16": Scenario("taco", (2, 2), dict(num_negatives=5, pool_size=9), dtype=torch.bfloat16),
    # Packed blocks cut into documents: 16 tokens on each rank, in 3 and 2 sequences; no layout travels.
    "taco_equal_tokens_documents": Scenario(
        "taco", (3, 2), dict(num_negatives=6, pool_size=11, temperature=0.1, equal_tokens=True), lengths=(8, 5, 3, 8, 8)
    ),
}


def build(s: Scenario, seed: int) -> dict:
    """The concatenated batch of a scenario (deterministic, so every process builds the same)."""
    g = torch.Generator().manual_seed(seed)
    B, L, D = sum(s.sizes), s.L, s.D
    lengths = torch.randint(3, L + 1, (B,), generator=g)
    lengths[0] = L
    if s.lengths:
        lengths = torch.tensor(s.lengths)
    if s.one_token_sequence:
        lengths[-1] = 1
    attention = (torch.arange(L)[None, :] < lengths[:, None]).long()
    masked = (torch.rand(B, L, generator=g) < 0.35) & attention.bool()
    masked[0, 2] = True
    if s.rank1_unmasked:
        masked[s.sizes[0] :] = False
    return dict(
        x=torch.randn(B, L, D, generator=g),
        W=torch.eye(D) + 0.1 * torch.randn(D, D, generator=g),
        other=torch.randn(B, L, D, generator=g),  # embeddings (TACO) or teacher (TaCL)
        attention=attention,
        masked=masked,
    )


def run(s: Scenario, full: dict, rows: slice, group) -> dict:
    """One loss call and backward on `rows` of the batch. Returns loss, metrics and gradients."""
    x = full["x"][rows].clone().requires_grad_(True)
    W = full["W"].clone().requires_grad_(True)
    other = full["other"][rows].to(s.dtype).requires_grad_(True)
    hidden = (x @ W).to(s.dtype)
    generator = torch.Generator().manual_seed(GENERATOR_SEED)
    common = dict(attention_mask_BL=full["attention"][rows], group=group, generator=generator)
    if s.kind == "tacl":
        loss, metrics = tacl_loss(hidden, teacher_BLD=other, masked_BL=full["masked"][rows], **common, **s.loss_kwargs)
    else:
        loss, metrics = taco_loss(
            hidden, embeddings_BLD=other, masked_BL=full["masked"][rows], **common, **s.loss_kwargs
        )
    loss.backward()
    grad_W = W.grad.clone()
    if group is not None or dist.is_initialized():
        # What DeepSpeed does with parameter gradients: the mean over data-parallel ranks.
        dist.all_reduce(grad_W, group=group)
        grad_W /= WORLD
    return dict(
        loss=loss.detach(),
        metrics={k: v.item() for k, v in metrics.items()},
        grad_x=x.grad,
        grad_other=other.grad,
        grad_W=grad_W,
    )


def _worker(rank: int, port: int, outdir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    results = {}
    for i, (name, s) in enumerate(SCENARIOS.items()):
        full = build(s, seed=i)
        start = sum(s.sizes[:rank])
        results[name] = run(s, full, slice(start, start + s.sizes[rank]), group=pair if s.explicit_group else None)
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("losses_2ranks")
    mp.spawn(_worker, args=(free_port(), str(outdir)), nprocs=WORLD, join=True)
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def expected_bytes(s: Scenario, full: dict, ranks_rows: list) -> int:
    """The 4-float64 metrics reduction, and for the losses with a pool: the layout all-gather (4 int64
    per rank; none with equal_tokens) + the pool all-gather (rows padded to the busiest rank, D values
    in the input dtype plus an int64 sequence id). TaCL without a pool gathers no layout."""
    total = 4 * 8
    pool_size = s.loss_kwargs.get("pool_size", TACO_POOL_SIZE) if s.kind == "taco" else s.loss_kwargs.get("num_pool", 0)
    if pool_size:
        if not s.loss_kwargs.get("equal_tokens"):
            total += WORLD * 4 * 8
        tokens = [int(full["attention"][rows].sum()) for rows in ranks_rows]
        seed = loss_sampling.draw_seed(torch.Generator().manual_seed(GENERATOR_SEED))
        picks = loss_sampling.pool_token_indices(sum(tokens), pool_size, seed=seed, device=torch.device("cpu"))
        per_rank = [int(((picks >= sum(tokens[:r])) & (picks < sum(tokens[: r + 1]))).sum()) for r in range(WORLD)]
        total += WORLD * max(per_rank) * (s.D * torch.empty(0, dtype=s.dtype).element_size() + 8)
    return total


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_process_on_the_concatenated_batch(two_ranks, name):
    s = SCENARIOS[name]
    full = build(s, seed=list(SCENARIOS).index(name))
    single = run(s, full, slice(None), group=None)
    bounds = [0, s.sizes[0], sum(s.sizes)]
    ranks_rows = [slice(bounds[r], bounds[r + 1]) for r in range(WORLD)]
    tol = dict(rtol=1e-4, atol=1e-6) if s.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)

    losses = torch.stack([two_ranks[r][name]["loss"] for r in range(WORLD)])
    torch.testing.assert_close(losses.mean(), single["loss"], **tol)
    for r, rows in enumerate(ranks_rows):
        result = two_ranks[r][name]
        for key in ("loss", "acc", "num_anchors", "num_skipped"):
            assert result["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-6), key
        # Rank r's input gradient is d(sum of all ranks' losses)/d(its rows); the objective is their mean.
        torch.testing.assert_close(result["grad_x"] / WORLD, single["grad_x"][rows], **tol)
        torch.testing.assert_close(result["grad_W"], single["grad_W"], **tol)
        if s.kind == "tacl":
            assert result["grad_other"] is None, "the teacher got a gradient"
        else:
            torch.testing.assert_close(result["grad_other"].float() / WORLD, single["grad_other"][rows].float(), **tol)
        assert result["metrics"]["gathered_bytes"] == expected_bytes(s, full, ranks_rows)
    assert single["metrics"]["gathered_bytes"] == 0
    assert single["grad_x"].abs().sum() > 0


@pytest.mark.multiproc
def test_unmasked_rank_contributes_nothing_but_still_joins(two_ranks):
    """A rank with no anchors returns 0 and its share goes to the others; with detach=False its
    rows still receive gradient from the other rank's anchors through the gather's backward."""
    for name in ("tacl_global_rank1_unmasked", "taco_no_detach_masked_rank1_unmasked"):
        rank0, rank1 = two_ranks[0][name], two_ranks[1][name]
        assert rank1["loss"].item() == 0.0
        assert rank0["loss"].item() == pytest.approx(WORLD * rank0["metrics"]["loss"], rel=1e-5)
    assert two_ranks[1]["taco_no_detach_masked_rank1_unmasked"]["grad_x"].abs().sum() > 0
    assert two_ranks[1]["tacl_global_rank1_unmasked"]["grad_x"].abs().sum() == 0


@pytest.mark.multiproc
def test_one_sequence_per_rank_draws_negatives_from_the_other_rank(two_ranks):
    """With one sequence per rank, every negative is a row of the other rank: the loss is finite and
    the anchors (all of them) were kept."""
    result = two_ranks[0]["taco_no_detach_one_sequence_per_rank"]
    assert result["metrics"]["num_skipped"] == 0 and result["metrics"]["num_anchors"] > 0
    with pytest.raises(ValueError, match="2 sequences"):
        s = SCENARIOS["taco_no_detach_one_sequence_per_rank"]
        run(s, build(s, seed=0), slice(0, 1), group=None)
