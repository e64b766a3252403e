"""Our call of torch's varlen attention kernel (pipeline.modeling.attention), which only CUDA runs: the
arguments we pass, the output we reshape, and the gradients through the op's autograd, against the exact
fallback that CPU runs take. The op gets a CPU implementation here (tests.support.varlen_kernel).
Compiled, the same call is tests/integration/test_compile.py's."""

from __future__ import annotations

import pytest
import torch

from pipeline.modeling import attention
from pipeline.modeling.student import Student
from tests.support import varlen_kernel
from tests.support.batches import collate, model

pytestmark = pytest.mark.skipif(attention._VARLEN is None, reason="torch < 2.10 has no varlen kernel")


def _loss_and_grads(student: Student, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    student.zero_grad()
    out = student(batch, with_nsp=True)
    loss = out["mlm_logits"].float().logsumexp(-1).mean() + out["nsp_logits"].float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in student.parameters() if p.grad is not None]


def test_the_kernel_call_gives_the_fallbacks_loss_and_gradients(monkeypatch):
    varlen_kernel.register_cpu_kernel()
    student = Student(model()).train()
    batch = collate([9, 14, 11, 16, 5])
    assert batch["layout"] == "unpadded"
    monkeypatch.setattr(attention, "varlen_path", lambda **kw: "fallback")
    loss, grads = _loss_and_grads(student, batch)
    monkeypatch.setattr(attention, "varlen_path", lambda **kw: "varlen")  # what CUDA picks for bf16
    varlen_kernel.CALLS.clear()
    loss_k, grads_k = _loss_and_grads(student, batch)
    assert varlen_kernel.CALLS == [batch["num_tokens"]] * student.config.num_hidden_layers  # every layer's
    torch.testing.assert_close(loss_k, loss, rtol=1e-5, atol=1e-5)
    assert len(grads_k) == len(grads)
    for got, want in zip(grads_k, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
