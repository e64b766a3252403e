"""Everything that knows about ranks: the launch environment (torchrun, deepspeed, Slurm's srun),
the process group, and the collectives the losses and the trainer need.

No other module reads RANK / LOCAL_RANK / WORLD_SIZE / SLURM_* or calls torch.distributed. Every
function here also works without a process group (a single process): the gathers return their input
and the reductions are the identity, so the losses run unchanged in unit tests and notebooks.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import zlib
from typing import Optional

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------------
# Launch environment
# ---------------------------------------------------------------------------------------------------


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[003-010,012],cpu1" -> "gpu003"), without scontrol."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def env_from_slurm() -> bool:
    """Fill RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from Slurm's
    variables when the job was started by `srun` and no launcher set them. Returns True if it did.

    Variables that are already set win, so a launcher script may map them itself. DeepSpeed on CPU
    tries MPI discovery when it sees SLURM_PROCID without RANK; setting them here avoids that.
    """
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return False
    env = os.environ
    env["RANK"] = env["SLURM_PROCID"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
    env.setdefault("LOCAL_WORLD_SIZE", re.match(r"\d+", tasks_per_node).group(0))
    env.setdefault("MASTER_ADDR", _first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    # A port derived from the job id, so two jobs sharing a node do not collide.
    job = env.get("SLURM_JOB_ID", "0")
    env.setdefault("MASTER_PORT", str(20000 + zlib.crc32(job.encode()) % 20000))
    return True


def launched_distributed() -> bool:
    """True when a launcher (deepspeed, torchrun, srun) started several processes."""
    env_from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    """The process's rank on its node, from the launcher (0 without one)."""
    env_from_slurm()
    return int(os.environ.get("LOCAL_RANK", "0"))


def hostname() -> str:
    return socket.gethostname()


# ---------------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------------


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


def init_process_group(*, backend: str, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from the launcher's environment (env:// rendezvous).

    `timeout_s` bounds every collective: if a rank dies, the others fail after this long instead of
    hanging until the job's time limit.
    """
    env_from_slurm()
    if dist.is_initialized():
        return
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (e.g. a pre-emption signal seen by one)."""
    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """gloo reduces CPU tensors, nccl CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
