"""docs/scaling.md's communication model (pipeline.bench.comm_model): the page's tables are what the model
computes, its pieces add up (the FLOPs model, DeepSpeed's bucketing, NCCL's bus bandwidth), and the
64-GPU configs take its bucket size. The formula itself is checked against counted collectives in
tests/integration/test_comm_bytes.py."""

import json
import re

import pytest

from pipeline.bench.comm_bytes import bucket_sizes, padded_numel, ring_bytes_sent, zero2_step_bytes
from pipeline.bench.comm_model import (
    BUCKET,
    MODELS,
    Cluster,
    Device,
    backward_flops,
    layout,
    markdown_tables,
    micro_flops,
    step,
)
from tests.conftest import REPO


def page_tables() -> dict[str, str]:
    text = (REPO / "docs" / "scaling.md").read_text()
    pattern = r"<!-- comm_model:(\w+) -->\n(.*?)\n<!-- /comm_model:\1 -->"
    return {m.group(1): m.group(2) for m in re.finditer(pattern, text, re.S)}


def test_the_pages_tables_are_the_models():
    assert page_tables() == markdown_tables()


def test_zero2_formula_terms():
    """Gradients all-reduced every micro-batch, 4 B of norm per group, groups padded to 2R elements;
    a ring all-reduce sends twice what a reduce-scatter of the same payload sends."""
    terms = zero2_step_bytes(group_numels=[10, 7], grad_numel=15, world=4, accum=3, comm_bytes=2, param_bytes=2)
    assert terms == {
        "all_reduce": {"gradient_buckets": 3 * 15 * 2, "gradient_norm": 2 * 4},
        "all_gather_into_tensor": {"parameters": (16 + 8) * 2},
    }
    assert padded_numel(16, world=4) == 16 and padded_numel(17, world=4) == 24
    assert ring_bytes_sent("all_reduce", 100, world=64) == 2 * ring_bytes_sent("reduce_scatter_tensor", 100, world=64)
    assert zero2_step_bytes(group_numels=[10], grad_numel=10, world=1, accum=1, comm_bytes=2, param_bytes=2) == {}


def test_bucketing_rule():
    """A bucket goes when the next gradient would overflow it (equal is not over), the rest after
    backward; a gradient larger than a bucket goes alone."""
    assert bucket_sizes([3, 3, 3, 10, 1], bucket=6) == [6, 3, 10, 1]
    assert bucket_sizes([2, 2], bucket=100) == [4]
    assert bucket_sizes([], bucket=6) == []


@pytest.mark.parametrize("model", MODELS)
def test_layout_and_backward_flops(model):
    lay = layout(model)
    # The word embeddings, tied to the MLM decoder, are the last gradient to be complete.
    assert lay.ready[-1][0] == "net.bert.embeddings.word_embeddings.weight"
    D = lay.config.hidden_size
    pooler_and_nsp = D * D + D + 2 * D + 2
    assert lay.grad_numel == sum(lay.groups) - pooler_and_nsp
    assert sum(backward_flops(lay, 128)) == pytest.approx(2 / 3 * micro_flops(lay, 128), rel=1e-12)


def test_rail_optimised_nodes_use_all_eight_nics():
    c = Cluster()
    assert c.busbw(8) == c.nvlink_busbw and c.busbw(64) == 8 * c.nic_busbw == 320e9
    assert c.seconds("all_reduce", 1e9, world=64) == pytest.approx(60e-6 + 2 * 63 / 64 * 1e9 / 320e9)
    assert c.seconds("all_gather_into_tensor", 1e9, world=8) == pytest.approx(20e-6 + 7 / 8 * 1e9 / 360e9)


def test_the_overlap_replay_at_its_limits():
    """With a free network the step is all compute; with free compute it is every collective back to
    back: each bucket, the norms, the all-gather."""
    lay, world = layout("base"), 64
    free = Cluster(nvlink_busbw=1e30, nic_busbw=1e30, latency_node=0.0, latency_fabric=0.0)
    assert step(lay, world=world, micro=128, accum=2, cluster=free)["efficiency"] == pytest.approx(1.0)
    c, instant = Cluster(), Device(peak_flops=1e30)
    sizes = bucket_sizes([n for _, n in lay.ready], bucket=BUCKET)
    expected = 2 * sum(c.seconds("all_reduce", 2 * n, world=world) for n in sizes)
    expected += 2 * c.seconds("all_reduce", 4, world=world)
    expected += sum(
        c.seconds("all_gather_into_tensor", 2 * padded_numel(n, world=world), world=world) for n in lay.groups
    )
    assert step(lay, world=world, micro=128, accum=2, device=instant)["time"] == pytest.approx(expected)


def test_the_64_gpu_configs_take_the_models_bucket_and_no_config_runs_lamb():
    for name in ("zero2_64gpu.json", "zero2_64gpu_fp32comm.json"):
        zero = json.loads((REPO / "deepspeed_configs" / name).read_text())["zero_optimization"]
        assert zero["reduce_bucket_size"] == BUCKET == 1e7
    # DeepSpeed's LAMB does not work under ZeRO (docs/scaling.md): every shipped config is ZeRO.
    for path in (REPO / "deepspeed_configs").glob("*.json"):
        cfg = json.loads(path.read_text())
        assert "lamb" not in cfg.get("optimizer", {}).get("type", "").lower(), path.name
