"""What the evaluation commands share: `--model [LABEL=]DIR` arguments and the device choice
(pipeline/analyze.py and pipeline/finetune.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def parse_model(arg: str) -> tuple[str, Path]:
    """ "DIR" -> (folder name, DIR); "LABEL=DIR" -> (LABEL, DIR) unless the whole string is a path."""
    if "=" in arg and not Path(arg).exists():
        label, path = arg.split("=", 1)
        if label and "/" not in label:
            return label, Path(path)
    return Path(arg).resolve().name, Path(arg)


def unique_labels(models: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """Two folders called `export` get their parent's name in front, so metrics.json keys stay distinct."""
    seen: dict[str, int] = {}
    out = []
    for label, path in models:
        if label in seen:
            label = f"{path.resolve().parent.name}/{label}"
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out.append((label, path))
    return out


def resolve_device(name: str) -> torch.device:
    """--device: auto (cuda when available), cpu, cuda, cuda:1, ..."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
