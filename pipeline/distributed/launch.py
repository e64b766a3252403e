"""The launch environment, before and after the process group exists: what torchrun, the deepspeed
launcher and Slurm's srun tell a process (RANK, LOCAL_RANK, WORLD_SIZE, SLURM_*), and the env://
rendezvous store, over which ranks can gather small things before the process group exists.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from typing import Optional

import torch.distributed as dist


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
    to count ranks per node: without it, streaming takes every rank for a node of its own. The
    launcher writes LOCAL_SIZE for this very launch, so it wins over a LOCAL_WORLD_SIZE inherited
    from the shell that started it (a stale 1 would make each rank a node of its own).
    """
    env_from_slurm()
    env = os.environ
    if "LOCAL_SIZE" in env:
        env["LOCAL_WORLD_SIZE"] = env["LOCAL_SIZE"]


def local_world_size() -> int:
    """Processes per node, from the launcher (1 without one)."""
    normalize_launch_env()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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
