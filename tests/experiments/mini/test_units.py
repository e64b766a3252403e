"""The miniature reproduction's in-process parts: the score table, the verdict rules on constructed
results, the settings and their checks (up front, before any stage), the arms' config files against
what the committed runs used, how text is split into training and held-out documents, and the
experiment's rules (nothing in the core imports it; no function over 60 lines)."""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.evaluation.downstream.tasks import TaskSpec
from pipeline.experiments.mini import verdicts as R
from pipeline.experiments.mini.data import read_documents, split_language
from pipeline.experiments.mini.settings import (
    CONFIGS,
    MiniConfig,
    PretrainArgs,
    RunArgs,
    TextArgs,
    _fractions,
    native_precision,
    parse_args,
    parse_tasks,
)
from preprocessing.errors import UsageError

REPO = Path(__file__).resolve().parents[3]
EXPERIMENT = REPO / "pipeline" / "experiments" / "mini"


def ft_result(**per_task: list[float]) -> dict:
    """A fine-tuning stage's result with the given dev scores per seed."""
    return {"tasks": {t: {"splits": {"dev": {"score": {"per_seed": v}}}} for t, v in per_task.items()}}


def test_score_table_averages_seed_by_seed():
    table = R.score_table({"m": ft_result(a=[0.5, 0.7, 0.6], b=[0.9, 0.7, 0.8])})
    assert table["m"]["a"]["mean"] == pytest.approx(0.6) and table["m"]["a"]["std"] == pytest.approx(0.1)
    # Seed i of every task: (0.5+0.9)/2, (0.7+0.7)/2, (0.6+0.8)/2 -> [0.7, 0.7, 0.7], no spread.
    assert table["m"]["average"]["per_seed"] == pytest.approx([0.7, 0.7, 0.7])
    assert table["m"]["average"]["std"] == pytest.approx(0.0)


def cell(*values: float) -> dict:
    return R.mean_std(list(values))


@pytest.mark.parametrize(
    "tacl, mlm, verdict",
    [
        ((0.80, 0.81, 0.79), (0.70, 0.71, 0.69), R.REPRODUCES),  # +10 points, spread 2
        ((0.70, 0.71, 0.69), (0.80, 0.81, 0.79), R.FAILS),
        ((0.70, 0.75, 0.65), (0.71, 0.76, 0.66), R.INCONCLUSIVE),  # -1 point, spread 10
    ],
)
def test_tacl_verdict_calls_a_difference_only_beyond_the_spread(tacl, mlm, verdict):
    table = {
        "cont_tacl": {"average": cell(*tacl), "x": cell(*tacl)},
        "cont_mlm": {"average": cell(*mlm), "x": cell(*mlm)},
    }
    got = R.tacl_verdict(table, "average")
    assert got["verdict"] == verdict
    assert got["average"]["difference"] == pytest.approx(statistics.fmean(tacl) - statistics.fmean(mlm))
    assert got["per_task"]["x"]["beyond_spread"] == (verdict != R.INCONCLUSIVE)


def test_left_floor_and_the_gate_on_the_start_model():
    # 1200 masked positions at a floor of 0.066: one standard error is about 0.0072.
    assert not R.left_floor({"accuracy": 0.080, "floor": 0.066, "masked": 1200})  # ~1.9 errors
    assert R.left_floor({"accuracy": 0.095, "floor": 0.066, "masked": 1200})  # ~4 errors
    verdict = {"verdict": R.REPRODUCES, "claim": "c"}
    above = {"accuracy": 0.2, "floor": 0.066, "masked": 1200}
    at_floor = {"accuracy": 0.066, "floor": 0.066, "masked": 1200}
    kept = R.gate_on_start(verdict, {"en": above, "zh": above})
    assert kept["verdict"] == kept["by_rule"] == R.REPRODUCES and "why" not in kept
    gated = R.gate_on_start(verdict, {"en": above, "zh": at_floor})
    assert gated["verdict"] == R.INCONCLUSIVE and gated["by_rule"] == R.REPRODUCES
    assert "zh" in gated["why"] and gated["start_left_floor"] == {"en": True, "zh": False}


