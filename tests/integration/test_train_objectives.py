"""Each objective trains the tiny model on shards built by our builder with real DeepSpeed (2 CPU
ranks, gloo): the loss goes down on a small fixed dataset and every metrics field is there; TaCL
from a real pre-trained checkpoint; the NaN guard aborts naming the step; the launcher-level
fail-fast exits 2 before any process group exists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.hardware import cpu_bf16_native
from tests.support import logs
from tests.support.trainer import (
    explain,
    free_port,
    minilm_dir,
    read_metrics,
    read_trace,
    run_deepspeed,
    session_run,
    shard_sets,
    tacl_straight,
    train_args,
    write_ds_config,
)

pytestmark = pytest.mark.multiproc

COMMON = {
    "step",
    "phase",
    "global_step",
    "loss",
    "mlm_loss",
    "mlm_acc",
    "lr",
    "grad_norm",
    "loss_scale",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_s",
    "mfu",
    "step_time_s",
    "mem_gb",
    "mem_kind",
    "skipped_micro_batches",
    "overflow_steps",
    "time",
}
TERMS = {"mlm": set(), "taco": {"tc_loss", "tc_acc"}, "tacl": {"nsp_loss", "nsp_acc", "tacl_loss", "tacl_acc"}}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return write_ds_config(tmp_path_factory.getbasetemp() / "ds_micro4.json", micro=4)


def _run(objective: str, tmp_path_factory, shards, ds) -> Path:
    if objective == "tacl":
        return tacl_straight(tmp_path_factory)[0]
    if objective == "mlm":  # English and Chinese streams mixed half and half
        data, extra = [shards["packed32"], shards["packed32_zh"]], ["--data_weights", "0.5,0.5", "--trace_samples"]
    else:
        data, extra = [shards["packed32"]], []
    return session_run(
        tmp_path_factory,
        objective,
        lambda save: train_args(
            ds_config=ds,
            objective=objective,
            data=data,
            save_dir=save,
            max_steps=60,
            extra=["--lr", "5e-3", "--save_every", "60", *extra],
        ),
    )[0]


@pytest.mark.parametrize("objective", ["mlm", "taco", "tacl"])
def test_objective_trains_and_logs_every_field(objective, tmp_path_factory, shards, ds):
    save = _run(objective, tmp_path_factory, shards, ds)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert set(r) == COMMON | TERMS[objective], set(r) ^ (COMMON | TERMS[objective])
        assert r["mfu"] is None and r["mem_kind"] == "cpu_max_rss"  # no known peak on CPU
        assert (
            r["loss_scale"] == 1.0
            and r["overflow_steps"] == 0
            and r["tokens_per_s"] > 0
            and r["samples_per_s"] > 0
            and r["mem_gb"] > 0
        )
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        parts = r["mlm_loss"] + r.get("nsp_loss", 0) + r.get("tacl_loss", 0) + r.get("tc_loss", 0)
        assert abs(r["loss"] - parts) < 1e-4 * max(1.0, abs(r["loss"]))
    # The first four steps against the last ten: MLM on the mixed tiny corpus reaches the unigram
    # plateau (about 0.89 of the start, step to step noise of +-0.3), TACO and TaCL go well below.
    first = sum(r["loss"] for r in rows[:4]) / 4
    last = sum(r["loss"] for r in rows[-10:]) / 10
    assert last < 0.93 * first, f"{objective}: loss {first:.3f} -> {last:.3f}"
    assert sum(r["mlm_acc"] for r in rows[-10:]) / 10 > rows[0]["mlm_acc"] + 0.05
    assert any((save / "tensorboard").glob("events.out.tfevents.*"))
    config = json.loads((save / "config.json").read_text())
    assert config["objective"]["objective"] == objective
    micro, accum = (2, 2) if objective == "tacl" else (4, 1)  # read back from the engine, not set twice
    assert config["engine"] == {
        "micro_batch_per_rank": micro,
        "gradient_accumulation_steps": accum,
        "world_size": 2,
        "global_batch": 8,
        "dtype": "bfloat16",
        "device": "cpu",
    }


def test_bf16_on_a_cpu_without_native_bf16_warns_once(tmp_path_factory, shards, ds):
    """The JSON owns precision, so the bf16 run stays bf16; where this CPU has no native bf16 the
    trainer says once (rank 0) what that costs and which flag fixes it, and elsewhere says nothing."""
    save = _run("mlm", tmp_path_factory, shards, ds)
    out = (save.parent / "launcher.log").read_text()
    warned = [line for line in out.splitlines() if "has no native bf16" in line]
    if cpu_bf16_native():
        assert warned == []
    else:
        assert len(warned) == 1, warned
        assert "WARNING r0" in warned[0] and f"--ds_config {ds}" in warned[0], warned[0]


def test_mixing_weights_draw_from_both_languages(tmp_path_factory, shards, ds):
    save = _run("mlm", tmp_path_factory, shards, ds)
    en = sum(
        json.loads((shards["packed32"] / "index.json").read_text())["shards"][i]["samples"]
        for i in range(len(json.loads((shards["packed32"] / "index.json").read_text())["shards"]))
    )
    ids = [i for step in read_trace(save).values() for rank in step for i in rank]
    zh_share = sum(i >= en for i in ids) / len(ids)  # stream 2's samples come after stream 1's
    assert 0.3 < zh_share < 0.7, zh_share


def test_tacl_from_the_real_pretrained_checkpoint(tmp_path, shards):
    from transformers import BertModel

    from pipeline.modeling.teacher import fingerprint

    ds = write_ds_config(tmp_path / "ds.json", micro=2)
    save = tmp_path / "minilm"
    proc = run_deepspeed(
        free_port(),
        train_args(
            ds_config=ds,
            objective="tacl",
            data=[shards["nsp48_minilm"]],
            save_dir=save,
            max_steps=4,
            extra=["--init_from", str(minilm_dir()), "--lr", "5e-5", "--save_every", "4"],
        ),
    )
    assert proc.returncode == 0, explain(proc)
    assert logs.has(proc.stdout, f"initialised from {minilm_dir()}")
    assert "not in the checkpoint, initialised at random: " in proc.stdout
    assert "cls.predictions.transform.dense" in proc.stdout and "cls.seq_relationship" in proc.stdout
    rows = read_metrics(save)
    assert len(rows) == 4 and all(math.isfinite(r["tacl_loss"]) for r in rows)
    # The teacher is MiniLM's own encoder (in the engine's bf16), and it uses MiniLM's tokenizer.
    states = torch.load(save / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt", weights_only=False)
    ref = BertModel.from_pretrained(minilm_dir())
    ref.pooler = None
    assert states["teacher_fingerprint"] == fingerprint(ref.to(torch.bfloat16))
    config = json.loads((save / "config.json").read_text())
    # The run's own model arguments (what analyze.py reads as step 0 of a run) and the resolved BERT config.
    assert config["model"]["init_from"] == str(minilm_dir())
    assert config["bert_config"]["hidden_size"] == 384 and config["bert_config"]["vocab_size"] == 30522
    assert config["tokenizer"] == str(shards["nsp48_minilm"] / "tokenizer")  # a copy of MiniLM's own


def test_nan_losses_in_a_row_abort_naming_the_step(tmp_path, shards, ds):
    # One micro-batch per step: rank 1's loss is NaN at steps 3, 4 and 5, three in a row.
    proc = run_deepspeed(
        free_port(),
        train_args(
            ds_config=ds,
            objective="mlm",
            data=[shards["packed32"]],
            save_dir=tmp_path / "nan",
            max_steps=8,
            extra=["--fault_nan_steps", "3,4,5", "--fault_nan_rank", "1", "--max_nonfinite", "3"],
        ),
    )
    assert proc.returncode != 0, explain(proc)
    assert "loss was NaN/inf for 3 micro-batches in a row, the last at step 5" in proc.stdout + proc.stderr
    # Both ranks neutralised the micro-batch in lockstep (rank 0's loss was finite) and rank 0 said so
    # once per step, at each control step (every log step here).
    for step in (3, 4, 5):
        assert logs.count(proc.stdout, f"non-finite loss at step {step}: micro-batch neutralised") == 1, step
    rows = read_metrics(tmp_path / "nan")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["skipped_micro_batches"] for r in rows] == [0, 0, 1, 2]


def test_launcher_fails_fast_on_a_batch_identity_that_does_not_hold(tmp_path, shards):
    bad = write_ds_config(tmp_path / "bad.json", micro=4, train_batch_size=12)
    proc = run_deepspeed(
        free_port(),
        train_args(ds_config=bad, objective="mlm", data=[shards["packed32"]], save_dir=tmp_path / "r", max_steps=2),
    )
    assert proc.returncode == 2, explain(proc)
    assert (
        "train_batch_size=12 does not equal train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=1 x "
        "world size 2" in proc.stderr
    )
    assert not logs.has(proc.stdout, "rank ")  # before any process group (or GPU) work
