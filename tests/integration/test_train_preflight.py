"""Fail fast, before any process group or device work: every bad-input case of the issue, through
the same parse_args + prepare the entry point runs; plus the paper defaults per objective and the
DeepSpeed JSON's ownership rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import objectives
from pipeline.data.shards import ShardError
from pipeline.training.config import ScheduleArgs, parse_args
from pipeline.training.ds_config import resolve_ds_config
from pipeline.training.preflight import prepare
from tests.support.trainer import REPO, minilm_dir, shard_sets, write_ds_config


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture
def ds(tmp_path) -> Path:
    return write_ds_config(tmp_path / "ds.json", micro=4)


def args(ds: Path, data: Path | list[Path], save: Path, *, objective: str = "mlm", extra: list[str] = ()) -> list[str]:
    out = ["--ds_config", str(ds), "--objective", objective, "--max_steps", "10", "--save_dir", str(save)]
    for d in data if isinstance(data, list) else [data]:
        out += ["--data", str(d)]
    if "--init_from" not in extra and "--model_config" not in extra:
        out += ["--model_config", "tiny"]
    return out + list(extra)


def test_a_good_job_passes(shards, ds, tmp_path):
    p = prepare(parse_args(args(ds, shards["nsp48"], tmp_path / "run", objective="tacl")))
    assert p.use_nsp and p.data.format == "nsp" and p.data.max_seq_len == 48
    assert p.tokenizer_dir == str(shards["nsp48"] / "tokenizer")  # defaults to DATA/tokenizer
    assert p.bert_config.vocab_size == len(p.tokenizer)
    assert p.ds_config["optimizer"]["params"]["lr"] == 1e-4  # TaCL's paper rate, written once
    assert p.ds_config["scheduler"]["params"]["total_num_steps"] == 10
    assert p.resume_from is None


def test_tokenizer_model_vocabulary_mismatch(shards, ds, tmp_path):
    # MiniLM's 30522-token model with the shards' small tokenizer.
    with pytest.raises(
        ValueError, match=r"--init_from .* has vocab_size 30522 but tokenizer .*tokenizer has \d+ tokens"
    ):
        prepare(parse_args(args(ds, shards["nsp48"], tmp_path / "r", extra=["--init_from", str(minilm_dir())])))
    # MiniLM's tokenizer with shards built by another one.
    with pytest.raises(ValueError, match=r"shards were built with a \d+-token vocabulary"):
        prepare(parse_args(args(ds, shards["nsp48"], tmp_path / "r", extra=["--tokenizer", str(minilm_dir())])))


def test_max_seq_len_above_max_position_embeddings(shards, ds, tmp_path):
    tok_size = len(__import__("transformers").AutoTokenizer.from_pretrained(shards["packed32"] / "tokenizer"))
    cfg = tmp_path / "small.json"
    cfg.write_text(
        json.dumps(
            {
                "vocab_size": tok_size,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "max_position_embeddings": 16,
            }
        )
    )
    with pytest.raises(
        ValueError, match=r"up to 32 tokens but --model_config .*small.json has max_position_embeddings 16"
    ):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "r", extra=["--model_config", str(cfg)])))


def test_batch_identity_must_hold_for_the_world_size(shards, tmp_path, monkeypatch):
    bad = write_ds_config(tmp_path / "bad.json", micro=4, accum=1, train_batch_size=6)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=6 does not equal train_micro_batch_size_per_gpu=4 x "
        r"gradient_accumulation_steps=1 x world size 2",
    ):
        prepare(parse_args(args(bad, shards["packed32"], tmp_path / "r")))
    good = write_ds_config(tmp_path / "good.json", micro=4, accum=1, train_batch_size=8)
    assert prepare(parse_args(args(good, shards["packed32"], tmp_path / "r"))).world_size == 2
    nomicro = tmp_path / "nomicro.json"
    cfg = json.loads(good.read_text())
    del cfg["train_micro_batch_size_per_gpu"]
    nomicro.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"set train_micro_batch_size_per_gpu"):
        prepare(parse_args(args(nomicro, shards["packed32"], tmp_path / "r")))


def test_missing_or_empty_data(ds, tmp_path):
    with pytest.raises(ValueError, match=r"--data .*absent: no such folder"):
        prepare(parse_args(args(ds, tmp_path / "absent", tmp_path / "r")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    with pytest.raises(ValueError, match=r"--data .*empty: the index lists no samples"):
        prepare(parse_args(args(ds, empty, tmp_path / "r")))
    with pytest.raises(SystemExit) as e:  # no --data at all: argparse, exit 2
        parse_args(
            [
                "--ds_config",
                str(ds),
                "--objective",
                "mlm",
                "--model_config",
                "tiny",
                "--max_steps",
                "1",
                "--save_dir",
                str(tmp_path),
            ]
        )
    assert e.value.code == 2


def test_objective_data_mismatch(shards, ds, tmp_path):
    with pytest.raises(ValueError, match=r"--objective tacl trains on NSP pairs.*packed shards"):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "r", objective="tacl")))
    assert not prepare(
        parse_args(args(ds, shards["packed32"], tmp_path / "r", objective="tacl", extra=["--nsp", "off"]))
    ).use_nsp
    with pytest.raises(ValueError, match=r"--objective taco trains on packed blocks.*nsp shards"):
        prepare(parse_args(args(ds, shards["nsp48"], tmp_path / "r", objective="taco")))


def test_corrupted_shard_is_named(shards, ds, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards["packed32"], data)
    shard = sorted(data.glob("part-*/shard.*"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(ShardError, match=rf"corrupted shard .*{shard.name}"):
        prepare(parse_args(args(ds, data, tmp_path / "r")))


def test_existing_checkpoints_need_resume_auto(shards, ds, tmp_path):
    ck = tmp_path / "r" / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "complete.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds checkpoint step_00000004: pass --resume auto"):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "r")))
    # A checkpoint with no configuration at all (no run_config.json, no client state) cannot be checked.
    with pytest.raises(ValueError, match=r"records no configuration .*pass --resume_unchecked to resume it anyway"):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "r", extra=["--resume", "auto"])))
    unchecked = ["--resume", "auto", "--resume_unchecked"]
    p = prepare(parse_args(args(ds, shards["packed32"], tmp_path / "r", extra=unchecked)))
    assert p.resume_from == (4, ck)
    assert p.resume_notes == [f"resume: {ck} records no configuration; resumed unchecked (--resume_unchecked)"]


def test_the_json_owns_batch_and_precision_and_we_own_the_schedule(tmp_path):
    base = json.loads((REPO / "deepspeed_configs" / "zero2.json").read_text())
    sched = ScheduleArgs(max_steps=100, lr=3e-4, warmup_steps=7)
    out = resolve_ds_config(base, schedule=sched, world_size=8, path="z.json")
    assert out["optimizer"]["params"]["lr"] == 3e-4
    assert out["scheduler"]["params"] == {
        **base["scheduler"]["params"],
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 7,
        "total_num_steps": 100,
    }
    assert "train_batch_size" not in out  # follows the world size
    for where, key in (("optimizer", "lr"), ("scheduler", "warmup_num_steps"), ("scheduler", "total_num_steps")):
        twice = json.loads(json.dumps(base))
        twice[where]["params"][key] = 1
        with pytest.raises(ValueError, match=rf"{where}.params.{key} is set in the JSON"):
            resolve_ds_config(twice, schedule=sched, world_size=8, path="z.json")
    for name in ("zero2.json", "zero2_fp16.json", "zero2_offload.json"):
        cfg = json.loads((REPO / "deepspeed_configs" / name).read_text())
        assert cfg["zero_optimization"]["stage"] == 2 and cfg["gradient_clipping"] == 1.0
        assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["weight_decay"] == 0.01
        assert "train_batch_size" not in cfg and "lr" not in cfg["optimizer"]["params"]
    fp16 = json.loads((REPO / "deepspeed_configs" / "zero2_fp16.json").read_text())
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    off = json.loads((REPO / "deepspeed_configs" / "zero2_offload.json").read_text())
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_paper_defaults_per_objective(shards, ds, tmp_path):
    common = ["--ds_config", str(ds), "--model_config", "tiny", "--save_dir", str(tmp_path), "--data", "x"]
    tacl = parse_args([*common, "--objective", "tacl", "--max_steps", "150000"])
    assert (tacl.schedule.lr, tacl.schedule.warmup_steps, tacl.objective.nsp) == (1e-4, 15000, "on")
    assert (tacl.objective.tacl_temperature, tacl.data.mask_prob) == (0.01, 0.15)
    taco = parse_args([*common, "--objective", "taco", "--max_steps", "500000"])
    assert (
        taco.schedule.warmup_steps,
        taco.objective.taco_temperature,
        taco.objective.taco_window,
        taco.objective.taco_num_negatives,
        taco.objective.taco_lambda,
        taco.objective.nsp,
    ) == (10000, 0.07, 5, 50, 1.0, "off")
    short = parse_args([*common, "--objective", "taco", "--max_steps", "30"])
    assert short.schedule.warmup_steps == 3 and "warm-up" in short.notes[0]  # capped, and said so
    assert parse_args([*common, "--objective", "mlm", "--max_steps", "10"]).objective.nsp == "auto"
    assert {"tacl", "taco", "mlm"} <= set(objectives.names())
    with pytest.raises(ValueError, match=r"--data_weights has 2 value\(s\) for 1 --data"):
        parse_args([*common, "--objective", "mlm", "--max_steps", "10", "--data_weights", "0.5,0.5"])
    with pytest.raises(SystemExit):  # --model_config and --init_from together
        parse_args([*common, "--objective", "mlm", "--max_steps", "10", "--init_from", "x"])


def test_a_save_dir_that_cannot_hold_a_run_is_refused_up_front(shards, ds, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(ValueError, match=rf"--save_dir {file} is a file; pass a folder"):
        prepare(parse_args(args(ds, shards["packed32"], file)))
    with pytest.raises(ValueError, match=rf"--save_dir {file / 'run'} is under {file}, which is a file"):
        prepare(parse_args(args(ds, shards["packed32"], file / "run")))
    # Read-only storage (procfs refuses every new file, root included).
    with pytest.raises(ValueError, match=r"--save_dir /proc/tokencl_run: cannot write in /proc \("):
        prepare(parse_args(args(ds, shards["packed32"], Path("/proc/tokencl_run"))))


def test_attention_dropout_is_the_runs_knob_for_presets_and_init_from(shards, ds, tmp_path):
    # MiniLM's folder says 0.1; the run's default (0: the fused kernels can run) replaces it, and the
    # knob replaces both. The prepared config is what the student is built from and what is recorded.
    assert json.loads((minilm_dir() / "config.json").read_text())["attention_probs_dropout_prob"] == 0.1
    data = shards["nsp48_minilm"]
    for extra, expected in (([], 0.0), (["--attention_dropout", "0.1"], 0.1)):
        p = prepare(parse_args(args(ds, data, tmp_path / "r", extra=["--init_from", str(minilm_dir()), *extra])))
        assert p.bert_config.attention_probs_dropout_prob == expected
        p = prepare(parse_args(args(ds, data, tmp_path / "r", extra=["--model_config", "base", *extra])))
        assert p.bert_config.attention_probs_dropout_prob == expected
        assert p.bert_config.hidden_dropout_prob == 0.1  # hidden dropout stays
    with pytest.raises(ValueError, match=r"--attention_dropout must be in \[0, 1\), got 1.0"):
        parse_args(args(ds, data, tmp_path / "r", extra=["--attention_dropout", "1"]))
