"""A real Slurm on this machine for the launcher tests: munge plus a controller and two fake nodes
(`n1`, `n2`, both 127.0.0.1) configured under a temporary folder.

Nothing here touches /etc/slurm or a system munged: the cluster has its own slurm.conf (clients
find it through SLURM_CONF, see `SlurmCluster.env`), its own munge socket, free ports, and is
stopped by the pids its daemons wrote, never by process name. The only system change is
installing the Debian packages when they are missing (`ensure_installed`, needs root), and only when
asked: TOKENCL_REQUIRE_SLURM=1 (CI, .ci/run) or TOKENCL_INSTALL_SLURM=1; otherwise the tests skip and
say the command to run.

    python -m tests.support.slurm_cluster     # start one by hand; prints `export SLURM_CONF=...`, Ctrl-C stops it

`SlurmCluster(gpu_sockets=True)` makes the nodes two-socket GPU nodes whose GPU binding is real:
task/affinity binds tasks to CPUs, and each node's 8 fake GPUs (character devices that slurmd
accepts; plain files it rejects, and then sets no CUDA_VISIBLE_DEVICES) are attached 4 per socket
in gres.conf. task/affinity binds to the machine's real CPUs, so such a node has 2 of them, one per
socket (`GPU_NODE_CPUS`): CPU 0 is socket 0 with GPUs 0-3, CPU 1 socket 1 with GPUs 4-7.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "munged")
NODES = ("n1", "n2")
CPUS_PER_NODE = 8  # more than the machine has (allowed by config_overrides): jobs oversubscribe
# Fake: by default plain files, which slurmd rejects as devices: the launchers' --gpus-per-node
# headers get through, and no task gets a CUDA_VISIBLE_DEVICES (gpu_sockets=True makes them work).
GPUS_PER_NODE = 8
MEMORY_MB_PER_NODE = 64000  # not a consumable here (CR_Core); requests are only checked against it
# gpu_sockets=True: 2 sockets x 1 core, a real CPU each (task/affinity cannot bind to CPUs the
# machine lacks); GPUs 0-3 on the first socket, 4-7 on the second.
GPU_NODE_CPUS = (0, 1)
NVIDIA_MAJOR = 195  # the character-device major of /dev/nvidiaN; nothing opens these files


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; `.skippable` says whether that is a normal developer set-up (not root)
    rather than a broken CI machine."""

    def __init__(self, msg: str, *, skippable: bool) -> None:
        super().__init__(msg)
        self.skippable = skippable


def _missing_binaries() -> list[str]:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
    return [b for b in BINARIES if shutil.which(b, path=search) is None]


