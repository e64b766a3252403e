"""Representation analysis of one or more models (and of one run's checkpoints).

    tokencl-analyze --model DIR [--model LABEL=DIR ...] --data SHARDS_OR_TEXT --out report/
                    [--run RUN_DIR] [--max_sequences N] [--heatmap_text "..."]

Writes report/metrics.json, report/layerwise.png, report/heatmap.png, report/training_gap.png (with
--run) and report/README.md. The logic is in pipeline/evaluation/representation/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from pipeline.evaluation.representation.report import AnalyzeConfig, print_summary, run_analysis  # noqa: E402
from preprocessing import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(p, AnalyzeConfig)

    cfg, _ = cli.parse_into(p, AnalyzeConfig, argv)

    def run() -> int:
        cfg.validate()
        print_summary(run_analysis(cfg), out=cfg.out)
        return 0

    return cli.run(run, prog="analyze.py")


if __name__ == "__main__":
    sys.exit(main())
