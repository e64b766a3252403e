"""python -m pipeline.experiments.mini: the miniature reproduction (settings.py lists every flag; the
experiment's README says what it runs and what it found)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional

from preprocessing import cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pipeline.experiments.mini.settings import PROG, native_precision, parse_args

    def run() -> int:
        from pipeline.experiments.mini.experiment import child_env, reproduce
        from pipeline.hardware import cpu_bf16_native

        cfg = parse_args(argv)
        cfg.validate()  # before the hardware probe imports torch: a bad flag answers at once
        on_cpu = child_env()["DS_ACCELERATOR"] == "cpu"  # the accelerator the pre-training runs will get
        run_cfg, notes = native_precision(cfg, bf16_native=cpu_bf16_native(), pretrain_on_cpu=on_cpu)
        for note in notes:
            print(f"[mini] {note}")
        rep = reproduce(run_cfg)
        if cfg.run.start_only:
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

    return cli.run(run, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
