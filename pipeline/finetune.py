"""Downstream evaluation from local files: the entry point.

    python pipeline/finetune.py --model DIR [--model LABEL=DIR ...] \
        --task cola:glue_data/CoLA --task mnli:glue_data/MNLI --task ner:data/msra --task cws:data/pku \
        --out results/ [--seeds 1,2,3] [--epochs 3] [--lr 2e-5] [--batch_size 32] [--max_seq_len 128]

GLUE tasks read the standard GLUE TSVs (train.tsv, dev.tsv; MNLI dev_matched/dev_mismatched.tsv) and are
scored on dev with the official metric; ner/cws read CoNLL files (*train*, *dev*, *test*) with BIO or
BMES tags and are scored with span F1. Writes OUT/results.json and OUT/results.md. Nothing is
downloaded. The logic is in pipeline/finetuning.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.model_args import parse_model, unique_labels  # noqa: E402
from pipeline.finetuning import FinetuneConfig, config_dict, evaluate_model, results_markdown  # noqa: E402
from pipeline.task_data import GLUE_TASKS, TAGGING_TASKS  # noqa: E402


def parse_task(arg: str) -> tuple[str, Path]:
    name, sep, path = arg.partition(":")
    name = name.strip().lower().replace("-", "")
    if not sep or not path:
        raise ValueError(f"--task {arg!r}: expected TASK:FOLDER, e.g. cola:glue_data/CoLA")
    if name not in GLUE_TASKS and name not in TAGGING_TASKS:
        raise ValueError(f"--task {arg!r}: unknown task {name!r}; choose from {sorted(GLUE_TASKS) + list(TAGGING_TASKS)}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="[LABEL=]DIR")
    p.add_argument("--task", action="append", required=True, metavar="TASK:FOLDER")
    p.add_argument("--out", required=True, type=Path)
    d = FinetuneConfig()
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="comma-separated; results are averaged")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch_size", type=int, default=d.batch_size)
    p.add_argument("--eval_batch_size", type=int, default=d.eval_batch_size)
    p.add_argument("--max_seq_len", type=int, default=d.max_seq_len)
    p.add_argument("--warmup_ratio", type=float, default=d.warmup_ratio)
    p.add_argument("--weight_decay", type=float, default=d.weight_decay)
    p.add_argument("--max_train_samples", type=int, help="use only the first N training examples (quick runs)")
    p.add_argument("--max_eval_samples", type=int)
    p.add_argument("--device", default=d.device, help="auto (cuda when available), cpu, cuda, ...")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(",") if s.strip())
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: expected comma-separated integers, e.g. 1,2,3")
    if not seeds:
        p.error("--seeds: give at least one seed")
    for flag in ("epochs", "lr", "batch_size", "eval_batch_size", "max_seq_len"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag} must be > 0 (got {getattr(a, flag)})")
    cfg = FinetuneConfig(epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, eval_batch_size=a.eval_batch_size,
                         max_seq_len=a.max_seq_len, warmup_ratio=a.warmup_ratio, weight_decay=a.weight_decay,
                         seeds=seeds, max_train_samples=a.max_train_samples, max_eval_samples=a.max_eval_samples,
                         device=a.device, bf16=a.bf16)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized classifier weights" is expected for every task
    t0 = time.time()
    try:
        tasks = [parse_task(t) for t in a.task]
        models = unique_labels([parse_model(m) for m in a.model])
        results = {label: evaluate_model(path, tasks=tasks, cfg=cfg) for label, path in models}
    except ValueError as e:
        print(f"finetune.py: error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    payload = {"config": config_dict(cfg), "models": {label: str(path) for label, path in models},
               "results": results, "wall_s": round(time.time() - t0, 1)}
    (a.out / "results.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    md = results_markdown(results, cfg=cfg)
    (a.out / "results.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
