"""Held-out masked-LM accuracy and cross-entropy: how far a model's MLM has left the floor.

Blocks of max_seq_len tokens ([CLS] ... [SEP]) from held-out documents, 15% of the inner tokens
masked (all by [MASK], no random/kept tokens: the evaluation convention), the same positions for every
model (a fixed generator). The floor is what always predicting the held-out text's most frequent token
scores on the same positions.

Accuracy is coarse early in pre-training: a model can take something from context and still rank the
most frequent token first everywhere. So the same positions also get the model's cross-entropy and that
of a unigram model of the pre-training text (its token frequencies): below the unigram, the model uses
context; at it, it has learned token frequencies only.

Shape legend: N blocks, L tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.experiments.mini.data import LANGS, read_documents

MASK_SHARE = 0.15


def _token_ids(tokenizer, path: Path) -> list[int]:
    ids: list[int] = []
    for doc in read_documents(path):
        ids += tokenizer(" ".join(doc), add_special_tokens=False)["input_ids"]
    return ids


def heldout_blocks(tokenizer, path: Path, *, max_seq_len: int, max_blocks: int) -> torch.Tensor:
    """ids_NL: the held-out file's documents, tokenised and cut into full blocks."""
    ids = _token_ids(tokenizer, path)
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


def unigram_log_probs(tokenizer, path: Path) -> torch.Tensor:
    """logp_V: token frequencies of a (pre-training) text file, add-half smoothed so that a token the
    text never has costs a finite amount."""
    counts_V = torch.bincount(torch.tensor(_token_ids(tokenizer, path), dtype=torch.long), minlength=len(tokenizer))
    probs_V = (counts_V.double() + 0.5) / (counts_V.sum() + 0.5 * len(counts_V))
    return probs_V.log()


@dataclass
class HeldOut:
    """One language's held-out positions and what does not depend on the model scored on them."""

    ids_NL: torch.Tensor
    masked_NL: torch.Tensor
    inputs_NL: torch.Tensor  # ids_NL with [MASK] at masked_NL
    floor: float
    unigram_cross_entropy: float


def prepare(tokenizer, heldout: Path, train: Path, *, max_seq_len: int, max_blocks: int = 64, seed: int = 0) -> HeldOut:
    """The held-out blocks and masked positions (module doc), the floor, and the cross-entropy there of
    a unigram model of the pre-training text `train`. Every model shares the tokenizer, so this is done
    once per language, not once per model."""
    ids_NL = heldout_blocks(tokenizer, heldout, max_seq_len=max_seq_len, max_blocks=max_blocks)
    masked_NL = mask_positions(ids_NL, seed=seed)
    gold = ids_NL[masked_NL]
    most_frequent = int(torch.bincount(ids_NL[:, 1:-1].reshape(-1)).argmax())
    return HeldOut(
        ids_NL=ids_NL,
        masked_NL=masked_NL,
        inputs_NL=ids_NL.masked_fill(masked_NL, tokenizer.mask_token_id),
        floor=float((gold == most_frequent).float().mean()),
        unigram_cross_entropy=float(-unigram_log_probs(tokenizer, train)[gold].mean()),
    )


@torch.no_grad()
def mlm_accuracy(model_dir: Path, held: HeldOut) -> dict:
    """{accuracy, floor, masked, cross_entropy, unigram_cross_entropy}: the model's top-1 accuracy and
    mean cross-entropy (nats) at the held-out masked positions, beside the floor and the unigram's."""
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    correct, nll = 0, 0.0
    for start in range(0, len(held.ids_NL), 16):
        logits_BLV = model(input_ids=held.inputs_NL[start : start + 16]).logits
        m_BL = held.masked_NL[start : start + 16]
        logits_MV, gold_M = logits_BLV[m_BL].float(), held.ids_NL[start : start + 16][m_BL]
        correct += int((logits_MV.argmax(-1) == gold_M).sum())
        nll += float(torch.nn.functional.cross_entropy(logits_MV, gold_M, reduction="sum"))
    masked = int(held.masked_NL.sum())
    return {
        "accuracy": correct / masked,
        "floor": held.floor,
        "masked": masked,
        "cross_entropy": nll / masked,
        "unigram_cross_entropy": held.unigram_cross_entropy,
    }


def heldout_scores(models: dict[str, Path], *, data: Path, max_seq_len: int, seed: int) -> dict:
    """{label: {lang: mlm_accuracy(...)}}: every model's held-out MLM accuracy and cross-entropy, on the
    same blocks and positions per language (data/heldout_LANG.txt; the unigram of data/train_LANG.txt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))  # one joint vocabulary for all
    held = {
        lang: prepare(
            tokenizer, data / f"heldout_{lang}.txt", data / f"train_{lang}.txt", max_seq_len=max_seq_len, seed=seed
        )
        for lang in LANGS
    }
    return {label: {lang: mlm_accuracy(path, held[lang]) for lang in LANGS} for label, path in models.items()}
