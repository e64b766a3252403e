"""The BERT encoder's forward pass, written over Hugging Face's own modules.

The weights stay exactly those of `transformers.BertModel` (so checkpoints and exports are plain HF
folders), but the pass is ours, for three reasons: packed batches go to SDPA with no mask (HF builds
an all-ones mask and checks it on the host, which also keeps CUDA off its flash kernel); NSP batches
run without their padding, as one [T] token stream split by `cu_seqlens`; and each layer is one
function that `torch.compile` can fuse (`Encoder(compile=True)`). Query, key and value are one GEMM.

Equivalence with HF's forward (logits, losses, gradients) is a test: tests/unit/test_encoder.py.

Legend: B sequences, L positions, T real tokens, D hidden size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from pipeline.modeling.attention import Varlen, dense_attention, varlen_attention

if TYPE_CHECKING:
    from transformers import BertModel


def embed(
    bert: BertModel, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Word + token type + position embeddings, LayerNorm, dropout: HF's BertEmbeddings, any shape."""
    e = bert.embeddings
    x = e.word_embeddings(input_ids) + e.token_type_embeddings(token_type_ids) + e.position_embeddings(position_ids)
    return e.dropout(e.LayerNorm(x))


def layer_forward(
    layer: torch.nn.Module,
    x: torch.Tensor,
    key_mask_BL: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    grid_index_T: Optional[torch.Tensor],
    max_len: int,
    *,
    heads: int,
    attention_dropout: float,
) -> torch.Tensor:
    """One BertLayer on x: [B, L, D] (cu_seqlens None; key_mask_BL None = no padding) or an unpadded
    [T, D] stream (cu_seqlens, grid_index_T, key_mask_BL and max_len of its Varlen layout). Plain
    tensors and numbers in, so that one compiled graph serves every layer and batch."""
    a = layer.attention
    w = torch.cat([a.self.query.weight, a.self.key.weight, a.self.value.weight])
    b = torch.cat([a.self.query.bias, a.self.key.bias, a.self.value.bias])
    qkv = F.linear(x, w, b)
    p = attention_dropout if layer.training else 0.0
    if cu_seqlens is None:
        context = dense_attention(*qkv.chunk(3, dim=-1), heads=heads, key_mask_BL=key_mask_BL, dropout_p=p)
    else:
        context = varlen_attention(
            qkv,
            heads=heads,
            cu_seqlens=cu_seqlens,
            max_len=max_len,
            grid_index_T=grid_index_T,
            key_mask_BL=key_mask_BL,
            dropout_p=p,
        )
    h = a.output.LayerNorm(a.output.dropout(a.output.dense(context)) + x)
    inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h))
    return layer.output.LayerNorm(layer.output.dropout(layer.output.dense(inner)) + h)


class Encoder:
    """Runs a BertModel's embeddings and layers (not a module: it holds no weights of its own).

    `compile`: torch.compile the layer function (one compiled graph for every layer; dynamic in the
    token count, which varies from batch to batch in the unpadded layout).
    """

    def __init__(self, bert: BertModel, *, compile: bool = False) -> None:
        self.bert = bert
        self.heads = bert.config.num_attention_heads
        self.attention_dropout = float(bert.config.attention_probs_dropout_prob)
        self.layer_fn = torch.compile(layer_forward, dynamic=True) if compile else layer_forward

    def _layers(self, x: torch.Tensor, key_mask_BL, cu_seqlens, grid_index_T, max_len: int):
        for layer in self.bert.encoder.layer:
            x = self.layer_fn(
                layer,
                x,
                key_mask_BL,
                cu_seqlens,
                grid_index_T,
                max_len,
                heads=self.heads,
                attention_dropout=self.attention_dropout,
            )
        return x

    def dense(
        self,
        input_ids_BL: torch.Tensor,
        token_type_ids_BL: torch.Tensor,
        *,
        key_mask_BL: Optional[torch.Tensor] = None,
        output_embeddings: bool = False,
    ):
        """[B, L] inputs -> (hidden_BLD, embeddings_BLD or None). key_mask_BL None: no padding."""
        B, L = input_ids_BL.shape
        positions = torch.arange(L, device=input_ids_BL.device).expand(B, L)
        first = embed(self.bert, input_ids_BL, token_type_ids_BL, positions)
        hidden = self._layers(first, key_mask_BL, None, None, L)
        return hidden, (first if output_embeddings else None)

    def unpadded(
        self,
        input_ids_T: torch.Tensor,
        token_type_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        *,
        layout: Varlen,
        output_embeddings: bool = False,
    ):
        """A [T] token stream of B sequences (layout) -> (hidden_TD, embeddings_TD or None)."""
        first = embed(self.bert, input_ids_T, token_type_ids_T, position_ids_T)
        hidden = self._layers(first, layout.key_mask_BL, layout.cu_seqlens, layout.grid_index_T, layout.max_len)
        return hidden, (first if output_embeddings else None)

    def pool(self, first_tokens_BD: torch.Tensor) -> torch.Tensor:
        """HF's BertPooler on the [CLS] vectors."""
        p = self.bert.pooler
        return p.activation(p.dense(first_tokens_BD))


def to_grid(x_TD: torch.Tensor, layout: Varlen) -> torch.Tensor:
    """The padded [B, max_len, D] view of an unpadded stream (zeros at padding; differentiable)."""
    B, L = layout.num_sequences, layout.max_len
    grid = x_TD.new_zeros(B * L, x_TD.shape[-1]).index_copy(0, layout.grid_index_T, x_TD)
    return grid.view(B, L, -1)
