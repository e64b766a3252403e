"""The schedules that fit cluster life, through the real trainer (one CPU rank, real DeepSpeed): a WSD
run resumed with a later decay start follows the new schedule, and a --max_time run (its clock
injected: every step takes 0.5 s by the budget's account) ends when its budget is spent, with its
decay reaching 0 there, the time spent carried over a pre-emption. The rates logged in metrics.jsonl
are compared with pipeline.training.schedule's formulas (tests/unit/test_schedule.py checks those
against references)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.training.schedule import Shape, lr_at
from tests.support.trainer import REPO, explain, one_rank_env, read_metrics, shard_sets, train_args, write_ds_config

pytestmark = pytest.mark.multiproc

LR = 1e-3


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def train(tmp_path: Path, shards, *, max_steps: int, extra: list[str]) -> subprocess.CompletedProcess:
    ds = write_ds_config(tmp_path / "ds.json", micro=2, bf16=False)
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[shards["packed16"]],
        save_dir=tmp_path / "run",
        max_steps=max_steps,
        extra=["--lr", str(LR), "--save_every", "1000", "--report_to", "none", *extra],
    )
    # --fault_ flags: the trainer under tests/support/faults.py (here: the budget's clock).
    faults = any(a.startswith("--fault_") for a in args)
    script = REPO / "tests" / "support" / "faults.py" if faults else REPO / "pipeline" / "train.py"
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=one_rank_env(), timeout=400
    )
    assert proc.returncode == 0, explain(proc)
    return proc


def lrs(save_dir: Path) -> dict[int, float]:
    rows = read_metrics(save_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), steps  # every step once, in order
    return {r["step"]: r["lr"] for r in rows}


def test_a_wsd_run_resumed_with_a_later_decay_start_follows_the_new_schedule(shards, tmp_path):
    # 16 steps with the decay over the last 6 (from 10 steps), stopped after step 8 ...
    train(tmp_path, shards, max_steps=16, extra=["--schedule", "wsd", "--decay_steps", "6", "--stop_after_step", "8"])
    # ... and resumed for 20: the decay, not begun, now begins at 14 steps (no flag needed).
    second = train(
        tmp_path, shards, max_steps=20, extra=["--schedule", "wsd", "--decay_steps", "6", "--resume", "auto"]
    )
    assert "resume: schedule.max_steps 16 -> 20" in second.stdout
    shape = Shape(peak=LR, decay="wsd", decay_steps=6)
    want = {s: lr_at(s - 1, shape, total=16 if s <= 8 else 20) for s in range(1, 21)}
    assert lrs(tmp_path / "run") == pytest.approx(want, rel=1e-6)
    assert want[15] == LR and want[16] < LR and want[20] == pytest.approx(LR * (1 - (5 / 6) ** 0.5))


def test_max_time_ends_the_run_when_the_budget_is_spent_across_a_preemption(shards, tmp_path):
    timed = ["--schedule", "wsd", "--max_time", "12", "--fault_step_time_s", "0.5"]  # 24 steps fit
    first = train(tmp_path, shards, max_steps=1000, extra=[*timed, "--stop_after_step", "10"])
    assert "the run ends at step 24" in first.stdout
    second = train(
        tmp_path, shards, max_steps=1000, extra=[*timed, "--resume", "auto", "--export_dir", str(tmp_path / "hf")]
    )
    # 5 s were spent before the pre-emption: the resumed run ends at step 24, not 34, saved and exported.
    assert "5.0 s of 12.0 s spent at step 10" in second.stdout and "done: step 24" in second.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000024" / "complete.json").is_file()
    assert (tmp_path / "hf" / "config.json").is_file()
    # The first 2 steps ran before the first fit (to --max_steps 1000: at --lr); then the decay is the
    # last 20% of the 24 steps, reaching 0 at the end.
    shape = Shape(peak=LR, decay="wsd")
    want = {s: lr_at(s - 1, shape, total=1000 if s <= 2 else 24) for s in range(1, 25)}
    assert lrs(tmp_path / "run") == pytest.approx(want, rel=1e-6)
    assert want[20] == LR and want[24] == pytest.approx(LR * (1 - 0.8**0.5)) and lr_at(24, shape, total=24) == 0.0
