"""A census of host reads and collectives in the trainer's step, on CPU, run under a launcher:

    python -m torch.distributed.run --nproc_per_node 2 -m tests.support.census OUT.json TRAIN_ARGS...

On CPU nothing is a device sync, so the census marks what would live on the device: every tensor of
the batch is handed to the step as `OnDevice` (a tensor subclass that every op result inherits), and a
host read of an OnDevice value (`item`, `tolist`, `bool`, `int`, `float`, `numpy`, `nonzero`, a boolean
mask, ...) is what a GPU would stall on. DeepSpeed's own reads act on its flat buffers, which are not
OnDevice: every host read made from DeepSpeed's code is counted instead. Collectives: every call of a
torch.distributed collective, attributed to the code that made it (ours, Hugging Face's, DeepSpeed's)
by the innermost such frame of the stack. Writes {"counts": {who: {what: n}}, "steps": N} per rank;
with CENSUS_SITES=1 also DeepSpeed's reads by file and line ("sites"), to find them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
ACTIVE = [False]
REPO = str(Path(__file__).resolve().parents[2])


def _who() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if f.startswith(os.path.join(REPO, "pipeline")):
            return "ours"
        if "/transformers/" in f:
            return "hf"
        if "/deepspeed/" in f:
            return "deepspeed"
    return "other"


def _count(what: str, *, device_value: bool) -> None:
    if not ACTIVE[0]:
        return
    who = _who()
    if device_value or who == "deepspeed":
        COUNTS[who][what] += 1
        if who == "deepspeed" and os.environ.get("CENSUS_SITES"):
            site = next(f for f in reversed(traceback.extract_stack()[:-2]) if "/deepspeed/" in f.filename)
            COUNTS["sites"][f"{what}@{site.filename.split('deepspeed/')[-1]}:{site.lineno}"] += 1


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a device tensor; results of ops on it are OnDevice too."""

    _READS = {
        torch.Tensor.item: "item",
        torch.Tensor.tolist: "tolist",
        torch.Tensor.__bool__: "bool",
        torch.Tensor.__int__: "int",
        torch.Tensor.__float__: "float",
        torch.Tensor.numpy: "numpy",
        torch.Tensor.__index__: "index",
        torch.nonzero: "nonzero",
        torch.Tensor.nonzero: "nonzero",
        torch.masked_select: "masked_select",
        torch.Tensor.masked_select: "masked_select",
        torch.unique: "unique",
        torch.Tensor.unique: "unique",
        torch.Tensor.cpu: "cpu",
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = cls._READS.get(func)
        if what is None and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                what = "bool_mask_index"
        if what is not None:
            _count(what, device_value=True)
        return super().__torch_function__(func, types, args, kwargs)


def _patch_plain_reads() -> None:
    """DeepSpeed's reads happen on plain tensors: count those made from its frames."""
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, __original=original, __name=name, **k):
            if not isinstance(self, OnDevice):
                _count(__name.strip("_"), device_value=False)
            return __original(self, *a, **k)

        setattr(torch.Tensor, name, wrapped)


def _patch_collectives() -> None:
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "broadcast",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "barrier",
        "reduce",
    ):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*a, __original=original, __name=name, **k):
            if ACTIVE[0]:
                COUNTS[_who()][f"collective:{__name}"] += 1
            return __original(*a, **k)

        setattr(dist, name, wrapped)


def main(argv: list[str]) -> int:
    out_path, train_args = argv[0], argv[1:]
    sys.path.insert(0, REPO)
    from pipeline.training import config, preflight, step, trainer

    _patch_plain_reads()
    _patch_collectives()
    real_to_device, real_step = step.to_device, trainer.train_step
    steps = [0]

    def to_device(batch, device):
        moved = real_to_device(batch, device)
        return {k: v.as_subclass(OnDevice) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}

    def train_step(program, state, batches, meter, **kw):
        steps[0] += 1
        ACTIVE[0] = True  # from the first step on: set-up is not the step
        return real_step(program, state, batches, meter, **kw)

    step.to_device, trainer.train_step = to_device, train_step
    code = trainer.train(preflight.prepare(config.parse_args(train_args)))
    ACTIVE[0] = False
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{out_path}.rank{rank}").write_text(json.dumps({"counts": COUNTS, "steps": steps[0]}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
