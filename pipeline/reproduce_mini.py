"""The miniature reproduction of TaCL's and TACO's representation analyses, on CPU in minutes.

    python pipeline/reproduce_mini.py --out mini/ [--corpora ../shared/corpora] [--steps 200]

What it runs and reports: pipeline/evaluation/reproduction.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from pipeline import cli  # noqa: E402
from pipeline.evaluation.reproduction import MiniConfig, reproduce  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(p, MiniConfig)
    cfg, _ = cli.parse_into(p, MiniConfig, argv)

    def run() -> int:
        result = reproduce(cfg)
        for label, s in result["last_layer"].items():
            print(
                f"[mini] {label:5s} intra-sentence {s['intra_sentence']:.4f}  intra-context "
                f"{s['intra_context']:.4f}  inter-context {s['inter_context']:.4f}  gap {s['gap']:.4f}"
            )
        for name, c in result["checks"].items():
            print(
                f"[mini] {name}: {c['value']:.4f} {c['op']} {c['reference']:.4f}: "
                f"{'holds' if c['holds'] else 'DOES NOT hold'}"
            )
        print(f"[mini] report: {cfg.out / 'report' / 'README.md'} ({result['wall_s']} s)")
        return 0

    return cli.run(run, prog="reproduce_mini.py")


if __name__ == "__main__":
    sys.exit(main())
