"""The learning-rate schedule's math (pipeline.training.schedule) against references: DeepSpeed's own
WarmupDecayLR / WarmupLR for the linear shapes, a hand-written loop for WSD; its scheduler's states;
and the --max_time budget (pipeline.training.budget) with an injected clock, in process."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.training import schedule as S
from pipeline.training.budget import TimeBudget
from pipeline.training.state import TrainState


def _optimizer(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize("warmup_type", ["linear", "log"])
@pytest.mark.parametrize(("warmup", "total", "low"), [(1, 10, 0.0), (4, 10, 0.0), (10, 60, 1e-5), (7, 7, 0.0)])
@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupLR"])
def test_the_linear_shapes_are_deepspeeds_own(kind, warmup, total, low, warmup_type):
    from deepspeed.runtime.lr_schedules import WarmupDecayLR, WarmupLR

    params = {"warmup_min_lr": low, "warmup_max_lr": 1e-3, "warmup_num_steps": warmup, "warmup_type": warmup_type}
    opt = _optimizer()
    if kind == "WarmupDecayLR":
        ds = WarmupDecayLR(opt, total_num_steps=total, **params)
    else:
        ds = WarmupLR(opt, **params)
    shape = S.shape_from_json({"type": kind, "params": {**params, "total_num_steps": total}}, peak=1.0)
    for i in range(total + 5):
        ds.step(last_batch_iteration=i)  # DeepSpeed's rate after i steps
        assert S.lr_at(i, shape, total=total) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), i


def _wsd_reference(i: int, *, peak: float, warmup: int, total: int, decay: int) -> float:
    """WSD written out: linear warm-up, --lr until the last `decay` steps, then 1 - sqrt of the share
    of the decay done, reaching 0 after the last step."""
    if i < warmup:
        return peak * i / warmup
    start = total - decay
    if i < start:
        return peak
    if i >= total:
        return 0.0
    return peak * (1 - ((i - start) / decay) ** 0.5)


@pytest.mark.parametrize(("warmup", "total", "decay"), [(0, 20, 5), (3, 20, 5), (3, 20, 17), (10, 100, None)])
def test_wsd_is_the_hand_written_reference(warmup, total, decay):
    shape = S.Shape(peak=1e-3, warmup=warmup, decay="wsd", decay_steps=decay)
    d = decay if decay is not None else 20  # the default: 20% of the steps
    got = [S.lr_at(i, shape, total=total) for i in range(total + 3)]
    want = [_wsd_reference(i, peak=1e-3, warmup=warmup, total=total, decay=d) for i in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert S.decay_start(shape, total) == total - d
    if warmup == 3 and decay == 5:  # a few numbers by hand
        assert got[:4] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3])
        assert got[14:20] == pytest.approx(
            [1e-3, 1e-3, 1e-3 * (1 - math.sqrt(0.2)), 1e-3 * (1 - math.sqrt(0.4))] + got[18:20]
        )
        assert got[19] == pytest.approx(1e-3 * (1 - math.sqrt(0.8))) and got[20] == 0.0


def test_a_refit_keeps_a_begun_decay_and_never_starts_one_in_the_past():
    shape = S.Shape(peak=1.0, warmup=2, decay="wsd", decay_steps=10)
    assert S.refit_start(shape, total=100, taken=50, start=90) == 90  # not begun: follows the total
    assert S.refit_start(shape, total=200, taken=50, start=90) == 190
    assert S.refit_start(shape, total=55, taken=50, start=90) == 50  # would be 45: begins now instead
    assert S.refit_start(shape, total=120, taken=95, start=90) == 90  # begun: kept, the end moves
    linear = S.Shape(peak=1.0, warmup=2, decay="linear")
    assert S.refit_start(linear, total=55, taken=50, start=2) == 2


def test_the_scheduler_steps_through_lr_at_and_its_state_round_trips():
    shape = S.Shape(peak=1e-3, warmup=4, decay="wsd", decay_steps=6)
    opt = _optimizer()
    sched = S.ScheduleLR(opt, shape, total=20)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])  # the rate the optimizer step uses
        opt.step()
        sched.step()
    assert seen == pytest.approx([S.lr_at(i, shape, total=20) for i in range(20)])
    # A resumed job with a later end (the decay had not begun): its own total, from the step taken.
    later = S.ScheduleLR(_optimizer(), shape, total=30)
    state = {**sched.state_dict(), "steps_taken": 12}
    later.load_state_dict(state)
    assert later.taken == 12 and later.rate() == S.lr_at(12, shape, total=30) == 1e-3
    # Older states: torch's LambdaLR (--warmup_steps 0 before), DeepSpeed's own.
    for old, taken in (({"last_epoch": 7, "base_lrs": [1e-3]}, 7), ({"last_batch_iteration": 6}, 7)):
        s = S.ScheduleLR(_optimizer(), shape, total=20)
        s.load_state_dict(old)
        assert s.taken == taken and s.optimizer.param_groups[0]["lr"] == S.lr_at(taken, shape, total=20)


def test_a_fitted_scheduler_restores_its_fit():
    shape = S.Shape(peak=1.0, decay="wsd", decay_steps=10)
    fitted = S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    fitted.taken = 45
    fitted.refit(50)  # would begin at 40: begins at 45 instead
    assert (fitted.total, fitted.start) == (50, 45)
    again = S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    again.load_state_dict(fitted.state_dict())
    assert (again.taken, again.total, again.start, again.rate()) == (45, 50, 45, 1.0)
    fixed = S.ScheduleLR(_optimizer(), shape, total=1000)  # no longer fitted: this job's knobs
    fixed.load_state_dict(fitted.state_dict())
    assert (fixed.total, fixed.start) == (1000, 990)


class FakeClock:
    """Seconds that advance by `tick` at every reading: every step measures `tick`."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def _run(budget: TimeBudget, state: TrainState, sched: S.ScheduleLR, *, stop: int = 10**9) -> list[float]:
    """The trainer's loop, minus the step's work: the rate each step uses."""
    rates = []
    while state.step < budget.total and state.step < stop:
        budget.start_step()
        rates.append(sched.optimizer.param_groups[0]["lr"])
        state.step += 1
        sched.step()
        budget.end_step()
    return rates


