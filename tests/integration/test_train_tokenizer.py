"""Tokenizer identity in pre-flight: a tokenizer of the same size whose ids differ from the shards'
(given as --tokenizer, or inside an --init_from folder) is refused with both sides named;
--allow_tokenizer_mismatch trains anyway and warns; the shards' own tokenizer, in any folder or JSON
layout, passes; an older manifest without a fingerprint falls back to the shards' tokenizer folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.training import tokenizer_identity
from pipeline.training.config import parse_args
from pipeline.training.preflight import prepare
from preprocessing.shard_format import read_vocabulary
from tests.support.trainer import (
    REPO,
    explain,
    free_port,
    one_rank_env,
    run_deepspeed,
    shard_sets,
    write_ds_config,
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture
def ds(tmp_path) -> Path:
    return write_ds_config(tmp_path / "ds.json", micro=4)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(tokenizer_identity.log, "warning", seen.append)
    return seen


def permuted_tokenizer(src: Path, dest: Path, *, swap: tuple[int, int] = (10, 20)) -> Path:
    """src's WordPiece tokenizer with the tokens of two ids swapped: the same size and specials."""
    from transformers import BertTokenizerFast

    lines = (src / "vocab.txt").read_text(encoding="utf-8").splitlines()
    i, j = swap
    lines[i], lines[j] = lines[j], lines[i]
    dest.mkdir(parents=True)
    (dest / "vocab.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(dest / "vocab.txt"), do_lower_case=True).save_pretrained(dest)
    return dest


def args(ds: Path, data: Path, save: Path, *extra: str) -> list[str]:
    model = [] if "--init_from" in extra else ["--model_config", "tiny"]
    return [
        *("--ds_config", str(ds), "--objective", "mlm", "--max_steps", "2", "--save_dir", str(save)),
        *("--data", str(data), *model, "--warmup_steps", "0", "--seed", "0", "--num_workers", "0", *extra),
    ]


def test_a_same_size_tokenizer_with_other_ids_is_refused_naming_both_sides(shards, ds, tmp_path):
    data = shards["packed32"]
    other = permuted_tokenizer(data / "tokenizer", tmp_path / "permuted")
    words = (data / "tokenizer" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "pipeline" / "train.py"),
            *args(ds, data, tmp_path / "r", "--tokenizer", str(other)),
        ],
        capture_output=True,
        text=True,
        env=one_rank_env(),
        timeout=400,
    )
    assert r.returncode == 2, explain(r)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr
    message = lines[0]
    assert message.startswith("train.py: error: tokenizer mismatch: --tokenizer ")
    assert str(other) in message and f"{data}/build_manifest.json" in message  # both sides, and where each is from
    assert f"id 10 is {words[10]!r} vs {words[20]!r}" in message  # the first ids that differ
    assert "--allow_tokenizer_mismatch" in message
    assert not (tmp_path / "r" / "checkpoints").exists()  # refused before any training


@pytest.mark.multiproc
def test_allow_tokenizer_mismatch_trains_and_says_what_it_risks(shards, ds, tmp_path):
    data = shards["packed32"]
    other = permuted_tokenizer(data / "tokenizer", tmp_path / "permuted")
    r = run_deepspeed(
        free_port(),
        args(ds, data, tmp_path / "r", "--tokenizer", str(other), "--allow_tokenizer_mismatch"),
        num_gpus=1,
        timeout=400,
    )
    assert r.returncode == 0, explain(r)
    warning = next(line for line in r.stdout.splitlines() if "WARNING" in line and "--allow_tokenizer_mismatch" in line)
    assert "is not the tokenizer the shards were built with" in warning and "Training anyway" in warning
    assert "done: step 2" in r.stdout
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["model"]["allow_tokenizer_mismatch"] is True  # recorded with the run


def test_the_shards_own_tokenizer_passes_from_any_folder_and_layout(shards, ds, tmp_path, warnings):
    data = shards["nsp48"]
    copy = shutil.copytree(data / "tokenizer", tmp_path / "copy")
    # The same vocabulary as a slow tokenizer's folder (no tokenizer.json: transformers converts it).
    only_vocab = tmp_path / "vocab_only"
    only_vocab.mkdir()
    shutil.copy(data / "tokenizer" / "vocab.txt", only_vocab / "vocab.txt")
    (only_vocab / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    for tok in (None, copy, only_vocab):
        extra = ["--tokenizer", str(tok)] if tok else []
        p = prepare(parse_args(args(ds, data, tmp_path / "r", *extra)))
        assert p.tokenizer_dir == str(tok or data / "tokenizer")
    assert read_vocabulary(only_vocab).fingerprint == read_vocabulary(copy).fingerprint
    assert warnings == []


def test_lower_casing_and_special_roles_are_part_of_the_identity(shards, tmp_path):
    src = shards["packed32"] / "tokenizer"
    base = read_vocabulary(src)
    cased = shutil.copytree(src, tmp_path / "cased")
    config = json.loads((cased / "tokenizer_config.json").read_text())
    (cased / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    assert read_vocabulary(cased).lowercase is False and base.lowercase is True
    assert read_vocabulary(cased).fingerprint != base.fingerprint
    roles = shutil.copytree(src, tmp_path / "roles")
    (roles / "special_tokens_map.json").write_text(json.dumps({"mask_token": "[UNK]", "unk_token": "[MASK]"}))
    assert read_vocabulary(roles).fingerprint != base.fingerprint
    # What does not change an id does not change the identity.
    longer = shutil.copytree(src, tmp_path / "longer")
    (longer / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    assert read_vocabulary(longer).fingerprint == base.fingerprint


def test_an_init_from_folder_with_another_tokenizer_is_refused(shards, ds, tmp_path):
    from transformers import BertConfig, BertForPreTraining

    data = shards["packed32"]
    model = permuted_tokenizer(data / "tokenizer", tmp_path / "model")
    size = read_vocabulary(model).size
    config = BertConfig(
        vocab_size=size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    BertForPreTraining(config).save_pretrained(model)
    with pytest.raises(ValueError, match=rf"tokenizer mismatch: --init_from {model}'s tokenizer is not the tokenizer"):
        prepare(parse_args(args(ds, data, tmp_path / "r", "--init_from", str(model))))


def test_an_older_manifest_without_a_fingerprint_falls_back_to_the_shards_tokenizer(shards, ds, tmp_path, warnings):
    data = shutil.copytree(shards["packed32"], tmp_path / "old")
    manifest = json.loads((data / "build_manifest.json").read_text())
    del manifest["tokenizer"]["vocab_fingerprint"]
    (data / "build_manifest.json").write_text(json.dumps(manifest))
    other = permuted_tokenizer(data / "tokenizer", tmp_path / "permuted")
    # DATA/tokenizer is still the file the manifest's sha256 names: it stands for the build.
    with pytest.raises(ValueError, match=r"tokenizer mismatch: .*its tokenizer.json is the one build_manifest.json"):
        prepare(parse_args(args(ds, data, tmp_path / "r", "--tokenizer", str(other))))
    prepare(parse_args(args(ds, data, tmp_path / "r")))
    assert warnings == []
    # A replaced DATA/tokenizer cannot stand for the build: only the sizes are compared, and it says so.
    shutil.rmtree(data / "tokenizer")
    shutil.copytree(other, data / "tokenizer")
    prepare(parse_args(args(ds, data, tmp_path / "r", "--tokenizer", str(other))))
    assert len(warnings) == 1 and "predates vocabulary fingerprints" in warnings[0], warnings
