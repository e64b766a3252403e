"""Counting what the collectives carry (pipeline.bench.comm_bytes): every torch.distributed collective
of this process, with its payload bytes and the code that called it."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# op -> the argument whose bytes are the collective's payload: the reduced or broadcast tensor, the
# gathered result of an all-gather (all R parts), the input of a reduce-scatter or all-to-all, this
# rank's own tensor for gather, scatter and point-to-point. What one rank puts on the wire follows from
# it and the algorithm (ring all-reduce: 2 (R-1)/R x payload; all-gather (R-1)/R x).
_PAYLOAD_ARG = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce": "tensor",
    "broadcast": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",  # torch 2.14's name for all_gather_into_tensor
    "_all_gather_base": "output_tensor",
    "all_gather": "tensor_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "gather": "tensor",
    "gather_into_tensor": "tensor",
    "gather_single": "tensor",
    "scatter": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "barrier": None,
    # Pickled objects: their size is not a tensor's (the project's own small host objects).
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
}


# Frames that only pass a collective on: torch.distributed itself, DeepSpeed's comm wrappers, this package.
_PLUMBING = (
    f"{os.sep}torch{os.sep}distributed{os.sep}",
    f"{os.sep}deepspeed{os.sep}comm{os.sep}",
    str(Path(__file__).parent) + os.sep,  # this package
)


_RECORDING: Optional[list] = None


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank called it: the op, its payload bytes (see _PAYLOAD_ARG), the dtype,
    the size of its group, and who called it ("deepspeed/runtime/zero/stage_1_and_2.py:allreduce_bucket",
    "pipeline/losses/taco.py:taco_loss"): the first frame past the plumbing."""

    op: str
    nbytes: int
    dtype: Optional[str]
    group_size: int
    caller: str


def _tensor_bytes(x: object) -> tuple[int, Optional[str]]:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size(), str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return sum(t.numel() * t.element_size() for t in x), str(x[0].dtype).replace("torch.", "")
    return 0, None


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(p in frame.f_code.co_filename for p in _PLUMBING):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for root in ("site-packages" + os.sep, str(Path(__file__).resolve().parents[2]) + os.sep):
        if root in path:
            path = path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_code.co_name}"


def _counted(op: str, fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _RECORDING is not None:
            bound = signature.bind(*args, **kwargs).arguments
            arg = _PAYLOAD_ARG[op]
            nbytes, dtype = _tensor_bytes(bound.get(arg)) if arg else (0, None)
            size = dist.get_world_size(bound.get("group"))
            _RECORDING.append(CollectiveCall(op, nbytes, dtype, size, _caller()))
        return fn(*args, **kwargs)

    wrapper._counted = True
    return wrapper


def install_collective_counter() -> None:
    """Route torch.distributed's collectives through a counter (idle until `counting_collectives`).
    Call it before DeepSpeed initialises its comm backend, which keeps references to some of them."""
    for op in _PAYLOAD_ARG:
        fn = getattr(dist, op, None)
        if fn is not None and not getattr(fn, "_counted", False):
            setattr(dist, op, _counted(op, fn))


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[CollectiveCall]]:
    """The collectives this process calls through torch.distributed inside the block, in order."""
    global _RECORDING
    install_collective_counter()
    calls: list[CollectiveCall] = []
    _RECORDING = calls
    try:
        yield calls
    finally:
        _RECORDING = None
