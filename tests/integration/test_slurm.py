"""The Slurm launchers on a real Slurm: a controller and two fake nodes (n1, n2) on this machine.

One cluster for the whole module (tests/support/slurm_cluster.py). The training jobs are the real
slurm/taco_64gpu.sh, submitted with `sbatch --wait` and sized down by sbatch options and the
script's environment knobs: 2 nodes x 1 CPU rank, a tiny model, shards made by our builder.

Slurm needs root here (slurmd runs jobs as their users, and apt-get installs it when missing):
not root on a developer machine -> skipped, saying so; in CI (CI or TOKENCL_REQUIRE_SLURM set) ->
a failure with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.support import logs
from tests.support.slurm_cluster import SlurmCluster, SlurmUnavailable
from tests.support.trainer import read_metrics, shard_sets

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "preprocessing" / "sample_corpus"
pytestmark = pytest.mark.multiproc

# Shards: the README demo's build of the embedded sample corpus.
BUILD_ARGS = [
    "--input",
    f"en:{SAMPLE / 'en.txt'}",
    "--input",
    f"zh:{SAMPLE / 'zh.jsonl'}",
    "--train_tokenizer",
    "wordpiece",
    "--vocab_size",
    "3000",
    "--format",
    "packed",
    "--max_seq_len",
    "64",
    "--seed",
    "0",
]
# What scales the 64-GPU job down to this machine: 2 nodes x 1 CPU rank.
SMALL_ALLOCATION = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem-per-cpu=1G"]


def _require_slurm() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("TOKENCL_REQUIRE_SLURM"))


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        if e.skippable and not _require_slurm():
            pytest.skip(f"no Slurm on this machine: {e}")
        pytest.fail(f"cannot start the test Slurm cluster: {e}")
    except Exception:
        cluster.stop(keep_files=True)  # the error names log files under cluster.root
        raise
    yield cluster
    cluster.stop()


def job_env(cluster: SlurmCluster, **knobs: str) -> dict[str, str]:
    """The submitting shell's environment: the cluster's SLURM_CONF, our Python, no launcher
    variables (the scripts must map them from Slurm), and the scripts' knobs."""
    env = cluster.env
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # Node-local scratch (streaming cache, Ray's temp folder) inside the cluster's own short-named
    # folder: removed with it, never shared with another session's job of the same id.
    env.update(
        PYTHON=sys.executable, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", LOCAL_DISK=str(cluster.root)
    )
    env.update(knobs)
    return env


def sbatch(
    cluster: SlurmCluster, script: Path, *options: str, env: dict[str, str], log: Path, timeout_s: float = 300
) -> tuple[int, int, str]:
    """`sbatch --wait` -> (exit code, job id, job log)."""
    cmd = ["sbatch", "--wait", "--parsable", f"--output={log}", *options, str(script)]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    job = int(r.stdout.strip().split(";")[0]) if r.stdout.strip() else -1
    text = log.read_text(errors="replace") if log.exists() else ""
    return r.returncode, job, text + (f"\n[sbatch stderr] {r.stderr}" if r.stderr.strip() else "")


def test_two_fake_nodes_run_one_task_each(slurm, tmp_path):
    script = tmp_path / "hello.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        "srun bash -c 'echo task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME'\n"
    )
    rc, job, log = sbatch(slurm, script, env=job_env(slurm), log=tmp_path / "hello.out")
    assert rc == 0, log
    assert sorted(re.findall(r"task \d of 2 on n\d", log)) == ["task 0 of 2 on n1", "task 1 of 2 on n2"], log


# ---------------------------------------------------------------------------------------------------
# Training jobs: slurm/taco_64gpu.sh scaled down
# ---------------------------------------------------------------------------------------------------

