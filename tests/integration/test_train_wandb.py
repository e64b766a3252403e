"""--report_to wandb with the real trainer (2 CPU ranks, DeepSpeed, WANDB_MODE=offline): a run that is
stopped and resumed stays one W&B run, and W&B holds every logged step exactly once, with the values
of metrics.jsonl. The offline .wandb files are read back with wandb's own reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'tokencl[wandb]'")

from tests.support import logs  # noqa: E402
from tests.support.trainer import (  # noqa: E402
    REPO,
    deepspeed_cmd,
    explain,
    free_port,
    launch_env,
    read_metrics,
    shard_sets,
    train_args,
    write_ds_config,
)
from tests.support.wandb_files import read_offline_runs  # noqa: E402

pytestmark = pytest.mark.multiproc
TERMS = ("loss", "mlm_loss", "mlm_acc", "tc_loss", "tc_acc", "lr", "grad_norm")


def run(args: list[str], tmp_path: Path):
    import subprocess

    env = launch_env(
        WANDB_MODE="offline",
        WANDB_PROJECT="tokencl-tests",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
    )
    for k in ("WANDB_RUN_ID", "WANDB_DIR", "WANDB_NAME"):
        env.pop(k, None)
    return subprocess.run(
        deepspeed_cmd(free_port(), args), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_a_resumed_run_is_one_wandb_run_with_every_step_once(tmp_path_factory, tmp_path):
    shards = shard_sets(tmp_path_factory)
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    save = tmp_path / "run"

    def args(*extra: str) -> list[str]:
        return train_args(
            ds_config=ds,
            objective="taco",
            data=[shards["packed32"]],
            save_dir=save,
            max_steps=12,
            extra=["--lr", "5e-3", "--save_every", "4", "--report_to", "tensorboard,wandb", *extra],
        )

    first = run(args("--stop_after_step", "6"), tmp_path)
    assert first.returncode == 0, explain(first)
    state = json.loads((save / "wandb.json").read_text())
    assert state["last_step"] == 6 and state["closed"] is True
    # As if the process had died after logging steps 5 and 6 but before saving step 6: the next one
    # resumes from step 4 and trains 5 and 6 again, which W&B already has.
    shutil.rmtree(save / "checkpoints" / "step_00000006")
    (save / "checkpoints" / "latest").write_text("step_00000004")

    second = run(args("--resume", "auto"), tmp_path)
    assert second.returncode == 0, explain(second)
    assert logs.has(second.stdout + second.stderr, f"W&B run {state['id']} (offline)")
    assert "steps up to 6 were sent by an earlier process" in second.stdout + second.stderr

    metrics = {r["step"]: r for r in read_metrics(save)}
    assert sorted(metrics) == list(range(1, 13))
    runs = read_offline_runs(save / "wandb")
    assert len(runs) == 2 and {r.run_id for r in runs} == {state["id"]}
    assert [r.exit_code for r in runs] == [0, 0]
    steps = [row["_step"] for r in runs for row in r.history]
    assert steps == list(range(1, 13))  # every step once, in order, across both files
    for r in runs:
        for row in r.history:
            if row["_step"] in (5, 6):
                continue  # W&B keeps what the first process sent; metrics.jsonl has the re-trained values
            m = metrics[row["_step"]]
            for key in TERMS:
                assert row[f"train/{key}"] == pytest.approx(m[key], rel=1e-6, abs=1e-9), (row["_step"], key)
    config = runs[0].config
    assert config["objective"]["objective"] == "taco" and config["engine"]["world_size"] == 2
    assert config["run"]["report_to"] == ["tensorboard", "wandb"]
