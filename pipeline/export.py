"""Export a training checkpoint as a Hugging Face BERT folder (AutoModelForMaskedLM, AutoModel, fill-mask).

    tokencl-export --checkpoint RUN/checkpoints/step_00001000 --out HF_DIR

The weights are the fp32 master weights of the ZeRO optimizer; the logic is in pipeline/training/hf_export.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from preprocessing import cli  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step_XXXXXXXX")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)

    def run() -> int:
        from pipeline.training.hf_export import export

        out = export(args.checkpoint, args.out)
        print(f"[pipeline] exported {args.checkpoint} to {out}")
        return 0

    return cli.run(run, prog="export.py")


if __name__ == "__main__":
    sys.exit(main())
