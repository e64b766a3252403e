"""Export: the trained student as a Hugging Face folder that loads with AutoModelForMaskedLM /
AutoModel, runs in a fill-mask pipeline, and gives the engine's logits.

The tolerance, honestly: the engine computes in bf16 with bf16 copies of the fp32 master weights;
the export holds the fp32 master weights. Cast to bf16, the export *is* the engine's weights, so the
same forward gives the same logits (0 difference on CPU). In fp32 it differs by bf16 rounding:
within 4 bf16 steps (2^-7 each) of the largest logit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, BertForPreTraining, pipeline

from pipeline.training.hf_export import load_student
from tests.support.trainer import REPO, launch_env, tacl_straight

pytestmark = pytest.mark.multiproc
BF16_STEP = 2.0**-7


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return tacl_straight(tmp_path_factory)[0]


def test_export_gives_the_engine_logits(run):
    export = run.parent / "export"
    probe = torch.load(run / "export_check.pt")
    assert probe["dtype"] == "bfloat16"
    inputs = {k: probe[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    real = inputs["attention_mask"].bool()
    engine = probe["engine_logits"]
    model = AutoModelForMaskedLM.from_pretrained(export).eval()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        fp32 = model(**inputs).logits
        bf16 = model.to(torch.bfloat16)(**inputs).logits.float()
    scale = engine[real].abs().max()
    assert torch.equal(bf16[real], engine[real]), (bf16 - engine)[real].abs().max()
    fp32_diff = (fp32 - engine)[real].abs().max()
    assert fp32_diff <= 4 * BF16_STEP * scale, (fp32_diff, scale)
    # What the trainer itself measured and reported.
    check = json.loads((run / "export_check.json").read_text())
    assert check["max_abs_diff_same_dtype"] == 0.0 and check["max_abs_diff_fp32"] == pytest.approx(float(fp32_diff))


def test_export_loads_every_way(run):
    export = run.parent / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["BertForPreTraining"]
    full = BertForPreTraining.from_pretrained(export).eval()
    encoder = AutoModel.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    enc = tok(["the big cat sees the dog in the park ."], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(encoder(**enc).last_hidden_state, full.bert(**enc).last_hidden_state)
    fill = pipeline("fill-mask", model=str(export), tokenizer=str(export), device="cpu")
    preds = fill("the big cat [MASK] the dog in the park .")
    assert len(preds) == 5 and all(p["token_str"] and 0 <= p["score"] <= 1 for p in preds)


def test_load_student_and_the_cli_export_the_same_weights(run, tmp_path):
    ckpt = run / "checkpoints" / "step_00000016"
    model, tok = load_student(ckpt)
    exported = BertForPreTraining.from_pretrained(run.parent / "export")
    for (name, a), (_, b) in zip(model.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
    assert len(tok) == model.config.vocab_size
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "pipeline" / "export.py"),
            "--checkpoint",
            str(ckpt),
            "--out",
            str(tmp_path / "cli"),
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = BertForPreTraining.from_pretrained(tmp_path / "cli")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), exported.state_dict().values()))
    # An incomplete checkpoint is refused with exit 2 and a reason.
    bad = tmp_path / "ck" / "step_00000001"
    bad.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "export.py"), "--checkpoint", str(bad), "--out", str(tmp_path / "x")],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "incomplete (no complete.json)" in proc.stderr
