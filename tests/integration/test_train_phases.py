"""A second phase (--continue_from): a tiny model trained at 64 tokens, then continued at 128 tokens
from its last checkpoint, each phase interrupted and resumed (--stop_after_step saves and exits 0 as a
pre-emption does; --resume auto continues), on 2 real DeepSpeed ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.training.checkpoint import weights_only_loads
from pipeline.training.config import parse_args
from pipeline.training.preflight import prepare
from tests.support.trainer import (
    explain,
    free_port,
    read_metrics,
    run_deepspeed,
    shard_sets,
    train_args,
    write_ds_config,
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def adam_steps(checkpoint: Path) -> set[int]:
    """The optimizer step counts in a checkpoint's ZeRO shards (weights-only loads)."""
    steps = set()
    with weights_only_loads():
        for f in sorted(checkpoint.glob("*optim_states.pt")):
            state = torch.load(f, weights_only=True)["optimizer_state_dict"]["base_optimizer_state"]
            groups = state["state"].values() if isinstance(state, dict) else state
            steps |= {int(s["step"]) for s in groups if "step" in s}
    return steps


def phase(shards, tmp_path: Path, name: str, *, data: str, steps: int, stop: int | None, model: list[str]) -> Path:
    """A run of `steps` steps, interrupted after step `stop` and resumed (not interrupted: stop None)."""
    ds = write_ds_config(tmp_path / "ds.json", micro=4, bf16=False)
    save = tmp_path / name
    for extra in (["--stop_after_step", str(stop)], ["--resume", "auto"]) if stop else ([],):
        args = train_args(
            ds_config=ds, objective="mlm", data=[shards[data]], save_dir=save, max_steps=steps, model_config="tiny",
            extra=[*model, "--lr", "3e-3", "--save_every", "100", "--log_every", "1", *extra],
        )  # fmt: skip
        if "--model_config" not in model:  # the second phase's model comes from --continue_from
            args = [a for i, a in enumerate(args) if a != "--model_config" and args[i - 1] != "--model_config"]
        proc = run_deepspeed(free_port(), args)
        assert proc.returncode == 0, explain(proc)
    return save


def test_two_phases_64_then_128_tokens_each_interrupted(shards, tmp_path):
    first = phase(shards, tmp_path, "p1", data="packed64", steps=12, stop=6, model=["--model_config", "tiny"])
    second = phase(shards, tmp_path, "p2", data="packed128", steps=8, stop=4, model=["--continue_from", str(first)])
    one, two = read_metrics(first), read_metrics(second)
    assert [r["step"] for r in two] == list(range(1, 9)) and {r["phase"] for r in two} == {2}
    assert [r["global_step"] for r in two] == list(range(13, 21)) and {r["phase"] for r in one} == {1}
    config = json.loads((second / "config.json").read_text())
    assert config["phase"]["index"] == 2 and config["phase"]["steps_before"] == 12
    assert config["phase"]["continued_from"] == str((first / "checkpoints" / "step_00000012").resolve())
    assert config["max_seq_len"] == 128 and config["schedule"]["max_steps"] == 8
    # The optimizer state carried over: Adam's step count runs on from the first phase's 12.
    assert adam_steps(first / "checkpoints" / "step_00000012") == {12}
    assert adam_steps(second / "checkpoints" / "step_00000008") == {20}
    # The loss continues from where the first phase left it, far below a model's at initialisation.
    vocab = config["bert_config"]["vocab_size"]
    assert one[0]["mlm_loss"] > math.log(vocab) - 1.0
    assert two[0]["mlm_loss"] < one[0]["mlm_loss"] - 1.0 and abs(two[0]["mlm_loss"] - one[-1]["mlm_loss"]) < 1.0


def test_a_phase_longer_than_the_models_positions_is_refused(shards, tmp_path):
    model = tmp_path / "short.json"
    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model.write_text(json.dumps({"vocab_size": 128, "max_position_embeddings": 64, "model_type": "bert", **shape}))
    first = phase(shards, tmp_path, "p1", data="packed64", steps=1, stop=None, model=["--model_config", str(model)])
    ds = write_ds_config(tmp_path / "ds.json", micro=4, bf16=False)
    args = ["--ds_config", str(ds), "--objective", "mlm", "--data", str(shards["packed128"]), "--max_steps", "4"]
    with pytest.raises(ValueError, match=r"up to 128 tokens but --continue_from .* has max_position_embeddings 64"):
        prepare(parse_args([*args, "--save_dir", str(tmp_path / "p2"), "--continue_from", str(first)]))