def _budget(state, sched, *, max_time_s, max_steps=1000, tick=0.5):
    return TimeBudget(
        max_time_s=max_time_s, max_steps=max_steps, state=state, scheduler=sched, every=10, now=FakeClock(tick)
    )


def test_max_time_fits_the_decay_to_the_budget_and_a_resume_carries_the_time():
    shape = S.Shape(peak=1e-3, warmup=0, decay="wsd")  # D: 20% of the fitted total
    state, sched = TrainState(), S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    rates = _run(_budget(state, sched, max_time_s=12.0), state, sched)
    # 0.5 s a step: 24 steps fit 12 s, fitted after the second step; the decay is the last 5 (20%).
    assert state.step == 24 and state.train_time_s == 12.0 and state.step_time_s == 0.5
    assert (sched.total, sched.start) == (24, 19)
    assert rates == pytest.approx(
        [S.lr_at(i, shape, total=1000) for i in range(2)] + [S.lr_at(i, shape, total=24) for i in range(2, 24)]
    )
    assert rates[-1] == pytest.approx(1e-3 * (1 - math.sqrt(0.8))) and S.lr_at(24, shape, total=24) == 0.0

    # Pre-empted at step 10 and resumed: the spent time (and the step time) carry over.
    state, sched = TrainState(), S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    first = _run(_budget(state, sched, max_time_s=12.0), state, sched, stop=10)
    saved_state, saved_sched = TrainState(**vars(state)), sched.state_dict()
    resumed = S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    resumed.load_state_dict(saved_sched)
    budget = _budget(saved_state, resumed, max_time_s=12.0)
    assert budget.total == 24  # fitted at once from the checkpoint's numbers
    assert first + _run(budget, saved_state, resumed) == pytest.approx(rates)
    assert saved_state.step == 24 and saved_state.train_time_s == 12.0


def test_max_time_and_max_steps_whichever_ends_first():
    shape = S.Shape(peak=1.0, decay="linear")
    state, sched = TrainState(), S.ScheduleLR(_optimizer(), shape, total=15, fitted=True)
    _run(_budget(state, sched, max_time_s=12.0, max_steps=15), state, sched)
    assert state.step == 15 and sched.total == 15  # --max_steps first
    state, sched = TrainState(), S.ScheduleLR(_optimizer(), shape, total=100, fitted=True)
    _run(_budget(state, sched, max_time_s=12.0, max_steps=100, tick=2.0), state, sched)
    assert state.step == 6 and state.train_time_s == 12.0  # the budget first
    # A resume with a larger budget goes on; one whose budget is spent ends where it is.
    for budget_s, end in ((20.0, 10), (12.0, 6)):
        again = TrainState(**vars(state))
        b = _budget(again, S.ScheduleLR(_optimizer(), shape, total=100, fitted=True), max_time_s=budget_s, tick=2.0)
        assert b.total == end


def test_a_begun_decay_keeps_its_start_when_the_steps_get_slower():
    shape = S.Shape(peak=1.0, decay="wsd", decay_steps=10)
    state, sched = TrainState(), S.ScheduleLR(_optimizer(), shape, total=1000, fitted=True)
    clock = FakeClock(1.0)
    budget = TimeBudget(max_time_s=40.0, max_steps=1000, state=state, scheduler=sched, every=1, now=clock)
    _run(budget, state, sched, stop=30)
    assert (sched.total, sched.start) == (40, 30)  # the decay begins at 30 steps
    clock.tick = 2.0  # slower from here: the 10 s left at step 30 hold 5 more steps
    _run(budget, state, sched)
    assert (sched.total, sched.start) == (35, 30) and state.step == 35
