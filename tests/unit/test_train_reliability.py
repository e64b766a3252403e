"""The trainer's paths made as safe as the others (issue 31), in-process: a skipped step logs null,
never a perfect 0; a full disk under metrics.jsonl is one line naming the file; --num_workers is
capped at the cores per rank; the run folder's lock (the builder's) refuses a planted symbolic link
and takes over from an earlier run of the same Slurm job; an environment that forbids weights-only
loads is named wherever a checkpoint is loaded."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from pipeline.training import checkpoint
from pipeline.training.metrics import Meter, MetricsWriter
from preprocessing.errors import UsageError
from preprocessing.lock import OutputLock

KEYS = ["loss", "mlm_loss", "mlm_acc"]


def micro_batch(meter: Meter, value: float, *, ok: bool) -> None:
    values = {k: torch.tensor(value) for k in KEYS}
    meter.add(values, ok=torch.tensor(ok), tokens=10, samples=2, flops=1.0)


def record_of(meter: Meter, *, grad_norm: float) -> dict:
    vals, _, _ = meter.reduce()
    return {"step": 1, **{k: vals[k] for k in KEYS}, "grad_norm": meter.grad_norm(grad_norm)}


def test_a_skipped_step_is_logged_as_null_not_as_a_perfect_step(tmp_path):
    meter = Meter(KEYS, torch.device("cpu"))
    # A step whose every micro-batch was non-finite: the guard zeroed its loss and gradients.
    micro_batch(meter, float("nan"), ok=False)
    micro_batch(meter, float("nan"), ok=False)
    meter.steps += 1
    skipped = record_of(meter, grad_norm=0.0)  # the engine's norm of the zeroed gradient
    # Then a step with one finite micro-batch of two: its values are that one's.
    micro_batch(meter, float("nan"), ok=False)
    micro_batch(meter, 2.0, ok=True)
    meter.steps += 1
    half = record_of(meter, grad_norm=0.5)
    writer = MetricsWriter(tmp_path, enabled=True, resume_step=0, trace=False, report_to=())
    writer.log(skipped)
    writer.log({**half, "step": 2})
    writer.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "loss": None, "mlm_loss": None, "mlm_acc": None, "grad_norm": None}
    assert lines[1] == {"step": 2, "loss": 2.0, "mlm_loss": 2.0, "mlm_acc": 2.0, "grad_norm": 0.5}


def test_a_full_disk_under_metrics_jsonl_is_one_line_naming_the_file(tmp_path):
    ck = tmp_path / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "complete.json").write_text("{}")
    writer = MetricsWriter(tmp_path, enabled=True, resume_step=0, trace=False, report_to=())
    writer.log({"step": 1, "loss": 1.0})
    full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC, as a full file system answers
    os.dup2(full, writer._f.fileno())
    os.close(full)
    with pytest.raises(
        UsageError,
        match=rf"^no space left on the device \(ENOSPC\) while writing {tmp_path / 'metrics.jsonl'}; the last "
        rf"checkpoint, {ck}, is intact: free space and resume with --resume auto$",
    ):
        writer.log({"step": 2, "loss": 1.0})
    writer.close(failed=True)  # the refused line is not flushed again into a second error


def test_num_workers_is_capped_at_the_cores_per_rank():
    from pipeline.data.loader import cores_per_rank, loader_workers

    said: list[str] = []
    cores = cores_per_rank()
    assert loader_workers(1000, say=said.append) == cores
    assert said == [f"--num_workers 1000: capped at {cores}, the cores per rank (more workers would wait for them)"]
    assert loader_workers(cores, say=said.append) == cores and loader_workers(0, say=said.append) == 0
    assert loader_workers(None, say=said.append) == max(1, min(8, cores - 1)) and len(said) == 1


def test_the_lock_refuses_a_planted_symbolic_link(tmp_path):
    """The builder's lock and the run folder's (the same class): a link at the lock's name must not
    redirect the holder's record into the file it points to."""
    target = tmp_path / "precious.log"  # empty: read as no holder, it would be overwritten with a record
    target.write_text("")
    run = tmp_path / "run"
    run.mkdir()
    for name, flag, kwargs in (
        (".build.lock", "--output", {}),
        (".train.lock", "--save_dir", {"flag": "--save_dir", "what": "training", "name": ".train.lock"}),
    ):
        (run / name).symlink_to(target)
        with pytest.raises(UsageError, match=rf"^{flag} .*run: .*{name} is a symbolic link \(to .*precious"):
            OutputLock(run, **kwargs).acquire()
        assert target.read_text() == ""


def test_the_lock_is_taken_over_from_an_earlier_run_of_the_same_slurm_job(tmp_path, monkeypatch, capsys):
    """A requeued Slurm job runs on other nodes: the lock its killed predecessor left names another
    host, which cannot be checked from here, but the same job id can (Slurm runs a job once at a time)."""
    record = tmp_path / ".build.lock"
    earlier = {"pid": 4242, "host": "node-elsewhere", "started": "today", "slurm_job": "777"}
    record.write_text(json.dumps(earlier))
    monkeypatch.setenv("SLURM_JOB_ID", "778")  # another job
    with pytest.raises(UsageError, match=r"left by pid 4242 on host node-elsewhere .*if no build is running there"):
        OutputLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "777")  # the same job, requeued
    lock = OutputLock(tmp_path)
    lock.acquire()
    assert capsys.readouterr().err == (
        f"build_shards.py: note: --output {tmp_path}: taking over the lock left by pid 4242 on host node-elsewhere "
        "(started today), an earlier run of job 777\n"
    )
    held = json.loads(record.read_text())
    assert (held["pid"], held["host"], held["slurm_job"]) == (os.getpid(), socket.gethostname(), "777")
    lock.release()
    assert not record.exists()


def test_a_variable_that_forbids_weights_only_loads_is_named_by_every_load(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "true")
    with pytest.raises(UsageError, match=r"^TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=true is set in the environment"):
        with checkpoint.weights_only_loads():
            pass
