"""What the trainer's held-out evaluation does not measure: the context-free reference on its positions.

Every pre-training run evaluates itself (pipeline.training.evaluation, `--eval_data en=... zh=...`):
masked-LM accuracy and cross-entropy on the first samples of each language's held-out shards, at
every checkpoint, with the run's masking (15% of the tokens; of those 80% [MASK], 10% a random token,
10% kept), the same positions at every evaluation. Whether a model has left the floor needs what a model
that uses no context at all would score on those same positions. That model knows the pre-training
text's token frequencies (a unigram, add-half smoothed) and the masking rule: at [MASK] it gives the
unigram; at a token x shown at a predicted position (kept, or a random replacement) it gives
P(g | x) = u(g) ([g = x] + 1/R) / (u(x) + 1/R), u the unigram over the R tokens a replacement is drawn
from (kept and replaced are equally likely). Its top-1 accuracy is the floor, its cross-entropy the
reference: above the floor and below the reference, a model takes something from context.

The positions are the trainer's: the held-out shards read and masked as its evaluator does them (the
product's reader and masking collator, the run's seed and masking settings from RUN/config.json).

Shape legend: N masked positions, V vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pipeline.experiments.mini.data import read_documents


def unigram_log_probs(tokenizer, path: Path) -> torch.Tensor:
    """logp_V: token frequencies of a (pre-training) text file, add-half smoothed so that a token the
    text never has costs a finite amount."""
    ids: list[int] = []
    for doc in read_documents(path):
        ids += tokenizer(" ".join(doc), add_special_tokens=False)["input_ids"]
    counts_V = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(tokenizer))
    probs_V = (counts_V.double() + 0.5) / (counts_V.sum() + 0.5 * len(counts_V))
    return probs_V.log()


def masking_collator(tokenizer, run: Path):
    """The masking collator of the run's evaluation: its tokenizer's specials, the run's seed and masking
    settings (RUN/config.json), as the trainer builds it (the masked positions do not depend on the
    layout, NSP labels or document cuts, so those are left at their defaults)."""
    from pipeline.data.collator import MaskingCollator
    from pipeline.data.masking import MaskingSpec

    cfg = json.loads((run / "config.json").read_text())
    spec = MaskingSpec(
        mask_token_id=tokenizer.mask_token_id,
        special_ids=tuple(sorted(set(tokenizer.all_special_ids))),
        vocab_size=len(tokenizer),
        mask_prob=cfg["data"]["mask_prob"],
        whole_word=cfg["data"]["whole_word_masking"],
    )
    return MaskingCollator(
        spec=spec, pad_id=tokenizer.pad_token_id, seed=cfg["run"]["seed"], nsp=False, max_seq_len=None
    )


def evaluated_positions(shards: Path, *, collator, samples: int, cache: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(gold_N, shown_N): the original token and what the model was shown at every masked position of
    the first `samples` samples of a held-out shard folder, masked by `collator`."""
    from pipeline.data.loader import open_dataset
    from pipeline.data.shards import inspect_data

    info = inspect_data([str(shards)], cache_root=str(cache))
    vocab = collator.spec.vocab_size
    dataset = open_dataset(info, vocab_size=vocab, batch_size=samples, shuffle=False, seed=0, run_id=cache.name)
    return masked_tokens(collator([dataset[i] for i in range(samples)]))


def masked_tokens(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(gold_N, shown_N) of a collated batch, in the order of its masked positions (whatever its layout,
    and with or without documents cut out of packed blocks)."""
    # The model's rows ([B, L] or the unpadded stream), indexed by the masked tokens' rows.
    return batch["mlm_labels"], batch["input_ids"].reshape(-1)[batch["masked_index"]]


def context_free(gold_N: torch.Tensor, shown_N: torch.Tensor, *, logp_V: torch.Tensor, spec) -> dict:
    """{floor, unigram_cross_entropy, masked}: the top-1 accuracy and the cross-entropy (nats) of the
    context-free model (module doc) at these positions. `spec`: the masking's MaskingSpec."""
    pool = torch.from_numpy(spec.replacement_pool())
    u_V = torch.zeros_like(logp_V)
    u_V[pool] = logp_V[pool].exp()
    u_V /= u_V.sum()  # a gold token is never special: the unigram over the tokens masking can choose
    r = 1.0 / len(pool)
    at_mask_N = shown_N == spec.mask_token_id
    same_N = (gold_N == shown_N).double()
    p_N = torch.where(at_mask_N, u_V[gold_N], u_V[gold_N] * (same_N + r) / (u_V[shown_N] + r))
    top = int(u_V.argmax())
    # Shown x: x itself (u(x)(1 + r)) unless the most frequent token's u_top * r beats it.
    copy_N = u_V[shown_N] * (1 + r) >= u_V[top] * r
    guess_N = torch.where(at_mask_N | ~copy_N, torch.full_like(gold_N, top), shown_N)
    return {
        "floor": float((guess_N == gold_N).double().mean()),
        "unigram_cross_entropy": float(-p_N.log().mean()),
        "masked": len(gold_N),
    }


def reference(shards: Path, *, run: Path, samples: int, logp_V: torch.Tensor, tokenizer, cache: Path) -> dict:
    """context_free(...) on the positions `run` evaluated on (the first `samples` samples of `shards`)."""
    collator = masking_collator(tokenizer, run)
    try:
        gold_N, shown_N = evaluated_positions(shards, collator=collator, samples=samples, cache=cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # the decompressed copy of the shards, read once
    return context_free(gold_N, shown_N, logp_V=logp_V, spec=collator.spec)
