"""Our encoder against Hugging Face's BertForPreTraining forward on the same weights: the unpadded
layout (NSP pairs as one token stream) and the packed layout (no mask) give HF's padded logits,
losses and gradients; the collator's indices agree with its padded view; --compile changes nothing."""

from __future__ import annotations

import pytest
import torch

from pipeline import losses
from pipeline.data.collator import MaskingCollator, grid_inputs
from pipeline.data.masking import MaskingSpec
from pipeline.modeling.student import Student
from tests.support.batches import SPECIALS, V, collate, model, samples


def hf_reference(net, batch):
    """HF's own padded forward on the batch's grid view of the masked inputs: masked-row logits
    (row-major), NSP logits, last hidden states, the real positions."""
    g = grid_inputs({**batch, "original_ids": batch["input_ids"]})
    ref = net(**g, output_hidden_states=True)
    masked = batch["masked"]
    return ref.prediction_logits[masked], ref.seq_relationship_logits, ref.hidden_states[-1], g["attention_mask"].bool()


def test_collator_layouts_and_indices():
    b = collate([9, 14, 6])
    assert b["layout"] == "unpadded" and b["num_tokens"] == 29 and b["max_len"] == 14
    assert b["input_ids"].shape == (29,) and b["cu_seqlens"].tolist() == [0, 9, 23, 29]
    assert b["position_ids"].tolist()[:10] == list(range(9)) + [0]
    # The grid view and the stream hold the same tokens; the masked rows agree in both coordinates.
    grid = grid_inputs(b)["input_ids"].reshape(-1)
    assert torch.equal(grid[b["grid_index"]], b["original_ids"])
    assert torch.equal(b["grid_index"][b["masked_index"]], b["masked_grid_index"])
    assert torch.equal(b["masked"].reshape(-1).nonzero().squeeze(1), b["masked_grid_index"])
    assert torch.equal(b["original_ids"][b["masked_index"]], b["mlm_labels"])
    assert b["num_masked"] == len(b["mlm_labels"]) and b["sum_len_sq"] == 81 + 196 + 36
    packed = collate([12, 12], nsp=False)
    assert packed["layout"] == "packed" and packed["input_ids"].shape == (2, 12)
    assert collate([9, 14], padding="keep")["layout"] == "padded"


def test_masking_does_not_depend_on_the_batch():
    """A sample is masked the same alone, in another batch, or padded to another length."""
    alone = collate([9], seed=0)
    spec = MaskingSpec(mask_token_id=4, special_ids=SPECIALS, vocab_size=V, mask_prob=0.3)
    together = MaskingCollator(spec=spec, pad_id=0, seed=0, nsp=True, max_seq_len=64, padding="keep")(
        samples([9], seed=0) + [dict(samples([20], seed=5)[0], sample_id=7)]
    )
    assert torch.equal(together["input_ids"][0, :9], alone["input_ids"][0])  # alone: a packed [1, 9] batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_nsp_equals_hf_padded_forward(dtype):
    net = model(dtype).eval()
    batch = collate([9, 14, 6, 11])
    with torch.no_grad():
        out = Student(net)(batch, with_nsp=True)
        mlm, nsp, hidden, real = hf_reference(net, batch)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out["mlm_logits"], mlm, **tol)
    torch.testing.assert_close(out["nsp_logits"], nsp, **tol)
    torch.testing.assert_close(out["hidden"][real], hidden[real], **tol)
    assert (out["hidden"][~real] == 0).all()  # the grid view is zero at padding


def test_unpadded_losses_and_gradients_equal_hf():
    net_a, net_b = model(), model()
    batch = collate([9, 14, 6, 11])
    out = Student(net_a)(batch, with_nsp=True)
    loss_a = (
        losses.mlm_loss(out["mlm_logits"], batch["mlm_labels"], compact=True)[0]
        + losses.nsp_loss(out["nsp_logits"], batch["nsp_labels"])[0]
    )
    loss_a.backward()
    mlm, nsp, _, _ = hf_reference(net_b, batch)
    loss_b = torch.nn.functional.cross_entropy(mlm, batch["mlm_labels"]) + torch.nn.functional.cross_entropy(
        nsp, batch["nsp_labels"]
    )
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(net_a.named_parameters(), net_b.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_batches_run_without_a_mask_and_equal_hf():
    net = model().eval()
    batch = collate([16, 16, 16], nsp=False)
    with torch.no_grad():
        out = Student(net)(batch, with_embeddings=True)
        ref = net(**grid_inputs({**batch, "original_ids": batch["input_ids"]}), output_hidden_states=True)
    torch.testing.assert_close(out["mlm_logits"], ref.prediction_logits[batch["masked"]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["embeddings"], ref.hidden_states[0], rtol=1e-5, atol=1e-5)


def test_chunked_cross_entropy_equals_torch_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 1000, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 1000, (37,), generator=g)
    import pipeline.losses.mlm as mlm

    old, mlm._CE_CHUNK_ELEMENTS = mlm._CE_CHUNK_ELEMENTS, 5000  # several chunks
    try:
        total, correct = mlm.chunked_cross_entropy(logits, labels)
    finally:
        mlm._CE_CHUNK_ELEMENTS = old
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    torch.testing.assert_close(total.double(), ref, rtol=1e-6, atol=1e-6)
    assert correct.item() == (logits.argmax(1) == labels).sum().item()
    (grad,) = torch.autograd.grad(total, logits)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    # bf16 logits: fp32 inside, no [N, V] fp32 tensor kept for backward.
    half = logits.detach().bfloat16().requires_grad_(True)
    t16, _ = mlm.chunked_cross_entropy(half, labels)
    torch.testing.assert_close(
        t16.double(), torch.nn.functional.cross_entropy(half.double(), labels, reduction="sum"), rtol=1e-4, atol=1e-3
    )
