"""Tiny BERT folders built in code for the analysis and fine-tuning tests (no downloads)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tokenizer(folder: Path, words: Sequence[str]):
    """A WordPiece BertTokenizerFast over SPECIALS + words, saved into `folder`; returns it."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join([*SPECIALS, *dict.fromkeys(words)]) + "\n", encoding="utf-8")
    tok = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True, tokenize_chinese_chars=True)
    tok.save_pretrained(folder)
    return tok


def write_tiny_bert(
    folder: Path, words: Sequence[str], *, seed: int = 0, hidden: int = 32, layers: int = 2, head: str = "pretraining"
):
    """A randomly initialised tiny BERT + tokenizer saved as an HF folder (as the trainer exports)."""
    import torch
    from transformers import BertConfig, BertForPreTraining, BertModel

    tok = write_tokenizer(folder, words)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForPreTraining(cfg) if head == "pretraining" else BertModel(cfg)
    model.save_pretrained(folder)
    return folder
