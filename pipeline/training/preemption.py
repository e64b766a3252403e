"""A pre-emption signal before training starts (Slurm's --signal reaches a job in pre-flight too).

From the start of pipeline/train.py until the trainer installs its own handlers
(pipeline.training.trainer.PreemptionFlag, which saves at the next step boundary), SIGUSR1 or SIGTERM
ends the process with exit 0 instead of killing it: nothing was trained, so nothing needs saving, and
exit 0 is what tells slurm/train_job.sh to requeue the job rather than give up on a failed step.
"""

from __future__ import annotations

import signal
from typing import Any

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptedEarly(BaseException):
    """Raised by the signal handler. A BaseException, as KeyboardInterrupt is: the `except Exception`
    of a library that pre-flight calls (a download, a tokenizer) must not swallow it."""


def exit_on_signals_until_training() -> None:
    """Install the handler that turns a pre-emption signal into PreemptedEarly."""

    def handler(signum: int, _frame: Any) -> None:
        raise PreemptedEarly(signal.Signals(signum).name)

    for signum in SIGNALS:
        signal.signal(signum, handler)


def message(error: PreemptedEarly) -> str:
    return (
        f"pre-emption signal {error} before training started: nothing to save, exiting 0 "
        f"(slurm/train_job.sh requeues the job; it resumes from the last checkpoint, if any)"
    )