TACO = REPO / "slurm" / "taco_64gpu.sh"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Shards made by our builder (its CLI, a local Ray), as a user would make them."""
    out = tmp_path_factory.mktemp("slurm_data") / "shards_local"
    cmd = [
        sys.executable,
        str(REPO / "preprocessing" / "build_shards.py"),
        *BUILD_ARGS,
        "--output",
        str(out),
        "--num_workers",
        "2",
        "--no_progress",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    """zero2.json with a micro-batch of 4 in fp32: fast on CPU."""
    cfg = json.loads((REPO / "deepspeed_configs" / "zero2.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["bf16"] = {"enabled": False}
    path = tmp_path_factory.mktemp("slurm_ds") / "zero2_tiny.json"
    path.write_text(json.dumps(cfg))
    return path


def taco_knobs(
    *, data: Path, save_dir: Path, ds_config: Path, max_steps: int, save_every: int = 1000, **more: str
) -> dict[str, str]:
    knobs = dict(
        CPU_MODE="1",
        DATA=str(data),
        SAVE_DIR=str(save_dir),
        DS_CONFIG=str(ds_config),
        MODEL_CONFIG="tiny",
        MAX_STEPS=str(max_steps),
        SAVE_EVERY=str(save_every),
        EXTRA_ARGS="--num_workers 0 --log_every 1",
    )
    knobs.update(more)
    return knobs


def metrics_steps(save_dir: Path) -> list[int]:
    f = save_dir / "metrics.jsonl"
    if not f.exists():
        return []
    steps = []
    for line in f.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


def wait_for(predicate, *, timeout_s: float, what: str, log: Optional[Path] = None, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")


RANK_LINE = logs.pattern(r"rank (\d+) of world_size (\d+) \(local_rank (\d+), host \S+\)")
TASK_LINE = re.compile(
    r"\[slurm\] node (\S+) task (\d+): RANK=(\d+) LOCAL_RANK=(\d+) WORLD_SIZE=(\d+) "
    r"LOCAL_WORLD_SIZE=(\d+) MASTER_ADDR=(\S+) MASTER_PORT=(\d+)"
)
PREEMPTED = logs.pattern(r"pre-emption signal (SIGUSR1|SIGTERM): saved checkpoint at step (\d+)")
RESUMED = logs.pattern(r"resumed from (\S+) at step (\d+)")
DONE = logs.pattern(r"done: step (\d+)")


def test_taco_job_runs_two_ranks_on_two_nodes_and_checkpoints(slurm, shards, ds_config, tmp_path):
    save = tmp_path / "run"
    env = job_env(slurm, **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=6, save_every=3))
    rc, job, log = sbatch(slurm, TACO, *SMALL_ALLOCATION, env=env, log=tmp_path / "taco.out")
    assert rc == 0, log

    # Slurm -> torch.distributed: one rank per node, the master on the first node, a port from the job id.
    tasks = {int(m[1]): m for m in TASK_LINE.findall(log)}
    assert sorted(tasks) == [0, 1], log
    for rank, (node, _, env_rank, local_rank, world, local_world, addr, port) in tasks.items():
        assert (node, env_rank, local_rank, world, local_world) == (f"n{rank + 1}", str(rank), "0", "2", "1")
        assert addr == "127.0.0.1"  # n1's NodeAddr: the node names do not resolve here
        assert int(port) == 20000 + job % 20000
    # ... and the trainer formed one 2-rank group from them.
    ranks = sorted((int(r), int(w), int(lr)) for r, w, lr in RANK_LINE.findall(log))
    assert ranks == [(0, 2, 0), (1, 2, 0)], log
    assert DONE.findall(log) == ["6"], log
    config = json.loads((save / "config.json").read_text())
    assert config["engine"]["world_size"] == 2 and config["engine"]["global_batch"] == 8

    ckpts = save / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert (ckpts / "step_00000003").is_dir() and (ckpts / "step_00000006").is_dir()
    # ZeRO-2 shards the optimizer state: one file per rank, so both ranks saved.
    assert len(list((ckpts / "step_00000006").glob("*optim_states.pt"))) == 2
    assert metrics_steps(save) == [1, 2, 3, 4, 5, 6]
    assert "training finished: checkpoint at step 6 of 6" in log
    assert not (slurm.root / f"tokencl-{job}").exists()  # the job's node-local scratch is cleaned up


def test_preemption_saves_requeues_and_resumes(slurm, shards, ds_config, tmp_path):
    """Two pre-emptions of one job: USR1 to the ranks (how --signal=USR1@180 arrives), then USR1 to
    the batch shell only (scancel --batch). Each time the ranks save and exit 0, the script
    requeues the job, and the next run resumes from that checkpoint; the third run finishes."""
    save, log_path, max_steps = tmp_path / "run", tmp_path / "preempt.out", 120
    env = job_env(slurm, **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=max_steps))
    cmd = ["sbatch", "--wait", "--parsable", f"--output={log_path}", *SMALL_ALLOCATION, str(TACO)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = int(proc.stdout.readline().strip())

        def log() -> str:
            return log_path.read_text(errors="replace") if log_path.exists() else ""

        wait_for(lambda: max(metrics_steps(save), default=0) >= 3, timeout_s=180, what="step 3", log=log_path)
        subprocess.run(["scancel", "--signal=USR1", str(job)], env=slurm.env, check=True)
        first = int(wait_for(lambda: PREEMPTED.findall(log()), timeout_s=60, what="the 1st save", log=log_path)[0][1])
        wait_for(
            lambda: RESUMED.findall(log()) and max(metrics_steps(save)) >= first + 3,
            timeout_s=180,
            what="the requeued run to train on",
            log=log_path,
        )
        subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", str(job)], env=slurm.env)
            proc.kill()
    text = log()
    assert proc.returncode == 0, text[-6000:] + err

    saves = [(sig, int(step)) for sig, step in PREEMPTED.findall(text)]
    assert [sig for sig, _ in saves] == ["SIGUSR1", "SIGUSR1"], text[-6000:]
    second = saves[1][1]
    assert first < second < max_steps
    resumes = [(Path(p).name, int(step)) for p, step in RESUMED.findall(text)]
    assert resumes == [(f"step_{first:08d}", first), (f"step_{second:08d}", second)], text[-6000:]
    assert "(restart 1)" in text and "(restart 2)" in text
    assert "after SIGUSR1: pre-empted" in text  # the batch shell saw the second signal and forwarded it
    assert DONE.findall(text) == [str(max_steps)]
    assert (save / "checkpoints" / "latest").read_text().strip() == f"step_{max_steps:08d}"
    # Every step was trained: the runs pick up exactly where the previous one saved.
    steps = metrics_steps(save)
    assert sorted(set(steps)) == list(range(1, max_steps + 1))


def test_a_late_copy_of_the_preemption_signal_does_not_fail_the_job(slurm, shards, ds_config, tmp_path):
    """Slurm signals every node through its own slurmd, so the copies arrive at different times: a
    rank may get its SIGUSR1 after the ranks agreed to stop (one copy is enough) and while it is
    already exiting. Here n2's rank gets it first and n1's rank gets it late, repeatedly, until it
    is gone. The step must still exit 0 and the job be requeued and resume."""
    save, log_path, max_steps = tmp_path / "run", tmp_path / "late.out", 60
    env = job_env(slurm, **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=max_steps))
    proc, job = start_job(slurm, env, log_path)
    try:
        wait_for(lambda: max(metrics_steps(save), default=0) >= 3, timeout_s=180, what="step 3", log=log_path)
        rank0, rank1 = (wait_for(lambda r=r: rank_pid(job, r), timeout_s=10, what=f"rank {r}") for r in (0, 1))
        os.kill(rank1, signal.SIGUSR1)
        wait_for(
            lambda: PREEMPTED.search(log_path.read_text(errors="replace")), timeout_s=60, what="the save", log=log_path
        )
        while True:  # the late copy, until rank 0 has exited
            try:
                os.kill(rank0, signal.SIGUSR1)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", str(job)], env=slurm.env)
            proc.kill()
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    (at,) = [int(step) for _, step in PREEMPTED.findall(text)]
    assert [int(step) for _, step in RESUMED.findall(text)] == [at] and DONE.findall(text) == [str(max_steps)]


# ---------------------------------------------------------------------------------------------------
# Two phases in one job (PHASE2_DATA): 64 then 128 tokens, each pre-empted, the job requeued
# ---------------------------------------------------------------------------------------------------

CONTINUED = logs.pattern(r"phase 2: continuing from (\S+) ")


def test_two_phases_each_preempted_requeued_and_finished(slurm, ds_config, tmp_path_factory, tmp_path):
    """Phase 1 (packed64) is pre-empted through the ranks (--signal=USR1@180's way), the requeued job
    resumes it, finishes it and starts phase 2 (packed128, --continue_from) in the same allocation;
    phase 2 is pre-empted through the batch shell (scancel --batch); the second requeue skips the
    finished phase 1 and resumes phase 2 to its end."""
    sets = shard_sets(tmp_path_factory)  # packed64 and packed128: one corpus, one tokenizer
    save, log_path, steps1, steps2 = tmp_path / "run", tmp_path / "phases.out", 60, 40
    save2 = save / "phase2"  # PHASE2_SAVE_DIR's default
    knobs = taco_knobs(data=sets["packed64"], save_dir=save, ds_config=ds_config, max_steps=steps1)
    env = job_env(slurm, **knobs, PHASE2_DATA=str(sets["packed128"]), PHASE2_STEPS=str(steps2))
    proc, job = start_job(slurm, env, log_path)
    try:

        def log() -> str:
            return log_path.read_text(errors="replace") if log_path.exists() else ""

        wait_for(lambda: max(metrics_steps(save), default=0) >= 3, timeout_s=240, what="phase 1 step 3", log=log_path)
        subprocess.run(["scancel", "--signal=USR1", str(job)], env=slurm.env, check=True)
        wait_for(lambda: PREEMPTED.findall(log()), timeout_s=60, what="phase 1's save", log=log_path)
        wait_for(lambda: max(metrics_steps(save2), default=0) >= 3, timeout_s=300, what="phase 2 step 3", log=log_path)
        subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", str(job)], env=slurm.env)
            proc.kill()
    text = log()
    assert proc.returncode == 0, text[-8000:]

    (first, second) = saves = [(sig, int(step)) for sig, step in PREEMPTED.findall(text)]
    assert [sig for sig, _ in saves] == ["SIGUSR1", "SIGUSR1"], text[-8000:]
    assert 3 <= first[1] < steps1 and 3 <= second[1] < steps2
    resumes = [(Path(p).resolve().parent.parent, Path(p).name) for p, _ in RESUMED.findall(text)]
    want = [(save.resolve(), f"step_{first[1]:08d}"), (save2.resolve(), f"step_{second[1]:08d}")]
    assert resumes == want, text[-8000:]
    assert DONE.findall(text) == [str(steps1), str(steps2)]
    assert "(restart 1)" in text and "(restart 2)" in text
    assert "phase 2: the step exited 0 at step" in text and "after SIGUSR1: pre-empted" in text
    # Phase 2 started once, from phase 1's last checkpoint; the last run did not train phase 1 again.
    last1 = (save / "checkpoints" / f"step_{steps1:08d}").resolve()
    assert [Path(p).resolve() for p in CONTINUED.findall(text)] == [last1]
    assert f"phase 1: not trained again: phase 2 has started (checkpoint step {second[1]}" in text
    assert metrics_steps(save) == list(range(1, steps1 + 1))  # each step once: never retrained
    assert (save / "checkpoints" / "latest").read_text().strip() == f"step_{steps1:08d}"
    # Phase 2's metrics: every step once, its global steps running on from phase 1's.
    lines = read_metrics(save2)
    assert [r["step"] for r in lines] == list(range(1, steps2 + 1)) and {r["phase"] for r in lines} == {2}
    assert [r["global_step"] for r in lines] == list(range(steps1 + 1, steps1 + steps2 + 1))
    config = json.loads((save2 / "config.json").read_text())
    assert config["phase"]["steps_before"] == steps1 and config["max_seq_len"] == 128
    assert (save2 / "checkpoints" / "latest").read_text().strip() == f"step_{steps2:08d}"


# ---------------------------------------------------------------------------------------------------
# Reliability: a dead or hung rank fails the job in bounded time; a resubmission resumes
# ---------------------------------------------------------------------------------------------------


def rank_pid(job: int, rank: int) -> Optional[int]:
    """The pid of the trainer process of `rank` in Slurm job `job`: a task that slurmstepd started
    (task_env.sh execs the trainer), with that job id and rank in its environment. (srun, in the
    batch step, has the same command line.)"""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode()}
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if len(argv) < 2 or not argv[1].endswith(b"pipeline/train.py"):
                continue
            if not want <= set((p / "environ").read_bytes().split(b"\0")):
                continue
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if Path(f"/proc/{ppid}/cmdline").read_bytes().startswith(b"slurmstepd"):
                found.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found[0] if len(found) == 1 else None


def job_end_time(cluster: SlurmCluster, job: int) -> float:
    r = subprocess.run(["scontrol", "show", "job", str(job)], env=cluster.env, capture_output=True, text=True)
    m = re.search(r"EndTime=(\S+)", r.stdout)
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))


def start_job(cluster: SlurmCluster, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    cmd = ["sbatch", "--wait", "--parsable", f"--output={log}", *SMALL_ALLOCATION, str(TACO)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline().strip())


def test_killed_rank_fails_the_job_fast_and_the_resubmission_resumes(slurm, shards, ds_config, tmp_path):
    save, max_steps = tmp_path / "run", 120
    env = job_env(
        slurm, **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=max_steps, save_every=5)
    )
    log1 = tmp_path / "killed.out"
    proc, job = start_job(slurm, env, log1)
    try:
        latest = save / "checkpoints" / "latest"
        wait_for(
            lambda: latest.exists() and latest.read_text().strip() >= "step_00000010",
            timeout_s=180,
            what="checkpoint step 10",
            log=log1,
        )
        pid = wait_for(lambda: rank_pid(job, 1), timeout_s=10, what="rank 1's pid")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", str(job)], env=slurm.env)
            proc.kill()
    text = log1.read_text(errors="replace")
    assert proc.returncode != 0, text[-4000:]
    # srun --kill-on-bad-exit ends rank 0 at once: no waiting for a collective to time out.
    assert job_end_time(slurm, job) - killed_at < 20, text[-4000:]
    assert "submit the same script again to resume from checkpoint step" in text
    assert not DONE.findall(text)
    last_good = int(latest.read_text().strip().removeprefix("step_"))
    assert last_good >= 10 and last_good % 5 == 0

    # Resubmitted the way the script sizes itself from the environment (NODES, GPUS_PER_NODE):
    # `bash slurm/taco_64gpu.sh [sbatch options]` calls sbatch with them.
    log2 = tmp_path / "resubmitted.out"
    env2 = {**env, "NODES": "2", "GPUS_PER_NODE": "1"}
    r = subprocess.run(
        ["bash", str(TACO), "--wait", f"--output={log2}", "--cpus-per-task=1", "--mem-per-cpu=1G"],
        env=env2,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text2 = log2.read_text(errors="replace") if log2.exists() else ""
    assert r.returncode == 0, text2[-6000:] + r.stdout + r.stderr
    assert "--nodes=2 --ntasks-per-node=1 --gpus-per-node=0" in r.stdout  # the sbatch line it ran
    assert [(Path(p).name, int(s)) for p, s in RESUMED.findall(text2)] == [(f"step_{last_good:08d}", last_good)]
    assert DONE.findall(text2) == [str(max_steps)]


def test_hung_rank_fails_the_job_after_the_collective_timeout(slurm, shards, ds_config, tmp_path):
    """A rank that stops answering (SIGSTOP: alive, so srun sees no exit) is caught by the
    trainer's --dist_timeout_s on the other rank; srun then ends the stopped one."""
    save, timeout_s = tmp_path / "run", 20
    env = job_env(
        slurm,
        **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=100000, DIST_TIMEOUT_S=str(timeout_s)),
    )
    log = tmp_path / "hung.out"
    proc, job = start_job(slurm, env, log)
    try:
        wait_for(lambda: max(metrics_steps(save), default=0) >= 3, timeout_s=180, what="step 3", log=log)
        pid = wait_for(lambda: rank_pid(job, 1), timeout_s=10, what="rank 1's pid")
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", str(job)], env=slurm.env)
            proc.kill()
    text = log.read_text(errors="replace")
    assert proc.returncode != 0, text[-4000:]
    took = job_end_time(slurm, job) - stopped_at
    assert timeout_s - 2 <= took < timeout_s + 40, (took, text[-4000:])
    assert f"Timed out waiting {timeout_s * 1000}ms" in text  # gloo's collective timeout on rank 0
    assert "the training step failed with exit code" in text and "(no checkpoint yet: it starts over)" in text


