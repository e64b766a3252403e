"""The fast tier is in-process: a test in tests/unit that starts a process (a subprocess, a spawned
worker) must say so with @pytest.mark.multiproc, which moves it to the slow tier. This guard makes
any other process start an error, so `make test-fast` stays what it says."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


class StartsAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def in_process_only(request, monkeypatch):
    if request.node.get_closest_marker("multiproc") is not None:
        yield
        return

    def refuse(*args, **kwargs):
        raise StartsAProcess(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiproc (the slow tier), or keep it "
            f"in process"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