def ensure_installed() -> None:
    """Install slurmctld, slurmd, slurm-client and munge with apt-get when any is missing.

    Raises SlurmUnavailable when they are missing and cannot be installed (not root, no apt-get,
    or apt-get failed), with what to do.
    """
    missing = _missing_binaries()
    if not missing:
        return
    if not (os.environ.get("TOKENCL_REQUIRE_SLURM") or os.environ.get("TOKENCL_INSTALL_SLURM")):
        raise SlurmUnavailable(
            f"Slurm is not installed (missing {', '.join(missing)}); install it with "
            f"`apt-get install -y --no-install-recommends {' '.join(PACKAGES)}`, or set "
            f"TOKENCL_INSTALL_SLURM=1 to let the tests install it",
            skippable=True,
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            f"Slurm is not installed (missing {', '.join(missing)}) and installing it needs root: "
            f"sudo apt-get install -y --no-install-recommends {' '.join(PACKAGES)}",
            skippable=True,
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm is not installed (missing {', '.join(missing)}) and there is no apt-get to "
            f"install {' '.join(PACKAGES)}",
            skippable=False,
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    print(f"[slurm tests] installing Slurm for the launcher tests: {' '.join(install)}", file=sys.stderr, flush=True)
    r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # a stale package list: refresh once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0 or _missing_binaries():
        raise SlurmUnavailable(
            f"`{' '.join(install)}` failed (exit {r.returncode}):\n{r.stderr[-2000:]}", skippable=False
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or name


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pids(pids: list[Optional[int]], *, timeout_s: float = 10.0) -> None:
    """SIGTERM to each daemon we started (by its pid), then SIGKILL to any still alive after
    `timeout_s`. All at once: each takes a couple of seconds to exit."""
    live = [p for p in pids if p is not None and _alive(p)]
    for p in live:
        os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [p for p in live if _alive(p)]
    for p in live:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SlurmCluster:
    """One controller and two slurmd's (`n1`, `n2`) with everything under `root`."""

    def __init__(self, root: Optional[Path] = None, *, gpu_sockets: bool = False) -> None:
        # A short path: munge's socket path must fit in a sockaddr_un (108 bytes).
        self.root = Path(root or tempfile.mkdtemp(prefix="tks-", dir="/tmp"))
        self.gpu_sockets = gpu_sockets
        self.conf = self.root / "slurm.conf"
        self.hostname = socket.gethostname().split(".")[0]
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in NODES}
        self.started = False

    # -- paths ------------------------------------------------------------------------------------
    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def _pidfiles(self) -> list[Path]:
        run = self.root / "run"
        return [run / f"slurmd-{n}.pid" for n in NODES] + [run / "slurmctld.pid"]

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: what client commands (sbatch, srun, scontrol) need."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start ------------------------------------------------------------------------------------
    def start(self, *, timeout_s: float = 30.0) -> SlurmCluster:
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting slurmd needs root (it runs jobs as their users)", skippable=True)
        for sub in ("state", "spool", "log", "run", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        self._start_munge()
        self._write_config()
        self.started = True
        self._run([_sbin("slurmctld"), "-i"])
        for n in NODES:
            self._run([_sbin("slurmd"), "-N", n])
        self.wait_idle(timeout_s=timeout_s)
        return self

    def _run(self, cmd: list[str]) -> None:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()}\n{self.log_tail()}")

    def _start_munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/mungekey", "--create"], check=True)
        d = self.munge_socket.parent
        d.mkdir(exist_ok=True)
        shutil.chown(d, "munge", "munge")
        d.chmod(0o755)
        cmd = [
            "runuser",
            "-u",
            "munge",
            "--",
            _sbin("munged"),
            f"--socket={self.munge_socket}",
            f"--pid-file={d / 'munged.pid'}",
            f"--seed-file={d / 'seed'}",
            f"--log-file={d / 'munged.log'}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"munged did not start (exit {r.returncode}): {r.stderr.strip()}")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged started but {self.munge_socket} never appeared")
            time.sleep(0.05)

    def _write_config(self) -> None:
        r = self.root
        if self.gpu_sockets:
            cpus, task_plugin = self._gpu_socket_devices(), "task/affinity"
        else:
            for i in range(GPUS_PER_NODE):
                (r / "dev" / f"gpu{i}").touch()
            (r / "gres.conf").write_text(
                f"NodeName={','.join(NODES)} Name=gpu File={r}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
            )
            cpus, task_plugin = f"CPUs={CPUS_PER_NODE}", "task/none"
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={self.node_ports[n]} "
            f"{cpus} RealMemory={MEMORY_MB_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for n in NODES
        )
        self.conf.write_text(f"""\
ClusterName=tokencl
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin={task_plugin}
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Schedule at once and re-check often, so that requeued jobs restart within seconds.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Fake nodes claim the CPUs, memory and GPUs configured below, not what slurmd detects.
SlurmdParameters=config_overrides
ReturnToService=2
# sbatch --wait polls at growing intervals (up to 32 s): a record purged sooner reads as exit 0.
MinJobAge=600
KillWait=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
GresTypes=gpu
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _gpu_socket_devices(self) -> str:
        """Character devices nvidia0..7 and a gres.conf with 4 per socket; the nodes' CPU layout."""
        per_socket = GPUS_PER_NODE // len(GPU_NODE_CPUS)
        lines = []
        for socket_index in range(len(GPU_NODE_CPUS)):  # Slurm numbers a socket's cores from socket 0 up
            first = socket_index * per_socket
            for i in range(first, first + per_socket):
                os.mknod(self.root / "dev" / f"nvidia{i}", 0o600 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
            files = f"{self.root}/dev/nvidia[{first}-{first + per_socket - 1}]"
            lines.append(f"NodeName={','.join(NODES)} Name=gpu File={files} Cores={socket_index}\n")
        (self.root / "gres.conf").write_text("".join(lines))
        return f"CPUs={len(GPU_NODE_CPUS)} Sockets={len(GPU_NODE_CPUS)} CoresPerSocket=1 ThreadsPerCore=1"

    def wait_idle(self, *, timeout_s: float = 30.0) -> None:
        """Until sinfo shows every node idle (resuming nodes that registered as down)."""
        deadline = time.monotonic() + timeout_s
        resumed = False
        states = ""
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = r.stdout.strip()
            lines = [line.split() for line in states.splitlines() if line.strip()]
            if len(lines) == len(NODES) and all(s == "idle" for _, s in lines):
                return
            if not resumed and any(s.startswith(("down", "drain", "inval")) for _, s in lines):
                subprocess.run(
                    ["scontrol", "update", f"NodeName={','.join(NODES)}", "State=RESUME"],
                    env=self.env,
                    capture_output=True,
                )
                resumed = True
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s:.0f} s (sinfo: {states!r})\n{self.log_tail()}")

    # -- inspect ----------------------------------------------------------------------------------
    def log_tail(self, lines: int = 15) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f}\n" + "\n".join(text))
        return "\n".join(out)

    def job_state(self, job_id: int) -> str:
        r = subprocess.run(["scontrol", "show", "job", str(job_id)], env=self.env, capture_output=True, text=True)
        for tok in r.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    # -- stop -------------------------------------------------------------------------------------
    def stop(self, *, keep_files: bool = False) -> None:
        """Cancel jobs still running, stop slurmd's, slurmctld and munged by their pids."""
        if self.started:
            subprocess.run(
                ["scancel", "--full", "--quiet", "--user", str(os.geteuid())],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.3)
        # The daemons first; munged last, since they talk to it while shutting down.
        _stop_pids([_read_pid(f) for f in self._pidfiles()])
        _stop_pids([_read_pid(self.munge_socket.parent / "munged.pid")])
        self.started = False
        if not keep_files:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(keep_files=exc[0] is not None)


if __name__ == "__main__":
    import sys

    # Ctrl-C or `kill PID` stops the daemons (SystemExit runs the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    c = SlurmCluster().start()
    print(f"export SLURM_CONF={c.conf}   # Ctrl-C or kill {os.getpid()} stops the cluster", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
