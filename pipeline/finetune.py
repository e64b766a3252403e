"""Downstream evaluation from local files.

    tokencl-finetune --model DIR [--model LABEL=DIR ...] \
        --task cola:glue_data/CoLA --task mnli:glue_data/MNLI --task ner:data/msra --task cws:data/pku \
        --task reviews=classify:data/reviews --out results/ [--seeds 1,2,3] [--epochs 3] [--lr 2e-5] \
        [--batch_size 32] [--max_seq_len 128]

GLUE tasks read the standard GLUE TSVs (train.tsv, dev.tsv; MNLI dev_matched/dev_mismatched.tsv) and are
scored on dev with the official metric; ner/cws read CoNLL files (*train*, *dev*, *test*) with BIO or
BMES tags and are scored with span F1; NAME=classify:DIR reads any label<TAB>text folder (train.tsv,
dev.tsv, optional test.tsv, no header; the labels are the training file's), scored by accuracy and
macro-F1. Writes OUT/results.json and OUT/results.md. Nothing is downloaded. The logic is in
pipeline/evaluation/downstream/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from pipeline.evaluation.downstream.finetuning import FinetuneConfig, parse_task, run_finetuning  # noqa: E402
from pipeline.evaluation.models import parse_model, unique_labels  # noqa: E402
from preprocessing import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="[LABEL=]DIR")
    p.add_argument("--task", action="append", required=True, metavar="TASK:FOLDER|NAME=classify:FOLDER")
    p.add_argument("--out", required=True, type=Path)
    cli.add_arguments(p, FinetuneConfig)
    cfg, ns = cli.parse_into(p, FinetuneConfig, argv)

    def run() -> int:
        cfg.validate()
        run_finetuning(
            unique_labels([parse_model(m) for m in ns.model]),
            tasks=[parse_task(t) for t in ns.task],
            cfg=cfg,
            out=ns.out,
        )
        return 0

    return cli.run(run, prog="finetune.py")


if __name__ == "__main__":
    sys.exit(main())
