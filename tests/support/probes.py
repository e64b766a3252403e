"""Probes for the trainer tests: `pipeline/train.py`'s main with instruments that read the engine,
switched on by flags of its own, which it takes off the command line:

    --probe_optimizer_after_resume DIR
        right after the checkpoint is loaded, every rank writes DIR/rank{R}.pt: its ZeRO optimizer's
        state_dict() (what DeepSpeed would save from the engine at that moment), then trains on.

Launched in place of pipeline/train.py (tests.support.trainer.deepspeed_cmd does so when a --probe_
flag is present); the product itself carries no probes.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dump_optimizer_after_resume(folder: Path) -> None:
    """Wrap pipeline.training.state.resume (which trainer.setup calls through the module)."""
    import torch

    from pipeline import distributed
    from pipeline.training import state

    resume = state.resume

    def probed(*args, engine, **kwargs):
        resume(*args, engine=engine, **kwargs)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(engine.optimizer.state_dict(), folder / f"rank{distributed.rank()}.pt")

    state.resume = probed


def main() -> int:
    sys.path.insert(0, str(REPO))
    from tests.support.faults import take_flags

    faults, rest = take_flags(sys.argv[1:])  # the --fault_ flags' reader takes --probe_ ones alike
    probes, rest = take_flags(rest, prefix="--probe_")
    assert not faults, f"tests/support/probes.py runs no fault injection: {faults}"
    if "optimizer_after_resume" in probes:
        dump_optimizer_after_resume(Path(probes["optimizer_after_resume"]))
    from pipeline.train import main as train_main

    return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
