"""Which documents a build holds out for evaluation (--eval_share): a pure function of a document's
text and --seed, so every worker, chunk plan and resume picks the same ones."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Optional

TRAIN, EVAL = "train", "eval"
"""The two splits of a build: OUTPUT/ (what training reads) and OUTPUT/eval/ (held out)."""


def held_out_rule(*, seed: int, share: float) -> Optional[Callable[[list[str]], bool]]:
    """A test of a document's decoded lines (the first part's, for a document read in parts): held
    out when their xxh3 hash, keyed by --seed, falls in the lowest `share` of the 64-bit range.
    None when nothing is held out.

    The text before cleaning, and nothing else, decides: not the chunk a document falls in, the
    number of workers, its position or file, nor a resume; a text repeated in the corpus falls on
    one side; the language is not looked at, so every language gives about `share` of its
    documents."""
    if share <= 0:
        return None
    import xxhash

    key = int.from_bytes(hashlib.sha256(f"eval:{seed}".encode()).digest()[:8], "little")
    threshold = int(share * (1 << 64))

    def held_out(lines: list[str]) -> bool:
        text = "\n".join(lines).encode("utf-8", "surrogatepass")
        return xxhash.xxh3_64_intdigest(text, seed=key) < threshold

    return held_out
