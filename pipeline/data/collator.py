"""The masking collator: pads a list of samples to the longest one and masks it (pipeline.data.masking).

Legend: B sequences per micro-batch, L the longest sequence of the batch, N masked positions of
the batch (row-major order).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from pipeline.data.masking import IGNORE_INDEX, MaskingSpec, mask_sequence, sample_rng
from pipeline.data.padding import pad_right
from pipeline.data.shards import ShardError


class MaskingCollator:
    """Pads a list of samples to the longest one and masks it (pipeline.data.masking).

    Out (torch tensors): input_ids_BL (masked), original_ids_BL, token_type_ids_BL, attention_mask_BL
    (1 = real token), masked_BL (bool), mlm_labels_N (the original ids at masked_BL, row-major),
    sample_ids_B, and nsp_labels_B when `nsp`.
    """

    def __init__(self, *, spec: MaskingSpec, pad_id: int, seed: int, nsp: bool, max_seq_len: Optional[int]) -> None:
        self.spec = spec
        self.pad_id = pad_id
        self.seed = seed
        self.nsp = nsp
        self.max_seq_len = max_seq_len
        self.pool = spec.replacement_pool()

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        L = max(len(s["input_ids"]) for s in samples)
        if self.max_seq_len is not None and L > self.max_seq_len:
            sid = next(s["sample_id"] for s in samples if len(s["input_ids"]) == L)
            raise ShardError(f"sample {sid} has {L} tokens, more than max_seq_len {self.max_seq_len}")
        ids = [np.asarray(s["input_ids"], np.int64) for s in samples]
        masked, labels = [], []
        for s, ids_L in zip(samples, ids):
            rng = sample_rng(seed=self.seed, epoch=int(s.get("epoch", 0)), sample_id=int(s["sample_id"]))
            masked_L, labels_L = mask_sequence(ids_L, word_starts_L=np.asarray(s["word_starts"]), spec=self.spec,
                                               replacement_pool=self.pool, rng=rng)
            masked.append(masked_L)
            labels.append(labels_L)
        labels_BL = pad_right(labels, fill=IGNORE_INDEX)
        masked_BL = labels_BL != IGNORE_INDEX
        batch = {
            "input_ids": torch.from_numpy(pad_right(masked, fill=self.pad_id)),
            "original_ids": torch.from_numpy(pad_right(ids, fill=self.pad_id)),
            "token_type_ids": torch.from_numpy(pad_right([s["token_type_ids"] for s in samples], fill=0)),
            "attention_mask": torch.from_numpy(pad_right([np.ones(len(x), np.int64) for x in ids], fill=0)),
            "masked": torch.from_numpy(masked_BL),
            "mlm_labels": torch.from_numpy(labels_BL[masked_BL]),
            "sample_ids": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.int64),
        }
        if self.nsp:
            batch["nsp_labels"] = torch.tensor([int(s["nsp_label"]) for s in samples], dtype=torch.int64)
        return batch
