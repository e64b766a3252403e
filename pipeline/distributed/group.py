"""The process group and what the trainer asks of it: rank and world size (1 without a group), the
gloo twin of an NCCL world for host numbers, small collectives of host values and objects, nodes and
hosts, and the clean-up of DeepSpeed's CPU shared memory.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from pipeline.distributed.launch import _rendezvous_store, env_from_slurm, hostname, local_world_size


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_distributed(group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when collectives over `group` (default: the world) involve more than this process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0 of the world: the only process that prints, logs or draws progress bars."""
    return rank() == 0


# A gloo twin of the world group where the world runs NCCL: the small collectives of host numbers
# (batch layouts, control flags) travel over it without touching the device.
_HOST_GROUP: Optional[dist.ProcessGroup] = None


def init_process_group(*, backend: str, timeout_s: float = 600.0, device: Optional[torch.device] = None) -> None:
    """Initialise the default process group from the launcher's environment (env:// rendezvous).

    `timeout_s` bounds every collective: if a rank dies, the others fail after this long instead of
    hanging until the job's time limit. `device` (NCCL): this rank's GPU, bound to the group up front.
    With NCCL a gloo group of the same ranks is created beside it for host-side collectives. The
    rendezvous store is the one `gpu_for_this_rank` already gathered over, when it ran first.
    """
    global _HOST_GROUP
    env_from_slurm()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank_, world = _rendezvous_store(timeout_s)
    store.set_timeout(timeout)
    # What init_process_group(init_method="env://") builds from the same store.
    args = dict(
        backend=backend, timeout=timeout, store=dist.PrefixStore("default_pg", store), rank=rank_, world_size=world
    )
    if backend == "nccl" and device is not None:
        args["device_id"] = device
    dist.init_process_group(**args)
    if backend == "nccl":
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=timeout)


def host_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """The group to send host (CPU) tensors over for the ranks of `group`: the group itself on gloo,
    the world's gloo twin for the NCCL world."""
    if group is None and _HOST_GROUP is not None:
        return _HOST_GROUP
    return group


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """gloo reduces CPU tensors, nccl CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """nccl where there are GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def all_gather_object(obj: object) -> list:
    """Every rank's picklable `obj`, in rank order ([obj] without a process group). For small
    things only: host names, RNG states."""
    if not is_distributed():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def node_index() -> int:
    """This process's node: rank // LOCAL_WORLD_SIZE (ranks are numbered node by node)."""
    return rank() // local_world_size()


def num_nodes() -> int:
    return world_size() // local_world_size()


def nodes_by_host() -> dict[str, set[int]]:
    """Host name -> the nodes that run on it (a collective). Several "nodes" share a host when a test
    or a Slurm set-up with fake nodes starts two launchers on one machine; host-wide resources
    (shared-memory names) must then be told apart per node."""
    hosts: dict[str, set[int]] = {}
    for host, node in all_gather_object((hostname(), node_index())):
        hosts.setdefault(host, set()).add(node)
    return hosts


def node_on_host() -> tuple[int, int, int]:
    """(node, index of this node among the nodes on this host, number of nodes on this host); a
    collective."""
    node, here = node_index(), sorted(nodes_by_host()[hostname()])
    return node, here.index(node), len(here)


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """The element-wise maximum of host integers over all ranks, on every rank: one small collective
    over the host group for the decisions all ranks take together (stop, abort)."""
    if not is_distributed():
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return t.tolist()


def any_rank_flags(flags: Sequence[bool]) -> list[bool]:
    """For each flag, True on every rank if it is True on any rank (a pre-emption signal seen by one)."""
    return [v > 0 for v in max_over_ranks([1 if f else 0 for f in flags])]


def bound_new_group_timeouts(*, timeout_s: float) -> None:
    """Make process groups created later without an explicit timeout use `timeout_s` too.

    DeepSpeed clones the world group for ZeRO's gradient reduction with `new_group(ranks)`, which
    would get torch's 30-minute default instead of the timeout given to init_process_group: a hung
    rank would then hold the others for half an hour. torch reads these module defaults whenever a
    group is created, so set them before DeepSpeed builds its groups.
    """
    import torch.distributed.distributed_c10d as c10d

    bound = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = bound
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = bound


def release_deepspeed_shm() -> None:
    """Remove this rank's DeepSpeed CPU shared-memory all-reduce buffer (~70 MB in /dev/shm).

    With DS_ACCELERATOR=cpu and every rank on one host (LOCAL_SIZE == world size, the deepspeed
    launcher), DeepSpeed creates `deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}`
    and never unlinks it, so every run would leave its buffers in RAM. The name is this job's and this
    rank's alone; mappings other ranks hold stay valid after the unlink.
    """
    env = os.environ
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
        f"{env.get('MASTER_PORT', '')}_{env.get('RANK', rank())}"
    )
    try:
        os.unlink(name)
    except OSError:
        pass
