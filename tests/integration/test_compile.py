"""--compile: torch.compile of the encoder layers gives the eager logits on CPU, for batches of
different token counts (one compiled graph, dynamic in T). Slow (inductor compiles C++), hence
not in the unit tier."""

from __future__ import annotations

import torch

from pipeline.modeling.student import Student
from tests.support.batches import V, collate, model


def test_compiled_encoder_equals_eager():
    net = model().eval()
    batch = collate([9, 14, 6, 11])
    with torch.no_grad():
        eager = Student(net)(batch, with_nsp=True)
        compiled = Student(net, compile=True)(batch, with_nsp=True)
        again = Student(net, compile=True)(collate([7, 12, 10, 5], seed=3), with_nsp=True)  # other lengths
    torch.testing.assert_close(compiled["mlm_logits"], eager["mlm_logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled["nsp_logits"], eager["nsp_logits"], rtol=1e-4, atol=1e-4)
    assert again["mlm_logits"].shape[1] == V
