"""Right padding of variable-length rows into one [B, L] array: the one collate step every batch of
the pipeline shares (training, representation analysis, fine-tuning)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np


def pad_right(
    rows: Sequence[Sequence[int]], *, fill: int, length: Optional[int] = None, dtype: type = np.int64
) -> np.ndarray:
    """[B, L] array of the rows, each followed by `fill` up to L = `length` (default: the longest row).
    Rows longer than `length` are an error (the caller decides what may be cut)."""
    lengths = [len(r) for r in rows]
    width = max(lengths, default=0) if length is None else length
    assert max(lengths, default=0) <= width, (max(lengths), width)
    out = np.full((len(rows), width), fill, dtype=dtype)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        out[b, :n] = row
    return out
