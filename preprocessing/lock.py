"""One job at a time per output folder: OUTPUT/.build.lock for a build (flock()ed for the whole
build), RUN/.train.lock for a training run (pipeline.training.preflight), the same lock.

The lock file holds a JSON record of its holder (pid, host, start time, command, Slurm job). The
kernel drops an flock when its holder dies, however it dies, so a file whose flock is free was left
by a dead job. On this host that is checked against the recorded pid and the lock is taken over with
a note. A record from another host is refused instead: flock does not reach across hosts on every
shared file system, so a free flock there proves nothing; unless it names this Slurm job, which
Slurm runs once at a time (a requeued job lands on other nodes). The file is opened with O_NOFOLLOW:
a symbolic link planted at its name cannot redirect the record into another file. The build's lock
covers OUTPUT only, not --remote.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from preprocessing.errors import UsageError, note

LOCK_NAME = ".build.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def _describe(record: dict) -> str:
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')} (started {record.get('started', '?')})"


class OutputLock:
    """`acquire()` or raise UsageError naming the job that holds the folder; `release()` at the end.

    `flag` names the folder in messages (--output, --save_dir), `what` the kind of job (build,
    training), `name` the lock file, `say` where notes go."""

    def __init__(
        self,
        folder: Path,
        *,
        flag: str = "--output",
        what: str = "build",
        name: str = LOCK_NAME,
        say: Callable[[str], None] = note,
    ):
        self.folder = folder
        self.path = folder / name
        self.flag, self.what, self.say = flag, what, say
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = self._open()
            try:
                flocked = self._flock(fd)
                if not _same_file(fd, self.path):
                    # The holder removed the file between our open and our flock (release() unlinks
                    # while it holds the lock): this inode is no longer the lock; start again.
                    os.close(fd)
                    continue
                previous = _read_record(fd)
                if previous:
                    self._check_stale(previous, flocked=flocked)
                record = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                    "command": sys.argv,
                    "slurm_job": os.environ.get("SLURM_JOB_ID"),
                }
                data = json.dumps(record).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise UsageError(
                f"{self.flag} {self.folder}: {self.path} is a symbolic link (to {os.readlink(self.path)}); a lock is "
                f"a plain file: remove the link and rerun"
            ) from None

    def _flock(self, fd: int) -> bool:
        """True when we hold the flock now; False when this file system has no flock (the record
        alone decides then). Raises UsageError when another build holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = {}
            for _ in range(20):  # the holder writes its record just after it takes the flock
                holder = _read_record(fd)
                if holder:
                    break
                time.sleep(0.05)
            who = _describe(holder) if holder else "a process that has not written its record yet"
            raise UsageError(
                f"{self.flag} {self.folder}: another {self.what} is writing into it: {who}; "
                f"wait for it to finish or choose another {self.flag} (lock: {self.path})"
            ) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            self.say(f"{self.path}: this file system does not support flock; the lock relies on its pid record alone")
            return False

    def _check_stale(self, previous: dict, *, flocked: bool) -> None:
        here = socket.gethostname()
        pid = previous.get("pid")
        where = f"{self.flag} {self.folder}"
        if previous.get("host") != here:
            job = os.environ.get("SLURM_JOB_ID")
            if flocked and job and previous.get("slurm_job") == job:
                self.say(f"{where}: taking over the lock left by {_describe(previous)}, an earlier run of job {job}")
                return
            raise UsageError(
                f"{where}: {self.path} was left by {_describe(previous)}, which this host ({here}) cannot "
                f"check; if no {self.what} is running there, delete {self.path} and rerun"
            )
        if not isinstance(pid, int) or pid == os.getpid():
            return
        if _pid_alive(pid):
            if not flocked:
                raise UsageError(
                    f"{where}: another {self.what} is writing into it: "
                    f"{_describe(previous)}; wait for it to finish or choose another {self.flag}"
                )
            self.say(
                f"{where}: taking over the lock of {_describe(previous)}: that pid is running but does not hold the "
                "lock (a reused pid)"
            )
        else:
            self.say(f"{where}: taking over the lock left by {_describe(previous)}, which is no longer running")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still holding it: see the inode check in acquire()
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def _read_record(fd: int) -> dict:
    data = os.pread(fd, 1 << 16, 0)
    try:
        record = json.loads(data) if data.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "started": f"unreadable record {data[:80]!r}"}
    return record if isinstance(record, dict) else {}


@contextlib.contextmanager
def output_lock(folder: Path, **kwargs: Any) -> Iterator[OutputLock]:
    """Hold the folder's lock for the duration of the block (`kwargs`: OutputLock's)."""
    lock = OutputLock(folder, **kwargs)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
