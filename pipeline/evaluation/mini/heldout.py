"""Held-out masked-LM accuracy: how far a model's MLM has left the floor.

Blocks of max_seq_len tokens ([CLS] ... [SEP]) from held-out documents, 15% of the inner tokens
masked (all by [MASK], no random/kept tokens: the evaluation convention), the same positions for every
model (a fixed generator). The floor is what always predicting the held-out text's most frequent token
scores on the same positions.

Shape legend: N blocks, L tokens, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

MASK_SHARE = 0.15


def heldout_blocks(tokenizer, path: Path, *, max_seq_len: int, max_blocks: int) -> torch.Tensor:
    """ids_NL: the held-out file's documents, tokenised and cut into full blocks."""
    from pipeline.evaluation.mini.data import read_documents

    ids: list[int] = []
    for doc in read_documents(path):
        ids += tokenizer(" ".join(doc), add_special_tokens=False)["input_ids"]
    inner = max_seq_len - 2
    n = min(max_blocks, len(ids) // inner)
    if n == 0:
        raise ValueError(f"{path}: fewer than {inner} tokens of held-out text")
    body_NL = torch.tensor(ids[: n * inner]).view(n, inner)
    cls = torch.full((n, 1), tokenizer.cls_token_id)
    sep = torch.full((n, 1), tokenizer.sep_token_id)
    return torch.cat([cls, body_NL, sep], dim=1)


def mask_positions(ids_NL: torch.Tensor, *, seed: int) -> torch.Tensor:
    """bool_NL: MASK_SHARE of the inner positions (never [CLS]/[SEP]), drawn by a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    draw_NL = torch.rand(ids_NL.shape, generator=g)
    draw_NL[:, 0] = draw_NL[:, -1] = 2.0
    return draw_NL < MASK_SHARE


@torch.no_grad()
def mlm_accuracy(model_dir: Path, path: Path, *, max_seq_len: int, max_blocks: int = 64, seed: int = 0) -> dict:
    """{accuracy, floor, masked}: top-1 accuracy at the masked positions, and the floor (module doc)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    ids_NL = heldout_blocks(tokenizer, path, max_seq_len=max_seq_len, max_blocks=max_blocks)
    masked_NL = mask_positions(ids_NL, seed=seed)
    inputs_NL = ids_NL.masked_fill(masked_NL, tokenizer.mask_token_id)
    correct = 0
    for start in range(0, len(ids_NL), 16):
        logits_BLV = model(input_ids=inputs_NL[start : start + 16]).logits
        m_BL = masked_NL[start : start + 16]
        correct += int((logits_BLV[m_BL].argmax(-1) == ids_NL[start : start + 16][m_BL]).sum())
    gold = ids_NL[masked_NL]
    inner = ids_NL[:, 1:-1].reshape(-1)
    most_frequent = int(torch.bincount(inner).argmax())
    return {
        "accuracy": correct / len(gold),
        "floor": float((gold == most_frequent).float().mean()),
        "masked": len(gold),
    }
