"""The miniature reproduction's pure parts: the score table, the verdict rules on constructed results,
the configuration's checks, and how text is split into training and held-out documents."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from pipeline.evaluation.mini import report as R
from pipeline.evaluation.mini.config import MiniConfig, _fractions, effective, parse_tasks
from pipeline.evaluation.mini.data import read_documents, split_language
from preprocessing.errors import UsageError


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


def test_config_curve_tasks_and_quick():
    cfg = MiniConfig(out=Path("o"), start_steps=800)
    assert cfg.curve_steps() == [200, 400, 800] and cfg.save_every() == 200
    assert _fractions("0.5,1") == (0.5, 1.0)
    for bad in ("1,0.5", "0,1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _fractions(bad)
    assert parse_tasks("sst2=a/SST-2, ner=b") == [("sst2", Path("a/SST-2")), ("ner", Path("b"))]
    for bad, needle in (("nope=x", "unknown task"), ("sst2", "NAME=DIR"), ("sst2=a,sst2=b", "twice")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse_tasks(bad)
    # --quick shrinks what the user left at its default, and keeps what they set.
    quick = effective(MiniConfig(out=Path("o"), quick=True, ft_seeds="1,2"))
    assert quick.layers == 2 and quick.start_steps == 24 and quick.ft_seeds == "1,2"
    assert effective(MiniConfig(out=Path("o"), quick=True, layers=3)).layers == 3


def test_config_validate_names_the_flag(tmp_path):
    for lang in ("en", "zh"):
        (tmp_path / lang).mkdir()
        (tmp_path / lang / "a.txt").write_text("x\n\n")
    base = dict(out=tmp_path / "o", corpora=tmp_path, tasks=[("sst2", tmp_path)])
    MiniConfig(**base).validate()
    for kwargs, needle in (
        (dict(curve=(0.25, 0.5)), "ending at 1"),
        (dict(start_steps=10, curve=(0.25, 1.0)), "whole step"),
        (dict(ft_seeds="1"), "at least 2 seeds"),
        (dict(hidden=100), "multiple of 64"),
        (dict(tasks=[("sst2", tmp_path / "missing")]), "no such folder"),
        (dict(corpora=tmp_path / "none"), "no en/\\*.txt"),
    ):
        with pytest.raises(UsageError, match=needle):
            MiniConfig(**{**base, **kwargs}).validate()


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


def test_heldout_cross_entropy_and_unigram_match_a_direct_computation(tmp_path):
    import math
    import random

    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from pipeline.evaluation.mini.heldout import (
        heldout_blocks,
        mask_positions,
        mlm_accuracy,
        prepare,
        unigram_log_probs,
    )
    from tests.support.tiny_bert import write_tiny_bert

    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    rng = random.Random(0)
    docs = [[" ".join(rng.choices(words, weights=[8, 2, 2, 3, 4, 1, 2, 1], k=12)) for _ in range(4)] for _ in range(6)]
    held = tmp_path / "heldout.txt"
    held.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    train = tmp_path / "train.txt"
    train.write_text("the cat sat on the mat\nthe the dog\n", encoding="utf-8")
    model_dir = write_tiny_bert(tmp_path / "m", words)

    tok = AutoTokenizer.from_pretrained(model_dir)
    logp_V = unigram_log_probs(tok, train)
    # add-half smoothing over the whole vocabulary: the (4), cat sat on mat dog (1 each): 9 training tokens
    V = len(tok)
    assert math.exp(logp_V[tok.convert_tokens_to_ids("the")]) == pytest.approx(4.5 / (9 + 0.5 * V))
    assert math.exp(logp_V[tok.convert_tokens_to_ids("ran")]) == pytest.approx(0.5 / (9 + 0.5 * V))

    got = mlm_accuracy(model_dir, prepare(tok, held, train, max_seq_len=16, seed=3))
    ids = heldout_blocks(tok, held, max_seq_len=16, max_blocks=64)
    m = mask_positions(ids, seed=3)
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=ids.masked_fill(m, tok.mask_token_id)).logits[m]
    gold = ids[m]
    assert got["masked"] == len(gold) > 10
    assert got["cross_entropy"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, gold)), rel=1e-5)
    assert got["accuracy"] == pytest.approx(float((logits.argmax(-1) == gold).float().mean()))
    assert got["unigram_cross_entropy"] == pytest.approx(float(-logp_V[gold].mean()), rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, message",
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
def test_values_that_cannot_be_meant_are_refused_up_front(tmp_path, kwargs, message):
    """These were accepted: --eval_samples -1 and --ft_epochs inf failed (or trained on) only in the
    fine-tuning stage after an hour of pre-training, --vocab_size 5 in the tokenizer stage, and a
    repeated seed reported a smaller spread."""
    for lang in ("en", "zh"):
        (tmp_path / lang).mkdir()
        (tmp_path / lang / "a.txt").write_text("x\n\n")
    cfg = MiniConfig(out=tmp_path / "o", corpora=tmp_path, tasks=[("sst2", tmp_path)], **kwargs)
    with pytest.raises(UsageError) as e:
        cfg.validate()
    assert str(e.value).startswith(message)
