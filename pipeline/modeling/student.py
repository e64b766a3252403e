"""The student: a Hugging Face BertForPreTraining run with SDPA attention and a masked-only MLM head,
built from scratch or loaded from a pre-trained folder (--init_from).

The student wraps HF's own modules, so its weights are exactly a BertForPreTraining state dict
(under the `net.` prefix) and export is a plain `save_pretrained`.

Legend: B sequences, L positions, D hidden size, V vocabulary, N masked positions (row-major).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining

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


def load_pretrained(path: str) -> tuple[BertForPreTraining, InitReport]:
    """BertForPreTraining from an HF folder holding BertModel or BertForPreTraining weights; heads it
    lacks are initialised by HF's rule (call torch.manual_seed first for reproducible heads)."""
    folder = Path(path)
    check_init_from(path)
    net, info = BertForPreTraining.from_pretrained(folder, output_loading_info=True, attn_implementation="sdpa")
    return net, InitReport(source=str(folder), missing=list(info["missing_keys"]),
                           unexpected=list(info["unexpected_keys"]))


class Student(nn.Module):
    """BertForPreTraining whose MLM head runs on the masked positions only.

    Gathering the N masked rows before the vocabulary projection saves the B x L x V logits (and
    ~85% of the head's FLOPs), as NVIDIA's and MLPerf's BERT do; the weights stay HF's.
    """

    def __init__(self, net: BertForPreTraining, *, full_head: bool = False) -> None:
        super().__init__()
        self.net = net
        # The ablation: project every row, then keep the masked ones (the same loss and gradients).
        self.full_head = full_head

    @property
    def config(self) -> BertConfig:
        return self.net.config

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        masked: torch.Tensor,
        *,
        with_embeddings: bool = False,
        with_nsp: bool = False,
    ) -> dict[str, torch.Tensor]:
        """In: [B, L] ids, token types, attention mask (1 = real), masked (bool).
        Out: hidden [B, L, D] (last layer), mlm_logits [N, V]; embeddings [B, L, D] (the embedding
        layer's output, HF hidden_states[0]) if with_embeddings; nsp_logits [B, 2] if with_nsp."""
        out = self.net.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                            output_hidden_states=with_embeddings, return_dict=True)
        hidden_BLD = out.last_hidden_state
        if self.full_head:
            logits_NV = self.net.cls.predictions(hidden_BLD)[masked]
        else:
            logits_NV = self.net.cls.predictions(hidden_BLD[masked])
        result = {"hidden": hidden_BLD, "mlm_logits": logits_NV}
        if with_embeddings:
            result["embeddings"] = out.hidden_states[0]
        if with_nsp:
            result["nsp_logits"] = self.net.cls.seq_relationship(out.pooler_output)
        return result
