"""Pre-train a BERT student: `deepspeed|torchrun|srun python pipeline/train.py --ds_config ... --objective ...`.

Without a launcher (`python pipeline/train.py ...`) it trains as a single process.

Exit codes: 0 done (or pre-empted: after saving, or before training started); 2 a user error (one
line naming the flag, file or value and the fix; a second training into the same --save_dir is one);
1 anything else: a bug, with its traceback on the rank where it happened (the other ranks then fail
within --dist_timeout_s). The logic is in pipeline/training/.
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
        from pipeline.training import preemption

        preemption.exit_on_signals_until_training()
        try:
            from pipeline.training import config, preflight, trainer

            cfg = config.parse_args(argv)
            if cfg.print_config:
                print(config.describe_json(cfg))
                return 0
            with preflight.run_folder(cfg):  # the run folder's lock, until the job ends
                return trainer.train(preflight.prepare(cfg), hooks=hooks)
        except preemption.PreemptedEarly as e:
            from pipeline.training import log

            log.info(preemption.message(e))
            return 0

    return cli.run(run, prog="train.py")


if __name__ == "__main__":
    sys.exit(main())
