"""TACO's per-anchor loss as one autograd Function that works through the anchors in chunks.

For a chunk of n anchors it forms their rows g = hidden - embeddings and their positives' rows,
scores the anchors against the whole pool with one [n, D] x [D, P] GEMM, picks each anchor's K
negative logits from it, and keeps only the logits [n, K+1] and the inverse norms for the
backward, which re-forms the rows. So no [B, L, K, D] tensor, no [N, P] logits and not even a
[B, L, D] copy of g exist at once: memory is O(chunk * (D + P) + N * K).

The backward is written out because autograd over normalize, index and subtract made ~30 passes
over [N, D] tensors and dominated the time. With u = g / |g| and v = dl/du, the gradient of the
normalisation is (v - u (u.v)) / |g|, and u.v needs no pass over D: it is tau times the sum of the
logits weighted by their gradients, which the saved logits give.

Legend: M = B*L rows of the flattened batch, N anchors, P pool rows, K negatives, D hidden size,
n anchors in a chunk.
"""

from __future__ import annotations

import torch

_EPS = 1e-12  # as F.normalize: x / max(|x|, eps)
# Largest [chunk, max(P, D)] block held at once.
_CHUNK_ELEMENTS = 1 << 21


class _Rows:
    """g rows of a chunk: anchors by slicing when they are all M rows (no gather), else gathered."""

    def __init__(self, hidden_MD, embeddings_MD, anchor_N):
        self.hidden_MD, self.embeddings_MD, self.anchor_N = hidden_MD, embeddings_MD, anchor_N
        self.all_rows = anchor_N.shape[0] == hidden_MD.shape[0]  # anchors are unique and ascending
        # fp32 (float64 stays float64, which gradcheck needs).
        self.dtype = torch.promote_types(hidden_MD.dtype, torch.float32)

    def gather(self, index_n):
        h = self.hidden_MD.index_select(0, index_n).to(self.dtype)
        return h.sub_(self.embeddings_MD.index_select(0, index_n).to(self.dtype))

    def anchors(self, chunk: slice):
        if self.all_rows:
            return self.hidden_MD[chunk].to(self.dtype) - self.embeddings_MD[chunk].to(self.dtype)
        return self.gather(self.anchor_N[chunk])


