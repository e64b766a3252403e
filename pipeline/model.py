"""The student (a Hugging Face BertForPreTraining run with SDPA attention and a masked-only MLM
head) and the TaCL teacher (a frozen copy of the student's initial encoder).

The student wraps HF's own modules, so its weights are exactly a BertForPreTraining state dict
(under the `net.` prefix) and export is a plain `save_pretrained`.

Legend: B sequences, L positions, D hidden size, V vocabulary, N masked positions (row-major).
"""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining, BertModel

# From-scratch sizes. tiny: a debug model that trains in seconds on a laptop CPU.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def bert_config(spec: str, *, vocab_size: int) -> BertConfig:
    """A BertConfig from a preset name (vocabulary = the tokenizer's) or a JSON file (its own
    vocab_size, checked against the tokenizer later)."""
    if spec in PRESETS:
        cfg = BertConfig(vocab_size=vocab_size, max_position_embeddings=512, **PRESETS[spec])
    else:
        try:
            cfg = BertConfig.from_dict(json.loads(Path(spec).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--model_config {spec}: cannot read a BertConfig JSON ({e})")
    cfg._attn_implementation = "sdpa"
    return cfg


def check_vocab(*, model_vocab: int, tokenizer_size: int, tokenizer_dir: str, data_vocab: Optional[int],
                model_source: str) -> None:
    """Fail when the tokenizer, the model and the shards disagree on the vocabulary.

    The model may carry a few unused rows (vocabularies padded to a multiple of 8..128), never fewer
    rows than the tokenizer has ids, and never a different vocabulary altogether.
    """
    if data_vocab is not None and data_vocab != tokenizer_size:
        raise ValueError(f"tokenizer {tokenizer_dir} has {tokenizer_size} tokens but the shards were built with a "
                         f"{data_vocab}-token vocabulary (build_manifest.json): pass the shards' tokenizer "
                         f"(DATA/tokenizer) or rebuild the shards")
    padded = -(-tokenizer_size // 128) * 128
    if not tokenizer_size <= model_vocab <= padded:
        raise ValueError(f"{model_source} has vocab_size {model_vocab} but tokenizer {tokenizer_dir} has "
                         f"{tokenizer_size} tokens: use the model's own tokenizer (and shards built with it), "
                         f"or a model config whose vocab_size matches")


def check_positions(*, max_seq_len: Optional[int], config: BertConfig, model_source: str) -> None:
    if max_seq_len is not None and max_seq_len > config.max_position_embeddings:
        raise ValueError(f"the shards hold sequences of up to {max_seq_len} tokens but {model_source} has "
                         f"max_position_embeddings {config.max_position_embeddings}: rebuild the shards with "
                         f"--max_seq_len <= {config.max_position_embeddings}")


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
    if not (folder / "config.json").is_file():
        raise ValueError(f"--init_from {path}: no config.json; expected a Hugging Face BERT folder")
    cfg = BertConfig.from_pretrained(folder)
    if cfg.model_type != "bert":
        raise ValueError(f"--init_from {path}: model_type {cfg.model_type!r}, expected 'bert'")
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


def build_teacher(student: Student, *, dtype: torch.dtype, device: torch.device) -> BertModel:
    """TaCL's teacher: a frozen copy of the student's encoder as it is now (call before training).

    Only the encoder: no vocabulary head (it would cost ~7% more FLOPs for nothing) and no pooler.
    Eval mode (dropout off), no gradients, in the engine's dtype, outside the engine: it has no
    optimizer state and is not in the checkpoint.
    """
    teacher = copy.deepcopy(student.net.bert)
    teacher.pooler = None
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher.to(device=device, dtype=dtype)


def check_teacher(teacher: BertModel, student: Student) -> None:
    if teacher.config.hidden_size != student.config.hidden_size:
        raise ValueError(f"teacher hidden size {teacher.config.hidden_size} != student {student.config.hidden_size}")


def fingerprint(module: nn.Module) -> str:
    """A short digest of a module's parameters (to check, on resume, that the teacher is rebuilt
    from the same initial weights)."""
    h = hashlib.sha1()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def non_embedding_params(config: BertConfig) -> tuple[int, int]:
    """(encoder-layer parameters, MLM-head transform parameters) for the FLOPs model."""
    D, I, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = 4 * (D * D + D) + (D * I + I) + (I * D + D) + 4 * D  # attention, MLP, two LayerNorms
    head_transform = D * D + D + 2 * D
    return n * per_layer, head_transform
