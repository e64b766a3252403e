"""The trainer's paths made as safe as the others (issue 31), with real processes: one training per run
folder (a second one exits 2 naming the first), nothing in a checkpoint that unpickles untrusted files,
a diverging run that logs its skipped steps as null and can be resumed from the last checkpoint before
the divergence with the command its abort names, a plain `python pipeline/train.py` that trains as
one process, and a pre-emption signal during pre-flight that exits 0 for Slurm to requeue."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.training import checkpoint
from tests.support import logs
from tests.support.trainer import (
    REPO,
    explain,
    free_port,
    launch_env,
    read_metrics,
    run_deepspeed,
    shard_sets,
    tacl_straight,
    train_args,
    write_ds_config,
)

pytestmark = pytest.mark.multiproc
TRAIN = str(REPO / "pipeline" / "train.py")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return write_ds_config(tmp_path_factory.getbasetemp() / "ds_reliability.json", micro=4)


def plain(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python pipeline/train.py ARGS` without a launcher (no RANK in the environment); with --fault_*
    flags, under tests/support/faults.py."""
    script = REPO / "tests" / "support" / "faults.py" if any(a.startswith("--fault_") for a in args) else TRAIN
    return subprocess.run(
        [sys.executable, script, *args], cwd=REPO, env=launch_env(**env), capture_output=True, text=True, timeout=400
    )


def test_a_second_training_into_the_same_save_dir_exits_2_naming_the_first(shards, ds, tmp_path):
    save = tmp_path / "run"
    args = train_args(ds_config=ds, objective="mlm", data=[shards["packed32"]], save_dir=save, max_steps=4)
    # The first training holds the run folder as pipeline/train.py does, from before pre-flight.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pipeline.training import config, preflight\n"
            "with preflight.run_folder(config.parse_args(sys.argv[1:])):\n"
            "    print('held', flush=True); sys.stdin.read()",
            *args,
        ],
        cwd=REPO,
        env=launch_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while (line := holder.stdout.readline()) != "held\n":
            assert line, "the holder exited"
        t0 = time.time()
        second = run_deepspeed(free_port(), args)
        assert second.returncode == 2, explain(second)
        assert (
            f"train.py: error: --save_dir {save}: another training is writing into it: pid {holder.pid} on host "
            f"{socket.gethostname()} (started " in second.stderr
        ), explain(second)
        assert time.time() - t0 < 200  # its other rank did not wait out --dist_timeout_s
        assert sorted(p.name for p in save.iterdir()) == [".train.lock"]  # it wrote nothing
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not save.exists()  # released at exit, and the folder it made for nothing removed


def test_checkpoints_hold_no_script_that_unpickles_and_their_export_script_works(tmp_path_factory, tmp_path):
    """DeepSpeed copies zero_to_fp32.py (torch.load(weights_only=False)) into RUN/checkpoints at every
    save; export_hf.py, which goes through pipeline/export.py (weights-only), takes its place."""
    run, _ = tacl_straight(tmp_path_factory)
    root = run / "checkpoints"
    assert not list(root.glob("zero_to_*.py")) and not list(root.glob("*/zero_to_*.py"))
    done = subprocess.run(
        [sys.executable, str(root / checkpoint.EXPORT_SCRIPT), str(tmp_path / "hf")],
        env=launch_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported {root / 'step_00000016'} to {tmp_path / 'hf'}" in done.stdout
    from transformers import AutoModelForMaskedLM

    assert AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").config.hidden_size == 64


def test_a_diverging_run_logs_null_keeps_a_fallback_and_its_advice_resumes(shards, ds, tmp_path):
    """No launcher (one process): steps 5-7 are non-finite (every micro-batch: the whole step skipped),
    --max_nonfinite 3 stops at step 7. The checkpoint of step 6 (after the first non-finite step) is
    `latest`; step 4's is last_finite and survives --keep_checkpoints 1. The command the abort names
    resumes from step 4 at a tenth of the rate, and the schedule changes from step 5 on."""
    save = tmp_path / "run"
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[shards["packed32"]],
        save_dir=save,
        max_steps=8,
        extra=["--lr", "1e-3", "--save_every", "2", "--keep_checkpoints", "1", "--max_nonfinite", "3"],
    )
    first = plain([*args, "--fault_nan_steps", "5,6,7", "--fault_nan_rank", "0", "--fault_nan_attempts", "9"])
    assert first.returncode == 1, explain(first)
    assert logs.has(first.stdout, "no launcher (RANK is unset): training as one process")
    out = first.stdout + first.stderr
    m = re.search(r"loss was NaN/inf for 3 micro-batches in a row, the last at step 7: stopping .*", out)
    assert m, explain(first)
    ck4 = save / "checkpoints" / "step_00000004"
    assert f"The last checkpoint saved before it went non-finite is {ck4} (step 4" in m.group(0)
    advice = m.group(0).split("rerun the same command with ")[1].split()
    assert advice == ["--resume", "last_finite", "--lr", "0.0001", "--allow_schedule_change"]
    metrics = read_metrics(save)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
    for r in metrics[4:]:  # skipped whole: null, not a perfect 0
        assert [r[k] for k in ("loss", "mlm_loss", "mlm_acc", "grad_norm")] == [None] * 4, r
    assert [r["skipped_micro_batches"] for r in metrics] == [0, 0, 0, 0, 1, 2]
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in metrics[:4])
    assert [s for s, _ in checkpoint.list_checkpoints(save)] == [4, 6]
    assert checkpoint.latest_checkpoint(save)[0] == 6 and checkpoint.last_finite_checkpoint(save) == (4, ck4)
    assert not (save / ".train.lock").exists()  # released on the error too

    second = plain([*args, *advice])
    assert second.returncode == 0, explain(second)
    assert logs.has(second.stdout, f"resumed from {ck4} at step 4")
    assert logs.has(second.stdout, "resume: schedule.lr 0.001 -> 0.0001")
    metrics = read_metrics(save)
    assert [r["step"] for r in metrics] == list(range(1, 9))
    assert all(r["loss"] is not None for r in metrics)
    # The no-warm-up linear decay over 8 steps: step s trains at lr * (8 - (s - 1)) / 8.
    assert metrics[3]["lr"] == pytest.approx(1e-3 * 5 / 8) and metrics[4]["lr"] == pytest.approx(1e-4 * 4 / 8)
    assert [s for s, _ in checkpoint.list_checkpoints(save)] == [8] == [checkpoint.last_finite_checkpoint(save)[0]]


def test_a_preemption_signal_during_preflight_exits_0(shards, ds, tmp_path):
    """Pre-flight fetches remote shards' index from an S3 endpoint that accepts and never answers; the
    signal arrives there, as Slurm's --signal can before training starts."""
    save = tmp_path / "run"
    args = train_args(ds_config=ds, objective="mlm", data=[], save_dir=save, max_steps=4)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(120)
        env = launch_env(
            S3_ENDPOINT_URL=f"http://127.0.0.1:{server.getsockname()[1]}",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        proc = subprocess.Popen(
            [sys.executable, TRAIN, *args, "--data", "s3://bucket/shards"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            connection, _ = server.accept()  # pre-flight is fetching index.json now
            with connection:
                assert (save / ".train.lock").exists()
                proc.send_signal(signal.SIGUSR1)
                stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert logs.has(stdout, "pre-emption signal SIGUSR1 before training started: nothing to save, exiting 0")
    assert not save.exists()  # the lock released, and the folder pre-flight made for it removed
