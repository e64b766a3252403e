"""One GPU per rank, decided before the process group exists (NCCL binds its device at init).

What a rank sees depends on the launch: torchrun, deepspeed and srun without --gpu-bind (the Slurm
scripts) show every GPU of the node; `srun --gpus-per-task=1` shows one; `--gpu-bind=closest` shows the
GPUs of the rank's socket, to every rank bound there (Slurm's socket-cyclic task layout: local ranks
0, 2, 4, 6 see GPUs 0-3 of a 2-socket node). Every rank posts what it sees to the rendezvous store
and takes the GPU at its position among the ranks that see the same GPUs: distinct GPUs in all three
cases, where LOCAL_RANK modulo the GPUs seen gives ranks 0 and 4 the same one under `closest`.
`check_one_gpu_per_rank` then compares the GPUs' UUIDs and refuses any shared.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import torch

from pipeline.distributed.launch import all_gather_at_launch, launch_rank, local_rank, node_name
from preprocessing.errors import UsageError


def visible_gpu_uuids() -> list[str]:
    """The UUIDs ("GPU-...") of the GPUs this process sees, in CUDA order; [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def gpu_uuid(index: int) -> str:
    """The UUID of visible GPU `index`, as nvidia-smi writes it: the same physical GPU has the same
    UUID whatever index a CUDA_VISIBLE_DEVICES list gives it in each process."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def gpu_index(local_rank: int, *, visible: Sequence[str], sharing: Sequence[int]) -> int:
    """Which of the GPUs it sees a rank drives: an index into `visible` (its GPUs, in CUDA order).

    `sharing`: the local ranks of its node that see the same `visible` list, itself included. One
    GPU seen: that one. Several: the one at the rank's position among `sharing` (its LOCAL_RANK
    where every rank sees all the node's GPUs). More sharers than GPUs wrap around, and
    `check_one_gpu_per_rank` refuses the result.
    """
    order = sorted(sharing)
    if local_rank not in order or not visible:
        raise AssertionError(f"local rank {local_rank} is not among {order}, or sees no GPU ({list(visible)})")
    return order.index(local_rank) % len(visible)


class RankView(NamedTuple):
    """What one rank sees at start-up: `visible` identifies its GPUs in CUDA order (their UUIDs, so
    equal lists mean the same GPUs; [] without GPUs)."""

    rank: int
    local_rank: int
    visible: tuple[str, ...]


def pick_gpus(views: Sequence[RankView]) -> list[Optional[int]]:
    """Every rank's GPU, as an index into its own `visible` (None without GPUs), in the order of
    `views`: `gpu_index` with the ranks that see the same GPUs as the sharers."""
    sharers: dict[tuple[str, ...], list[int]] = {}
    for v in views:
        sharers.setdefault(tuple(v.visible), []).append(v.local_rank)
    return [
        gpu_index(v.local_rank, visible=v.visible, sharing=sharers[tuple(v.visible)]) if v.visible else None
        for v in views
    ]


def gpu_for_this_rank(
    *, visible: Callable[[], Sequence[str]] = visible_gpu_uuids, timeout_s: float = 600.0
) -> Optional[torch.device]:
    """The GPU this rank drives (`pick_gpus`), None without GPUs: a collective of every rank before
    the process group exists (over the rendezvous store). `visible`: the identities of the GPUs this
    process sees, in CUDA order (their UUIDs; a test passes its own)."""
    me = RankView(rank=launch_rank(), local_rank=local_rank(), visible=tuple(visible()))
    views = [RankView(r, lr, tuple(v)) for r, lr, v in all_gather_at_launch(list(me), timeout_s=timeout_s)]
    index = pick_gpus(views)[me.rank]
    return None if index is None else torch.device("cuda", index)


class GpuClaim(NamedTuple):
    """One rank's GPU at start-up: `uuid` None without one; `visible_devices` is its
    CUDA_VISIBLE_DEVICES as the launcher set it."""

    rank: int
    node: str
    uuid: Optional[str]
    visible_devices: str


def check_one_gpu_per_rank(
    gpu: Optional[torch.device], *, uuid_of: Callable[[int], str] = gpu_uuid, timeout_s: float = 600.0
) -> None:
    """Refuse to start, on every rank, when ranks share a GPU or only some ranks have one
    (`refuse_shared_gpus`). A collective over the rendezvous store: call it before NCCL starts,
    which would fail on a shared GPU with a less telling error. `uuid_of`: visible index -> UUID."""
    claim = GpuClaim(
        rank=launch_rank(),
        node=node_name(),
        uuid=None if gpu is None else uuid_of(torch.cuda.current_device() if gpu.index is None else gpu.index),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
    )
    refuse_shared_gpus([GpuClaim(*row) for row in all_gather_at_launch(list(claim), timeout_s=timeout_s)])


def refuse_shared_gpus(claims: Sequence[GpuClaim]) -> None:
    """UsageError when two ranks drive one physical GPU (same UUID), naming the ranks, their node(s),
    the GPU and what each saw; or when some ranks have a GPU and others none. Else nothing."""
    by_uuid: dict[str, list[GpuClaim]] = {}
    for c in claims:
        if c.uuid is not None:
            by_uuid.setdefault(c.uuid, []).append(c)
    shared = sorted((sorted(cs) for cs in by_uuid.values() if len(cs) > 1), key=lambda cs: cs[0].rank)
    fix = (
        "launch one task per GPU (--ntasks-per-node equal to the GPUs per node, and srun without "
        "--gpu-bind as slurm/train_job.sh does, or srun --gpus-per-task=1)"
    )
    if shared:
        cs = shared[0]
        both = "both" if len(cs) == 2 else "all"
        more = f" ({len(shared) - 1} more GPU(s) are driven by several ranks)" if len(shared) > 1 else ""
        raise UsageError(
            f"ranks {_and_list([c.rank for c in cs])} on {_nodes(cs)} {both} drive GPU {cs[0].uuid} "
            f"({_visible_devices(cs)}){more}: {fix}"
        )
    without = [c for c in claims if c.uuid is None]
    if without and len(without) < len(claims):
        sees = "sees" if len(without) == 1 else "see"
        raise UsageError(
            f"{_plural('rank', without)} {_and_list([c.rank for c in without])} on {_nodes(without)} {sees} no GPU "
            f"({_visible_devices(without)}) while the other ranks each drive one: give every node GPUs "
            "(sbatch --gpus-per-node), or run every rank on CPU (CPU_MODE=1 in the Slurm scripts)"
        )


def _and_list(items: Sequence[object]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _plural(word: str, items: Sequence[object]) -> str:
    return word if len(items) == 1 else word + "s"


def _nodes(claims: Sequence[GpuClaim]) -> str:
    nodes = sorted({c.node for c in claims})
    return f"{_plural('node', nodes)} {_and_list(nodes)}"


def _visible_devices(claims: Sequence[GpuClaim]) -> str:
    """CUDA_VISIBLE_DEVICES=X when the ranks saw the same list, else each rank's."""
    if len({c.visible_devices for c in claims}) == 1:
        return f"CUDA_VISIBLE_DEVICES={claims[0].visible_devices}"
    return "CUDA_VISIBLE_DEVICES=" + ", ".join(f"{c.visible_devices} on rank {c.rank}" for c in claims)
