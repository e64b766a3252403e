"""The two kinds of failure, told apart: a user error exits 2 with one line naming the flag and the fix;
a bug (here a ValueError injected into the loss computation of one rank) exits 1 with its traceback
naming the function, and the other rank does not hang past --dist_timeout_s."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.trainer import REPO, deepspeed_cmd, free_port, launch_env, shard_sets, train_args, write_ds_config

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def test_a_bad_value_is_one_line_and_exit_2(tmp_path, shards):
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    args = train_args(
        ds_config=ds,
        objective="taco",
        data=[shards["packed32"]],
        save_dir=tmp_path / "r",
        max_steps=2,
        extra=["--taco_window", "4"],
    )
    r = subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "train.py"), *args],
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=120,
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["train.py: error: --taco_window must be odd and >= 3, got 4"], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


INJECT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from pipeline import distributed
    from pipeline.objectives.base import Objective

    real = Objective.losses

    def compute_losses(self, out, batch, **kw):
        if distributed.rank() == 1 and trainer_step[0] >= 2:
            raise ValueError("injected internal error")
        trainer_step[0] += 1
        return real(self, out, batch, **kw)

    trainer_step = [0]
    Objective.losses = compute_losses
    from pipeline.train import main
    sys.exit(main())
""")


def test_an_internal_error_keeps_its_traceback_and_exits_1(tmp_path, shards):
    script = tmp_path / "inject.py"
    script.write_text(INJECT.format(repo=str(REPO)))
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    timeout_s = 30
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[shards["packed32"]],
        save_dir=tmp_path / "r",
        max_steps=50,
        extra=["--dist_timeout_s", str(timeout_s)],
    )
    cmd = deepspeed_cmd(free_port(), args)
    cmd[cmd.index(str(REPO / "pipeline" / "train.py"))] = str(script)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), cwd=REPO, timeout=300)
    elapsed = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "Traceback (most recent call last)" in out and "in compute_losses" in out
    assert "ValueError: injected internal error" in out
    assert "train.py: error:" not in out  # not reported as a user error
    assert elapsed < 240, f"the job took {elapsed:.0f} s to fail"
