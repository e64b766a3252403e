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
import warnings
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------------
# Launch environment
# ---------------------------------------------------------------------------------------------------


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[003-010,012]-ib,cpu1" -> "gpu003-ib"): scontrol's own
    expansion where Slurm is installed, else a parser of the same syntax."""
    import shutil
    import subprocess

    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass  # a login node without a reachable controller: parse it ourselves
    # The first item is the text before the first comma outside brackets; its first host takes the
    # first number of every bracket group ("rack[1-2]-n[01-02]" -> "rack1-n01"), padding as written.
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda g: re.split(r"[-,]", g.group(1))[0], first.group(0))


def master_port_for_job(job_id: str) -> int:
    """The rendezvous port of a Slurm job, 20000 + id mod 20000: a function of its id, so two jobs
    sharing a node do not collide, every node derives the same one, and a requeued job (same id)
    finds it again. The Slurm scripts ask this function too (slurm/train_job.sh): one formula."""
    digits = "".join(c for c in str(job_id) if c.isdigit())
    return 20000 + int(digits or 0) % 20000


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
    env.setdefault("MASTER_ADDR", first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    env.setdefault("MASTER_PORT", str(master_port_for_job(env.get("SLURM_JOB_ID", "0"))))
    return True


def local_rank() -> int:
    """The process's rank on its node, from the launcher (0 without one)."""
    env_from_slurm()
    return int(os.environ.get("LOCAL_RANK", "0"))


def hostname() -> str:
    return socket.gethostname()


# ---------------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------------


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
    With NCCL a gloo group of the same ranks is created beside it for host-side collectives.
    """
    global _HOST_GROUP
    env_from_slurm()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl" and device is not None:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    if backend == "nccl":
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=timeout)


def gpu_for_this_rank() -> Optional[torch.device]:
    """The GPU this rank drives: LOCAL_RANK modulo the GPUs it sees (a Slurm task bound to one GPU
    sees one, whatever its local rank). None without GPUs."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", local_rank() % torch.cuda.device_count())


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


# ---------------------------------------------------------------------------------------------------
# Gathers and reductions for the contrastive losses
#
# Row counts differ per rank (masked tokens, sampled pool rows), so every gather takes the per-rank
# sizes, pads each rank's rows to the largest count, all-gathers, and strips the padding. Without a
# process group they return their input unchanged (autograd intact).
#
# Gradient convention of the autograd gather (`autograd=True`): its backward sums, over all ranks,
# the gradients that every rank's loss sends to this rank's rows (a reduce-scatter with SUM; gloo
# emulates it with all-to-all). Rank r's rows therefore receive d(sum_s loss_s)/d(rows_r). DeepSpeed
# and DDP average parameter gradients over ranks, so the parameters receive the gradient of
# mean_s(loss_s): the losses scale each rank's loss so that this mean is the global objective.
# ---------------------------------------------------------------------------------------------------


