"""The step is sync-free: the host reads nothing back from the device, and our own collectives are
the ones the objective needs. Counted on 2 gloo ranks (tests/support/census.py), as the difference
between a 20-step and a 10-step run of each objective, so that set-up, the last step's log line and
its checkpoint cancel out: per optimizer step, 0 host reads from our code and Hugging Face's, at most
2 from DeepSpeed; per micro-batch, collectives of our own: MLM 0, TaCL 1, TACO 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer import REPO, free_port, launch_env, shard_sets, train_args, write_ds_config

pytestmark = pytest.mark.multiproc

OWN_COLLECTIVES = {"mlm": 0, "tacl": 1, "taco": 2}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def census(tmp_path: Path, objective: str, data: Path, steps: int) -> dict:
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    save = tmp_path / f"{objective}{steps}"
    args = train_args(
        ds_config=ds,
        objective=objective,
        data=[data],
        save_dir=save,
        max_steps=steps,
        extra=["--log_every", "1000", "--control_every", "1000", "--save_every", "1000", "--num_workers", "0"],
    )
    out = tmp_path / f"census_{objective}_{steps}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "tests.support.census",
        str(out),
        *args,
    ]
    r = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{k}").read_text()) for k in range(2)]


@pytest.mark.parametrize("objective, shard_set", [("mlm", "packed32"), ("taco", "packed32"), ("tacl", "nsp48")])
def test_the_step_reads_nothing_back_and_calls_only_its_own_collectives(tmp_path, shards, objective, shard_set):
    short, long = census(tmp_path, objective, shards[shard_set], 10), census(tmp_path, objective, shards[shard_set], 20)
    for rank in range(2):
        a, b = short[rank]["counts"], long[rank]["counts"]
        per_step = {
            who: {
                what: (b.get(who, {}).get(what, 0) - a.get(who, {}).get(what, 0)) / 10
                for what in set(b.get(who, {})) | set(a.get(who, {}))
            }
            for who in set(a) | set(b)
        }
        reads = {
            who: sum(v for what, v in kinds.items() if not what.startswith("collective:"))
            for who, kinds in per_step.items()
        }
        collectives = {
            who: sum(v for what, v in kinds.items() if what.startswith("collective:"))
            for who, kinds in per_step.items()
        }
        detail = json.dumps(per_step, sort_keys=True)
        assert reads.get("ours", 0) == 0 and reads.get("hf", 0) == 0, detail
        assert reads.get("deepspeed", 0) <= 2, detail
        assert collectives.get("ours", 0) == OWN_COLLECTIVES[objective], detail  # accumulation 1: per micro-batch
        assert reads.get("other", 0) == 0, detail