class _TacoLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_MD, embeddings_MD, pool_PD, anchor_N, positive_N, negative_NK, inverse_tau, detach):  # type: ignore[override]
        N, K = negative_NK.shape
        rows = _Rows(hidden_MD, embeddings_MD, anchor_N)
        step = max(1, _CHUNK_ELEMENTS // max(pool_PD.shape[0], hidden_MD.shape[1]))
        logits_NC = pool_PD.new_empty(N, K + 1)
        log_z_N = pool_PD.new_empty(N)
        inverse_anchor_N, inverse_positive_N = pool_PD.new_empty(N), pool_PD.new_empty(N)
        for start in range(0, N, step):
            chunk = slice(start, start + step)
            a_nD, p_nD = rows.anchors(chunk), rows.gather(positive_N[chunk])
            inv_a_n = 1.0 / torch.linalg.vector_norm(a_nD, dim=1).clamp_min(_EPS)
            inv_p_n = 1.0 / torch.linalg.vector_norm(p_nD, dim=1).clamp_min(_EPS)
            scale_n = inv_a_n * inverse_tau
            logits_NC[chunk, 0] = torch.linalg.vecdot(a_nD, p_nD, dim=1) * inv_p_n * scale_n
            logits_NC[chunk, 1:] = (a_nD @ pool_PD.T).gather(1, negative_NK[chunk]) * scale_n[:, None]
            log_z_N[chunk] = torch.logsumexp(logits_NC[chunk], dim=1)
            inverse_anchor_N[chunk], inverse_positive_N[chunk] = inv_a_n, inv_p_n
        correct_N = logits_NC[:, 0] > logits_NC[:, 1:].max(dim=1).values
        ctx.save_for_backward(
            hidden_MD, embeddings_MD, pool_PD, anchor_N, positive_N, negative_NK, logits_NC, log_z_N, inverse_anchor_N,
            inverse_positive_N,
        )  # fmt: skip
        ctx.inverse_tau, ctx.detach, ctx.step = inverse_tau, detach, step
        ctx.mark_non_differentiable(correct_N)
        return log_z_N - logits_NC[:, 0], correct_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_correct):  # type: ignore[override]
        (hidden_MD, embeddings_MD, pool_PD, anchor_N, positive_N, negative_NK, logits_NC, log_z_N, inverse_anchor_N,
         inverse_positive_N) = ctx.saved_tensors  # fmt: skip
        need_rows = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_pool = ctx.needs_input_grad[2]
        rows = _Rows(hidden_MD, embeddings_MD, anchor_N)
        M, D = hidden_MD.shape
        # d loss / d logits = softmax - onehot(positive), times the incoming gradient.
        grad_logits_NC = torch.exp(logits_NC - log_z_N[:, None]) * grad_loss_N[:, None]
        grad_logits_NC[:, 0] -= grad_loss_N
        # u.v of the anchor normalisation (module docstring), per anchor, in units of 1/tau.
        radial_N = (grad_logits_NC * logits_NC).sum(1)
        unclamped_a_N = inverse_anchor_N < 1.0 / _EPS
        unclamped_p_N = inverse_positive_N < 1.0 / _EPS
        # Anchors are all rows and nothing else gets a gradient: write each chunk's result in place.
        direct = rows.all_rows and ctx.detach
        grad_MD = None
        if need_rows:
            grad_MD = (torch.empty if direct else torch.zeros)((M, D), dtype=pool_PD.dtype, device=pool_PD.device)
        grad_pool_PD = torch.zeros_like(pool_PD) if need_pool else None
        for start in range(0, anchor_N.shape[0], ctx.step):
            chunk = slice(start, start + ctx.step)
            a_nD, p_nD = rows.anchors(chunk), rows.gather(positive_N[chunk])
            inv_a_n, inv_p_n = inverse_anchor_N[chunk], inverse_positive_N[chunk]
            grad_positive_n = grad_logits_NC[chunk, 0] * ctx.inverse_tau
            grad_negative_nP = grad_logits_NC.new_zeros(a_nD.shape[0], pool_PD.shape[0])
            grad_negative_nP.scatter_add_(1, negative_NK[chunk], grad_logits_NC[chunk, 1:] * ctx.inverse_tau)
            if need_rows:
                # grad_a = (v - u (u.v)) / |a|, v = g_pos * p / |p| + G @ pool, built in place.
                out_nD = grad_MD[chunk] if direct else torch.empty_like(a_nD)
                torch.mm(grad_negative_nP, pool_PD, out=out_nD)
                out_nD.addcmul_(p_nD, (grad_positive_n * inv_p_n)[:, None])
                radial_n = torch.where(unclamped_a_N[chunk], radial_N[chunk] * inv_a_n, 0.0)
                out_nD.addcmul_(a_nD, -radial_n[:, None])
                out_nD.mul_(inv_a_n[:, None])
                if rows.all_rows and not direct:
                    grad_MD[chunk] += out_nD  # positives of other chunks may already be there
                elif not rows.all_rows:
                    grad_MD.index_add_(0, anchor_N[chunk], out_nD)
                if not ctx.detach:
                    # v_p = g_pos * a / |a|; u_p.v_p = g_pos * cos = g_pos * tau * logit_pos.
                    cos_n = logits_NC[chunk, 0] / ctx.inverse_tau
                    radial_p_n = torch.where(unclamped_p_N[chunk], grad_positive_n * cos_n * inv_p_n, 0.0)
                    grad_p_nD = a_nD * (grad_positive_n * inv_a_n)[:, None]
                    grad_p_nD.addcmul_(p_nD, -radial_p_n[:, None]).mul_(inv_p_n[:, None])
                    grad_MD.index_add_(0, positive_N[chunk], grad_p_nD)
            if need_pool:
                # d/d pool = G^T @ (a / |a|): scale G's rows, not a's.
                grad_pool_PD.addmm_((grad_negative_nP * inv_a_n[:, None]).T, a_nD)
        grad_hidden = grad_MD.to(hidden_MD.dtype) if need_rows and ctx.needs_input_grad[0] else None
        grad_embeddings = (-grad_MD).to(embeddings_MD.dtype) if need_rows and ctx.needs_input_grad[1] else None
        return grad_hidden, grad_embeddings, grad_pool_PD, None, None, None, None, None


def taco_anchor_losses(
    hidden_MD: torch.Tensor,
    embeddings_MD: torch.Tensor,
    pool_PD: torch.Tensor,
    *,
    anchor_N: torch.Tensor,
    positive_N: torch.Tensor,
    negative_NK: torch.Tensor,
    temperature: float,
    detach: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor TACO losses l_n = logsumexp([s_pos, s_neg_1..K]) - s_pos, s = cosine / tau.

    In: hidden_MD, embeddings_MD [M, D] (g = hidden - embeddings, computed in fp32); pool_PD [P, D]
    L2-normalised fp32 (gets a gradient if it requires one); anchor_N int64 row indices, unique and
    ascending; positive_N int64 row indices; negative_NK int64 pool indices. `detach=True`: the
    positives get no gradient (the pool gets one only if it requires it).
    Out: loss_N fp32, correct_N bool (the positive strictly above every negative).
    """
    return _TacoLoss.apply(
        hidden_MD, embeddings_MD, pool_PD, anchor_N, positive_N, negative_NK, 1.0 / temperature, detach
    )
