"""A CPU implementation of torch's varlen attention op (torch.nn.attention.varlen, whose kernel only CUDA
has): exact bidirectional attention within each sequence, written out, forward and backward. With it
the tests run our call of the kernel (pipeline.modeling.attention), eagerly and compiled, on a CPU."""

from __future__ import annotations

import torch

CALLS: list[int] = []  # T of every forward call


def _bind(op, args, kwargs) -> dict:
    """The op's arguments by their schema names (the schema grows between torch releases)."""
    return {**dict(zip((a.name for a in op._schema.arguments), args)), **kwargs}


def _sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds, bounds[1:]))


def _forward(*args, **kwargs):
    """(out [T, H, E], logsumexp [H, T], rng state), as the op returns them."""
    a = _bind(torch.ops.torch_attn._varlen_attn.default, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    assert not a.get("is_causal") and q.shape == k.shape == v.shape and q.shape[0] == a["cu_seq_q"][-1]
    assert torch.equal(a["cu_seq_q"], a["cu_seq_k"]) and a["max_q"] == a["max_k"]
    CALLS.append(q.shape[0])
    scale = a.get("scale") or q.shape[-1] ** -0.5
    out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for s, e in _sequences(a["cu_seq_q"]):
        assert e - s <= a["max_q"]
        scores_HNM = torch.einsum("nhe,mhe->hnm", q[s:e].float(), k[s:e].float()) * scale
        out[s:e] = torch.einsum("hnm,mhe->nhe", scores_HNM.softmax(-1), v[s:e].float()).to(q.dtype)
        lse[:, s:e] = scores_HNM.logsumexp(-1)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _backward(*args, **kwargs):
    """dq, dk, dv of `_forward`, by hand (a kernel runs below autograd)."""
    a = _bind(torch.ops.torch_attn._varlen_attn_backward.default, args, kwargs)
    q, k, v, g = a["query"], a["key"], a["value"], a["grad_out"]
    scale = a.get("scale") or q.shape[-1] ** -0.5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in _sequences(a["cu_seq_q"]):
        Q, K, V, G = (x[s:e].float() for x in (q, k, v, g))
        P_HNM = (torch.einsum("nhe,mhe->hnm", Q, K) * scale).softmax(-1)
        dP_HNM = torch.einsum("nhe,mhe->hnm", G, V)
        dS_HNM = P_HNM * (dP_HNM - (dP_HNM * P_HNM).sum(-1, keepdim=True))
        dq[s:e] = torch.einsum("hnm,mhe->nhe", dS_HNM, K) * scale
        dk[s:e] = torch.einsum("hnm,nhe->mhe", dS_HNM, Q) * scale
        dv[s:e] = torch.einsum("hnm,nhe->mhe", P_HNM, G)
    return dq, dk, dv


def register_cpu_kernel() -> None:
    """For the rest of the process (a custom op's kernel cannot be taken back): nothing else calls these
    ops on a CPU, where pipeline.modeling.attention.varlen_path always picks the fallback."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward)