def all_gather_ints(values: Sequence[int], *, group: Optional[dist.ProcessGroup] = None) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), in rank order: one small collective of
    host integers (over the host group: no device work, no device read).

    In: a list of k Python ints. Out: R lists of k ints (R = world size of `group`; [values] alone
    without a process group).
    """
    if not is_distributed(group):
        return [list(values)]
    local_k = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(world_size(group) * len(values), dtype=torch.int64)
    _all_gather_flat(out, local_k, group=host_group(group))
    return out.view(world_size(group), len(values)).tolist()


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, *, group: Optional[dist.ProcessGroup]) -> None:
    """`out` [R * n, ...] <- every rank's `x` [n, ...], in rank order: one collective into one tensor
    (all_gather_single where torch has it, its older name otherwise)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def all_gather_uneven(
    x_N: torch.Tensor,
    *,
    sizes: Sequence[int],
    group: Optional[dist.ProcessGroup] = None,
    autograd: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's rows along dim 0 in rank order, when the row counts differ.

    In: `x_N` [n_r, ...] on rank r, with n_r == sizes[r] (all ranks pass the same `sizes`, e.g. from
    `all_gather_ints`). Out: [sum(sizes), ...]. `autograd=False` gathers detached rows (pools of
    vectors that carry no gradient); `autograd=True` lets gradients flow back to the ranks that sent
    the rows (see the convention above). Without a process group: `x_N` itself.
    """
    if not is_distributed(group):
        return x_N
    if len(sizes) != world_size(group) or x_N.shape[0] != sizes[rank(group)]:
        raise AssertionError(f"sizes {list(sizes)} do not match rank {rank(group)}'s {x_N.shape[0]} rows")
    longest = max(sizes)
    if not autograd:
        x_N = x_N.detach()
    pad_rows = longest - x_N.shape[0]
    # Collectives need equal shapes on every rank: pad with zero rows (their gradient is dropped).
    padded = torch.cat([x_N, x_N.new_zeros((pad_rows, *x_N.shape[1:]))]) if pad_rows else x_N
    padded = padded.contiguous()
    if autograd:
        parts = _all_gather_with_grad(padded, group)
    else:
        out = padded.new_empty((len(sizes) * longest, *padded.shape[1:]))
        _all_gather_flat(out, padded, group=group)
        parts = out.split(longest)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _all_gather_with_grad(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        # torch 2.14 marks it deprecated in favour of a private module (_functional_collectives);
        # the public function still works and its backward (SUM over ranks) is what we rely on.
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        return all_gather(x, group=group if group is not None else dist.group.WORLD)


def uneven_gather_bytes(sizes: Sequence[int], *, row_bytes: int) -> int:
    """Bytes one rank receives from `all_gather_uneven(sizes=...)`: every rank's rows, padded to the
    largest count (0 without a process group, where nothing moves)."""
    if len(sizes) <= 1:
        return 0
    return len(sizes) * max(sizes) * row_bytes


def sum_over_ranks(x: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The element-wise sum of `x` over the ranks of `group`, detached (for counts and metrics), on
    x's device (it travels on the backend's device: nccl reduces only CUDA tensors, gloo CPU ones)."""
    if not is_distributed(group):
        return x.detach().clone()
    buffer = x.detach().to(_collective_device(group), copy=True)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.to(x.device)


def mean_over_ranks(x: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The element-wise mean of `x` over the ranks of `group`, detached (for logging metrics)."""
    return sum_over_ranks(x, group=group) / world_size(group)


# ---------------------------------------------------------------------------------------------------
# Trainer helpers: the launch environment before the process group exists, hosts, objects, flags
# ---------------------------------------------------------------------------------------------------


def launch_rank() -> int:
    """RANK as the launcher set it (0 without one), readable before the process group exists."""
    env_from_slurm()
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 without one), readable before the process group exists,
    so that configuration errors surface before any collective or device work."""
    env_from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def normalize_launch_env() -> None:
    """Make every launcher look like torchrun to the libraries that read the environment.

    The deepspeed launcher sets LOCAL_SIZE but not LOCAL_WORLD_SIZE, which mosaicml-streaming reads
    to count ranks per node: without it, streaming takes every rank for a node of its own.
    """
    env_from_slurm()
    env = os.environ
    if "LOCAL_WORLD_SIZE" not in env and "LOCAL_SIZE" in env:
        env["LOCAL_WORLD_SIZE"] = env["LOCAL_SIZE"]


def local_world_size() -> int:
    """Processes per node, from the launcher (1 without one)."""
    normalize_launch_env()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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


def launched() -> bool:
    """Whether a launcher (deepspeed, torchrun, srun) described this process's place in a world."""
    env_from_slurm()
    return "RANK" in os.environ


def single_process_env() -> None:
    """Without a launcher, describe a world of one process (benchmarks, notebooks), so that the same
    env:// process group and DeepSpeed set-up run unchanged. Variables already set win."""
    env = os.environ
    if "MASTER_PORT" not in env:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        env.setdefault(k, v)


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
