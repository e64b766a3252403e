"""pipeline.demo_summary: the numbers it prints are the run's first and last records, and the fill-mask
line comes from the exported folder."""

from __future__ import annotations

import json

from pipeline import demo_summary
from tests.support.tiny_bert import write_tiny_bert


def test_summary_reports_first_and_last_values_and_a_fill_mask(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 50, "loss": 13.8, "mlm_loss": 8.0, "tc_loss": 5.8, "mlm_acc": 0.001, "tc_acc": 0.02,
         "tokens_per_s": 900.0, "step_time_s": 1.0},
        {"step": 100, "loss": 9.0, "mlm_loss": 6.5, "tc_loss": 2.5, "mlm_acc": 0.1, "tc_acc": 0.5,
         "tokens_per_s": 2000.0, "step_time_s": 0.5},
        {"step": 150, "loss": 6.0, "mlm_loss": 5.0, "tc_loss": 1.0, "mlm_acc": 0.3, "tc_acc": 0.8,
         "tokens_per_s": 3000.0, "step_time_s": 0.3},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(
        json.dumps({"objective": {"objective": "taco"}, "engine": {"world_size": 2, "micro_batch_per_rank": 16}})
    )
    export = tmp_path / "export"
    write_tiny_bert(export, ["the", "river", "is", "long", "."])
    code = demo_summary.main(
        ["--run", str(run), "--plot", str(run / "curves.png"), "--export", str(export), "--fill_mask", "the [MASK] ."]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "(taco, 150 steps, 2 rank(s) x micro-batch 16)" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert lines["mlm_acc"] == ["0.0010", "0.3000", "rises"]
    assert lines["tc_loss"] == ["5.8000", "1.0000", "falls"]
    assert list(lines)[:4] == ["step", "loss", "mlm_loss", "tc_loss"]  # losses first, then accuracies
    assert "tokens/s   2,500 (all ranks" in out and "0.400 s/step" in out  # medians after the first interval
    assert f"plot       {run / 'curves.png'}" in out
    fill = [line for line in out.splitlines() if line.strip().startswith("->")]
    assert len(fill) == 1 and fill[0].count("'") == 6  # three guesses with their scores


def test_fill_mask_without_the_mask_token_is_a_usage_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    write_tiny_bert(tmp_path / "export", ["a", "b"])
    args = ["--run", str(run), "--export", str(tmp_path / "export"), "--fill_mask", "no mask here"]
    assert demo_summary.main(args) == 2
    assert "needs the tokenizer's mask token [MASK]" in capsys.readouterr().err


def test_a_run_without_metrics_is_named(tmp_path, capsys):
    assert demo_summary.main(["--run", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err
