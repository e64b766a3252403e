"""The analyze.py command end to end: text and shard inputs, bad input, the checkpoints of a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.evaluation.representation.inputs import (
    read_mds_sequences,
)
from pipeline.modeling import similarity as analysis
from tests.support.png import assert_png
from tests.support.tiny_bert import write_tiny_bert, write_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on a mat dog ran to park . it was sunny and warm we like tea".split()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))


def run_analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "analyze.py"), *args], capture_output=True, text=True, timeout=300
    )


def test_analyze_cli_on_text_with_two_models(tmp_path):
    a = write_tiny_bert(tmp_path / "a", WORDS, seed=0)
    b = write_tiny_bert(tmp_path / "b" / "export", WORDS, seed=1, head="base")
    text = tmp_path / "t.txt"
    text.write_text(
        "the cat sat on a mat .\nthe dog ran to park .\n\nit was sunny and warm .\nwe like tea\n", encoding="utf-8"
    )
    out = tmp_path / "report"
    r = run_analyze(
        "--model", f"first={a}", "--model", str(b), "--data", str(text), "--out", str(out), "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "metrics.json").read_text())
    assert list(m["models"]) == ["first", "export"]
    for label in m["models"]:
        layers = m["models"][label]["layers"]
        assert [x["layer"] for x in layers] == [0, 1, 2]
        assert layers[-1]["num_sentences"] == 4 and layers[-1]["num_tokens"] == 22
        assert -1 <= layers[-1]["intra_sentence"] <= 1
        assert m["models"][label]["heatmap"]["tokens"] == ["the", "cat", "sat", "on", "a", "mat", "."]
    # The CLI's number equals the metric function applied to the model's own hidden states.
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    enc = tok(["the cat sat on a mat ."], return_tensors="pt")
    hidden_LD = AutoModel.from_pretrained(a).eval()(**enc).last_hidden_state[0, 1:-1].detach()
    want = analysis.group_self_similarity(hidden_LD, torch.zeros(7, dtype=torch.long)).item()
    assert m["models"]["first"]["heatmap"]["similarity"][0][1] == pytest.approx(
        cos(hidden_LD[0], hidden_LD[1]), abs=1e-5
    )
    assert np.mean(np.array(m["models"]["first"]["heatmap"]["similarity"])[~np.eye(7, dtype=bool)]) == pytest.approx(
        want, abs=1e-5
    )
    for png in ("layerwise.png", "heatmap.png"):
        assert_png(out / png)
        assert f"({png})" in (out / "README.md").read_text()


def test_analyze_on_mds_shards(tmp_path):
    from streaming import MDSWriter

    model = write_tiny_bert(tmp_path / "model", WORDS)
    tok = write_tokenizer(tmp_path / "tok", WORDS)
    cls, sep = tok.cls_token_id, tok.sep_token_id
    a, b = tok.convert_tokens_to_ids(["the", "cat", "sat"]), tok.convert_tokens_to_ids(["we", "like", "tea", "."])
    columns = {
        "input_ids": "ndarray:uint16",
        "token_type_ids": "ndarray:uint8",
        "word_starts": "ndarray:uint8",
        "nsp_label": "int",
        "lang": "str",
    }
    with MDSWriter(out=str(tmp_path / "shards"), columns=columns) as w:
        for k in range(6):
            ids = [cls, *a, sep, *b, sep][: 10 - (k % 2)]
            types = [0] * (len(a) + 2) + [1] * (len(ids) - len(a) - 2)
            w.write(
                {
                    "input_ids": np.array(ids, np.uint16),
                    "token_type_ids": np.array(types, np.uint8),
                    "word_starts": np.ones(len(ids), np.uint8),
                    "nsp_label": k % 2,
                    "lang": "en",
                }
            )
    tok.save_pretrained(tmp_path / "shards" / "tokenizer")  # the builder always writes DIR/tokenizer/
    seqs, stats = read_mds_sequences(
        tmp_path / "shards", special_ids={0, 2, 3, 4}, max_sequences=4, vocab_size=len(tok)
    )
    assert stats.sequences == 4 and stats.skipped == {"beyond_max_sequences": 2}
    assert seqs[0].sentence_ids == [-1, 0, 0, 0, -1, 1, 1, 1, 1, -1]
    assert seqs[1].sentence_ids == [-1, 0, 0, 0, -1, 1, 1, 1, 1]
    out = tmp_path / "report"
    r = run_analyze("--model", str(model), "--data", str(tmp_path / "shards"), "--out", str(out), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    last = json.loads((out / "metrics.json").read_text())["models"]["model"]["layers"][-1]
    assert last["num_sentences"] == 12 and last["num_contexts"] == 6
    # A model with another vocabulary is refused with a message naming the shards.
    other = write_tiny_bert(tmp_path / "other", WORDS[::-1])
    r = run_analyze("--model", str(other), "--data", str(tmp_path / "shards"), "--out", str(out))
    assert r.returncode == 2 and "another vocabulary" in r.stderr
    assert stats.notes == []
    # Packed shards have no sentence boundaries inside a document piece: the report says what that does.
    packed = {k: v for k, v in columns.items() if k != "nsp_label"}
    with MDSWriter(out=str(tmp_path / "packed"), columns=packed) as w:
        for _ in range(4):
            ids = [cls, *a, *b, sep]
            w.write(
                {
                    "input_ids": np.array(ids, np.uint16),
                    "token_type_ids": np.zeros(len(ids), np.uint8),
                    "word_starts": np.ones(len(ids), np.uint8),
                    "lang": "en",
                }
            )
    tok.save_pretrained(tmp_path / "packed" / "tokenizer")
    _, stats = read_mds_sequences(tmp_path / "packed", special_ids={0, 2, 3, 4}, max_sequences=4, vocab_size=len(tok))
    assert len(stats.notes) == 1 and "intra-sentence is (nearly) intra-context" in stats.notes[0]
    r = run_analyze("--model", str(model), "--data", str(tmp_path / "packed"), "--out", str(tmp_path / "rp"))
    assert r.returncode == 0, r.stderr
    assert (
        "Note: packed shards: a sample is a stretch of one or more documents"
        in (tmp_path / "rp" / "README.md").read_text()
    )


def test_analyze_cli_rejects_bad_input(tmp_path):
    r = run_analyze("--model", str(tmp_path / "missing"), "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path))
    assert r.returncode == 2 and "none.txt" in r.stderr
    (tmp_path / "t.txt").write_text("hello\n")
    r = run_analyze("--model", str(tmp_path / "missing"), "--data", str(tmp_path / "t.txt"), "--out", str(tmp_path))
    assert r.returncode == 2 and "missing" in r.stderr


@pytest.mark.multiproc
def test_analyze_run_checkpoints_of_a_real_training_run(tmp_path):
    """--run reads every checkpoint of a real pipeline/train.py run (tiny model, 4 steps, saves at 2, 4)."""
    from streaming import MDSWriter

    words = WORDS + [f"w{i}" for i in range(40)]
    tok = write_tokenizer(tmp_path / "tok", words)
    rng = np.random.default_rng(0)
    text_ids = tok.convert_tokens_to_ids(words)
    columns = {
        "input_ids": "ndarray:uint16",
        "token_type_ids": "ndarray:uint8",
        "word_starts": "ndarray:uint8",
        "lang": "str",
    }
    with MDSWriter(out=str(tmp_path / "shards"), columns=columns) as w:
        for _ in range(64):  # packed samples: [CLS] + 15 tokens, a document boundary [SEP] inside
            ids = [tok.cls_token_id, *rng.choice(text_ids, 7), tok.sep_token_id, *rng.choice(text_ids, 7)]
            w.write(
                {
                    "input_ids": np.array(ids, np.uint16),
                    "token_type_ids": np.zeros(16, np.uint8),
                    "word_starts": np.ones(16, np.uint8),
                    "lang": "en",
                }
            )
    tok.save_pretrained(tmp_path / "shards" / "tokenizer")
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {}},
            }
        )
    )
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(REPO / "pipeline" / "train.py"),
            "--ds_config",
            str(ds),
            "--objective",
            "taco",
            "--data",
            str(tmp_path / "shards"),
            "--model_config",
            "tiny",
            "--max_seq_len",
            "16",
            "--max_steps",
            "4",
            "--save_every",
            "2",
            "--keep_checkpoints",
            "5",
            "--save_dir",
            str(run),
            "--export_dir",
            str(tmp_path / "export"),
            "--num_workers",
            "0",
            "--lr",
            "1e-3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on a mat .\nw1 w2 w3 w4\n\nit was sunny and warm .\nwe like tea\n", encoding="utf-8")
    out = tmp_path / "report"
    r = run_analyze(
        "--model",
        f"final={tmp_path / 'export'}",
        "--run",
        str(run),
        "--data",
        str(text),
        "--out",
        str(out),
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "metrics.json").read_text())
    points = m["run"]["checkpoints"]
    assert [p["step"] for p in points] == [2, 4]
    # The last checkpoint is the exported model: the same numbers.
    assert points[-1]["gap"] == pytest.approx(m["models"]["final"]["last_layer"]["gap"], abs=1e-6)
    assert points[0]["gap"] != pytest.approx(points[1]["gap"], abs=1e-9)
    assert_png(out / "training_gap.png")
    assert "(training_gap.png)" in (out / "README.md").read_text()
