"""The schedule's knobs (--schedule, --decay_steps, --max_time): parsed, checked, replayed by --config,
shown by --print_config; and the resume rule for them: a change that keeps the rates of the steps
taken (a WSD decay moved before it begins, any change of a --max_time run's total) is allowed, one
that rewrites them needs --allow_schedule_change, and the error says how to begin the decay now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.training import config as C
from pipeline.training.ds_config import client_scheduler, resolve_ds_config
from pipeline.training.preflight import check_resume
from preprocessing.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
BASE = ["--ds_config", "ds.json", "--objective", "mlm", "--data", "shards", "--model_config", "tiny"]
BASE += ["--save_dir", "run", "--lr", "1e-3", "--warmup_steps", "10"]
WSD = BASE + ["--schedule", "wsd", "--decay_steps", "20"]
DS = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}},
}


def test_the_knobs_parse_check_and_replay(tmp_path):
    cfg = C.parse_args(WSD + ["--max_steps", "100", "--max_time", "1.5h"])
    s = cfg.schedule
    assert (s.schedule, s.decay_steps, s.max_time) == ("wsd", 20, 5400.0)
    assert C.parse_args(BASE + ["--max_steps", "90", "--max_time", "90"]).schedule.max_time == 90.0
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert C.parse_args(["--config", str(tmp_path / "config.json")]).to_dict() == cfg.to_dict()
    for argv, message in (
        (BASE + ["--max_steps", "100", "--decay_steps", "5"], r"--decay_steps 5 is WSD's decay: pass --schedule wsd"),
        (WSD[:-1] + ["91", "--max_steps", "100"], r"--decay_steps must be in \[1, --max_steps - --warmup_steps = 90\]"),
    ):
        with pytest.raises(UsageError, match=message):
            C.parse_args(argv)
    for bad in ("soon", "-1h", "0"):
        with pytest.raises(SystemExit):
            C.parse_args(BASE + ["--max_steps", "90", "--max_time", bad])
    (tmp_path / "bad.json").write_text(json.dumps({"schedule": {"max_time": -5}}))
    with pytest.raises(UsageError, match=r"--max_time must be a positive number of seconds, got -5"):
        C.parse_args(["--config", str(tmp_path / "bad.json")] + BASE + ["--max_steps", "90"])


def test_print_config_shows_them(capsys):
    from pipeline.train import main

    assert main([*WSD, "--max_steps", "100", "--max_time", "2h", "--print_config"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == {
        "max_steps": 100,
        "lr": 1e-3,
        "warmup_steps": 10,
        "schedule": "wsd",
        "decay_steps": 20,
        "max_time": 7200.0,
    }


def test_the_json_must_name_a_warmup_scheduler_wsd_can_refine():
    cfg = C.parse_args(WSD + ["--max_steps", "100"])
    ds = resolve_ds_config(DS, schedule=cfg.schedule, world_size=1, path="ds.json")
    given, build = client_scheduler(ds, schedule=cfg.schedule)  # WSD is not DeepSpeed's: ours replaces it
    assert "scheduler" not in given and build is not None
    for kind in ("WarmupLR", "WarmupCosineLR"):
        with pytest.raises(
            UsageError, match=rf"--schedule wsd needs the JSON's scheduler to be WarmupDecayLR.*not {kind}"
        ):
            resolve_ds_config({**DS, "scheduler": {"type": kind}}, schedule=cfg.schedule, world_size=1, path="ds.json")
    timed = C.parse_args(BASE + ["--max_steps", "100", "--max_time", "1h"]).schedule
    with pytest.raises(
        UsageError, match=r"--max_time fits a WarmupLR or WarmupDecayLR schedule .* not the JSON's OneCycle"
    ):
        resolve_ds_config({**DS, "scheduler": {"type": "OneCycle"}}, schedule=timed, world_size=1, path="ds.json")
    assert client_scheduler(resolve_ds_config(DS, schedule=timed, world_size=1, path="d"), schedule=timed)[1]


def _checkpoint(tmp_path: Path, argv: list[str], step: int) -> Path:
    ckpt = tmp_path / f"step_{step:08d}"
    ckpt.mkdir()
    saved = C.parse_args(argv).to_dict()
    (ckpt / "run_config.json").write_text(json.dumps({**saved, "deepspeed": DS, "engine": {"world_size": 1}}))
    return ckpt


def _resume(ckpt: Path, argv: list[str], step: int) -> list[str]:
    return check_resume(C.parse_args(argv), ds=DS, world_size=1, checkpoint_dir=ckpt, step=step)


def test_a_wsd_decay_moves_freely_until_it_begins(tmp_path):
    # 100 steps, the decay over the last 20: it begins at 80 steps. Checkpoint at step 50.
    ckpt = _checkpoint(tmp_path, WSD + ["--max_steps", "100"], 50)
    assert _resume(ckpt, WSD + ["--max_steps", "300"], 50) == ["resume: schedule.max_steps 100 -> 300"]
    assert _resume(ckpt, WSD + ["--max_steps", "70"], 50) == ["resume: schedule.max_steps 100 -> 70"]  # now
    assert _resume(ckpt, WSD[:-1] + ["40", "--max_steps", "100"], 50) == ["resume: schedule.decay_steps 20 -> 40"]
    with pytest.raises(
        UsageError,
        match=r"the decay would begin before the checkpoint's step 50; to begin it now pass "
        r"--max_steps 70 --decay_steps 20;",
    ):
        _resume(ckpt, WSD + ["--max_steps", "60"], 50)
    allowed = _resume(ckpt, WSD + ["--max_steps", "60", "--allow_schedule_change"], 50)
    assert "resume: schedule.max_steps 100 -> 60" in allowed
    with pytest.raises(UsageError, match=r"schedule.schedule: saved 'wsd', now 'linear' .*--allow_schedule_change"):
        _resume(ckpt, BASE + ["--max_steps", "100"], 50)


def test_a_begun_wsd_decay_needs_the_flag(tmp_path):
    ckpt = _checkpoint(tmp_path, WSD + ["--max_steps", "100"], 90)  # the decay began at 80 steps
    with pytest.raises(UsageError, match=r"the run's WSD decay had begun \(at 80 steps, before the checkpoint's 90\)"):
        _resume(ckpt, WSD + ["--max_steps", "200"], 90)
    longer = _resume(ckpt, WSD + ["--max_steps", "200", "--extend_schedule"], 90)
    assert longer == ["resume: run.extend_schedule False -> True"]
    assert _resume(ckpt, WSD + ["--max_steps", "100"], 90) == []


def test_a_timed_run_may_change_its_budget_and_end(tmp_path):
    timed = BASE + ["--max_time", "1h"]
    ckpt = _checkpoint(tmp_path, timed + ["--max_steps", "1000"], 500)
    assert _resume(ckpt, BASE + ["--max_time", "2h", "--max_steps", "5000"], 500) == [
        "resume: schedule.max_steps 1000 -> 5000",
        "resume: schedule.max_time 3600.0 -> 7200.0",
    ]
    with pytest.raises(UsageError, match=r"schedule.lr: saved 0.001, now 0.002"):
        _resume(ckpt, BASE[:-3] + ["2e-3", "--warmup_steps", "10", "--max_time", "1h", "--max_steps", "1000"], 500)
    linear = _checkpoint(tmp_path, BASE + ["--max_steps", "100"], 60)  # a linear decay is rewritten by a new end
    with pytest.raises(UsageError, match=r"a longer --max_steps needs --extend_schedule"):
        _resume(linear, BASE + ["--max_steps", "200"], 60)