def test_taco_dry_run_in_a_two_node_allocation_prints_the_resolved_step(slurm, shards, ds_config, tmp_path):
    save = tmp_path / "run"
    env = job_env(slurm, DRY_RUN="1", **taco_knobs(data=shards, save_dir=save, ds_config=ds_config, max_steps=6))
    rc, job, log = sbatch(slurm, TACO, *SMALL_ALLOCATION, env=env, log=tmp_path / "dry.out")
    assert rc == 0, log
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={20000 + job % 20000} WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" in log
    srun = [line for line in log.splitlines() if line.startswith("+ srun")]
    assert len(srun) == 1 and "--kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1" in srun[0]
    assert f"--data {shards} --model_config tiny --max_steps 6 --save_dir {save} --resume auto" in srun[0]
    assert "node n1: RANK 0..0" in log and "node n2: RANK 1..1" in log
    assert not save.exists() and "[pipeline]" not in log  # nothing ran

    # Asking for another size than the allocation is a mistake the script names.
    env["NODES"] = "3"
    rc, _, log = sbatch(slurm, TACO, *SMALL_ALLOCATION, env=env, log=tmp_path / "mismatch.out")
    assert rc == 2 and "NODES=3 but this allocation has 2 node(s)" in log, log


# ---------------------------------------------------------------------------------------------------
# slurm/build_shards_ray.sh
# ---------------------------------------------------------------------------------------------------

