"""What DeepSpeed's ZeRO-2 really sends per optimizer step, counted on 2 and 4 gloo ranks
(pipeline.bench.comm_bytes, torchrun, DS_ACCELERATOR=cpu), against docs/scaling.md's formula evaluated
here for the tiny model."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.timeout(400), pytest.mark.multiproc]

VOCAB, ACCUM, BUCKET = 1024, 2, 70_000  # a bucket under the tiny model's gradients: several per backward
BUCKET_CALLER = "deepspeed/runtime/zero/stage_1_and_2.py:allreduce_bucket"
GATHER_CALLER = "deepspeed/runtime/utils.py:all_gather_into_tensor_dp_groups"


def tiny_layout():
    """(numel of each optimizer group, numel of the parameters TACO trains: all but the pooler and NSP head)."""
    from transformers import BertForPreTraining

    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.param_groups import param_groups
    from pipeline.modeling.student import Student

    student = Student(BertForPreTraining(bert_config("tiny", vocab_size=VOCAB)))
    groups = [sum(p.numel() for p in g["params"]) for g in param_groups(student)]
    unused = {"pooler", "seq_relationship"}
    trained = sum(p.numel() for n, p in student.named_parameters() if not unused & set(n.split(".")))
    return groups, trained


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm") / "comm.json"
    args = ["--world_sizes", "2,4", "--objective", "taco", "--accum", str(ACCUM), "--vocab", str(VOCAB)]
    args += ["--reduce_bucket_sizes", f"json,{BUCKET}", "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.comm_bytes", *args],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert printed == json.loads(out.read_text())
    return printed


@pytest.mark.parametrize("world", [2, 4])
def test_counted_bytes_per_step_match_the_pages_formula(report, world):
    """fp32, accumulation 2: k x N_grad x 4 B of gradient all-reduce (every micro-batch, the whole
    gradient: DeepSpeed 0.19.8 all-reduces its buckets), 4 B of norm per group, and each group's flat
    parameters all-gathered once, padded to 2R elements."""
    groups, trained = tiny_layout()
    assert report["deepspeed"] == "0.19.8"
    shipped, small = report["runs"][str(world)]
    zero2 = json.loads((REPO / "deepspeed_configs" / "zero2.json").read_text())["zero_optimization"]
    assert shipped["reduce_bucket_size"] == zero2["reduce_bucket_size"] and small["reduce_bucket_size"] == BUCKET
    for case in (shipped, small):
        assert case["identical_steps_and_ranks"] and case["accumulation"] == ACCUM
        ds = case["per_step"]["deepspeed"]
        assert set(ds) == {"all_reduce", "all_gather_into_tensor"}  # no reduce-scatter, no broadcast
        assert ds["all_reduce"]["bytes"] == ACCUM * trained * 4 + 2 * 4
        gathered = ds["all_gather_into_tensor"]
        assert gathered["dtypes"] == ["float32"]
        assert gathered["callers"] == {GATHER_CALLER: [math.ceil(n / (2 * world)) * 2 * world * 4 for n in groups]}
        assert case["matches_formula"]
    # The shipped bucket holds the whole tiny gradient: one all-reduce per micro-batch.
    assert shipped["per_step"]["deepspeed"]["all_reduce"]["callers"][BUCKET_CALLER] == [trained * 4] * ACCUM
    # A small bucket: DeepSpeed's bucketing rule over the order the gradients became ready predicts
    # every call, and the last one (sent after backward ends) holds the word embeddings.
    sizes = small["per_step"]["deepspeed"]["all_reduce"]["callers"][BUCKET_CALLER]
    assert len(sizes) > 2 * ACCUM and sizes == small["formula"]["gradient_all_reduce_bytes"]
    assert sizes[len(sizes) // ACCUM - 1] == VOCAB * 64 * 4
    assert report["matches_formula"]


def test_the_objective_sends_only_its_own_small_collectives(report):
    """Beside DeepSpeed's, the only collectives are the loss code's: TACO's cross-rank pool and the
    loss normalisers (counted apart, by caller)."""
    for world in (2, 4):
        other = report["runs"][str(world)][0]["per_step"]["other"]
        callers = {c for t in other.values() for c in t["callers"]}
        assert "pipeline/losses/sampling.py:gather_pool" in callers
        assert all(c.startswith("pipeline/losses/") for c in callers), callers
