"""Checkpoints with real DeepSpeed (2 CPU ranks, gloo): exact resume, SIGTERM pre-emption, a
save that died half-way, the frozen teacher, and two "nodes" on one machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from pipeline.training.checkpoint import latest_checkpoint, list_checkpoints
from tests.support import logs
from tests.support.trainer import (
    REPO,
    deepspeed_cmd,
    explain,
    free_port,
    launch_env,
    read_metrics,
    read_trace,
    run_deepspeed,
    shard_sets,
    tacl_args,
    tacl_ds,
    tacl_straight,
    train_args,
    write_ds_config,
)

pytestmark = pytest.mark.multiproc
N = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return write_ds_config(tmp_path_factory.getbasetemp() / "ds_micro4.json", micro=4)


def test_resume_continues_exactly(tmp_path_factory, shards, tmp_path):
    straight, _ = tacl_straight(tmp_path_factory)
    ds = tacl_ds(tmp_path_factory)  # micro-batch 2 x accumulation 2
    save = tmp_path / "chunked"
    first = run_deepspeed(free_port(), tacl_args(shards, ds, save, extra=["--stop_after_step", str(N)]))
    assert first.returncode == 0, explain(first)
    assert logs.has(first.stdout, f"stopped after step {N} (--stop_after_step)")
    assert [s for s, _ in list_checkpoints(save)] == [N]
    second = run_deepspeed(free_port(), tacl_args(shards, ds, save, extra=["--resume", "auto"]))
    assert second.returncode == 0, explain(second)
    assert logs.has(second.stdout, f"resumed from {save / 'checkpoints' / f'step_{N:08d}'} at step {N}")
    assert logs.has(second.stdout, "done: step 16")

    a, b = read_metrics(straight), read_metrics(save)
    assert [r["step"] for r in b] == list(range(1, 17))  # every step once, none repeated
    ta, tb = read_trace(straight), read_trace(save)
    for step in range(N + 1, 2 * N + 1):
        assert tb[step] == ta[step], f"step {step}: other samples after resuming"
        for key in ("loss", "mlm_loss", "nsp_loss", "tacl_loss", "grad_norm", "lr"):
            assert b[step - 1][key] == a[step - 1][key], f"step {step} {key}: {b[step - 1][key]} != {a[step - 1][key]}"
    # The NaN injected at step 5 was skipped on both ranks, counted, and the count survived the resume.
    assert a[-1]["skipped_micro_batches"] == b[-1]["skipped_micro_batches"] == 1
    # Two ranks read different samples.
    assert not set(ta[N + 1][0]) & set(ta[N + 1][1])


def test_sigterm_saves_and_exits_0_then_resumes(shards, ds, tmp_path):
    save = tmp_path / "pre"
    args = train_args(
        ds_config=ds,
        objective="taco",
        data=[shards["packed32"]],
        save_dir=save,
        max_steps=400,
        extra=["--save_every", "1000"],
    )
    out, err = open(tmp_path / "out.log", "w"), open(tmp_path / "err.log", "w")
    launcher = subprocess.Popen(deepspeed_cmd(free_port(), args), cwd=REPO, env=launch_env(), stdout=out, stderr=err)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            metrics = save / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            assert launcher.poll() is None, (tmp_path / "err.log").read_text()[-3000:]
            time.sleep(0.2)
        # As Slurm does: the signal reaches every process of the job (ranks and their loader
        # workers), not the launcher.
        ranks = [
            p
            for p in psutil.Process(launcher.pid).children(recursive=True)
            if "pipeline/train.py" in " ".join(p.cmdline()) and "deepspeed.launcher" not in " ".join(p.cmdline())
        ]
        assert len(ranks) >= 2
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 0, (tmp_path / "err.log").read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stdout = (tmp_path / "out.log").read_text()
    m = logs.pattern(r"pre-emption signal SIGTERM: saved checkpoint at step (\d+)").search(stdout)
    assert m, stdout[-3000:]
    k = int(m.group(1))
    assert 3 <= k < 400 and latest_checkpoint(save) == (k, save / "checkpoints" / f"step_{k:08d}")
    assert not logs.has(stdout, "done:")
    assert read_metrics(save)[-1]["step"] == k
    assert not (save / ".train.lock").exists()  # the run folder's lock is released on a pre-emption exit too
    resumed = run_deepspeed(
        free_port(),
        train_args(
            ds_config=ds,
            objective="taco",
            data=[shards["packed32"]],
            save_dir=save,
            max_steps=400,
            extra=["--resume", "auto", "--stop_after_step", str(k + 2)],
        ),
    )
    assert resumed.returncode == 0, explain(resumed)
    assert logs.has(resumed.stdout, f"resumed from {save / 'checkpoints' / f'step_{k:08d}'} at step {k}")
    assert [r["step"] for r in read_metrics(save)][-3:] == [k, k + 1, k + 2]


def test_a_checkpoint_that_died_half_written_is_never_used(tmp_path_factory, shards, tmp_path):
    straight, _ = tacl_straight(tmp_path_factory)
    ds = tacl_ds(tmp_path_factory)
    save = tmp_path / "died"
    shutil.copytree(straight / "checkpoints", save / "checkpoints")
    shutil.copy(straight / "metrics.jsonl", save / "metrics.jsonl")
    # A save of step 24 that died: DeepSpeed's files partly there, no completion marker, `latest`
    # (written only after completion) still naming step 16.
    half = save / "checkpoints" / "step_00000024"
    shutil.copytree(save / "checkpoints" / "step_00000016", half)
    (half / "complete.json").unlink()
    for f in half.glob("*optim_states.pt"):
        f.write_bytes(f.read_bytes()[:100])
    assert latest_checkpoint(save)[0] == 16
    (save / "checkpoints" / "latest").write_text("step_00000024\n")  # even a `latest` pointing at it
    assert latest_checkpoint(save)[0] == 16
    assert [s for s, _ in list_checkpoints(save)] == [8, 16]
    proc = run_deepspeed(
        free_port(), tacl_args(shards, ds, save, max_steps=18, extra=["--resume", "auto", "--extend_schedule"])
    )
    assert proc.returncode == 0, explain(proc)
    assert "at step 16" in proc.stdout and logs.has(proc.stdout, "done: step 18")


def test_the_teacher_gets_no_gradient_and_never_changes(tmp_path_factory):
    from transformers import AutoTokenizer, BertForPreTraining

    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.student import Student
    from pipeline.modeling.teacher import build_teacher, fingerprint

    straight, _ = tacl_straight(tmp_path_factory)
    states = torch.load(straight / "checkpoints" / "step_00000016" / "mp_rank_00_model_states.pt", weights_only=False)
    # The teacher of the last checkpoint is exactly the initial student's encoder (rebuilt here).
    tok = AutoTokenizer.from_pretrained(straight / "checkpoints" / "step_00000016" / "hf")
    torch.manual_seed(0)
    initial = Student(BertForPreTraining(bert_config("tiny", vocab_size=len(tok))))
    assert states["teacher_fingerprint"] == fingerprint(
        build_teacher(initial, dtype=torch.bfloat16, device=torch.device("cpu"))
    )
    # Not in the engine: the module states and the optimizer's partitions hold the student alone.
    assert all(k.startswith("net.") for k in states["module"])
    student_numel = sum(p.numel() for p in initial.parameters())
    numel = 0
    for f in (straight / "checkpoints" / "step_00000016").glob("*optim_states.pt"):
        opt = torch.load(f, weights_only=False)["optimizer_state_dict"]
        numel += sum(t.numel() for t in opt["single_partition_of_fp32_groups"])
    assert student_numel <= numel < student_numel + 2 * 2 * 64  # padding to the ranks' alignment


def test_two_nodes_on_one_machine(shards, ds, tmp_path):
    """Two launchers (node ranks 0 and 1, one process each) on 127.0.0.1, as two hosts would run."""
    save, port = tmp_path / "twonode", free_port()
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[shards["packed32"]],
        save_dir=save,
        max_steps=6,
        extra=["--trace_samples", "--save_every", "3"],
    )
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(REPO / "pipeline" / "train.py"),
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=launch_env(),
                stdout=open(tmp_path / f"n{node}.out", "w"),
                stderr=open(tmp_path / f"n{node}.err", "w"),
            )
        )
    for node, p in enumerate(procs):
        assert p.wait(timeout=400) == 0, (tmp_path / f"n{node}.err").read_text()[-3000:]
    outs = [(tmp_path / f"n{n}.out").read_text() for n in range(2)]
    assert logs.has(outs[0], "rank 0 of world_size 2 (local_rank 0")
    assert logs.has(outs[1], "rank 1 of world_size 2 (local_rank 0")
    assert logs.has(outs[0], "done: step 6")
    assert [s for s, _ in list_checkpoints(save)] == [3, 6]
    assert len(list((save / "checkpoints" / "step_00000006").glob("*optim_states.pt"))) == 2
    trace = read_trace(save)
    assert all(not set(ids[0]) & set(ids[1]) for ids in trace.values())
    config = json.loads((save / "config.json").read_text())
    assert config["engine"]["world_size"] == 2 and config["engine"]["global_batch"] == 8


def test_a_hung_rank_fails_the_others_within_dist_timeout(shards, ds, tmp_path):
    """A rank that stops answering (SIGSTOP: no crash, no closed socket) must not hang the job:
    the others' next collective fails after --dist_timeout_s."""
    save, timeout_s = tmp_path / "hang", 10
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[shards["packed32"]],
        save_dir=save,
        max_steps=100000,
        extra=["--save_every", "100000", "--dist_timeout_s", str(timeout_s)],
    )
    out, err = open(tmp_path / "out.log", "w"), open(tmp_path / "err.log", "w")
    # faulthandler: if rank 0 does hang, SIGABRT makes it print where.
    port = free_port()
    launcher = subprocess.Popen(
        deepspeed_cmd(port, args), cwd=REPO, env=launch_env(PYTHONFAULTHANDLER="1"), stdout=out, stderr=err
    )
    stopped = None
    try:
        deadline = time.time() + 300
        while not ((save / "metrics.jsonl").exists() and len((save / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert time.time() < deadline and launcher.poll() is None, (tmp_path / "err.log").read_text()[-3000:]
            time.sleep(0.2)
        launch = next(
            c for c in psutil.Process(launcher.pid).children() if "deepspeed.launcher.launch" in " ".join(c.cmdline())
        )
        ranks = {int(re.search(r"--local_rank=(\d)", " ".join(p.cmdline())).group(1)): p for p in launch.children()}
        stopped = ranks[1]
        stopped.suspend()
        t0 = time.time()
        try:
            ranks[0].wait(timeout=timeout_s + 60)
        except psutil.TimeoutExpired:
            ranks[0].send_signal(signal.SIGABRT)
            time.sleep(3)
            pytest.fail(
                f"rank 0 still running {time.time() - t0:.0f} s after rank 1 hung:\n"
                + (tmp_path / "err.log").read_text()[-3000:]
            )
    finally:
        if stopped is not None:
            stopped.kill()
        launcher.wait(timeout=120)
        # The killed rank could not remove its DeepSpeed shared-memory buffer (see release_deepspeed_shm).
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_1").unlink(missing_ok=True)
    assert launcher.returncode != 0
    log = (tmp_path / "err.log").read_text()
    assert re.search(r"[Tt]imed? ?out", log), log[-3000:]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_resume_is_exact_for_50_steps_after_the_resume(shards, tmp_path, bf16):
    """Bit for bit, 50 steps on: the optimizer (torch AdamW, whose bias correction is a function of its
    saved step) restores exactly, so nothing drifts after a resume, in bf16 or in fp32."""
    ds = write_ds_config(tmp_path / "ds.json", micro=4, bf16=bf16)
    stop, total = 6, 56

    def args(save: Path, extra: list[str]) -> list[str]:
        return train_args(
            ds_config=ds,
            objective="taco",
            data=[shards["packed32"]],
            save_dir=save,
            max_steps=total,
            extra=["--lr", "2e-3", "--save_every", str(total), "--trace_samples", *extra],
        )

    straight = run_deepspeed(free_port(), args(tmp_path / "straight", []))
    assert straight.returncode == 0, explain(straight)
    first = run_deepspeed(free_port(), args(tmp_path / "chunked", ["--stop_after_step", str(stop)]))
    assert first.returncode == 0, explain(first)
    second = run_deepspeed(free_port(), args(tmp_path / "chunked", ["--resume", "auto"]))
    assert second.returncode == 0, explain(second)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "chunked")
    assert [r["step"] for r in b] == list(range(1, total + 1))
    ta, tb = read_trace(tmp_path / "straight"), read_trace(tmp_path / "chunked")
    for step in range(stop + 1, total + 1):
        assert tb[step] == ta[step], f"step {step}: other samples after resuming"
        for key in ("loss", "mlm_loss", "tc_loss", "mlm_acc", "tc_acc", "grad_norm", "lr"):
            assert b[step - 1][key] == a[step - 1][key], f"step {step} {key}: {b[step - 1][key]} != {a[step - 1][key]}"
    # The weights at the end are the same bits.
    for f in ("mp_rank_00_model_states.pt",):
        sa = torch.load(tmp_path / "straight" / "checkpoints" / f"step_{total:08d}" / f, weights_only=False)
        sb = torch.load(tmp_path / "chunked" / "checkpoints" / f"step_{total:08d}" / f, weights_only=False)
        assert all(torch.equal(sa["module"][k], sb["module"][k]) for k in sa["module"])
