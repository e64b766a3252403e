"""Plot training runs side by side: every loss term, accuracy, learning rate, gradient norm and throughput
against the step, one panel per field, one colour per run.

    tokencl-plot-runs RUN [RUN ...] --out curves.png

RUN is a run folder (--save_dir) or a metrics.jsonl; only metrics.jsonl is read. Runs that lack a field
are named on stderr and in its panel; values that cannot be drawn (NaN, infinite, beyond 1e300) are
gaps, named on stderr. The logic is in pipeline/training/curves.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from preprocessing import cli  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="plot_runs.py", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folder (--save_dir) or metrics.jsonl")
    p.add_argument("--out", default="curves.png", help="image to write (.png, .pdf, .svg) [curves.png]")
    p.add_argument("--fields", help="comma-separated fields to draw, in this order (default: all known ones)")
    p.add_argument("--title", help="a title above the panels")
    args = p.parse_args(argv)

    def run() -> int:
        from pipeline.training.curves import plot_runs

        fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
        runs, plan = plot_runs(args.runs, args.out, fields=fields, title=args.title)
        for r in runs:
            if r.bad_lines:
                print(f"plot_runs.py: note: {r.path}: {r.bad_lines} line(s) without a step skipped", file=sys.stderr)
            for name, points in r.left_out().items():
                # Decimal formats an int of any size (a float of it would overflow).
                shown = ", ".join(f"{Decimal(v) if isinstance(v, int) else v:.4g} at step {s}" for s, v in points[:3])
                shown += ", ..." if len(points) > 3 else ""
                print(f"plot_runs.py: note: {r.path}: {name} not drawn where it is {shown}", file=sys.stderr)
        for name, labels in plan.missing.items():
            print(f"plot_runs.py: note: {name} is not in {', '.join(labels)}", file=sys.stderr)
        steps = ", ".join(f"{r.label} (steps {r.records[0]['step']}-{r.records[-1]['step']})" for r in runs)
        print(f"wrote {args.out}: {len(plan.fields)} panels ({', '.join(plan.fields)}) for {steps}")
        return 0

    return cli.run(run, prog="plot_runs.py")


if __name__ == "__main__":
    sys.exit(main())
