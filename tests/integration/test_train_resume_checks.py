"""Pre-flight of a resumed run compares what the run trained on, not how paths are spelled (issue 31,
defect 3), and refuses environments that would break a run later (defect 11): through the same
parse_args + prepare the entry point runs, on shards built by our builder.

A checkpoint here is a folder with `complete.json` and the configuration the trainer records
(`saved_run`, what trainer.setup writes into run_config.json and the client state); pre-flight reads
nothing else of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.training.config import parse_args
from pipeline.training.preflight import Prepared, prepare
from preprocessing.shard_format import read_vocabulary
from tests.support.trainer import shard_sets, write_ds_config


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture
def ds(tmp_path) -> Path:
    return write_ds_config(tmp_path / "ds.json", micro=4)


def args(ds: Path, data: str | Path, save: Path, *, extra: tuple[str, ...] = ()) -> list[str]:
    out = ["--ds_config", str(ds), "--objective", "mlm", "--max_steps", "10", "--save_dir", str(save)]
    out += ["--data", str(data)]
    if "--model_config" not in extra and "--init_from" not in extra:
        out += ["--model_config", "tiny"]
    return out + list(extra)


def saved_run(p: Prepared) -> dict:
    """The configuration trainer.setup records for a prepared job (`run.resolved`: the client state
    holds it as it is, run_config.json as JSON)."""
    return {
        **p.cfg.to_dict(),
        "deepspeed": p.ds_config,
        "engine": {"world_size": p.world_size},
        "bert_config": p.bert_config.to_dict(),  # int label ids, as the trainer's
        "identity": getattr(p, "identity", None),  # (recorded since issue 31)
    }


def checkpoint_of(save: Path, config: dict | None, *, client_state: bool = False) -> Path:
    """RUN/checkpoints/step_00000004 recording `config` in run_config.json, or only in the client state
    of its model states file (as a checkpoint whose run_config.json was lost), or nowhere (None)."""
    ck = save / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "complete.json").write_text(json.dumps({"step": 4, "tag": ck.name}))
    if config is not None and client_state:
        torch.save({"module": {"w": torch.zeros(2)}, "config": config}, ck / "mp_rank_00_model_states.pt")
    elif config is not None:
        (ck / "run_config.json").write_text(json.dumps(config, default=str))
    return ck


def copy_data(shards: dict[str, Path], name: str, to: Path) -> Path:
    shutil.copytree(shards[name], to)
    return to


def test_a_data_folder_rebuilt_in_place_is_refused(shards, ds, tmp_path):
    data, save = copy_data(shards, "packed32", tmp_path / "data"), tmp_path / "run"
    checkpoint_of(save, saved_run(prepare(parse_args(args(ds, data, save)))))
    # Another corpus built into the same folder (same tokenizer, format and length).
    shutil.rmtree(data)
    copy_data(shards, "packed32_zh", data)
    with pytest.raises(ValueError, match=r"would change what it computes: data\[0\]\.index_sha256 \(.*data\)"):
        prepare(parse_args(args(ds, data, save, extra=("--resume", "auto"))))


def test_shards_of_a_tokenizer_with_swapped_ids_are_refused(shards, ds, tmp_path):
    data, save = copy_data(shards, "packed32", tmp_path / "data"), tmp_path / "run"
    checkpoint_of(save, saved_run(prepare(parse_args(args(ds, data, save)))))
    # Rebuilt with a tokenizer of the same size whose ids 10 and 11 are swapped: its own tokenizer/
    # and the manifest's fingerprint of it (so the tokenizer check of a fresh job passes).
    from transformers import BertTokenizerFast

    vocab = (data / "tokenizer" / "vocab.txt").read_text().splitlines()
    vocab[10], vocab[11] = vocab[11], vocab[10]
    shutil.rmtree(data / "tokenizer")
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"), do_lower_case=True).save_pretrained(data / "tokenizer")
    manifest = json.loads((data / "build_manifest.json").read_text())
    manifest["tokenizer"]["vocab_fingerprint"] = read_vocabulary(data / "tokenizer").fingerprint
    (data / "build_manifest.json").write_text(json.dumps(manifest))
    prepare(parse_args(args(ds, data, tmp_path / "fresh")))  # a new run on them is fine
    with pytest.raises(ValueError, match=r"data\[0\]\.vocabulary .*tokenizer vocabulary: saved 'vocab-v1:"):
        prepare(parse_args(args(ds, data, save, extra=("--resume", "auto"))))


def test_a_model_config_edited_in_place_is_refused(shards, ds, tmp_path):
    data, save = shards["packed32"], tmp_path / "run"
    tok = len(__import__("transformers").AutoTokenizer.from_pretrained(data / "tokenizer"))
    model = tmp_path / "model.json"
    shape = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    model.write_text(json.dumps({"vocab_size": tok, **shape, "hidden_dropout_prob": 0.1}))
    extra = ("--model_config", str(model))
    checkpoint_of(save, saved_run(prepare(parse_args(args(ds, data, save, extra=extra)))))
    prepare(parse_args(args(ds, data, save, extra=extra + ("--resume", "auto"))))  # unchanged: resumes
    model.write_text(json.dumps({"vocab_size": tok, **shape, "hidden_dropout_prob": 0.0, "layer_norm_eps": 1e-6}))
    with pytest.raises(
        ValueError,
        match=r"bert_config.hidden_dropout_prob: saved 0.1, now 0.0; "
        r"bert_config.layer_norm_eps: saved 1e-12, now 1e-06",
    ):
        prepare(parse_args(args(ds, data, save, extra=extra + ("--resume", "auto"))))


def test_a_checkpoint_without_run_config_is_checked_against_its_client_state(shards, ds, tmp_path):
    data, save = shards["packed32"], tmp_path / "run"
    checkpoint_of(save, saved_run(prepare(parse_args(args(ds, data, save)))), client_state=True)
    changed = ("--resume", "auto", "--objective", "taco", "--seed", "1", "--lr", "1e-3")
    with pytest.raises(
        ValueError,
        match=r"objective.objective: saved 'mlm', now 'taco'; .*run.seed: saved 0, now 1; "
        r"schedule.lr: saved 0.0001, now 0.001",
    ):
        prepare(parse_args(args(ds, data, save, extra=changed)))
    assert prepare(parse_args(args(ds, data, save, extra=("--resume", "auto")))).resume_from[0] == 4


@pytest.mark.parametrize("recorded", ["identity", "paths only"])
def test_another_spelling_of_the_same_data_folder_resumes(shards, ds, tmp_path, monkeypatch, recorded):
    data, save = copy_data(shards, "packed32", tmp_path / "work" / "data"), tmp_path / "run"
    saved = saved_run(prepare(parse_args(args(ds, data, save))))
    if recorded == "paths only":  # a checkpoint of a version that recorded no content identity
        del saved["identity"]
    checkpoint_of(save, saved)
    monkeypatch.chdir(tmp_path)
    for spelling in (f"{data}/", f"{data.parent}/../work/data", "work/data", "./work//data/"):
        p = prepare(parse_args(args(ds, spelling, save, extra=("--resume", "auto"))))
        assert p.resume_from[0] == 4, spelling
    with pytest.raises(ValueError, match=r"would change what it computes: data"):  # other shards
        prepare(parse_args(args(ds, shards["packed16"], save, extra=("--resume", "auto"))))


def test_a_schedule_change_on_resume_needs_its_flag(shards, ds, tmp_path):
    data, save = shards["packed32"], tmp_path / "run"
    checkpoint_of(save, saved_run(prepare(parse_args(args(ds, data, save)))))
    lower = ("--resume", "auto", "--lr", "1e-5")
    with pytest.raises(ValueError, match=r"schedule.lr: saved 0.0001, now 1e-05 \(--allow_schedule_change allows"):
        prepare(parse_args(args(ds, data, save, extra=lower)))
    p = prepare(parse_args(args(ds, data, save, extra=lower + ("--allow_schedule_change",))))
    assert "resume: schedule.lr 0.0001 -> 1e-05" in p.resume_notes
    assert p.ds_config["scheduler"]["params"]["warmup_max_lr"] == 1e-5


def test_an_environment_that_forbids_weights_only_loads_is_named(shards, ds, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=r"^TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set in the environment: .*unset it"):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "run")))


def test_a_save_dir_that_is_the_init_from_folder_is_refused(shards, ds, tmp_path):
    model, other = tmp_path / "bert", tmp_path / "x"
    model.mkdir()
    other.mkdir()
    (model / "config.json").write_text("{}")
    same = f"{other}/../bert"  # another spelling of the model's folder
    init = ("--init_from", str(model))
    with pytest.raises(ValueError, match=r"--save_dir .*/x/../bert is the --init_from folder: .*another --save_dir"):
        prepare(parse_args(args(ds, shards["packed32"], Path(same), extra=init)))
    with pytest.raises(ValueError, match=r"--export_dir .*/x/../bert is the --init_from folder"):
        prepare(parse_args(args(ds, shards["packed32"], tmp_path / "run", extra=init + ("--export_dir", same))))
    assert json.loads((model / "config.json").read_text()) == {}


def test_fp16_on_a_cpu_accelerator_is_a_named_error(shards, tmp_path):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator supports fp16 here")
    fp16 = write_ds_config(tmp_path / "fp16.json", micro=4, bf16=False, fp16={"enabled": True, "loss_scale": 0})
    with pytest.raises(ValueError, match=r"fp16.json: fp16 is enabled, which DeepSpeed's cpu accelerator does not"):
        prepare(parse_args(args(fp16, shards["packed32"], tmp_path / "run")))
