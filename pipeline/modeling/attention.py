"""Self-attention without padding: the kernels the encoder calls, chosen per batch layout.

- Dense [B, L] batches with no padding (packed shards): SDPA with no mask at all, so CUDA runs its
  flash kernel and nothing reads the mask on the host.
- Dense batches with padding: SDPA with a boolean key mask (the padded reference path).
- Unpadded token streams [T] split by `cu_seqlens` (NSP pairs, and packed blocks cut at their
  documents): torch's varlen flash attention on CUDA when the projections reach it in bf16/fp16 (bf16
  weights, or any weights under autocast) and no attention dropout is asked for (the kernel has none:
  the trainer's default attention dropout is 0); otherwise the exact fallback: scatter the tokens into
  a [B, L_max] grid, SDPA with a key mask, gather them back. Only attention sees the grid; every other
  layer runs on the T real tokens. `varlen_path` says which, from what the call sees.

Legend: B sequences, L positions, T real tokens, H heads, E head size, D = H * E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Varlen:
    """Where the T real tokens of a batch sit: `cu_seqlens` [B + 1] int32 (token offsets of each
    sequence), `max_len` (host int), and `grid_index_T` [T] int64: each token's flat position in the
    [B, max_len] grid, for the fallback and for losses that want the padded view; `key_mask_BL` [B, max_len]
    bool (True = real token)."""

    cu_seqlens: torch.Tensor
    max_len: int
    grid_index_T: torch.Tensor
    key_mask_BL: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.key_mask_BL.shape[0]


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


_VARLEN = _varlen_kernel()


def varlen_path(*, device_type: str, dtype: torch.dtype, dropout_p: float, kernel: bool = True) -> str:
    """Which path `varlen_attention` takes for projections of `dtype` on `device_type` with attention
    dropout `dropout_p`: "varlen" (the fused kernel: CUDA, bf16/fp16, no dropout) or "fallback".
    `kernel`: whether this torch has the kernel (torch >= 2.10)."""
    fused = kernel and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and dropout_p == 0
    return "varlen" if fused else "fallback"


def dense_attention(
    q_BLD: torch.Tensor,
    k_BLD: torch.Tensor,
    v_BLD: torch.Tensor,
    *,
    heads: int,
    key_mask_BL: Optional[torch.Tensor],
    dropout_p: float,
) -> torch.Tensor:
    """Bidirectional attention over [B, L, D] projections. key_mask_BL None: every position is real."""
    B, L, D = q_BLD.shape
    q, k, v = (x.view(B, L, heads, D // heads).transpose(1, 2) for x in (q_BLD, k_BLD, v_BLD))
    mask = None if key_mask_BL is None else key_mask_BL[:, None, None, :]
    out_BHLE = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return out_BHLE.transpose(1, 2).reshape(B, L, D)


def varlen_attention(
    qkv_T3D: torch.Tensor,
    *,
    heads: int,
    cu_seqlens: torch.Tensor,
    max_len: int,
    grid_index_T: torch.Tensor,
    key_mask_BL: torch.Tensor,
    dropout_p: float,
) -> torch.Tensor:
    """Attention within each sequence of an unpadded stream of fused [T, 3D] query/key/value projections
    (see `Varlen` for the layout); returns [T, D]. The fused kernel where `varlen_path` allows it (decided
    from the projections' own dtype and device: static for torch.compile), else the exact fallback."""
    T, D = qkv_T3D.shape[0], qkv_T3D.shape[1] // 3
    path = varlen_path(
        device_type=qkv_T3D.device.type, dtype=qkv_T3D.dtype, dropout_p=dropout_p, kernel=_VARLEN is not None
    )
    if path == "varlen":
        q, k, v = qkv_T3D.view(T, 3, heads, D // heads).unbind(1)
        return _VARLEN(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len).reshape(T, D)
    # One scatter of the fused projections (not three): the grid is the only padded tensor.
    B = key_mask_BL.shape[0]
    grid_BL3D = qkv_T3D.new_zeros(B * max_len, 3 * D).index_copy(0, grid_index_T, qkv_T3D).view(B, max_len, 3 * D)
    out_BLD = dense_attention(*grid_BL3D.chunk(3, dim=-1), heads=heads, key_mask_BL=key_mask_BL, dropout_p=dropout_p)
    return out_BLD.reshape(B * max_len, D).index_select(0, grid_index_T)
