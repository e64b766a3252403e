"""Ray on this machine for a local build, started so that it makes no network request and that
none of its processes outlives the builder.

- No dashboard process. Even with include_dashboard=False and RAY_USAGE_STATS_ENABLED=0, Ray starts
  `dashboard.py` with its usage-stats module, whose first act is to ask the cloud metadata endpoints
  (169.254.169.254, metadata.google.internal) which cloud it runs on (ray/_common/usage/usage_lib.py,
  get_cluster_config_to_report; Ray 2.60 has no setting that skips it). A build needs nothing of the
  dashboard (no job API, no web UI), so its start is skipped, the path Ray itself takes when the
  dashboard fails to start.
- A reaper. Ray ties the GCS and the raylet to the driver, but after a `kill -9` of the driver the
  raylet's dashboard and runtime-env agents wait 60 s for the dead GCS (a hard-coded timeout in
  publish_error_to_driver) before they exit. The reaper, a small process the driver starts first, keeps
  a list of the Ray processes (what ray.init started, and their descendants); when the driver ends,
  however it ends, its end of a pipe closes and the reaper kills what is left of that list.
  Without the reaper (e.g. if it was killed too), clean up with `ps -eo pid,ppid,cmd | grep ray::` and
  kill the `ray::DashboardAgent` / `ray::RuntimeEnvAgent` processes whose parent is 1; never
  `ray stop`, which stops every Ray of the machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.5


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: what Slurm or taskset gave it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def local_ray(*, num_cpus: int, **init_kwargs) -> Iterator:
    """ray.init(address="local", num_cpus=...) with no dashboard process and a reaper; shut down,
    and the reaper let go, at the end of the block."""
    import psutil
    import ray
    import ray._private.services as services

    root = str(Path(__file__).resolve().parents[1])
    reaper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {root!r}); from preprocessing.local_ray import reap; reap()",
            str(os.getpid()),
        ],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )  # its own session: a Ctrl-C does not stop it
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    start_api_server = getattr(services, "start_api_server", None)  # None if a Ray release renames it
    if start_api_server is not None:
        services.start_api_server = lambda *args, **kwargs: (None, None)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **init_kwargs)
    except BaseException:
        _let_go(reaper)
        raise
    finally:
        if start_api_server is not None:
            services.start_api_server = start_api_server
    started = [p.pid for p in me.children() if p.pid not in before and p.pid != reaper.pid]
    reaper.stdin.write((" ".join(map(str, started)) + "\n").encode())
    reaper.stdin.flush()
    try:
        yield ray
    finally:
        ray.shutdown()
        _let_go(reaper)


def _let_go(reaper: subprocess.Popen) -> None:
    """Close the pipe: the reaper kills what is left of Ray's processes and exits."""
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout=10)


def reap() -> None:
    """The reaper's main: read root pids from stdin; until stdin closes, record every root and
    descendant (pid, start time); then terminate those still running, and kill them after 3 s."""
    import select

    import psutil

    roots: set[int] = set()
    known: dict[int, float] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable:
            line = sys.stdin.buffer.readline()
            if not line:
                break
            roots.update(int(pid) for pid in line.split())
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for p in [proc, *proc.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        known.setdefault(p.pid, p.create_time())
    alive = []
    for pid, created in known.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created:  # not a new process that reuses the pid
                alive.append(proc)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs(alive, timeout=3)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
