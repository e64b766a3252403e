"""bf16 against fp32 on this machine's CPU (JSON out): one training step of a BERT with the
masked-only MLM head (forward, backward, AdamW) in fp32, in bf16 weights (what a DeepSpeed bf16
config does) and in fp32 weights under bf16 autocast (what `finetune.py --bf16` does).

    python -m pipeline.bench.precision [--quick] [--layers 4 --hidden 256 --micro 32 --seq_len 128]

Random tokens, 15% of positions masked: the point is the arithmetic's speed, not the loss. Where
`pipeline.hardware.cpu_bf16_native()` is False (no AVX-512), bf16 runs on reference kernels; this
measures by how much, and is what `pipeline/hardware.py`'s figures come from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Optional

from preprocessing import cli

MODES = ("fp32", "bf16_weights", "bf16_autocast")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    import torch

    torch.set_num_threads(a.threads)
    seconds = _time_modes(_bert_config(a), batch=_batch(a), steps=a.steps)
    cli.emit_json(_report(a, seconds=seconds), a.out)
    return 0


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = cli.bench_parser(
        __doc__.split("\n")[0], smoke="2 layers x 64, micro-batch 4 x 32, 1 step: a smoke run", out=True
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.vocab, a.micro, a.seq_len, a.steps = 2, 64, 1000, 4, 32, 1
    return a


def _bert_config(a: argparse.Namespace):
    from transformers import BertConfig

    cfg = BertConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64),
        intermediate_size=4 * a.hidden,
        max_position_embeddings=max(512, a.seq_len),
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _batch(a: argparse.Namespace) -> dict:
    """Random tokens (ids_BL), 15% of positions masked (masked_BL), one segment, no padding."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids_BL = torch.randint(5, a.vocab, (a.micro, a.seq_len), generator=gen)
    masked_BL = torch.rand(a.micro, a.seq_len, generator=gen) < 0.15
    types_BL, attn_BL = torch.zeros_like(ids_BL), torch.ones_like(ids_BL)
    return {"ids_BL": ids_BL, "types_BL": types_BL, "attn_BL": attn_BL, "masked_BL": masked_BL}


def _time_modes(cfg, *, batch: dict, steps: int) -> dict[str, float]:
    """Each mode's median step in seconds, over `steps` timed steps after one warm-up step, on a fresh
    model (seed 0) and optimizer."""
    import torch
    from transformers import BertForPreTraining

    from pipeline.modeling.student import Student

    seconds: dict[str, float] = {}
    for mode in MODES:
        torch.manual_seed(0)
        net = BertForPreTraining(cfg)
        if mode == "bf16_weights":
            net = net.to(torch.bfloat16)
        student = Student(net).train()
        opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
        _step_s(student, opt, batch=batch, autocast=mode == "bf16_autocast")  # warm-up
        seconds[mode] = statistics.median(
            _step_s(student, opt, batch=batch, autocast=mode == "bf16_autocast") for _ in range(steps)
        )
    return seconds


def _step_s(student, opt, *, batch: dict, autocast: bool) -> float:
    """Seconds of one step: forward (under bf16 autocast if asked), masked-only MLM loss, backward, AdamW."""
    import torch

    ids_BL, masked_BL = batch["ids_BL"], batch["masked_BL"]
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = student(ids_BL, batch["types_BL"], batch["attn_BL"], masked_BL)
    loss = torch.nn.functional.cross_entropy(out["mlm_logits"].float(), ids_BL[masked_BL])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def _report(a: argparse.Namespace, *, seconds: dict[str, float]) -> dict:
    import torch

    from pipeline.hardware import cpu_bf16_native

    tokens = a.micro * a.seq_len
    return {
        "benchmark": "precision",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_native": cpu_bf16_native(),
        "threads": a.threads,
        "model": f"{a.layers} layers x {a.hidden}, vocabulary {a.vocab}, masked-only MLM head",
        "micro_batch": f"{a.micro} x {a.seq_len}",
        "step_s": {m: round(s, 4) for m, s in seconds.items()},
        "tokens_per_s": {m: round(tokens / s, 1) for m, s in seconds.items()},
        "bf16_weights_over_fp32": round(seconds["bf16_weights"] / seconds["fp32"], 2),
        "bf16_autocast_over_fp32": round(seconds["bf16_autocast"] / seconds["fp32"], 2),
    }


if __name__ == "__main__":
    sys.exit(main())
