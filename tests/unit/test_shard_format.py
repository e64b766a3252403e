"""The builder/trainer contract (preprocessing.shard_format): the typed manifest reads what older
builders wrote and writes the JSON it always did; columns and formats; vocabulary differences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from preprocessing.errors import UsageError
from preprocessing.shard_format import (
    FINGERPRINT_SCHEME,
    BuildManifest,
    Counts,
    TokenizerRecord,
    Vocabulary,
    columns_for,
    format_of,
    id_dtype_for,
    vocabulary_differences,
)

# A manifest as the builder of the previous release wrote it: no vocab_fingerprint, and a key that
# this code does not know.
OLD = {
    "status": "complete",
    "config": {"output": "/x", "format": "packed", "max_seq_len": 128, "seed": 1},
    "fingerprint": {"chunk_bytes": 4096},
    "tokenizer": {
        "path": "/x/tokenizer",
        "source": "bert",
        "sha256": "ab" * 32,
        "vocab_size": 30522,
        "kind": "wordpiece",
    },
    "versions": {"python": "3.11"},
    "inputs": [],
    "counts": {"documents_in": 3, "samples": 7, "tokens_dropped_tail": 2, "from_the_future": 1},
    "chunks": 2,
    "wall_s": 1.5,
    "retired_key": True,
}


def test_an_older_manifest_reads_and_writes_back_the_same_json():
    m = BuildManifest.from_dict(OLD)
    assert (m.format, m.max_seq_len, m.vocab_size) == ("packed", 128, 30522)
    assert m.vocab_fingerprint is None and m.counts.samples == 7 and m.counts.nsp_random_next is None
    out = m.to_dict()
    assert "retired_key" not in out and "from_the_future" not in out["counts"]
    assert "nsp_random_next" not in out["counts"] and "mb_per_s" not in out  # unset fields are left out
    assert BuildManifest.from_dict(json.loads(json.dumps(out))) == m
    assert BuildManifest.from_dict({}).status == "complete"  # the oldest builders wrote no status


def test_a_fingerprint_of_another_scheme_is_not_compared():
    record = TokenizerRecord(path="p", source="s", sha256="0", vocab_size=5, kind="k")
    assert BuildManifest(tokenizer=record).vocab_fingerprint is None
    record.vocab_fingerprint = "vocab-v0:abc"
    assert BuildManifest(tokenizer=record).vocab_fingerprint is None
    record.vocab_fingerprint = f"{FINGERPRINT_SCHEME}:abc"
    assert BuildManifest(tokenizer=record).vocab_fingerprint == f"{FINGERPRINT_SCHEME}:abc"


def test_manifest_read_and_write(tmp_path):
    path = tmp_path / "build_manifest.json"
    m = BuildManifest(status="running", config={"format": "nsp"}, counts=Counts(samples=3, nsp_random_next=1))
    m.write(path)
    assert BuildManifest.read(path) == m and not list(tmp_path.glob("*.tmp"))
    path.write_text("[1, 2]")
    with pytest.raises(UsageError, match=r"build_manifest.json: cannot read the build manifest"):
        BuildManifest.read(path)


def test_columns_and_formats():
    assert columns_for(fmt="packed", vocab_size=30522)["input_ids"] == "ndarray:uint16"
    assert columns_for(fmt="nsp", vocab_size=70000)["input_ids"] == "ndarray:uint32"
    assert id_dtype_for(1 << 16) is np.uint16 and id_dtype_for((1 << 16) + 1) is np.uint32
    assert format_of(sorted(columns_for(fmt="nsp", vocab_size=9))) == "nsp"
    assert format_of(sorted(columns_for(fmt="packed", vocab_size=9))) == "packed"


def vocab(tokens, *, lowercase=True, specials=("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")) -> Vocabulary:
    roles = tuple(zip(("cls", "sep", "mask", "pad", "unk"), specials))
    return Vocabulary(where="w", tokens=tuple(tokens), added=(), specials=roles, normalizer=None, lowercase=lowercase)


def test_vocabulary_differences_name_the_first_ids():
    a = vocab(["[PAD]", "a", "b", "c", "d"])
    b = vocab(["[PAD]", "a", "c", "b", "d"])
    assert a.fingerprint != b.fingerprint and a.fingerprint == vocab(a.tokens).fingerprint
    assert vocabulary_differences(a, b) == ["2 of 5 ids name other tokens (id 2 is 'b' vs 'c'; id 3 is 'c' vs 'b')"]
    assert vocabulary_differences(a, vocab(a.tokens, lowercase=False)) == ["lower-cases: yes vs no"]
    assert vocabulary_differences(a, vocab([*a.tokens, "e"])) == ["5 vs 6 ids"]
    masked = vocab(a.tokens, specials=("[CLS]", "[SEP]", "[UNK]", "[PAD]", "[MASK]"))
    assert vocabulary_differences(a, masked) == ["special tokens mask '[MASK]' vs '[UNK]', unk '[UNK]' vs '[MASK]'"]
    assert vocabulary_differences(a, vocab(a.tokens)) == []


def test_a_manifest_with_a_held_out_split_round_trips(tmp_path):
    """counts.eval is a Counts of its own (unset fields left out of it too); older manifests have none."""
    held = Counts(documents_in=2, documents_written=2, samples=5, tokens_dropped_tail=1)
    m = BuildManifest(counts=Counts(documents_in=9, documents_written=9, samples=40, eval=held), split=None)
    out = m.to_dict()
    assert out["counts"]["eval"]["samples"] == 5 and "nsp_random_next" not in out["counts"]["eval"]
    assert "split" not in out and "eval" not in BuildManifest.from_dict(OLD).to_dict()["counts"]
    m.write(tmp_path / "m.json")
    assert BuildManifest.read(tmp_path / "m.json") == m and BuildManifest.read(tmp_path / "m.json").counts.eval == held
    own = BuildManifest(split="eval", counts=held)
    assert BuildManifest.from_dict(json.loads(json.dumps(own.to_dict()))).split == "eval"
