"""One GPU per rank under a real Slurm whose GPU binding is real: two fake 2-socket nodes (n1, n2)
with 8 fake GPUs each, 4 per socket (SlurmCluster(gpu_sockets=True): task/affinity, gres.conf with
Cores=, character devices). No CUDA here: each task prints what Slurm gave it (through
slurm/task_env.sh), and the test applies pipeline.distributed's choice (`pick_gpus`) and refusal
(`refuse_shared_gpus`) to those rows, with "<node>/<CUDA_VISIBLE_DEVICES entry>" as the GPU's UUID.
(The collectives that gather the rows in the trainer run in the CPU training jobs of test_slurm.py.)

task/affinity binds tasks to the machine's real CPUs: a fake node has 2 (CPU 0 on socket 0, CPU 1
on socket 1), so Slurm's own layout (`--cpu-bind=cores`) is shown with 2 tasks per node, and the
8-task steps place task i on CPU i mod 2 by hand (`--cpu-bind=map_cpu:0,1`): the socket-cyclic
layout that Slurm's default distribution gives a real 2-socket node.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline import distributed
from preprocessing.errors import UsageError
from tests.support.slurm_cluster import GPU_NODE_CPUS, GPUS_PER_NODE, SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc
ALL_GPUS = ",".join(str(i) for i in range(GPUS_PER_NODE))
SOCKET_GPUS = ("0,1,2,3", "4,5,6,7")
CYCLIC = ",".join(str(c) for c in GPU_NODE_CPUS)

# Four steps in one job: (tag, srun options). The old binding and the scripts' (BIND, GPU_BIND from
# slurm/train_job.sh's set_binding), each in Slurm's own layout and in the 8-task socket-cyclic one.
JOB = f"""#!/bin/bash
set -euo pipefail
source "{REPO}/slurm/common.sh"
source "{REPO}/slurm/train_job.sh"
CPU_MODE=0
set_binding
echo "BIND ${{BIND[*]}}"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=1  # task_env.sh wants them; the probe connects nowhere
probe=(bash "{REPO}/slurm/task_env.sh" bash -c \\
    'echo "PROBE $PROBE_TAG $SLURMD_NODENAME $RANK $LOCAL_RANK ${{CUDA_VISIBLE_DEVICES-unset}}" \\
     "$(sed -n "s/^Cpus_allowed_list:\\s*//p" /proc/self/status)"')
two=(--nodes=2 --ntasks=4 --ntasks-per-node=2)
eight=(--nodes=2 --ntasks=16 --ntasks-per-node=8 --overcommit --cpu-bind=map_cpu:{CYCLIC})
PROBE_TAG=old2 srun "${{two[@]}}" --cpu-bind=cores --gpu-bind=closest "${{probe[@]}}"
PROBE_TAG=new2 srun "${{two[@]}}" "${{BIND[@]}}" "${{probe[@]}}"
PROBE_TAG=old8 srun "${{eight[@]}}" --gpu-bind=closest "${{probe[@]}}"
PROBE_TAG=new8 srun "${{eight[@]}}" "${{GPU_BIND[@]}}" "${{probe[@]}}"
"""
PROBE = re.compile(r"^PROBE (\w+) (\S+) (\d+) (\d+) (\S+) (\S+)$", re.M)


@pytest.fixture(scope="module")
def gpu_slurm():
    if not set(GPU_NODE_CPUS) <= os.sched_getaffinity(0):
        pytest.skip(f"the fake GPU nodes bind tasks to CPUs {GPU_NODE_CPUS}, which this process may not use")
    cluster = SlurmCluster(gpu_sockets=True)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        if e.skippable and not (os.environ.get("CI") or os.environ.get("TOKENCL_REQUIRE_SLURM")):
            pytest.skip(f"no Slurm on this machine: {e}")
        pytest.fail(f"cannot start the test Slurm cluster: {e}")
    except Exception:
        cluster.stop(keep_files=True)  # the error names log files under cluster.root
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def steps(gpu_slurm, tmp_path_factory) -> dict[str, list[dict]]:
    """tag -> one row per task: node, rank, local_rank, visible (CUDA_VISIBLE_DEVICES), cpus."""
    tmp = tmp_path_factory.mktemp("slurm_gpus")
    (tmp / "job.sh").write_text(JOB)
    log = tmp / "job.out"
    cmd = ["sbatch", "--wait", f"--output={log}", "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=8"]
    cmd += ["--cpus-per-task=1", "--mem-per-cpu=100M", str(tmp / "job.sh")]
    env = {**gpu_slurm.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert r.returncode == 0, text + r.stderr + gpu_slurm.log_tail()
    assert "BIND --cpu-bind=cores" in text  # the scripts' binding, as set_binding sets it
    rows: dict[str, list[dict]] = defaultdict(list)
    for tag, node, rank, local, visible, cpus in PROBE.findall(text):
        rows[tag].append(dict(node=node, rank=int(rank), local_rank=int(local), visible=visible, cpus=cpus))
    for tag, n in (("old2", 4), ("new2", 4), ("old8", 16), ("new8", 16)):
        assert sorted(row["rank"] for row in rows[tag]) == list(range(n)), (tag, text)
    return {tag: sorted(r, key=lambda row: row["rank"]) for tag, r in rows.items()}


def picks(rows: list[dict]) -> list[str]:
    """The GPU (its CUDA_VISIBLE_DEVICES entry) that pipeline.distributed gives each task."""
    entries = [row["visible"].split(",") for row in rows]
    views = [
        distributed.RankView(row["rank"], row["local_rank"], tuple(f"{row['node']}/{e}" for e in ids))
        for row, ids in zip(rows, entries)
    ]
    return [ids[i] for ids, i in zip(entries, distributed.pick_gpus(views))]


def claims(rows: list[dict], gpus: list[str]) -> list[distributed.GpuClaim]:
    return [distributed.GpuClaim(r["rank"], r["node"], f"{r['node']}/{g}", r["visible"]) for r, g in zip(rows, gpus)]


def test_slurm_default_layout_alternates_sockets_and_closest_binds_a_socket_s_gpus(steps):
    for row in steps["old2"]:
        socket_ = row["local_rank"] % 2
        assert (row["cpus"], row["visible"]) == (str(GPU_NODE_CPUS[socket_]), SOCKET_GPUS[socket_]), row


def test_the_scripts_binding_shows_every_task_all_the_gpus_of_its_node(steps):
    for row in steps["new2"]:
        assert row["cpus"] == str(GPU_NODE_CPUS[row["local_rank"] % 2]), row  # --cpu-bind=cores applied
    for row in steps["new2"] + steps["new8"]:
        assert row["visible"] == ALL_GPUS, row


def test_closest_with_local_rank_modulo_gpus_makes_ranks_share_a_gpu(steps):
    rows = steps["old8"]
    assert [row["visible"] for row in rows] == [SOCKET_GPUS[row["local_rank"] % 2] for row in rows]
    old = [row["visible"].split(",")[row["local_rank"] % 4] for row in rows]  # the trainer's former pick
    for node in ("n1", "n2"):
        assert sorted(g for g, row in zip(old, rows) if row["node"] == node) == ["0", "0", "2", "2", "5", "5", "7", "7"]
    with pytest.raises(UsageError) as e:
        distributed.refuse_shared_gpus(claims(rows, old))
    assert str(e.value).startswith("ranks 0 and 4 on node n1 both drive GPU n1/0 (CUDA_VISIBLE_DEVICES=0,1,2,3)")
    assert "7 more GPU(s) are driven by several ranks" in str(e.value)


@pytest.mark.parametrize("tag", ["new8", "old8"])
def test_each_rank_gets_its_own_gpu(steps, tag):
    """With the scripts' binding, and even under --gpu-bind=closest: a distinct GPU per task of a
    node, the one at its position among the local ranks that see the same GPUs."""
    rows = steps[tag]
    got = picks(rows)
    for node in ("n1", "n2"):
        assert sorted(g for g, row in zip(got, rows) if row["node"] == node) == ALL_GPUS.split(","), (tag, got)
    for row, gpu in zip(rows, got):  # the reference: count the sharers below it, by hand
        sharers = [o["local_rank"] for o in rows if (o["node"], o["visible"]) == (row["node"], row["visible"])]
        position = sum(1 for lr in sharers if lr < row["local_rank"])
        assert gpu == row["visible"].split(",")[position], (tag, row)
    distributed.refuse_shared_gpus(claims(rows, got))  # accepted
