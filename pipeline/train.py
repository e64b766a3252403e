"""Pre-train a BERT student: `deepspeed|torchrun|srun python pipeline/train.py --ds_config ... --objective ...`.

Exit codes: 0 done (or pre-empted after saving); 2 a user error (one line naming the flag, file or
value and the fix); 1 anything else: a bug, with its traceback on the rank where it happened (the
other ranks then fail within --dist_timeout_s). The logic is in pipeline/training/.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from preprocessing import cli  # noqa: E402


def main(argv: list[str] | None = None, *, hooks: Sequence[Any] = ()) -> int:
    """The entry point; `hooks`: loss hooks for every step (pipeline.training.step.LossHook)."""

    def run() -> int:
        from pipeline.training import config, preflight, trainer

        cfg = config.parse_args(argv)
        if cfg.print_config:
            print(config.describe_json(cfg))
            return 0
        return trainer.train(preflight.prepare(cfg), hooks=hooks)

    return cli.run(run, prog="train.py")


if __name__ == "__main__":
    sys.exit(main())
