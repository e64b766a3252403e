"""pipeline.training.wandb_sink through MetricsWriter, in-process, WANDB_MODE=offline: one W&B run per
run folder across processes, every step sent once, the steps W&B lacks sent on the next start. The
offline files are read back with wandb's own reader. (tests/integration/test_train_wandb.py runs the
real trainer.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'tokencl[wandb]'")

from pipeline.data.shards import run_key  # noqa: E402
from pipeline.training import config as train_config  # noqa: E402
from pipeline.training import wandb_sink  # noqa: E402
from pipeline.training.metrics import MetricsWriter  # noqa: E402
from preprocessing.errors import UsageError  # noqa: E402
from tests.support.wandb_files import read_offline_runs  # noqa: E402

pytestmark = pytest.mark.multiproc  # every test here starts a process (the slow tier)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for k in ("WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest owns stdout/stderr
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def record(step: int) -> dict:
    return {"step": step, "loss": 10.0 / step, "mlm_acc": 0.01 * step, "mfu": None, "mem_kind": "cpu_max_rss"}


CONFIG = {"objective": {"objective": "taco"}, "schedule": {"lr": 1e-4}, "engine": {"world_size": 2}}


def process(
    save: Path,
    steps: range,
    *,
    resume_step: int,
    new_run: bool = False,
    failed: bool = False,
    config: dict = CONFIG,
) -> None:
    """What one trainer process does with its writer: open at its resume step, log, close."""
    w = MetricsWriter(
        save,
        enabled=True,
        resume_step=resume_step,
        trace=False,
        report_to=("wandb",),
        run_config=config,
        new_run=new_run,
    )
    for s in steps:
        w.log(record(s))
    w.close(failed=failed)


def history_steps(save: Path) -> list[list[int]]:
    return [[row["_step"] for row in r.history] for r in read_offline_runs(save / "wandb")]


def test_a_resumed_process_continues_the_run_and_sends_each_step_once(tmp_path):
    save = tmp_path / "run"
    process(save, range(1, 7), resume_step=0, new_run=True)  # logged 1..6, its checkpoint was at 4
    state = json.loads((save / "wandb.json").read_text())
    assert state["last_step"] == 6 and state["closed"] is True
    process(save, range(5, 11), resume_step=4)  # re-trains 5, 6
    runs = read_offline_runs(save / "wandb")
    assert len(runs) == 2 and {r.run_id for r in runs} == {state["id"]}
    assert state["id"].startswith(run_key(str(save)))  # the folder's key, then a draw
    assert [[row["_step"] for row in r.history] for r in runs] == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    # The record of metrics.jsonl, keys prefixed as in TensorBoard; nulls left out.
    row = runs[1].history[0]
    assert row["train/loss"] == pytest.approx(10 / 7) and row["train/mem_kind"] == "cpu_max_rss"
    assert "train/mfu" not in row and "train/step" not in row
    assert runs[0].config["objective"] == {"objective": "taco"}
    assert [r.exit_code for r in runs] == [0, 0]
    lines = [json.loads(x)["step"] for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, 11))


def test_steps_in_metrics_jsonl_that_wandb_lacks_are_sent_first(tmp_path):
    save = tmp_path / "run"
    # Four steps trained with TensorBoard only, then W&B switched on at the resume from step 4.
    w = MetricsWriter(save, enabled=True, resume_step=0, trace=False, report_to=())
    for s in range(1, 5):
        w.log(record(s))
    w.close()
    assert not (save / "wandb").exists()
    process(save, range(5, 7), resume_step=4)
    assert history_steps(save) == [[1, 2, 3, 4, 5, 6]]


def test_resume_none_starts_a_new_wandb_run_and_wandb_run_id_wins(tmp_path, monkeypatch):
    save = tmp_path / "run"
    process(save, range(1, 3), resume_step=0, new_run=True)
    first = json.loads((save / "wandb.json").read_text())["id"]
    process(save, range(1, 3), resume_step=0, new_run=True)  # the folder started over
    second = json.loads((save / "wandb.json").read_text())["id"]
    assert second != first
    monkeypatch.setenv("WANDB_RUN_ID", "chosen-by-user")
    process(save, range(3, 4), resume_step=2)
    runs = read_offline_runs(save / "wandb")
    # Keyed by id: processes that start within the same second have no order on disk.
    assert {r.run_id: [row["_step"] for row in r.history] for r in runs} == {
        first: [1, 2],
        second: [1, 2],
        "chosen-by-user": [1, 2, 3],
    }
    assert len(runs) == 3


def test_a_rerun_with_other_settings_before_the_first_checkpoint_gets_its_own_wandb_run(tmp_path):
    """Issue 31, defect 8: a first training logged steps 1-8 and died before its first checkpoint; a
    rerun with another --lr (--resume auto, nothing to resume) is another training: it must not fill
    steps 9-20 of the first one's W&B run. The same settings again (a requeue) continue it."""
    save = tmp_path / "run"
    process(save, range(1, 9), resume_step=0)
    first = json.loads((save / "wandb.json").read_text())["id"]
    other = {**CONFIG, "schedule": {"lr": 1e-3}}
    process(save, range(1, 21), resume_step=0, config=other)
    second = json.loads((save / "wandb.json").read_text())["id"]
    assert second != first
    process(save, range(1, 23), resume_step=0, config=other)  # requeued with the same settings
    assert json.loads((save / "wandb.json").read_text())["id"] == second
    runs = read_offline_runs(save / "wandb")
    steps: dict[str, list[int]] = {}
    for r in runs:
        steps.setdefault(r.run_id, []).extend(row["_step"] for row in r.history)
    assert steps == {first: list(range(1, 9)), second: list(range(1, 23))}
    assert {r.run_id: r.config["schedule"]["lr"] for r in runs} == {first: 1e-4, second: 1e-3}


def test_a_failed_process_marks_the_run_and_the_next_one_continues(tmp_path):
    save = tmp_path / "run"
    process(save, range(1, 3), resume_step=0, failed=True)
    process(save, range(3, 5), resume_step=2)
    runs = read_offline_runs(save / "wandb")
    assert [r.exit_code for r in runs] == [1, 0] and len({r.run_id for r in runs}) == 1


def test_report_to_is_checked_before_anything_runs(monkeypatch):
    base = ["--ds_config", "x.json", "--objective", "taco", "--data", "d", "--model_config", "tiny"]
    base += ["--max_steps", "10", "--save_dir", "r"]
    assert train_config.parse_args(base).run.report_to == ("tensorboard",)
    assert train_config.parse_args([*base, "--report_to", "wandb,tensorboard"]).run.report_to == (
        "wandb",
        "tensorboard",
    )
    assert train_config.parse_args([*base, "--report_to", "none"]).run.report_to == ()
    with pytest.raises(SystemExit) as e:
        train_config.parse_args([*base, "--report_to", "tensorbord"])
    assert e.value.code == 2
    # Without the package, pre-flight names the extra.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UsageError, match=r"wandb package is not installed; pip install 'tokencl\[wandb\]'"):
        wandb_sink.check_available(("tensorboard", "wandb"))
    wandb_sink.check_available(("tensorboard",))
