"""The miniature reproduction of TaCL and TACO, from scratch to downstream tasks, on CPU.

    python pipeline/reproduce_mini.py --out mini/ [--quick] [--corpora DIR] [--tasks NAME=DIR,...]
    python pipeline/reproduce_mini.py --out start/ --start_only --start_steps N --curve ...  (the start alone)

A small BERT pre-trained from scratch with MLM on real English and Chinese text (the start), TACO from
scratch against it, TaCL's two arms continued from it; held-out MLM accuracy, the representation
analysis, and fine-tuning on real tasks with several seeds; OUT/README.md holds the tables, figures and
one verdict per claim. A re-run with the same settings keeps the stages already done. The stages:
pipeline/evaluation/mini/experiment.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from pipeline.evaluation.mini.config import MiniConfig, effective, native_precision  # noqa: E402
from preprocessing import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(p, MiniConfig)
    cfg, _ = cli.parse_into(p, MiniConfig, argv)

    def run() -> int:
        from pipeline.evaluation.mini.experiment import child_env, reproduce
        from pipeline.hardware import cpu_bf16_native

        on_cpu = child_env()["DS_ACCELERATOR"] == "cpu"  # the accelerator the pre-training runs will get
        run_cfg, notes = native_precision(effective(cfg), bf16_native=cpu_bf16_native(), pretrain_on_cpu=on_cpu)
        for note in notes:
            print(f"[mini] {note}")
        rep = reproduce(run_cfg)
        if cfg.start_only:
            at = rep["left_floor_at"]
            print(f"[mini] start model: {'left the floor at step ' + str(at) if at else 'did not leave the floor'}")
            print(f"[mini] report: {cfg.out / 'START.md'} ({rep['wall_s'] / 60:.1f} minutes in this call)")
            return 0
        for name, v in rep["verdicts"].items():
            if "verdict" in v:
                print(f"[mini] {name}: {v['verdict']}")
        print(
            f"[mini] report: {cfg.out / 'README.md'} ({rep['budget_minutes']['total']:.1f} minutes of stage time, "
            f"{rep['wall_s'] / 60:.1f} in this call)"
        )
        return 0

    return cli.run(run, prog="reproduce_mini.py")


if __name__ == "__main__":
    sys.exit(main())
