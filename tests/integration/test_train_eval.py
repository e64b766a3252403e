"""Held-out evaluation during training (pipeline.training.evaluation): the same masked positions and
draws at every evaluation, the figures a direct computation gives, and the trainer's metrics lines,
health figures and best checkpoint on 2 real DeepSpeed ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from pipeline import distributed, objectives
from pipeline.bench.engine import BareEngine
from pipeline.data.masking import MaskingSpec
from pipeline.data.shards import inspect_data
from pipeline.modeling.bert_config import bert_config
from pipeline.modeling.encoder import Encoder
from pipeline.modeling.param_groups import param_groups
from pipeline.modeling.student import Student
from pipeline.modeling.teacher import build_teacher
from pipeline.training.config import ObjectiveArgs
from pipeline.training.evaluation import Evaluator
from pipeline.training.metrics import FlopsModel
from pipeline.training.nonfinite import NonfiniteGuard
from pipeline.training.preflight import eval_folder_names
from pipeline.training.step import StepProgram
from tests.support.trainer import explain, free_port, read_metrics, run_deepspeed, shard_sets, train_args

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def evaluator(data: Path, objective: str, tmp_path: Path, *, sets: Optional[dict[str, Path]] = None):
    """An evaluator over DATA/eval (or the named folders `sets`) in this process (a world of one), and
    its student, a tiny BERT (the same weights at every call)."""
    from transformers import AutoTokenizer, BertForPreTraining

    from pipeline.data.collator import MaskingCollator

    distributed.single_process_env()
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    torch.manual_seed(0)
    cfg = bert_config("tiny", vocab_size=len(tok))
    cfg.attention_probs_dropout_prob = 0.0
    student = Student(BertForPreTraining(cfg))
    obj = objectives.get(objective)
    teacher = build_teacher(student, dtype=torch.float32, device=torch.device("cpu")) if obj.needs_teacher else None
    engine = BareEngine(student, ds=DS, param_groups=param_groups(student), device=torch.device("cpu"))
    program = StepProgram(
        engine=engine, objective=obj, args=ObjectiveArgs(objective=objective), nsp=objective == "tacl",
        teacher=Encoder(teacher) if teacher is not None else None, guard=NonfiniteGuard(torch.device("cpu")),
        flops=FlopsModel.of(cfg, teacher=False), device=torch.device("cpu"), seed=0, accum=1,
    )  # fmt: skip
    spec = MaskingSpec(mask_token_id=tok.mask_token_id, special_ids=tuple(tok.all_special_ids), vocab_size=len(tok))
    collator = MaskingCollator(spec=spec, pad_id=tok.pad_token_id, seed=0, nsp=program.nsp, max_seq_len=64)
    infos = {
        name: inspect_data([str(folder)], cache_root=str(tmp_path / "cache" / name))
        for name, folder in (sets or {"eval": data / "eval"}).items()
    }
    ev = Evaluator(program, sets=infos, collator=collator, vocab_size=len(tok), samples=10, run_id=tmp_path.name)
    return ev, student


def test_an_evaluation_repeats_itself_and_equals_a_direct_computation(shards, tmp_path):
    ev, student = evaluator(shards["nsp48_eval"], "tacl", tmp_path)
    (held,) = ev.sets
    assert (held.samples, held.micro, held.batches) == (8, 4, 2)  # whole micro-batches of the first 10
    first, again = ev(health=True), ev(health=False)
    for key in ("eval/mlm_loss", "eval/mlm_acc", "eval/nsp_loss", "eval/nsp_acc", "eval/tacl_loss", "eval/tacl_acc"):
        assert again[key] == first[key], key  # the same masked positions and draws every time
    assert {"eval/intra_sentence", "eval/context_gap"} <= set(first) and "eval/context_gap" not in again
    assert student.training  # the training mode is back
    # The reference: HF's own heads on the padded batch, cross-entropy at the masked positions.
    net, losses, hits, masked = student.net.eval(), 0.0, 0, 0
    with torch.no_grad():
        for batch in held.collated:
            from pipeline.data.collator import grid_inputs

            grid = grid_inputs({**batch, "original_ids": batch["input_ids"]})
            logits = net(**grid).prediction_logits.flatten(0, 1)[batch["masked_grid_index"]]
            labels = batch["mlm_labels"]
            losses += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            hits += int((logits.argmax(-1) == labels).sum())
            masked += len(labels)
    assert first["eval/mlm_loss"] == pytest.approx(losses / masked, rel=1e-5)
    assert first["eval/mlm_acc"] == pytest.approx(hits / masked, abs=1e-9)
    assert first["eval/masked"] == masked and first["eval/samples"] == 8
    assert not [k for k in first if k.count("/") > 1]  # one folder: no eval/NAME/ fields


def test_each_folder_is_evaluated_on_its_own_and_all_of_them_together(shards, tmp_path):
    """Two --eval_data folders: each one's eval/NAME/ fields are what evaluating it alone gives (its
    own first samples, masks and draws), and eval/ is over both, weighted by masked positions."""
    folders = {"held": shards["nsp48_eval"] / "eval", "train": shards["nsp48"]}
    both = evaluator(shards["nsp48_eval"], "tacl", tmp_path / "both", sets=folders)[0](health=True)
    alone = {
        n: evaluator(shards["nsp48_eval"], "tacl", tmp_path / n, sets={n: f})[0](health=True)
        for n, f in folders.items()
    }
    for name, fields in alone.items():
        for key, value in fields.items():
            if key != "eval/time_s":
                assert both[key.replace("eval/", f"eval/{name}/")] == pytest.approx(value, rel=1e-12), (name, key)
    held, train = alone["held"], alone["train"]
    assert both["eval/masked"] == held["eval/masked"] + train["eval/masked"]
    assert both["eval/samples"] == held["eval/samples"] + train["eval/samples"] == 16
    for key in ("eval/mlm_loss", "eval/mlm_acc"):
        weighted = held[key] * held["eval/masked"] + train[key] * train["eval/masked"]
        assert both[key] == pytest.approx(weighted / both["eval/masked"], rel=1e-12), key
    assert both["eval/tacl_loss"] == pytest.approx((held["eval/tacl_loss"] + train["eval/tacl_loss"]) / 2, rel=1e-12)


@pytest.mark.parametrize(
    "values, named",
    [
        (["en=a/x", "zh=b/x"], [("en", "a/x"), ("zh", "b/x")]),
        (["data/wiki/eval", "data/books/eval"], [("wiki", "data/wiki/eval"), ("books", "data/books/eval")]),
        (["a/mds", "b/mds/", "c/other"], [("mds_1", "a/mds"), ("mds_2", "b/mds/"), ("other", "c/other")]),
        (["dir/a=b", "s3://bucket/x"], [("a=b", "dir/a=b"), ("x", "s3://bucket/x")]),
    ],
)
def test_eval_folders_are_named_as_given_or_by_their_folder(values, named):
    assert eval_folder_names(values) == named


def test_the_trainer_evaluates_logs_and_keeps_the_best_checkpoint(shards, tmp_path):
    """2 ranks, TACO on packed shards whose builder held out a quarter of the documents (DATA/eval,
    found without --eval_data): eval/ fields at every --eval_every step and the last, the health
    figures every 2nd evaluation, and the best checkpoint kept while --keep_checkpoints 1 prunes."""
    from tests.support.trainer import write_ds_config

    ds = write_ds_config(tmp_path / "ds.json", micro=4, bf16=False)
    save = tmp_path / "run"
    args = train_args(
        ds_config=ds, objective="taco", data=[shards["packed32_eval"]], save_dir=save, max_steps=10,
        extra=["--lr", "3e-3", "--log_every", "5", "--save_every", "3", "--keep_checkpoints", "1",
               "--eval_every", "4", "--eval_samples", "8", "--eval_health_every", "2", "--keep_best"],
    )  # fmt: skip
    proc = run_deepspeed(free_port(), args)
    assert proc.returncode == 0, explain(proc)
    assert "held-out evaluation every 4 steps and at the end: 8 samples of" in proc.stdout
    rows = {r["step"]: r for r in read_metrics(save)}
    evaluated = sorted(s for s, r in rows.items() if "eval/mlm_loss" in r)
    assert evaluated == [4, 8, 10]
    assert [("eval/context_gap" in rows[s]) for s in evaluated] == [False, True, True]  # every 2nd, and the last
    for s in evaluated:
        r = rows[s]
        assert r["eval/samples"] == 8 and 0 <= r["eval/mlm_acc"] <= 1 and r["eval/mlm_loss"] > 0
        assert "eval/tc_loss" in r and "loss" in r  # the same line as the step's training figures
    best = min(evaluated, key=lambda s: rows[s]["eval/mlm_loss"])
    root = save / "checkpoints"
    assert (root / "best").read_text().strip() == f"step_{best:08d}" and (root / f"step_{best:08d}").is_dir()
    assert json.loads((root / "best.json").read_text()) == {"step": best, "eval/mlm_loss": rows[best]["eval/mlm_loss"]}
