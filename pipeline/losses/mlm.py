"""MLM and NSP cross-entropy: the BERT heads' losses, computed in fp32 whatever the input dtype.

Each returns (loss, metrics): an fp32 scalar to back-propagate and a dict of detached fp32 scalars,
"loss" and "acc" on the logits' device and "num_anchors" on the CPU (the host knows it: reading it
costs no device sync).

The MLM head's rows come compact (the masked positions only, labels without -100), so `mlm_loss`
needs no boolean mask on the device; its cross-entropy works through the rows in chunks and never
holds an fp32 copy of the [N, V] logits (`chunked_cross_entropy`). Labels with -100 (a full-vocabulary
head, or a caller's own) take the general path, which selects the labelled rows first.

Legend: N rows, V classes (vocabulary), n rows of a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.data.masking import IGNORE_INDEX
from pipeline.losses.common import Metrics

# fp32 elements of one chunk's working copy ([n, V]); 2**24 = 64 MB, 550 rows of BERT's 30522 tokens.
_CE_CHUNK_ELEMENTS = 1 << 24


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[label], and the count of rows whose argmax is the label.
    fp32 inside, chunk by chunk; saves only the input and the per-row logsumexp."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N):  # type: ignore[override]
        N, V = logits_NV.shape
        step = max(1, _CE_CHUNK_ELEMENTS // max(V, 1))
        lse_N = logits_NV.new_empty(N, dtype=torch.float32)
        target_N = logits_NV.new_empty(N, dtype=torch.float32)
        correct = logits_NV.new_zeros((), dtype=torch.float32)
        for start in range(0, N, step):
            x = logits_NV[start : start + step].float()
            y = labels_N[start : start + step]
            lse_N[start : start + step] = torch.logsumexp(x, dim=1)
            target_N[start : start + step] = x.gather(1, y[:, None]).squeeze(1)
            correct += (x.argmax(1) == y).sum()
        ctx.save_for_backward(logits_NV, labels_N, lse_N)
        ctx.step = step
        ctx.mark_non_differentiable(correct)
        return (lse_N - target_N).sum(), correct

    @staticmethod
    def backward(ctx, grad_sum, _grad_correct):  # type: ignore[override]
        logits_NV, labels_N, lse_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], ctx.step):
            chunk = slice(start, start + ctx.step)
            p = torch.exp(logits_NV[chunk].float() - lse_N[chunk, None])
            p.scatter_add_(1, labels_N[chunk, None], p.new_full((p.shape[0], 1), -1.0))
            grad_NV[chunk] = (p * grad_sum).to(grad_NV.dtype)
        return grad_NV, None


def chunked_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the rows' cross-entropy, number of rows predicted right), fp32, without an [N, V] fp32 copy.
    In: logits [N, V] of any float dtype, labels [N] int64 (no -100)."""
    return _ChunkedCrossEntropy.apply(logits_NV, labels_N)


def mlm_loss(logits_NV: torch.Tensor, labels_N: torch.Tensor, *, compact: bool = False) -> tuple[torch.Tensor, Metrics]:
    """Masked-LM cross-entropy, mean over the labelled positions.

    In: logits [..., V] and labels with the same leading shape. `compact=True`: every row is labelled
    (the trainer's masked-only rows): no selection, no device read. Otherwise rows with label -100 are
    left out first (only the labelled rows are upcast). Out: (loss, {"loss", "acc", "num_anchors"}).
    """
    vocab = logits_NV.shape[-1]
    logits_NV = logits_NV.reshape(-1, vocab)
    labels_N = labels_N.reshape(-1)
    if logits_NV.shape[0] != labels_N.shape[0]:
        raise ValueError(f"mlm_loss: {logits_NV.shape[0]} logit rows but {labels_N.shape[0]} labels")
    if not compact:
        labelled_N = labels_N != IGNORE_INDEX
        logits_NV, labels_N = logits_NV[labelled_N], labels_N[labelled_N]
    count = labels_N.shape[0]
    total, correct = chunked_cross_entropy(logits_NV, labels_N)
    # A sum over zero rows is 0 with a grad_fn, where a mean would be NaN.
    loss = total / max(count, 1)
    return loss, {"loss": loss.detach(), "acc": correct / max(count, 1), "num_anchors": _host(count)}


def _host(count: int) -> torch.Tensor:
    return torch.tensor(float(count))


def nsp_loss(logits_N2: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Next-sentence-prediction cross-entropy (HF convention: label 0 = B follows A), mean over pairs.
    In: logits [N, 2], labels [N]. Out: (loss, {"loss", "acc", "num_anchors"})."""
    if logits_N2.shape[0] != labels_N.shape[0]:
        raise ValueError(f"nsp_loss: {logits_N2.shape[0]} logit rows but {labels_N.shape[0]} labels")
    count = labels_N.shape[0]
    logits = logits_N2.float()
    loss = F.cross_entropy(logits, labels_N, reduction="sum") / max(count, 1)
    correct = (logits.detach().argmax(-1) == labels_N).sum().float()
    return loss, {"loss": loss.detach(), "acc": correct / max(count, 1), "num_anchors": _host(count)}
