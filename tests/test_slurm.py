"""The Slurm launchers on a real Slurm: a controller and two fake nodes (n1, n2) on this machine.

One cluster for the whole module (tests/slurm_cluster.py). The training jobs are the real
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

from slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "preprocessing" / "sample_corpus"
pytestmark = pytest.mark.multiproc

# Shards: the README demo's build of the embedded sample corpus.
BUILD_ARGS = ["--input", f"en:{SAMPLE / 'en.txt'}", "--input", f"zh:{SAMPLE / 'zh.jsonl'}",
              "--train_tokenizer", "wordpiece", "--vocab_size", "3000", "--format", "packed",
              "--max_seq_len", "64", "--seed", "0"]
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
    yield cluster
    cluster.stop()


def job_env(cluster: SlurmCluster, **knobs: str) -> dict[str, str]:
    """The submitting shell's environment: the cluster's SLURM_CONF, our Python, no launcher
    variables (the scripts must map them from Slurm), and the scripts' knobs."""
    env = cluster.env
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHON=sys.executable, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(knobs)
    return env


def sbatch(cluster: SlurmCluster, script: Path, *options: str, env: dict[str, str], log: Path,
           timeout_s: float = 300) -> tuple[int, int, str]:
    """`sbatch --wait` -> (exit code, job id, job log)."""
    cmd = ["sbatch", "--wait", "--parsable", f"--output={log}", *options, str(script)]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    job = int(r.stdout.strip().split(";")[0]) if r.stdout.strip() else -1
    text = log.read_text(errors="replace") if log.exists() else ""
    return r.returncode, job, text + (f"\n[sbatch stderr] {r.stderr}" if r.stderr.strip() else "")


def test_two_fake_nodes_run_one_task_each(slurm, tmp_path):
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
                      "srun bash -c 'echo task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME'\n")
    rc, job, log = sbatch(slurm, script, env=job_env(slurm), log=tmp_path / "hello.out")
    assert rc == 0, log
    assert sorted(re.findall(r"task \d of 2 on n\d", log)) == ["task 0 of 2 on n1", "task 1 of 2 on n2"], log
