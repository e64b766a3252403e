"""The learning-rate schedule: --warmup_steps 0 trains its first step at the full rate (DeepSpeed's own
warm-up schedulers last at least 2 steps from warmup_min_lr, 0 by default, so it is replaced), and
the replacement reads the states of the schedulers that ran before it."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.config import ScheduleArgs
from pipeline.training.ds_config import client_scheduler, load_ds_json, resolve_ds_config
from tests.support.trainer import REPO


def _resolved(kind: str, warmup: int) -> tuple[dict, ScheduleArgs]:
    ds = load_ds_json(str(REPO / "deepspeed_configs" / "zero2.json"))
    ds["scheduler"]["type"] = kind
    schedule = ScheduleArgs(lr=1e-3, warmup_steps=warmup, max_steps=100)
    return resolve_ds_config(ds, schedule=schedule, world_size=1, path="zero2.json"), schedule


def _lrs(build, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build(opt)
    out = []
    for _ in range(steps):  # the rate each optimizer step uses
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupLR"])
def test_no_warmup_starts_at_the_full_rate(kind):
    ds, schedule = _resolved(kind, 0)
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 0  # recorded as asked
    given, build = client_scheduler(ds, schedule=schedule)
    assert "scheduler" not in given and build is not None
    lrs = _lrs(build, 100)
    if kind == "WarmupDecayLR":  # linear from --lr at the first step to 0 at --max_steps
        assert lrs[:3] == pytest.approx([1e-3, 0.99e-3, 0.98e-3]) and lrs[-1] == pytest.approx(1e-5)
    else:
        assert set(lrs) == {1e-3}


def test_a_warmup_is_deepspeeds_own():
    ds, schedule = _resolved("WarmupDecayLR", 10)
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 10
    assert client_scheduler(ds, schedule=schedule) == (ds, None)


def test_a_lambda_lr_state_of_an_older_no_warmup_run_continues_at_its_step():
    ds, schedule = _resolved("WarmupDecayLR", 0)
    _, build = client_scheduler(ds, schedule=schedule)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    old = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (100 - step) / 100)  # what such runs saved
    for _ in range(30):
        opt.step()
        old.step()
    sched = build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3))
    sched.load_state_dict(old.state_dict())
    assert sched.taken == 30 and sched.optimizer.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_a_deepspeed_schedule_state_continues_at_its_step():
    """A checkpoint of a run that started with DeepSpeed's own scheduler (before --warmup_steps 0
    meant no warm-up) continues at its step instead of restarting the decay."""
    ds, schedule = _resolved("WarmupDecayLR", 0)
    _, build = client_scheduler(ds, schedule=schedule)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build(opt)
    sched.load_state_dict({"last_batch_iteration": 49})  # 50 steps taken
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.49e-3)
    again = build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3))
    again.load_state_dict(sched.state_dict())  # our own state round-trips
    assert again.taken == sched.taken == 51
