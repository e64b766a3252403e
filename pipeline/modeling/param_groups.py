"""The one weight-decay rule, for pre-training and fine-tuning alike: BERT's, where biases and
LayerNorm weights get no decay."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn


def no_decay(name: str) -> bool:
    """True for the parameters BERT trains without weight decay."""
    return name.endswith(".bias") or name == "bias" or "LayerNorm" in name or "layer_norm" in name


def param_groups(model: nn.Module, *, weight_decay: Optional[float] = None) -> list[dict[str, Any]]:
    """Two optimizer groups of the trainable parameters: decayed, and not (weight_decay 0.0). The
    decayed group takes `weight_decay`, or, when None, the optimizer's own (the DeepSpeed JSON's)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(name) else decay).append(p)
    first: dict[str, Any] = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = weight_decay
    return [first, {"params": plain, "weight_decay": 0.0}]
