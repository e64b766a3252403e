"""The trainer's helpers in pipeline.distributed, on 2 real gloo ranks, against what one process
computes from both ranks' inputs: any_rank_flags, all_gather_object, node_on_host, and
bound_new_group_timeouts (a group DeepSpeed creates later still times out)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.trainer import REPO, free_port, launch_env

pytestmark = pytest.mark.multiproc

SCRIPT = textwrap.dedent("""
    import json, sys, time, datetime
    import torch.distributed as dist
    from pipeline import distributed
    distributed.init_process_group(backend="gloo", timeout_s=60)
    r = distributed.rank()
    out = {}
    flags = [[True, False, False, True], [False, True, False, True]][r]
    out["flags_in"] = flags
    out["flags"] = distributed.any_rank_flags(flags)
    out["objects"] = distributed.all_gather_object({"rank": r, "text": "x" * (r + 1)})
    out["node_on_host"] = list(distributed.node_on_host())
    distributed.bound_new_group_timeouts(timeout_s=3)
    group = dist.new_group(ranks=[0, 1])  # as DeepSpeed clones the world, without a timeout
    t0 = time.time()
    if r == 1:
        time.sleep(8)  # a hung rank
        out["timed_out_after_s"] = None
    else:
        try:
            dist.barrier(group=group)
            out["timed_out_after_s"] = None
        except RuntimeError as e:
            out["timed_out_after_s"] = time.time() - t0
            out["error"] = str(e)[:200]
    print("OUT " + json.dumps(out), flush=True)
""")


def _run(tmp_path, *, local_world_size: int) -> list[dict]:
    script = tmp_path / "dist_helpers.py"
    script.write_text(SCRIPT)
    port, procs = free_port(), []
    for r in range(2):
        env = launch_env(
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r % local_world_size),
            LOCAL_WORLD_SIZE=str(local_world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=REPO,
                env=env,
                stdout=open(tmp_path / f"o{r}", "w"),
                stderr=open(tmp_path / f"e{r}", "w"),
            )
        )
    for p in procs:
        p.wait(timeout=180)
    outs = []
    for r in range(2):
        lines = [line for line in (tmp_path / f"o{r}").read_text().splitlines() if line.startswith("OUT ")]
        assert lines, (tmp_path / f"e{r}").read_text()[-3000:]
        outs.append(json.loads(lines[0][4:]))
    return outs


def test_helpers_on_two_ranks(tmp_path):
    outs = _run(tmp_path, local_world_size=2)
    expected = [any(col) for col in zip(outs[0]["flags_in"], outs[1]["flags_in"])]  # one process, both inputs
    assert outs[0]["flags"] == outs[1]["flags"] == expected == [True, True, False, True]
    assert outs[0]["objects"] == outs[1]["objects"] == [{"rank": 0, "text": "x"}, {"rank": 1, "text": "xx"}]
    assert outs[0]["node_on_host"] == outs[1]["node_on_host"] == [0, 0, 1]  # one node of two ranks
    # The group created after bound_new_group_timeouts gives up after ~3 s, not torch's 30 minutes.
    assert outs[0]["timed_out_after_s"] is not None and outs[0]["timed_out_after_s"] < 15, outs[0]


def test_two_nodes_on_one_host_are_told_apart(tmp_path):
    outs = _run(tmp_path, local_world_size=1)
    assert [o["node_on_host"] for o in outs] == [[0, 0, 2], [1, 1, 2]]
