"""The student's shape: the from-scratch presets, the BertConfig they make, and the checks of a model's
vocabulary and positions against the tokenizer and the shards (run in pre-flight)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from preprocessing.errors import UsageError

if TYPE_CHECKING:
    from transformers import BertConfig

# From-scratch sizes. tiny: a debug model that trains in seconds on a laptop CPU.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def bert_config(spec: str, *, vocab_size: int) -> BertConfig:
    """A BertConfig from a preset name (vocabulary = the tokenizer's) or a JSON file (its own
    vocab_size, checked against the tokenizer later; without one, the tokenizer's, as for a preset:
    an architecture file need not know the size of a vocabulary trained with the shards)."""
    from transformers import BertConfig

    if spec in PRESETS:
        cfg = BertConfig(vocab_size=vocab_size, max_position_embeddings=512, **PRESETS[spec])
    else:
        try:
            cfg = BertConfig.from_dict({"vocab_size": vocab_size, **json.loads(Path(spec).read_text())})
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--model_config {spec}: cannot read a BertConfig JSON ({e})") from e
    cfg._attn_implementation = "sdpa"
    return cfg


def check_vocab(
    *, model_vocab: int, tokenizer_size: int, tokenizer_dir: str, data_vocab: Optional[int], model_source: str
) -> None:
    """Fail when the tokenizer, the model and the shards disagree on the vocabulary size.

    The model may carry a few unused rows (vocabularies padded to a multiple of 8..128), never fewer
    rows than the tokenizer has ids, and never a different vocabulary altogether.
    """
    if data_vocab is not None and data_vocab != tokenizer_size:
        raise UsageError(
            f"tokenizer {tokenizer_dir} has {tokenizer_size} tokens but the shards were built with a "
            f"{data_vocab}-token vocabulary (build_manifest.json): pass the shards' tokenizer "
            f"(DATA/tokenizer) or rebuild the shards"
        )
    padded = -(-tokenizer_size // 128) * 128
    if not tokenizer_size <= model_vocab <= padded:
        raise UsageError(
            f"{model_source} has vocab_size {model_vocab} but tokenizer {tokenizer_dir} has "
            f"{tokenizer_size} tokens: use the model's own tokenizer (and shards built with it), "
            f"or a model config whose vocab_size matches"
        )


def check_positions(*, max_seq_len: Optional[int], config: BertConfig, model_source: str) -> None:
    if max_seq_len is not None and max_seq_len > config.max_position_embeddings:
        raise UsageError(
            f"the shards hold sequences of up to {max_seq_len} tokens but {model_source} has "
            f"max_position_embeddings {config.max_position_embeddings}: rebuild the shards with "
            f"--max_seq_len <= {config.max_position_embeddings}"
        )


def non_embedding_params(config: BertConfig) -> tuple[int, int]:
    """(encoder-layer parameters, MLM-head transform parameters) for the FLOPs model."""
    D, F, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = 4 * (D * D + D) + (D * F + F) + (F * D + D) + 4 * D  # attention, MLP, two LayerNorms
    head_transform = D * D + D + 2 * D
    return n * per_layer, head_transform
