"""Document-aware packing (pipeline.data.collator.cut_documents, --packed_attention document): a packed
block attends within each of its documents, as if each document were a sequence of its own, and
TACO's positives and negatives respect the same boundaries."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.collator import MaskingCollator
from pipeline.data.masking import MaskingSpec
from pipeline.losses.sampling import negative_pool_indices, positive_positions
from pipeline.modeling.student import Student, run_encoder
from tests.support.batches import SPECIALS, V, model

CLS, SEP = 2, 3


def documents(seed: int = 0) -> list[np.ndarray]:
    """Three documents as the builder's packed stream holds them: each followed by [SEP]."""
    rng = np.random.default_rng(seed)
    return [np.r_[rng.integers(5, V, n), SEP] for n in (6, 9, 4)]


def packed_sample(tokens: np.ndarray, sample_id: int) -> dict:
    n = len(tokens)
    return {
        "input_ids": tokens.astype(np.uint16),
        "token_type_ids": np.zeros(n, np.uint8),
        "word_starts": np.ones(n, np.uint8),
        "sample_id": sample_id,
        "epoch": 0,
    }


def collator(*, documents: bool, mask_prob: float = 0.3) -> MaskingCollator:
    spec = MaskingSpec(mask_token_id=4, special_ids=SPECIALS, vocab_size=V, mask_prob=mask_prob)
    return MaskingCollator(
        spec=spec, pad_id=0, seed=0, nsp=False, max_seq_len=64, document_sep_id=SEP if documents else None
    )


def block_and_parts() -> tuple[np.ndarray, list[np.ndarray]]:
    """A block of [CLS] and three documents, and the same tokens cut where the block is cut."""
    d1, d2, d3 = documents()
    block = np.r_[CLS, d1, d2, d3]
    return block, [np.r_[CLS, d1], d2, d3]


def test_each_document_of_a_packed_block_gets_the_logits_it_gets_alone():
    block, parts = block_and_parts()
    net = model().eval()
    student = Student(net)
    batch = collator(documents=True)([packed_sample(block, 0), packed_sample(block, 1)])
    assert batch["layout"] == "unpadded" and batch["num_sequences"] == 6 and batch["num_samples"] == 2
    assert batch["position_ids"][: len(parts[0]) + 2].tolist() == [*range(len(parts[0])), 0, 1]
    with torch.no_grad():
        _, rows_TD, _, _ = run_encoder(student.encoder, batch, ids="original_ids")
        logits_TV = net.cls.predictions(rows_TD)
        start = 0
        for part in parts * 2:  # the second block's documents follow the first's
            alone = collator(documents=False)([packed_sample(part, 7)])
            assert alone["layout"] == "packed"
            _, alone_TD, _, _ = run_encoder(student.encoder, alone, ids="original_ids")
            expected_TV = net.cls.predictions(alone_TD)
            got_TV = logits_TV[start : start + len(part)]
            torch.testing.assert_close(got_TV, expected_TV, rtol=1e-5, atol=1e-5)
            start += len(part)
    # Attending across the whole block (the papers' packing) gives other logits for all but the first.
    whole = collator(documents=False)([packed_sample(block, 0)])
    with torch.no_grad():
        _, whole_TD, _, _ = run_encoder(student.encoder, whole, ids="original_ids")
    assert not torch.allclose(whole_TD[len(parts[0]) :], rows_TD[len(parts[0]) : len(block)], atol=1e-3)


def test_the_cut_keeps_the_masking_and_the_token_stream():
    block, _ = block_and_parts()
    other = np.resize(np.concatenate([[CLS], *documents(seed=1)]), len(block))  # a block that ends inside a document
    samples = [packed_sample(block, 3), packed_sample(other, 4)]
    cut, whole = collator(documents=True)(samples), collator(documents=False)(samples)
    assert whole["layout"] == "packed"
    # The model's rows are the same tokens in the same order; the same tokens are masked and predicted.
    assert torch.equal(cut["input_ids"], whole["input_ids"].flatten())
    assert torch.equal(cut["original_ids"], whole["original_ids"].flatten())
    assert torch.equal(cut["masked_index"], whole["masked_index"])
    assert torch.equal(cut["mlm_labels"], whole["mlm_labels"])
    assert cut["num_tokens"] == whole["num_tokens"] and cut["num_masked"] == whole["num_masked"]
    # Loop reference: a document starts at each row's start and after every [SEP] that is not last.
    lengths = []
    for s in samples:
        ids, n = s["input_ids"].tolist(), 0
        for i, t in enumerate(ids):
            n += 1
            if t == SEP and i < len(ids) - 1 or i == len(ids) - 1:
                lengths.append(n)
                n = 0
    assert np.diff(cut["cu_seqlens"].numpy()).tolist() == lengths
    assert cut["sum_len_sq"] == sum(n * n for n in lengths)
    assert cut["attention_mask"].sum(1).tolist() == lengths
    # The grid view agrees with the stream: every real token's grid cell holds its id.
    grid = torch.zeros(cut["attention_mask"].numel(), dtype=torch.int64)
    grid[cut["grid_index"]] = cut["original_ids"]
    assert torch.equal(grid.view_as(cut["attention_mask"])[cut["attention_mask"].bool()], cut["original_ids"])


def test_a_block_without_a_document_boundary_stays_packed():
    tokens = np.r_[CLS, np.arange(5, 5 + 15)]
    batch = collator(documents=True)([packed_sample(tokens, 0), packed_sample(tokens, 1)])
    assert batch["layout"] == "packed" and batch["num_sequences"] == 2


def test_tacos_positives_and_negatives_respect_the_document_boundaries():
    block, parts = block_and_parts()
    batch = collator(documents=True)([packed_sample(block, s) for s in range(4)])
    real_BL = batch["attention_mask"].bool()
    S, L = real_BL.shape
    anchors_N = batch["grid_index"]
    g = torch.Generator().manual_seed(0)
    u_N2 = torch.rand(len(anchors_N), 2, generator=g, dtype=torch.float64)
    has_two = real_BL.sum(1)[anchors_N // L] >= 2
    positives_N = positive_positions(u_N2[has_two], anchor_flat_N=anchors_N[has_two], real_BL=real_BL, window=5)
    assert torch.equal(positives_N // L, anchors_N[has_two] // L)  # the anchor's own document
    assert bool(real_BL.flatten()[positives_N].all()) and not bool((positives_N == anchors_N[has_two]).any())
    # Negatives: pool rows of *other* documents, including the other documents of the same block.
    pool_sequence_P = anchors_N // L
    u_NK = torch.rand(len(anchors_N), 50, generator=g, dtype=torch.float64)
    index_NK, ok_N = negative_pool_indices(u_NK, anchor_sequence_N=anchors_N // L, pool_sequence_P=pool_sequence_P)
    assert bool(ok_N.all())
    assert not bool((pool_sequence_P[index_NK] == (anchors_N // L)[:, None]).any())
    same_block = (pool_sequence_P[index_NK] // len(parts)) == ((anchors_N // L) // len(parts))[:, None]
    assert bool(same_block.any())