def curve(taco: list[float], mlm: list[float], steps=(100, 200, 400), noise=0.005) -> dict:
    table = {}
    for arm, means in (("taco", taco), ("mlm", mlm)):
        for s, m in zip(steps, means):
            table[f"{arm}@{s}"] = {"average": cell(m - noise, m, m + noise)}
    return table


def test_taco_verdict_rules():
    steps = [100, 200, 400]
    # TACO at step 100 already scores what MLM reaches at 400: reproduces, 4x.
    got = R.taco_verdict(curve([0.70, 0.71, 0.72], [0.60, 0.65, 0.70]), steps, "average")
    assert got["verdict"] == R.REPRODUCES and got["steps_to_reach"] == {"taco": 100, "mlm": 400}
    assert got["speedup"] == pytest.approx(4.0)
    # MLM ahead at every checkpoint: does not reproduce.
    got = R.taco_verdict(curve([0.50, 0.55, 0.60], [0.60, 0.65, 0.70]), steps, "average")
    assert got["verdict"] == R.FAILS and got["steps_to_reach"]["taco"] is None
    # Equal within the spread everywhere: inconclusive.
    got = R.taco_verdict(curve([0.60, 0.65, 0.70], [0.60, 0.65, 0.70]), steps, "average")
    assert got["verdict"] == R.INCONCLUSIVE and got["steps_to_reach"] == {"taco": 400, "mlm": 400}
    # Ahead early but behind at the end beyond the spread: not a reproduction.
    got = R.taco_verdict(curve([0.70, 0.70, 0.60], [0.60, 0.65, 0.70]), steps, "average")
    assert got["verdict"] == R.INCONCLUSIVE


def mini(tmp_path: Path, **knobs) -> MiniConfig:
    """Settings over a corpora folder in tmp_path (one tiny file per language) and one task, with `knobs`
    set in whichever section holds them."""
    for lang in ("en", "zh"):
        (tmp_path / lang).mkdir(exist_ok=True)
        (tmp_path / lang / "a.txt").write_text("x\n\n")
    args = ["--out", str(tmp_path / "o"), "--corpora", str(tmp_path), "--tasks", f"sst2={tmp_path}"]
    cfg = parse_args(args)
    for section in ("text", "pretrain", "analysis", "finetune", "run"):
        part = getattr(cfg, section)
        for k in [k for k in knobs if hasattr(part, k)]:
            setattr(part, k, knobs.pop(k))
    assert not knobs, f"no such knob: {knobs}"
    return cfg


