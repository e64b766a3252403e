"""Entry point: `deepspeed|torchrun|srun python pipeline/train.py --ds_config ... --objective ...`.

Exit codes: 0 done (or pre-empted after saving), 2 bad input (the message names the flag, file or
value), 1 anything else.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `pipeline` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import parse_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from pipeline import trainer

    try:
        prepared = trainer.prepare(parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return trainer.train(prepared)
    except ValueError as e:  # found once running (a corrupted sample, a changed teacher, ...)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
