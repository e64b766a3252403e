"""The student: a Hugging Face BertForPreTraining run by our encoder (no padding where the layout has
none, optionally compiled) with a masked-only MLM head, built from scratch or loaded from a
pre-trained folder (--init_from).

The student wraps HF's own modules, so its weights are exactly a BertForPreTraining state dict
(under the `net.` prefix) and export is a plain `save_pretrained`.

Legend: B sequences, L positions, D hidden size, V vocabulary, N masked positions (row-major).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining

from pipeline.modeling.attention import Varlen
from pipeline.modeling.encoder import Encoder, to_grid
from preprocessing.errors import UsageError


def check_init_from(path: str) -> BertConfig:
    """The BertConfig of an --init_from folder; UsageError when it is not a Hugging Face BERT folder."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--init_from {path}: no config.json; expected a Hugging Face BERT folder")
    cfg = BertConfig.from_pretrained(folder)
    if cfg.model_type != "bert":
        raise UsageError(f"--init_from {path}: model_type {cfg.model_type!r}, expected 'bert'")
    return cfg


@dataclass
class InitReport:
    """What --init_from found: the weights it lacked (initialised at random) and ignored."""

    source: str
    missing: list[str]
    unexpected: list[str]

    def lines(self) -> list[str]:
        heads = sorted({k.rsplit(".", 1)[0] for k in self.missing})
        out = [f"initialised from {self.source}"]
        if heads:
            out.append(f"not in the checkpoint, initialised at random: {', '.join(heads)}")
        if self.unexpected:
            out.append(f"in the checkpoint but unused: {', '.join(sorted(self.unexpected))}")
        return out


def load_pretrained(path: str, *, config: Optional[BertConfig] = None) -> tuple[BertForPreTraining, InitReport]:
    """BertForPreTraining from an HF folder holding BertModel or BertForPreTraining weights; heads it
    lacks are initialised by HF's rule (call torch.manual_seed first for reproducible heads). `config`:
    the folder's own config as the run resolved it (its attention dropout), instead of the folder's."""
    folder = Path(path)
    cfg = config if config is not None else check_init_from(path)
    net, info = BertForPreTraining.from_pretrained(
        folder, config=cfg, output_loading_info=True, attn_implementation="sdpa"
    )
    return net, InitReport(
        source=str(folder), missing=list(info["missing_keys"]), unexpected=list(info["unexpected_keys"])
    )


class Student(nn.Module):
    """BertForPreTraining run by our encoder (pipeline.modeling.encoder) on the collator's batches,
    with the MLM head on the masked rows only.

    Gathering the N masked rows before the vocabulary projection saves the B x L x V logits (and
    ~85% of the head's FLOPs), as NVIDIA's and MLPerf's BERT do; the weights stay HF's.
    """

    def __init__(self, net: BertForPreTraining, *, full_head: bool = False, compile: bool = False) -> None:
        super().__init__()
        self.net = net
        # The ablation: project every row, then keep the masked ones (the same loss and gradients).
        self.full_head = full_head
        self.encoder = Encoder(net.bert, compile=compile)

    @property
    def config(self) -> BertConfig:
        return self.net.config

    def forward(
        self,
        batch,
        token_type_ids=None,
        attention_mask=None,
        masked=None,
        *,
        with_embeddings: bool = False,
        with_nsp: bool = False,
    ) -> dict[str, torch.Tensor]:
        """In: a collated batch (pipeline.data.collator), on the device; or, for direct use, four [B, L]
        tensors (input ids, token types, attention mask, masked bool) of a padded batch. Out: hidden
        [B, L, D] (last layer, the padded grid view), mlm_logits [N, V] at the masked positions (row-major);
        embeddings [B, L, D] (the embedding layer's output, HF hidden_states[0]) if with_embeddings;
        nsp_logits [B, 2] if with_nsp."""
        if not isinstance(batch, dict):
            batch = padded_batch(batch, token_type_ids, attention_mask, masked)
        hidden_BLD, rows_MD, first_BD, embeddings_BLD = run_encoder(
            self.encoder, batch, ids="input_ids", with_embeddings=with_embeddings
        )
        head = self.net.cls.predictions
        index_N = batch["masked_index"]
        logits_NV = head(rows_MD).index_select(0, index_N) if self.full_head else head(rows_MD.index_select(0, index_N))
        result = {"hidden": hidden_BLD, "mlm_logits": logits_NV}
        if with_embeddings:
            result["embeddings"] = embeddings_BLD
        if with_nsp:
            result["nsp_logits"] = self.net.cls.seq_relationship(self.encoder.pool(first_BD))
        return result


def run_encoder(encoder: Encoder, batch: dict, *, ids: str, with_embeddings: bool = False):
    """The encoder on a collated batch, whatever its layout. `ids`: "input_ids" (the student) or
    "original_ids" (TaCL's teacher). Returns (hidden_BLD in the grid view, the model's rows [M, D]
    (B*L or T), the [CLS] vectors [B, D], embeddings_BLD or None)."""
    layout = batch["layout"]
    if layout == "unpadded":
        varlen = Varlen(
            cu_seqlens=batch["cu_seqlens"],
            max_len=batch["max_len"],
            grid_index_T=batch["grid_index"],
            key_mask_BL=batch["attention_mask"].bool(),
        )
        rows_TD, emb_TD = encoder.unpadded(
            batch[ids], batch["token_type_ids"], batch["position_ids"], layout=varlen, output_embeddings=with_embeddings
        )
        first_BD = rows_TD.index_select(0, batch["cu_seqlens"][:-1].long())
        embeddings = to_grid(emb_TD, varlen) if with_embeddings else None
        return to_grid(rows_TD, varlen), rows_TD, first_BD, embeddings
    key_mask = batch["attention_mask"].bool() if layout == "padded" else None
    hidden_BLD, emb_BLD = encoder.dense(
        batch[ids], batch["token_type_ids"], key_mask_BL=key_mask, output_embeddings=with_embeddings
    )
    return hidden_BLD, hidden_BLD.flatten(0, 1), hidden_BLD[:, 0], emb_BLD


def padded_batch(
    input_ids_BL: torch.Tensor,
    token_type_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    masked_BL: torch.Tensor,
) -> dict:
    """A padded batch in the collator's form from plain tensors (finds the masked rows on the device:
    for direct use, not the training loop)."""
    return {
        "layout": "padded",
        "input_ids": input_ids_BL,
        "original_ids": input_ids_BL,
        "token_type_ids": token_type_ids_BL,
        "attention_mask": attention_mask_BL,
        "masked_index": masked_BL.reshape(-1).nonzero().squeeze(1),
    }