def test_config_curve_tasks_and_quick(tmp_path):
    cfg = MiniConfig(TextArgs(), PretrainArgs(start_steps=800), run=RunArgs(out=Path("o")))
    assert cfg.curve_steps() == [200, 400, 800] and cfg.save_every() == 200
    assert _fractions("0.5,1") == (0.5, 1.0)
    for bad in ("1,0.5", "0,1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _fractions(bad)
    assert parse_tasks("sst2=a/SST-2, ner=b") == [TaskSpec("sst2", Path("a/SST-2")), TaskSpec("ner", Path("b"))]
    assert parse_tasks("mine=classify:c/d") == [TaskSpec("mine", Path("c/d"), "classify")]
    for bad, needle in (("nope=x", "unknown task"), ("sst2", "NAME=DIR"), ("sst2=a,sst2=b", "twice")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse_tasks(bad)
    # --quick (configs/quick.yaml) shrinks what the user did not type, and keeps what they typed, also a
    # value equal to the full run's default.
    base = ["--out", "o", "--corpora", "c"]
    quick = parse_args([*base, "--quick", "--ft_seeds", "1,2"])
    assert quick.pretrain.model == "tiny" and quick.pretrain.start_steps == 6 and quick.finetune.ft_seeds == "1,2"
    assert quick.config_file == "pipeline/experiments/mini/configs/quick.yaml" and quick.pretrain.curve == (0.5, 1.0)
    assert parse_args([*base, "--quick", "--start_steps", "800"]).pretrain.start_steps == 800
    assert parse_args(base).pretrain.start_steps == 800 and parse_args(base).config_file is None


def test_config_validate_names_the_flag(tmp_path):
    mini(tmp_path).validate()
    for knobs, needle in (
        (dict(curve=(0.25, 0.5)), "ending at 1"),
        (dict(start_steps=10, curve=(0.25, 1.0)), "whole step"),
        (dict(ft_seeds="1"), "at least 2 seeds"),
        (dict(model="nope.json"), "--model 'nope.json': neither one of"),
        (dict(tasks=[TaskSpec("sst2", tmp_path / "missing")]), "no such folder"),
        (dict(tasks=None), "--tasks is required"),
        (dict(corpora=tmp_path / "none"), "no en/\\*.txt"),
    ):
        with pytest.raises(UsageError, match=needle):
            mini(tmp_path, **knobs).validate()
    mini(tmp_path, tasks=None, start_only=True).validate()  # the start alone needs no tasks


def test_split_language_holds_out_the_last_documents_and_shares_bytes_equally(tmp_path):
    long_docs = tmp_path / "novels.txt"  # few long documents
    short_docs = tmp_path / "news.txt"  # many short ones
    long_docs.write_text("".join(f"long {i} " + "x" * 2000 + "\n\n" for i in range(10)))
    short_docs.write_text("".join(f"short {i} " + "y" * 100 + "\n\n" for i in range(300)))
    train, heldout, counts = split_language([long_docs, short_docs], budget_bytes=12000, heldout_docs=4)
    assert [d[0][:7] for d in heldout] == ["long 8 ", "long 9 ", "short 2", "short 2"]
    assert not {d[0] for d in train} & {d[0] for d in heldout}
    by_file = list(counts["train_bytes_by_file"].values())
    assert max(by_file) - min(by_file) < 2100 and counts["train_bytes"] >= 12000
    assert read_documents(long_docs)[0][0].startswith("long 0")
    with pytest.raises(UsageError, match="holds out"):
        split_language([long_docs], budget_bytes=10, heldout_docs=10)


def test_unigram_of_the_pretraining_text_is_add_half_smoothed(tmp_path):
    import math

    from transformers import AutoTokenizer

    from pipeline.experiments.mini.heldout import unigram_log_probs
    from tests.support.tiny_bert import write_tokenizer

    write_tokenizer(tmp_path / "tok", ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    train = tmp_path / "train.txt"
    train.write_text("the cat sat on the mat\nthe the dog\n", encoding="utf-8")
    logp_V = unigram_log_probs(tok, train)
    # add-half smoothing over the whole vocabulary: the (4), cat sat on mat dog (1 each): 9 training tokens
    V = len(tok)
    assert math.exp(logp_V[tok.convert_tokens_to_ids("the")]) == pytest.approx(4.5 / (9 + 0.5 * V))
    assert math.exp(logp_V[tok.convert_tokens_to_ids("ran")]) == pytest.approx(0.5 / (9 + 0.5 * V))


def test_the_context_free_reference_is_the_masking_rules_posterior():
    """The floor and reference cross-entropy against a brute-force posterior: every gold token and every
    masking action (80% [MASK], 10% a random token of the pool, 10% kept) that could show what was shown."""
    import math

    import torch

    from pipeline.data.masking import MaskingSpec
    from pipeline.experiments.mini.heldout import context_free

    spec = MaskingSpec(mask_token_id=4, special_ids=(0, 1, 2, 3, 4), vocab_size=12)
    pool = [int(t) for t in spec.replacement_pool()]  # 5 .. 11
    counts = torch.tensor(
        [9.0, 9, 9, 9, 9, 50, 20, 10, 5, 2, 1, 0.01], dtype=torch.float64
    )  # specials get no mass below
    logp_V = (counts / counts.sum()).log()
    u = {t: float(counts[t]) / float(sum(counts[t] for t in pool)) for t in pool}

    def posterior(shown: int) -> dict[int, float]:
        joint = {g: u[g] * (0.8 * (shown == 4) + 0.1 * (shown == g) + 0.1 * (shown in pool) / len(pool)) for g in pool}
        return {g: p / sum(joint.values()) for g, p in joint.items()}

    # [MASK] shown; kept tokens (7 is copied; 8 and 11 are too rare: u(x) (1 + 1/R) < u(5) / R); a random
    # replacement (5 shown for 9); a random replacement too rare to copy (11 shown for 5)
    gold = [5, 6, 10, 7, 8, 11, 9, 5]
    shown = [4, 4, 4, 7, 8, 11, 5, 11]
    got = context_free(torch.tensor(gold), torch.tensor(shown), logp_V=logp_V, spec=spec)
    best = [max(posterior(x), key=posterior(x).get) for x in shown]
    assert best == [5, 5, 5, 7, 5, 5, 5, 5]
    assert got["floor"] == pytest.approx(sum(b == g for b, g in zip(best, gold)) / len(gold))
    ce = sum(-math.log(posterior(x)[g]) for g, x in zip(gold, shown)) / len(gold)
    assert got["unigram_cross_entropy"] == pytest.approx(ce, rel=1e-9) and got["masked"] == len(gold)


def test_the_reference_masks_the_held_out_samples_as_the_trainer_does(tmp_path):
    """heldout.masking_collator, from RUN/config.json, against the trainer's own collator of the same run
    (a seed and a masking share that are not the defaults): the same gold and shown tokens."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from pipeline.data.shards import DataInfo
    from pipeline.experiments.mini.heldout import masked_tokens, masking_collator
    from pipeline.training.config import parse_args as train_args
    from pipeline.training.preflight import Prepared
    from pipeline.training.trainer import make_collator
    from tests.support.tiny_bert import write_tokenizer

    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    write_tokenizer(tmp_path / "tok", words)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ds = str(CONFIGS / "deepspeed_fp32.json")
    cfg = train_args(["--data", "d", "--save_dir", str(tmp_path / "run"), "--ds_config", ds, "--model_config", "tiny",
                      "--max_steps", "1", "--seed", "7", "--mask_prob", "0.3", "--objective", "mlm"])  # fmt: skip
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    info = DataInfo(sources=[], format="packed", max_seq_len=16, tokenizer_dir=None, manifest_vocab_size=None)
    prep = Prepared(cfg=cfg, ds_config={}, data=info, use_nsp=False, tokenizer=tok, tokenizer_dir=str(tmp_path / "tok"),
                    bert_config=None, world_size=1, resume_from=None)  # fmt: skip
    rng = np.random.default_rng(0)
    samples = []
    for i in range(6):  # packed blocks holding two documents each ([SEP] inside): the trainer cuts them
        ids = [tok.cls_token_id, *rng.integers(5, len(tok), 6), tok.sep_token_id, *rng.integers(5, len(tok), 7)]
        ids.append(tok.sep_token_id)
        samples.append({"input_ids": np.array(ids), "token_type_ids": np.zeros(16, np.int64), "sample_id": 100 + i})
    theirs, ours = (
        masked_tokens(make_collator(prep)(samples)),
        masked_tokens(masking_collator(tok, tmp_path / "run")(samples)),
    )
    assert len(ours[0]) == 6 * round(0.3 * 13) and int((ours[1] == tok.mask_token_id).sum()) > 0
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(eval_samples=-1), "--eval_samples must be >= 1 (got -1)"),
        (dict(ft_epochs=float("inf")), "--ft_epochs must be > 0 and finite (got inf)"),
        (dict(ft_lr=float("nan")), "--ft_lr must be > 0 and finite (got nan)"),
        (dict(en_mb=float("inf")), "--en_mb must be > 0 and finite (got inf)"),
        (dict(vocab_size=5), "--vocab_size 5: must be between 100 and 1048576"),
        (dict(heldout_docs=0), "--heldout_docs must be >= 1 (got 0)"),
        (dict(ft_seeds="1,2,1"), "--ft_seeds 1,2,1: seed(s) [1] repeated"),
    ],
)
def test_values_that_cannot_be_meant_are_refused_up_front(tmp_path, knobs, message):
    """These were accepted: --eval_samples -1 and --ft_epochs inf failed (or trained on) only in the
    fine-tuning stage after an hour of pre-training, --vocab_size 5 in the tokenizer stage, and a
    repeated seed reported a smaller spread."""
    with pytest.raises(UsageError) as e:
        mini(tmp_path, **knobs).validate()
    assert str(e.value).startswith(message)


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """python -m pipeline.experiments.mini ARGS, in-process: (exit code, stderr)."""
    from pipeline.experiments.mini.__main__ import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval_samples", "-1"], "--eval_samples must be >= 1 (got -1)"),
        (["--ft_epochs", "inf"], "--ft_epochs must be > 0 and finite (got inf)"),
        (["--vocab_size", "5"], "--vocab_size 5: must be between 100 and 1048576"),
        (["--ft_seeds", "3,3"], "--ft_seeds 3,3: seed(s) [3] repeated"),
    ],
)
def test_the_command_refuses_them_before_any_stage_runs(tmp_path, capsys, flags, message):
    mini(tmp_path)  # the corpora folder
    out = tmp_path / "o"
    rc, err = run_main(["--out", str(out), "--corpora", str(tmp_path), "--tasks", f"sst2={tmp_path}", *flags], capsys)
    assert rc == 2 and f"python -m pipeline.experiments.mini: error: {message}" in err, err
    assert not out.exists()  # no stage ran


def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    mini(tmp_path)
    for args, needle in (
        (["--tasks", "nope=/x"], "unknown task 'nope'"),
        (["--tasks", f"sst2={tmp_path / 'missing'}"], "no such folder"),
        (["--curve", "0.5,0.25"], "--curve"),
        (["--ft_seeds", "1"], "at least 2 seeds"),
        (["--config", str(tmp_path / "none.yaml")], "no such file"),
    ):
        quick = [] if "--config" in args else ["--quick"]
        rc, err = run_main(["--out", str(tmp_path / "o"), *quick, "--corpora", str(tmp_path), *args], capsys)
        assert rc == 2, (args, err[-2000:])
        assert needle in err and "Traceback" not in err, (args, err[-2000:])


def test_help_runs_as_a_module():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.experiments.mini", "--help"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "usage: python -m pipeline.experiments.mini" in proc.stdout, proc.stderr


# --------------------------------------------------------------------------- precision on CPUs without bf16


def test_miniature_keeps_bf16_where_the_cpu_runs_it(tmp_path):
    cfg = mini(tmp_path)
    assert native_precision(cfg, bf16_native=True) == (cfg, [])
    assert cfg.ds_config == CONFIGS / "deepspeed_bf16.json"


def test_miniature_falls_back_to_fp32_and_says_so(tmp_path):
    cfg, notes = native_precision(mini(tmp_path), bf16_native=False)
    assert (cfg.pretrain.bf16, cfg.finetune.ft_bf16) == (False, False)
    assert cfg.ds_config == CONFIGS / "deepspeed_fp32.json"
    assert len(notes) == 1 and notes[0].startswith("pre-training and fine-tuning in fp32")
    # Pre-training on another device keeps its bf16; fine-tuning always runs on the CPU.
    cfg, notes = native_precision(mini(tmp_path), bf16_native=False, pretrain_on_cpu=False)
    assert (cfg.pretrain.bf16, cfg.finetune.ft_bf16) == (True, False) and notes[0].startswith("fine-tuning in fp32")
    # Already fp32: nothing to say.
    cfg = mini(tmp_path, bf16=False, ft_bf16=False)
    assert native_precision(cfg, bf16_native=False) == (cfg, [])


# --------------------------------------------------------------------------- the arms are data


# What the committed runs (docs/results/2026-12-06-miniature*) wrote and ran with: the DeepSpeed JSON
# and the BertConfig the experiment generated in Python before its arms became files.
COMMITTED_DS = {
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True},
    },
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}},
    "steps_per_print": 1_000_000_000,
    "wall_clock_breakdown": False,
}
COMMITTED_BERT = {
    "model_type": "bert", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "intermediate_size": 1024, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12,
    "initializer_range": 0.02,
}  # fmt: skip


def test_deepspeed_and_model_configs_are_the_committed_runs():
    from transformers import BertConfig

    from pipeline.modeling.bert_config import bert_config

    assert json.loads((CONFIGS / "deepspeed_bf16.json").read_text()) == {**COMMITTED_DS, "bf16": {"enabled": True}}
    assert json.loads((CONFIGS / "deepspeed_fp32.json").read_text()) == COMMITTED_DS
    ours = bert_config(str(CONFIGS / "model.json"), vocab_size=16004)  # the vocabulary's real size
    committed = BertConfig.from_dict({**COMMITTED_BERT, "vocab_size": 16004})
    committed._attn_implementation = "sdpa"  # as bert_config sets it for every student
    assert ours.to_dict() == committed.to_dict()


@pytest.mark.parametrize(
    "arm, objective, nsp, data",
    [("mlm", "mlm", "off", "packed"), ("taco", "taco", "off", "packed"), ("cont_mlm", "mlm", "on", "nsp"),
     ("cont_tacl", "tacl", "on", "nsp")],
)  # fmt: skip
def test_each_arm_file_is_what_train_py_resolves(arm, objective, nsp, data):
    """The arm's train.py --config file plus the experiment's per-run flags, through train.py's own
    parser: the objective, NSP, learning rate and 1:1 mix the committed runs used."""
    from pipeline.experiments.mini import commands as C
    from pipeline.training.config import parse_args as train_args

    source = ["--model_config", str(CONFIGS / "model.json")] if data == "packed" else ["--init_from", "start"]
    cfg = train_args(
        ["--config", str(C.arm_config(arm)), "--ds_config", str(CONFIGS / "deepspeed_bf16.json"),
         "--data", f"{data}_en", "--data", f"{data}_zh", *source, "--max_steps", "800", "--warmup_steps", "48",
         "--save_dir", "run"]
    )  # fmt: skip
    assert (cfg.objective.objective, cfg.objective.nsp, cfg.schedule.lr) == (objective, nsp, 1e-3)
    assert cfg.data.data_weights == [1.0, 1.0] and cfg.data.num_workers == 1 and cfg.run.seed == 0


def test_tasks_reach_finetune_py_in_its_syntax():
    from pipeline.experiments.mini.commands import task_flag

    assert task_flag(TaskSpec("sst2", Path("glue/SST-2"))) == "sst2:glue/SST-2"
    assert task_flag(TaskSpec("reviews", Path("data/r"), "classify")) == "reviews=classify:data/r"


def test_stages_done_by_one_command_are_kept_or_redone_each_on_its_own(tmp_path):
    """The fine-tuning stages: one finetune.py command for the models not kept from an earlier run."""
    from pipeline.experiments.mini.stages import run_stages

    calls, lines = [], []

    def work(todo):
        calls.append(sorted(todo))
        return {name: {"model": name} for name in todo}

    folders = {n: tmp_path / n for n in ("m1", "m2", "m3")}
    first = run_stages(folders, {n: {"seeds": "1,2"} for n in folders}, work, say=lines.append)
    assert calls == [["m1", "m2", "m3"]] and list(first) == ["m1", "m2", "m3"] and first["m2"]["model"] == "m2"
    again = run_stages(folders, {"m1": {"seeds": "1,2"}, "m2": {"seeds": "1,3"}, "m3": {"seeds": "1,2"}}, work,
                       say=lines.append)  # fmt: skip
    assert calls[-1] == ["m2"] and again["m1"] == first["m1"] and list(again) == ["m1", "m2", "m3"]
    assert "m1: kept (done before with the same settings)" in " ".join(lines)
    assert json.loads((tmp_path / "m2" / "stage.json").read_text())["settings"] == {"seeds": "1,3"}


# --------------------------------------------------------------------------- the experiment's own rules


def test_nothing_outside_the_experiments_imports_them():
    """torchtitan's experiments/ rule: the core never depends on an experiment, so it can be deleted."""
    offenders = []
    for root in ("pipeline", "preprocessing", "tests"):
        for path in (REPO / root).rglob("*.py"):
            if "experiments" in path.relative_to(REPO).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("pipeline.experiments")]
    assert not offenders


def test_no_function_of_the_experiment_is_over_60_lines():
    long = []
    for path in EXPERIMENT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                long += [f"{path.name}:{node.name} ({n} lines)"] if n > 60 else []
    assert not long
