"""Which attention kernel each configuration reaches (pipeline.modeling.attention.varlen_path): on
CUDA the fused varlen kernel needs bf16/fp16 projections and no attention dropout. The encoder's
calls are recorded on the CPU (under CPU autocast, as CUDA autocast casts them) and the path they
would take on CUDA is asserted, for the student in training and TaCL's teacher."""

from __future__ import annotations

import pytest
import torch

from pipeline.modeling import encoder as encoder_module
from pipeline.modeling.attention import varlen_path
from pipeline.modeling.encoder import Encoder
from pipeline.modeling.student import Student, run_encoder
from tests.support.batches import collate, model


def test_the_path_rule():
    cuda = dict(device_type="cuda", dropout_p=0.0)
    assert varlen_path(dtype=torch.bfloat16, **cuda) == "varlen"
    assert varlen_path(dtype=torch.float16, **cuda) == "varlen"
    assert varlen_path(dtype=torch.float32, **cuda) == "fallback"
    assert varlen_path(dtype=torch.bfloat16, device_type="cuda", dropout_p=0.1) == "fallback"
    assert varlen_path(dtype=torch.bfloat16, device_type="cpu", dropout_p=0.0) == "fallback"
    assert varlen_path(dtype=torch.bfloat16, kernel=False, **cuda) == "fallback"


@pytest.fixture
def calls(monkeypatch):
    """(dtype of q/k/v, dropout) of every varlen attention call the encoder makes."""
    seen = []
    real = encoder_module.varlen_attention

    def recording(qkv_T3D, **kw):
        seen.append((qkv_T3D.dtype, kw["dropout_p"]))
        return real(qkv_T3D, **kw)

    monkeypatch.setattr(encoder_module, "varlen_attention", recording)
    return seen


def paths(seen) -> set[str]:
    return {varlen_path(device_type="cuda", dtype=dtype, dropout_p=p) for dtype, p in seen}


CASES = {
    # name: (attention dropout, weights dtype, autocast)
    "fp32 weights under bf16 autocast (the bare benchmark's old setting)": (0.0, torch.float32, True),
    "bf16 weights (DeepSpeed bf16, the shipped zero2.json)": (0.0, torch.bfloat16, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_student_and_teacher_reach_the_fused_kernel(case, calls):
    dropout, dtype, autocast = CASES[case]
    net = model()
    net.config.attention_probs_dropout_prob = dropout
    net = net.to(dtype)
    batch = collate([9, 14, 11, 16])
    assert batch["layout"] == "unpadded"
    student = Student(net).train()
    teacher = Encoder(net.bert)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        student(batch, with_nsp=True)
        assert paths(calls) == {"varlen"}, calls
        calls.clear()
        net.eval()
        with torch.no_grad():
            run_encoder(teacher, batch, ids="original_ids")
    assert paths(calls) == {"varlen"}, calls


def test_attention_dropout_in_training_takes_the_exact_fallback(calls):
    net = model()
    net.config.attention_probs_dropout_prob = 0.1
    student = Student(net.to(torch.bfloat16)).train()
    student(collate([9, 14]), with_nsp=True)
    assert paths(calls) == {"fallback"}
    calls.clear()
    student.eval()
    with torch.no_grad():
        student(collate([9, 14]), with_nsp=True)
    assert paths(calls) == {"varlen"}  # no dropout in eval
