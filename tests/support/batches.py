"""Collated batches of synthetic NSP samples and a tiny dropout-free BERT, for the encoder tests."""

from __future__ import annotations

import numpy as np
import torch
from transformers import BertForPreTraining

from pipeline.data.collator import MaskingCollator
from pipeline.data.masking import MaskingSpec
from pipeline.modeling.bert_config import bert_config

V = 60
SPECIALS = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK]


def samples(lengths, *, seed=0, nsp=True):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        a = n // 2
        ids = np.concatenate([[2], rng.integers(5, V, a - 2), [3], rng.integers(5, V, n - a - 1), [3]])
        types = np.r_[np.zeros(a), np.ones(n - a)].astype(np.uint8)
        s = {
            "input_ids": ids.astype(np.uint16),
            "token_type_ids": types,
            "word_starts": np.ones(n, np.uint8),
            "sample_id": 100 + i,
            "epoch": 0,
        }
        if nsp:
            s["nsp_label"] = i % 2
        out.append(s)
    return out


def collate(lengths, *, padding="remove", nsp=True, seed=0):
    spec = MaskingSpec(mask_token_id=4, special_ids=SPECIALS, vocab_size=V, mask_prob=0.3)
    return MaskingCollator(spec=spec, pad_id=0, seed=0, nsp=nsp, max_seq_len=64, padding=padding)(
        samples(lengths, seed=seed, nsp=nsp)
    )


def model(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = bert_config("tiny", vocab_size=V)
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    return BertForPreTraining(cfg).to(dtype)
