"""--compile: torch.compile of the encoder layers, in evaluation and in training, on CPU.

- the compiled encoder gives the eager logits, for batches of different token counts;
- one training step (forward, every loss term of the objective, backward) gives the eager gradients for
  every objective: each parameter's gradient within 1e-5 of its largest element (+ 1e-6) in fp32, the
  logged terms within 1e-4 relative (hidden dropout on: inductor draws it from the same generator as
  eager with `fallback_random`, which the test turns on so that the masks match). Element-wise relative
  bounds do not hold: fp32 sums in another order differ by ~3e-6 on gradients of ~1, and TACO's
  tau = 0.07 amplifies that;
- an encoder layer compiles into one graph, without a break, in training;
- 50 training steps of varying token counts compile the layer once (it is compiled dynamic in T).

Slow (inductor compiles C++), hence not in the unit tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from pipeline import objectives
from pipeline.data.collator import MaskingCollator
from pipeline.data.masking import MaskingSpec
from pipeline.modeling import attention
from pipeline.modeling.encoder import Encoder, layer_forward
from pipeline.modeling.student import Student, run_encoder
from pipeline.modeling.teacher import build_teacher
from pipeline.objectives import LossInputs
from pipeline.training.config import ObjectiveArgs
from tests.support import varlen_kernel
from tests.support.batches import SPECIALS, V, collate, model


@pytest.fixture(autouse=True)
def same_dropout_masks():
    import torch._inductor.config as inductor

    with inductor.patch(fallback_random=True):
        yield


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


def packed_documents(seed: int) -> dict:
    """Packed blocks of documents cut at [SEP] (the trainer's default for packed shards)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(4):
        ids = rng.integers(5, V, 24)
        ids[0], ids[rng.integers(3, 22, 2)] = 2, 3
        n = len(ids)
        samples.append(dict(input_ids=ids, token_type_ids=np.zeros(n), word_starts=np.ones(n), sample_id=i, epoch=0))
    spec = MaskingSpec(mask_token_id=4, special_ids=SPECIALS, vocab_size=V, mask_prob=0.3)
    return MaskingCollator(spec=spec, pad_id=0, seed=0, nsp=False, max_seq_len=64, document_sep_id=3)(samples)


def one_step(name: str, batch: dict, *, compile: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(gradients, logged terms) of one training step of objective `name`, from the same initial weights."""
    objective = objectives.get(name)
    net = model()
    net.config.hidden_dropout_prob = 0.1  # training mode as the trainer runs it: hidden dropout on
    student = Student(net, compile=compile).train()
    teacher = Encoder(build_teacher(student, dtype=torch.float32, device=torch.device("cpu")), compile=compile)
    nsp = "nsp_labels" in batch
    torch.manual_seed(1)
    out = student(batch, with_embeddings=objective.needs_embeddings, with_nsp=nsp)
    inputs = LossInputs(args=ObjectiveArgs(objective=name), teacher=teacher, generator=torch.Generator().manual_seed(2))
    res = objective.losses(out, batch, nsp=nsp, inputs=inputs)
    res.total.backward()
    grads = {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}
    return grads, {k: float(v) for k, v in res.values.items()}


@pytest.mark.parametrize("name,layout", [("mlm", "unpadded"), ("tacl", "unpadded"), ("taco", "documents")])
def test_compiled_training_step_gives_the_eager_gradients(name, layout):
    batch = collate([9, 14, 6, 11]) if layout == "unpadded" else packed_documents(0)
    assert batch["layout"] == "unpadded"
    eager, eager_terms = one_step(name, batch, compile=False)
    compiled, compiled_terms = one_step(name, batch, compile=True)
    assert compiled.keys() == eager.keys() and len(eager) > 20
    for key in eager_terms:
        assert compiled_terms[key] == pytest.approx(eager_terms[key], rel=1e-4, abs=1e-6), key
    for key, g in eager.items():
        bound = 1e-5 * float(g.abs().max()) + 1e-6
        torch.testing.assert_close(compiled[key], g, rtol=0, atol=bound, msg=key)


def layer_args(batch: dict, net) -> tuple:
    encoder = Encoder(net.bert)
    from pipeline.modeling.attention import Varlen
    from pipeline.modeling.encoder import embed

    layout = Varlen(
        cu_seqlens=batch["cu_seqlens"],
        max_len=batch["max_len"],
        grid_index_T=batch["grid_index"],
        key_mask_BL=batch["attention_mask"].bool(),
    )
    x = embed(net.bert, batch["input_ids"], batch["token_type_ids"], batch["position_ids"])
    return (net.bert.encoder.layer[0], x, layout.key_mask_BL, layout.cu_seqlens, layout.grid_index_T, layout.max_len), {
        "heads": encoder.heads,
        "attention_dropout": encoder.attention_dropout,
    }


def test_an_encoder_layer_compiles_without_a_graph_break_in_training():
    net = model().train()
    args, kwargs = layer_args(collate([9, 14, 6, 11]), net)
    explained = torch._dynamo.explain(layer_forward)(*args, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_varying_token_counts_compile_the_layer_once():
    torch._dynamo.reset()
    counters.clear()
    net = model()
    net.config.hidden_dropout_prob = 0.1
    student = Student(net, compile=True).train()
    rng = np.random.default_rng(0)
    totals = set()
    for step in range(50):
        batch = collate(rng.integers(6, 40, 4).tolist(), seed=step)
        totals.add(batch["num_tokens"])
        out = student(batch, with_nsp=True)
        (out["mlm_logits"].float().logsumexp(1).mean() + out["nsp_logits"].sum()).backward()
    assert len(totals) > 30  # the token count really varied
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The teacher's forward (eval, no gradient) is one more graph, also shared by every token count.
    teacher = Encoder(net.bert, compile=True)
    net.eval()
    with torch.no_grad():
        for step in range(5):
            run_encoder(teacher, collate(rng.integers(6, 40, 4).tolist(), seed=step), ids="original_ids")
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.skipif(attention._VARLEN is None, reason="torch < 2.10 has no varlen kernel")
def test_the_varlen_kernel_call_compiles_into_one_graph(monkeypatch):
    """The layer as CUDA compiles it for bf16 (the varlen kernel's op; a CPU implementation of it here,
    tests.support.varlen_kernel): fullgraph (a break raises), one graph for layouts of different T, B
    and max_len, the eager layer's output and input gradient."""
    varlen_kernel.register_cpu_kernel()
    monkeypatch.setattr(attention, "varlen_path", lambda **kw: "varlen")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer_forward, dynamic=True, fullgraph=True, backend="aot_eager")
    net = model().train()
    for lengths in ([9, 14, 11], [5, 16, 7, 12], [16, 15]):
        (layer, x, *layout), kwargs = layer_args(collate(lengths), net)
        x = x.detach().requires_grad_()
        results = []
        for fn in (compiled, layer_forward):
            x.grad = None
            y = fn(layer, x, *layout, **kwargs)
            y.square().sum().backward()
            results.append((y.detach(), x.grad.clone()))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
