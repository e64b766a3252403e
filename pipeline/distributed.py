"""Everything that knows about ranks: the launch environment (torchrun, deepspeed, Slurm's srun),
the process group, the collectives the losses and the trainer need, and a counter of the bytes every
collective carries (pipeline.bench.comm_bytes).

No other module reads RANK / LOCAL_RANK / WORLD_SIZE / SLURM_* or calls torch.distributed. Every
function here also works without a process group (a single process): the gathers return their input
and the reductions are the identity, so the losses run unchanged in unit tests and notebooks.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import os
import re
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from preprocessing.errors import UsageError

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


# ---------------------------------------------------------------------------------------------------
# One GPU per rank, decided before the process group exists (NCCL binds its device at init)
#
# What a rank sees depends on the launch: torchrun, deepspeed and srun without --gpu-bind (the
# Slurm scripts) show every GPU of the node; `srun --gpus-per-task=1` shows one; `--gpu-bind=closest`
# shows the GPUs of the rank's socket, to every rank bound there (Slurm's socket-cyclic task layout:
# local ranks 0, 2, 4, 6 see GPUs 0-3 of a 2-socket node). Every rank posts what it sees to the
# rendezvous store and takes the GPU at its position among the ranks that see the same GPUs: distinct
# GPUs in all three cases, where LOCAL_RANK modulo the GPUs seen gives ranks 0 and 4 the same one
# under `closest`. `check_one_gpu_per_rank` then compares the GPUs' UUIDs and refuses any shared.
# ---------------------------------------------------------------------------------------------------

# The env:// rendezvous store of this process's launch (store, rank, world size), made once.
_STORE: Optional[tuple[dist.Store, int, int]] = None
_LAUNCH_GATHERS = 0  # gathers made over it: each gets its own keys


def _rendezvous_store(timeout_s: float) -> tuple[dist.Store, int, int]:
    """The store that init_method="env://" would make (rank 0 serves it at MASTER_ADDR:MASTER_PORT;
    torchrun's agent serves it under torchrun), made once per process and shared by the launch
    gathers and the process group."""
    global _STORE
    if _STORE is None:
        env_from_slurm()
        _STORE = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return _STORE


def all_gather_at_launch(obj: object, *, timeout_s: float = 600.0) -> list:
    """Every rank's `obj` (JSON-serialisable: tuples come back as lists), in rank order, over the
    rendezvous store: a collective that works before the process group exists (and after). [obj] in
    a world of one."""
    global _LAUNCH_GATHERS
    if launch_world_size() == 1:
        return [obj]
    store, rank_, world = _rendezvous_store(timeout_s)
    _LAUNCH_GATHERS += 1  # every rank makes the same gathers in the same order
    scoped = dist.PrefixStore(f"tokencl/launch_gather_{_LAUNCH_GATHERS}", store)
    scoped.set(str(rank_), json.dumps(obj))
    return [json.loads(scoped.get(str(r))) for r in range(world)]  # get waits for the key


def node_name() -> str:
    """This process's node, for messages: Slurm's node name, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or hostname()


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
# Counting what the collectives carry (pipeline.bench.comm_bytes)
# ---------------------------------------------------------------------------------------------------

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
# Frames that only pass a collective on: torch.distributed itself, DeepSpeed's comm wrappers, this module.
_PLUMBING = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm{os.sep}", __file__)
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
    for root in ("site-packages" + os.sep, str(Path(__file__).resolve().parents[1]) + os.sep):
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
