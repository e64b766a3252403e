"""MLM and NSP cross-entropy: the BERT heads' losses, computed in fp32 whatever the input dtype.

Each returns (loss, metrics): an fp32 scalar to back-propagate and a dict of detached fp32 scalars
"loss", "acc" and "num_anchors".

Legend: N labelled rows, V vocabulary, M rows kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.data.masking import IGNORE_INDEX
from pipeline.losses.common import Metrics


def mlm_loss(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Masked-LM cross-entropy, mean over the labelled positions (labels != -100).

    In: logits [..., V] (any leading shape, e.g. [B, L, V] or only the masked rows [M, V]) and
    labels with the same leading shape. Only labelled rows are upcast to fp32, so a full-vocabulary
    bf16 head does not get copied whole. Out: (loss, {"loss", "acc", "num_anchors"}).
    """
    vocab = logits_NV.shape[-1]
    logits_NV = logits_NV.reshape(-1, vocab)
    labels_N = labels_N.reshape(-1)
    if logits_NV.shape[0] != labels_N.shape[0]:
        raise ValueError(f"mlm_loss: {logits_NV.shape[0]} logit rows but {labels_N.shape[0]} labels")
    labelled_N = labels_N != IGNORE_INDEX
    logits_MV = logits_NV[labelled_N].float()
    labels_M = labels_N[labelled_N]
    return _plain_cross_entropy(logits_MV, labels_M)


def nsp_loss(logits_N2: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Next-sentence-prediction cross-entropy (HF convention: label 0 = B follows A), mean over pairs.
    In: logits [N, 2], labels [N]. Out: (loss, {"loss", "acc", "num_anchors"})."""
    if logits_N2.shape[0] != labels_N.shape[0]:
        raise ValueError(f"nsp_loss: {logits_N2.shape[0]} logit rows but {labels_N.shape[0]} labels")
    return _plain_cross_entropy(logits_N2.float(), labels_N)


def _plain_cross_entropy(logits_MC: torch.Tensor, labels_M: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    count = labels_M.shape[0]
    # A sum over zero rows is 0 with a grad_fn, where a mean would be NaN.
    loss = F.cross_entropy(logits_MC, labels_M, reduction="sum") / max(count, 1)
    correct = (logits_MC.detach().argmax(-1) == labels_M).sum().float()
    metrics = {
        "loss": loss.detach(),
        "acc": correct / max(count, 1),
        "num_anchors": torch.tensor(float(count), device=logits_MC.device),
    }
    return loss, metrics

