"""Loading a checkpoint never runs code (issue 15, defect 4), and an unreadable one is named.

A crafted `mp_rank_00_model_states.pt` (a pickle whose reduction calls os.system) is put into a copy of
a real checkpoint and loaded through the three paths that read checkpoints: `export.py --checkpoint`,
`train.py --resume auto` and `analyze.py --run`. Each refuses with exit 2 naming the file and the
callable, and the command it carries never runs. DeepSpeed's own loader, which passes
weights_only=False, refuses it too inside `weights_only_loads()`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.training import checkpoint
from tests.support.trainer import (
    REPO,
    explain,
    free_port,
    launch_env,
    run_deepspeed,
    shard_sets,
    tacl_args,
    tacl_ds,
    tacl_straight,
)

pytestmark = pytest.mark.multiproc


class _Payload:
    """What an attacker pickles: unpickling it calls os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    return tacl_straight(tmp_path_factory)[0]


def _crafted_run(straight: Path, root: Path) -> tuple[Path, Path]:
    """A copy of the run's checkpoints whose newest model states carry the payload; (save dir, the
    file the payload would create)."""
    save = root / "run"
    shutil.copytree(straight / "checkpoints", save / "checkpoints")
    shutil.copy(straight / "config.json", save / "config.json")
    shutil.copy(straight / "metrics.jsonl", save / "metrics.jsonl")
    pwned = root / "PWNED"
    states = save / "checkpoints" / "step_00000016" / "mp_rank_00_model_states.pt"
    real = torch.load(states, map_location="cpu", weights_only=False)
    torch.save({**real, "module": _Payload(f"touch {pwned}")}, states)
    return save, pwned


def test_every_file_of_a_real_checkpoint_loads_weights_only(straight):
    for _, path in checkpoint.list_checkpoints(straight):
        checkpoint.verify_loadable(path)
        for f in path.glob("*.pt"):  # and plainly, as a user would, with the allow-list
            with torch.serialization.safe_globals(checkpoint._allowed_types()):
                assert torch.load(f, map_location="cpu", weights_only=True)


def test_a_crafted_checkpoint_is_refused_by_export_resume_and_analyze(straight, tmp_path_factory, tmp_path):
    save, pwned = _crafted_run(straight, tmp_path)
    crafted = save / "checkpoints" / "step_00000016"
    says = f"checkpoint file {crafted / 'mp_rank_00_model_states.pt'} holds posix.system"

    export = subprocess.run(
        [
            sys.executable,
            str(REPO / "pipeline" / "export.py"),
            "--checkpoint",
            str(crafted),
            "--out",
            str(tmp_path / "x"),
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 2 and says in export.stderr, export.stderr[-3000:]
    assert not pwned.exists()

    shards = shard_sets(tmp_path_factory)
    resume = run_deepspeed(
        free_port(), tacl_args(shards, tacl_ds(tmp_path_factory), save, max_steps=16, extra=["--resume", "auto"])
    )
    assert resume.returncode == 2, explain(resume)
    assert says in resume.stdout + resume.stderr, explain(resume)
    assert not pwned.exists()

    analyze = subprocess.run(
        [
            sys.executable,
            str(REPO / "pipeline" / "analyze.py"),
            "--model",
            str(straight.parent / "export"),
            "--run",
            str(save),
            "--data",
            str(shards["nsp48"]),
            "--out",
            str(tmp_path / "report"),
            "--device",
            "cpu",
            "--max_sequences",
            "8",
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert analyze.returncode == 2 and says in analyze.stderr, analyze.stderr[-3000:]
    assert not pwned.exists()


def test_deepspeeds_own_loader_is_weights_only_inside_the_guard(straight, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save, pwned = _crafted_run(straight, tmp_path)
    with (
        pytest.raises(pickle.UnpicklingError, match="posix.system"),
        checkpoint.weights_only_loads(),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        get_fp32_state_dict_from_zero_checkpoint(str(save / "checkpoints"), tag="step_00000016")
    assert not pwned.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored on the way out


def test_an_unreadable_latest_falls_back_to_the_previous_checkpoint(straight, tmp_path, caplog):
    save = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", save / "checkpoints")
    states = save / "checkpoints" / "step_00000016" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:4096])  # truncated, yet the marker was written
    assert checkpoint.latest_checkpoint(save)[0] == 16
    step, path = checkpoint.loadable_checkpoint(save)
    assert step == 8 and path.name == "step_00000008"
    with pytest.raises(checkpoint.CheckpointUnreadable, match=rf"checkpoint file {states} is unreadable"):
        checkpoint.verify_loadable(states.parent)
    older = save / "checkpoints" / "step_00000008" / "mp_rank_00_model_states.pt"
    older.write_bytes(b"not a torch file")
    with pytest.raises(checkpoint.CheckpointUnreadable, match="no older complete checkpoint reads either"):
        checkpoint.loadable_checkpoint(save)
