"""Resuming on another number of ranks (real DeepSpeed on CPU, gloo): a ZeRO-2 bf16 checkpoint written by
N ranks resumes on M. The optimizer state the M-rank engine holds after loading equals the N-rank
checkpoint's, element for element, and the run sees every sample of the epoch once across the resume."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.support import logs
from tests.support.trainer import explain, free_port, read_trace, run_deepspeed, shard_sets, train_args, write_ds_config

pytestmark = pytest.mark.multiproc
STOP, STEPS = 3, 7  # nsp48 holds 70 samples: 7 steps of 10 are one epoch


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    """Global batch 10 at any world size: train_batch_size without gradient_accumulation_steps, which
    DeepSpeed derives (1 on 2 ranks of micro-batch 5, 2 on one)."""
    path = write_ds_config(tmp_path_factory.getbasetemp() / "ds_global10.json", micro=5)
    cfg = json.loads(path.read_text())
    del cfg["gradient_accumulation_steps"]
    path.write_text(json.dumps({**cfg, "train_batch_size": 10}))
    return path


def consolidate(optimizers: list[dict]) -> tuple[dict[str, dict[str, torch.Tensor]], set[float]]:
    """({parameter: {"fp32": master weights, "exp_avg": ..., "exp_avg_sq": ...}}, the optimizer steps)
    from each rank's ZeRO optimizer state (in rank order), by the fragment each rank records it holds."""
    pieces: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    steps = set()
    for opt in optimizers:
        base = opt["base_optimizer_state"]
        for g, mapping in enumerate(opt["param_slice_mappings"]):
            state = base["state"][base["param_groups"][g]["params"][0]]
            steps.add(float(state["step"]))
            flats = {"fp32": opt["single_partition_of_fp32_groups"][g], "exp_avg": state["exp_avg"]}
            flats["exp_avg_sq"] = state["exp_avg_sq"]
            for name, where in mapping.items():
                for key, flat in flats.items():
                    pieces[name][key].append(flat[where.start : where.start + where.numel])
    return {name: {k: torch.cat(v) for k, v in keys.items()} for name, keys in pieces.items()}, steps


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_a_checkpoint_resumes_on_another_number_of_ranks(shards, ds, tmp_path, before, after):
    save, probe = tmp_path / "run", tmp_path / "probe"

    def args(extra: list[str]) -> list[str]:
        return train_args(
            ds_config=ds,
            objective="mlm",
            data=[shards["nsp48"]],
            save_dir=save,
            max_steps=STEPS,
            extra=["--trace_samples", *extra],
        )

    first = run_deepspeed(free_port(), args(["--stop_after_step", str(STOP)]), num_gpus=before)
    assert first.returncode == 0, explain(first)
    resumed = run_deepspeed(
        free_port(), args(["--resume", "auto", "--probe_optimizer_after_resume", str(probe)]), num_gpus=after
    )
    assert resumed.returncode == 0, explain(resumed)
    ckpt = save / "checkpoints" / f"step_{STOP:08d}"
    line = f"world size changed {before} -> {after}: resharded the ZeRO optimizer state of {ckpt.name}"
    assert logs.count(resumed.stdout, line) == 1, resumed.stdout[-3000:]
    assert logs.has(resumed.stdout, f"done: step {STEPS}")
    assert not list(ckpt.glob("*resharded*"))  # the copy for the new world is gone once loaded

    # (a) What the engine holds on M ranks after loading is the N-rank checkpoint's state, element for element.
    files = [ckpt / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(before)]
    saved, saved_steps = consolidate([torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files])
    loaded, loaded_steps = consolidate([torch.load(probe / f"rank{r}.pt", weights_only=False) for r in range(after)])
    assert saved_steps == loaded_steps == {float(STOP)}
    assert sorted(saved) == sorted(loaded) and len(saved) == 46  # every trained tensor of the tiny BERT
    compared = 0
    for name, keys in saved.items():
        for key, tensor in keys.items():
            assert torch.equal(loaded[name][key], tensor), f"{name} {key} differs after resharding"
            compared += tensor.numel()
    assert compared == 3 * 147_615

    # (b) Every sample of the epoch once: STOP steps on N ranks, then the rest of the epoch on M.
    trace = read_trace(save)
    assert [len(trace[s]) for s in range(1, STEPS + 1)] == [before] * STOP + [after] * (STEPS - STOP)
    seen = sorted(i for s in range(1, STEPS + 1) for ids in trace[s] for i in ids)
    assert seen == list(range(json.loads((save / "config.json").read_text())["samples"]))
