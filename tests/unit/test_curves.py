"""pipeline/plot_runs.py and pipeline.training.curves: runs read from metrics.jsonl, one panel per field,
one line per run carrying that run's numbers, the runs that lack a field named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline import plot_runs
from pipeline.training import curves
from preprocessing.errors import UsageError
from tests.support.png import assert_png


def write_run(folder: Path, objective: str, steps: range, *, extra_lines: tuple[str, ...] = ()) -> Path:
    """A metrics.jsonl as the trainer writes it: the terms of `objective`, lr, grad_norm, throughput."""
    folder.mkdir(parents=True)
    term = {"taco": "tc", "tacl": "tacl", "mlm": None}[objective]
    lines = []
    for s in steps:
        r = {"step": s, "loss": 8.0 - 0.1 * s, "mlm_loss": 7.0 - 0.1 * s, "mlm_acc": 0.01 * s}
        if term:
            r[f"{term}_loss"] = 3.0 - 0.05 * s
            r[f"{term}_acc"] = 0.02 * s
        r.update(lr=1e-3 * min(1, s / 5), grad_norm=2.0 / s, tokens_per_s=1000.0 + s, mfu=None, mem_kind="cpu")
        lines.append(json.dumps(r))
    (folder / "metrics.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    return folder


@pytest.fixture
def runs(tmp_path) -> list[str]:
    return [
        str(write_run(tmp_path / "taco", "taco", range(10, 101, 10))),
        str(write_run(tmp_path / "tacl", "tacl", range(5, 51, 5), extra_lines=('{"step": 55, "loss": 1', ""))),
        str(write_run(tmp_path / "mlm", "mlm", range(1, 31)) / "metrics.jsonl"),  # a file works too
    ]


def lines_by_panel(fig) -> dict[str, dict[str, tuple[list, list]]]:
    out = {}
    for ax in fig.axes:
        if ax.get_visible() and ax.get_title():
            out[ax.get_title()] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
    return out


def test_each_run_is_drawn_in_every_panel_it_has_data_for(runs):
    read = [curves.read_run(s) for s in runs]
    plan = curves.plan(read)
    assert plan.fields == [
        "loss", "mlm_loss", "tacl_loss", "tc_loss", "mlm_acc", "tacl_acc", "tc_acc", "lr", "grad_norm", "tokens_per_s"
    ]  # fmt: skip
    assert plan.missing == {
        "tacl_loss": ["taco", "mlm"],
        "tc_loss": ["tacl", "mlm"],
        "tacl_acc": ["taco", "mlm"],
        "tc_acc": ["tacl", "mlm"],
    }
    fig = curves.draw(read, plan)
    panels = lines_by_panel(fig)
    assert list(panels) == [curves.TITLES.get(f, f) for f in plan.fields]
    for run in read:
        for field in plan.fields:
            lines = panels[curves.TITLES.get(field, field)]
            if field in plan.missing and run.label in plan.missing[field]:
                assert run.label not in lines
                continue
            xs, ys = lines[run.label]
            assert xs == [r["step"] for r in run.records]
            assert ys == pytest.approx([r[field] for r in run.records])
    # One colour per run, the same in every panel.
    colours = {}
    for ax in fig.axes:
        for ln in ax.lines:
            colours.setdefault(ln.get_label(), set()).add(ln.get_color())
    assert all(len(c) == 1 for c in colours.values()) and len({next(iter(c)) for c in colours.values()}) == 3
    # The panel of a field some runs lack says which.
    tc_axis = next(ax for ax in fig.axes if ax.get_title() == "tc_loss")
    assert any(t.get_text() == "not in: tacl, mlm" for t in tc_axis.texts)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["taco", "tacl", "mlm"]  # in the order given


def test_the_command_writes_a_png_and_names_what_is_missing(runs, tmp_path, capsys):
    out = tmp_path / "plots" / "curves.png"
    assert plot_runs.main([*runs, "--out", str(out), "--title", "three objectives"]) == 0
    assert_png(out, min_bytes=20_000)
    captured = capsys.readouterr()
    assert "10 panels" in captured.out and "taco (steps 10-100)" in captured.out
    assert "tc_loss is not in tacl, mlm" in captured.err
    assert "1 line(s) without a step skipped" in captured.err  # the tacl run's cut last line


def test_fields_choose_the_panels(runs, tmp_path):
    read = [curves.read_run(s) for s in runs]
    assert curves.plan(read, ["mlm_acc", "lr"]).fields == ["mlm_acc", "lr"]
    fig = curves.draw(read, curves.plan(read, ["mlm_acc"]))
    assert list(lines_by_panel(fig)) == ["mlm_acc"]
    with pytest.raises(UsageError, match="nsp_acc in none of the runs"):
        curves.plan(read, ["nsp_acc"])


def test_runs_named_alike_get_their_parent_folder_and_bad_runs_are_named(tmp_path, capsys):
    a = write_run(tmp_path / "exp_a" / "run", "taco", range(1, 4))
    b = write_run(tmp_path / "exp_b" / "run", "taco", range(1, 4))
    read = [curves.read_run(str(a)), curves.read_run(str(b))]
    curves.unique_labels(read)
    assert [r.label for r in read] == ["exp_a/run", "exp_b/run"]
    assert plot_runs.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nowhere: no metrics.jsonl here" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match="no metrics lines yet"):
        curves.read_run(str(tmp_path / "empty"))


def test_null_and_non_finite_values_are_gaps_not_points(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    rows = [{"step": 1, "loss": 2.0, "grad_norm": None}, {"step": 2, "loss": math.inf, "grad_norm": 1.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = curves.read_run(str(folder))
    assert run.series("loss") == ([1], [2.0]) and run.series("grad_norm") == ([2], [1.0])


def test_values_too_large_to_draw_are_gaps_named_on_stderr(tmp_path, capsys):
    """Issue 31: a step of 1e400 (JSON's inf) raised OverflowError, and values near the largest float made
    matplotlib's tick computation fail; both were tracebacks. Now the rest is drawn and they are named."""
    folder = tmp_path / "r"
    folder.mkdir()
    lines = [
        '{"step": 1, "loss": 2.0, "grad_norm": 1.0}',
        '{"step": 1e400, "loss": 1.0}',
        '{"step": 2, "loss": 1e308, "grad_norm": 1' + "0" * 400 + "}",
        '{"step": 3, "loss": -1e308, "grad_norm": 0.5}',
        '{"step": 4, "loss": 1.5, "grad_norm": NaN}',
    ]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = curves.read_run(str(folder))
    assert run.bad_lines == 1 and [r["step"] for r in run.records] == [1, 2, 3, 4]
    assert run.series("loss") == ([1, 4], [2.0, 1.5]) and run.series("grad_norm") == ([1, 3], [1.0, 0.5])
    out = tmp_path / "c.png"
    assert plot_runs.main([str(folder), "--out", str(out)]) == 0
    assert_png(out)
    err = capsys.readouterr().err
    assert f"{folder / 'metrics.jsonl'}: 1 line(s) without a step skipped" in err
    assert f"{folder / 'metrics.jsonl'}: loss not drawn where it is 1e+308 at step 2, -1e+308 at step 3" in err
    assert "grad_norm not drawn where it is 1.000e+400 at step 2, nan at step 4" in err


def test_a_second_phase_is_drawn_after_the_first(tmp_path):
    """A --continue_from run's lines carry global_step (its steps counted from the first phase's start):
    the curves put it to the right of the first phase, not over it."""
    first = write_run(tmp_path / "p1", "taco", range(1, 11))
    second = tmp_path / "p2"
    second.mkdir()
    rows = [{"step": s, "phase": 2, "global_step": 10 + s, "loss": 5.0 - 0.1 * s} for s in range(1, 6)]
    (second / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps1, _ = curves.read_run(str(first)).series("loss")
    steps2, values2 = curves.read_run(str(second)).series("loss")
    assert steps1 == list(range(1, 11)) and steps2 == list(range(11, 16)) and values2[0] == 4.9