BUILD = REPO / "slurm" / "build_shards_ray.sh"


def sample_hashes(root: Path) -> list[str]:
    """sha256 of every sample (all columns), in index order."""
    import hashlib

    import numpy as np
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(root), batch_size=1, shuffle=False)
    out = []
    for i in range(len(ds)):
        sample, h = ds[i], hashlib.sha256()
        for key in sorted(sample):
            value = sample[key]
            h.update(key.encode())
            h.update(value.encode() if isinstance(value, str) else np.asarray(value).tobytes())
        out.append(h.hexdigest())
    return out


def build_knobs(out: Path, **more: str) -> dict[str, str]:
    inputs = " ".join(BUILD_ARGS[i + 1] for i, a in enumerate(BUILD_ARGS) if a == "--input")
    knobs = dict(
        INPUTS=inputs, OUTPUT=str(out), FORMAT="packed", MAX_SEQ_LEN="64", SEED="0", EXTRA_ARGS="--no_progress"
    )
    knobs.update(more)
    return knobs


def test_build_shards_ray_on_one_node_writes_the_same_shards_as_a_local_build(slurm, shards, tmp_path):
    """The same build command as the `shards` fixture's (tokenizer training included), run by the
    launcher on a Ray cluster it started. Ray head only: two Ray nodes cannot share a host over
    loopback."""
    out = tmp_path / "shards_slurm"
    env = job_env(slurm, RAY_LOOPBACK="1", **build_knobs(out, TRAIN_TOKENIZER="wordpiece", VOCAB_SIZE="3000"))
    rc, job, log = sbatch(
        slurm, BUILD, "--nodes=1", "--cpus-per-task=2", "--mem-per-cpu=1G", env=env, log=tmp_path / "build.out"
    )
    assert rc == 0, log[-6000:]
    assert "[slurm] Ray is up: 1 node(s)" in log and "--ray_address auto" in log
    # Stopped by SIGTERM to `ray start` alone, which then stops its node: not killed with its step.
    assert "[slurm] stopping Ray on 1 node(s)" in log and "Killed" not in log
    local, slurm_built = (json.loads((d / "build_manifest.json").read_text()) for d in (shards, out))
    assert slurm_built["tokenizer"]["sha256"] == local["tokenizer"]["sha256"]
    for key in ("documents_in", "documents_written", "sentences", "tokens", "samples", "tokens_dropped_tail"):
        assert slurm_built["counts"].get(key) == local["counts"].get(key), key
    hashes = sample_hashes(out)
    assert len(hashes) == local["counts"]["samples"] > 0
    assert hashes == sample_hashes(shards)


