"""A full disk at checkpoint time is a named error, not a traceback: the errors a real full device
gives (/dev/full answers every write with ENOSPC) are recognised, and the space check before a save
says what is short."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.checkpoint import is_out_of_space, previous_size, space_shortfall


def _error(write) -> BaseException:
    try:
        write()
    except (OSError, RuntimeError) as e:
        return e
    raise AssertionError("/dev/full accepted a write")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_the_errors_of_a_full_device_are_recognised():
    def plain():
        with open("/dev/full", "w") as f:
            f.write("x" * 10)

    assert is_out_of_space(_error(plain))
    assert is_out_of_space(_error(lambda: torch.save({"w": torch.zeros(1000)}, "/dev/full")))
    assert not is_out_of_space(RuntimeError("a bug"))
    assert not is_out_of_space(FileNotFoundError(2, "No such file or directory"))


def test_the_space_check_says_what_is_short(tmp_path):
    assert space_shortfall(tmp_path, need_bytes=0) == ""
    short = space_shortfall(tmp_path, need_bytes=10**18)
    assert short.startswith("it needs about 1000000000.000 GB (the size of the last one), ") and "GB are free" in short
    assert previous_size(tmp_path) == 0  # no checkpoint yet: nothing to compare with