def test_build_shards_ray_dry_run_in_a_two_node_allocation_starts_a_worker_per_node(slurm, tmp_path):
    out = tmp_path / "never_written"
    env = job_env(slurm, DRY_RUN="1", **build_knobs(out, TRAIN_TOKENIZER="wordpiece", VOCAB_SIZE="3000"))
    rc, job, log = sbatch(
        slurm, BUILD, "--nodes=2", "--cpus-per-task=2", "--mem-per-cpu=1G", env=env, log=tmp_path / "dry.out"
    )
    assert rc == 0, log
    port = 30000 + job % 2000
    cmds = [line for line in log.splitlines() if line.startswith("+ ")]
    heads = [c for c in cmds if "ray start --head" in c]
    workers = [c for c in cmds if "ray start --address" in c]
    assert len(heads) == 1 and "--nodelist=n1 " in heads[0] and f"--port={port}" in heads[0]
    assert "--node-ip-address=127.0.0.1" in heads[0] and "--block" in heads[0]
    assert len(workers) == 1 and "--nodelist=n2 " in workers[0]
    assert f"--address=127.0.0.1:{port}" in workers[0] and "--block" in workers[0]
    builder = [c for c in cmds if "build_shards.py" in c]
    assert len(builder) == 1 and f"--ray_address 127.0.0.1:{port}" in builder[0]
    assert f"--output {out}" in builder[0] and "--train_tokenizer wordpiece --vocab_size 3000" in builder[0]
    assert not out.exists() and "Ray is up" not in log

    # Loopback Ray cannot span two nodes: said before anything starts.
    env["RAY_LOOPBACK"], env["DRY_RUN"] = "1", "0"
    rc, _, log = sbatch(
        slurm, BUILD, "--nodes=2", "--cpus-per-task=2", "--mem-per-cpu=1G", env=env, log=tmp_path / "loopback.out"
    )
    assert rc == 2 and "RAY_LOOPBACK=1 keeps Ray on 127.0.0.1" in log, log
