"""The trainer's configuration: one declaration per knob (the parser is generated from the dataclasses),
--config files that replay a run with flags on top, strict keys, --print_config, and the resume rule
(settings that change the math are refused, the others recorded)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.training import config as C
from pipeline.training.preflight import check_resume
from preprocessing import cli
from preprocessing.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
BASE = [
    "--ds_config",
    "ds.json",
    "--objective",
    "taco",
    "--data",
    "shards",
    "--model_config",
    "tiny",
    "--max_steps",
    "100",
    "--save_dir",
    "run",
]


def test_every_knob_is_a_flag_with_its_dataclass_default_and_help():
    parser = C.build_parser()
    flags = {a.dest: a for a in parser._actions}
    for section, cls in C.SECTIONS.items():
        for f in cli.knob_fields(cls):
            assert f.name in flags, f"{section}.{f.name} has no flag"
            if not f.metadata["hidden"]:
                assert f.metadata["help"], f"{section}.{f.name} has no help text"
    # Nothing on the command line that is not a knob (besides --config/--print_config and the launcher's).
    knobs = {f.name for cls in C.SECTIONS.values() for f in cli.knob_fields(cls)}
    assert {a.dest for a in parser._actions} - knobs == {"help", "config", "print_config", "local_rank"}
    # The defaults of a parse are the dataclasses' own (no second copy in the parser).
    cfg = C.parse_args(BASE)
    assert cfg.run.save_every == C.RunArgs().save_every and cfg.data.num_workers == C.DataArgs().num_workers
    assert (
        cfg.objective.taco_detach is True and C.parse_args(BASE + ["--taco_no_detach"]).objective.taco_detach is False
    )


def test_config_file_replays_a_run_and_flags_override_it(tmp_path):
    first = C.parse_args(BASE + ["--lr", "3e-4", "--taco_num_negatives", "20", "--data_weights", "1"])
    # A run's config.json: the sections plus what the trainer recorded beside them.
    saved = {**first.to_dict(), "engine": {"world_size": 2}, "bert_config": {"hidden_size": 64}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    replay = C.parse_args(["--config", str(path)])
    assert replay.to_dict() == first.to_dict()
    again = C.parse_args(["--config", str(path), "--max_steps", "50", "--save_dir", "other", "--init_from", "hf"])
    assert again.schedule.max_steps == 50 and again.run.save_dir == "other"
    assert again.model.init_from == "hf" and again.model.model_config is None  # the typed source replaces the file's
    assert again.schedule.lr == 3e-4 and again.objective.taco_num_negatives == 20


def test_yaml_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("objective:\n  objective: mlm\nschedule:\n  max_steps: 7\n  lr: 0.002\nrun:\n  seed: 3\n")
    cfg = C.parse_args(
        ["--config", str(path), "--ds_config", "d.json", "--data", "s", "--model_config", "tiny", "--save_dir", "r"]
    )
    assert (cfg.objective.objective, cfg.schedule.max_steps, cfg.schedule.lr, cfg.run.seed) == ("mlm", 7, 0.002, 3)
    assert cfg.schedule.warmup_steps == 1  # the paper default, capped at 10% of the run, resolved after the file


def test_yaml_values_are_checked_against_the_fields_types(tmp_path):
    """Issue 31: YAML's `lr: 1e-3` (a string in YAML 1.1) gave a TypeError traceback, and `seed: 1.5`
    crashed after the process group started. Values are now checked (and converted where unambiguous)
    when the file is merged."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "schedule:\n  lr: 1e-3\ndata:\n  data_weights: [2]\n  max_seq_len: null\n"
        "run:\n  dist_timeout_s: 60\n  report_to: [tensorboard]\n"
    )
    cfg = C.parse_args(["--config", str(path)] + BASE)
    assert cfg.schedule.lr == 0.001 and cfg.data.data_weights == [2.0] and cfg.data.max_seq_len is None
    assert cfg.run.dist_timeout_s == 60.0 and isinstance(cfg.run.dist_timeout_s, float)
    assert cfg.run.report_to == ("tensorboard",)
    bad = {
        "run:\n  seed: 1.5\n": "run.seed is 1.5 (float); expected an integer",
        "run:\n  save_every: true\n": "run.save_every is true (bool); expected an integer",
        "schedule:\n  lr: fast\n": 'schedule.lr is "fast" (str); expected a number or null',
        "schedule:\n  max_steps: 1e4\n": 'schedule.max_steps is "1e4" (str); expected an integer',
        "data:\n  data: shards\n": 'data.data is "shards" (str); expected a list of strings',
        "data:\n  data_weights: [1, x]\n": 'data.data_weights is [1, "x"] (list); expected a list of numbers or null',
        "model:\n  tokenizer: 5\n": "model.tokenizer is 5 (int); expected a string or null",
        "data:\n  whole_word_masking: 1\n": "data.whole_word_masking is 1 (int); expected true or false",
        "objective:\n  taco_anchors: some\n": "objective.taco_anchors is 'some'; expected one of all, masked, unmasked",
    }
    for content, message in bad.items():
        path.write_text(content)
        with pytest.raises(UsageError) as e:
            C.parse_args(["--config", str(path)] + BASE)
        assert str(e.value) == f"--config {path}: {message}"


@pytest.mark.parametrize(
    "content, message",
    [
        ({"model": {"hidden_size": 3}}, r"unknown key model\.hidden_size"),
        ({"training": {}}, r"unknown key 'training'"),
        ({"run": []}, r"section 'run' must be a mapping"),
    ],
)
def test_unknown_config_keys_are_named(tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UsageError, match=message):
        C.parse_args(["--config", str(path)] + BASE)


def test_missing_and_malformed(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # as argparse would: its usage line and exit 2
        C.parse_args(["--objective", "mlm", "--data", "s", "--model_config", "tiny", "--max_steps", "5"])
    assert e.value.code == 2 and "required: --ds_config, --save_dir" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"--config .*nope.json: no such file"):
        C.parse_args(["--config", str(tmp_path / "nope.json")])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match=r"cannot parse it"):
        C.parse_args(["--config", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):
        C.parse_args(BASE + ["--init_from", "x"])
    assert "exactly one of --model_config" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a bad choice or type is a usage error, exit 2
        C.parse_args(BASE + ["--taco_anchors", "some"])
    with pytest.raises(SystemExit):
        C.parse_args(BASE + ["--data_weights", "nan"])


@pytest.mark.multiproc
def test_print_config_is_replayable(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "train.py"), *BASE, "--print_config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert printed["objective"]["objective"] == "taco" and printed["schedule"]["warmup_steps"] == 10
    (tmp_path / "p.json").write_text(r.stdout)
    assert C.parse_args(["--config", str(tmp_path / "p.json")]).to_dict() == printed


def test_resume_refuses_math_changes_and_records_the_others(tmp_path):
    saved_cfg = C.parse_args(BASE + ["--lr", "1e-3"])
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / "run_config.json").write_text(
        json.dumps({**saved_cfg.to_dict(), "deepspeed": ds, "engine": {"world_size": 2}})
    )
    same = check_resume(
        C.parse_args(BASE + ["--lr", "1e-3", "--log_every", "1"]),
        ds={**ds, "steps_per_print": 99},
        world_size=2,
        checkpoint_dir=ckpt,
    )
    assert same == ["resume: run.log_every 10 -> 1"]
    for extra, key in (
        (["--objective", "mlm"], "objective.objective"),
        (["--seed", "1"], "run.seed"),
        (["--taco_num_negatives", "3"], "objective.taco_num_negatives"),
        (["--data", "more"], "data.data"),
        (["--max_steps", "200"], "schedule.max_steps"),
    ):
        argv = BASE + ["--lr", "1e-3"] + extra
        with pytest.raises(UsageError, match=rf"{key}: saved .*, now "):
            check_resume(C.parse_args(argv), ds=ds, world_size=2, checkpoint_dir=ckpt)
    longer = C.parse_args(BASE + ["--lr", "1e-3", "--max_steps", "200", "--warmup_steps", "10", "--extend_schedule"])
    assert check_resume(longer, ds=ds, world_size=2, checkpoint_dir=ckpt) == [
        "resume: run.extend_schedule False -> True"
    ]
    with pytest.raises(UsageError, match=r"deepspeed.train_micro_batch_size_per_gpu: saved 4, now 8"):
        check_resume(saved_cfg, ds={**ds, "train_micro_batch_size_per_gpu": 8}, world_size=2, checkpoint_dir=ckpt)
    with pytest.raises(UsageError, match=r"trained on 2 rank\(s\), this launch has 4"):
        check_resume(saved_cfg, ds=ds, world_size=4, checkpoint_dir=ckpt)


def test_another_number_of_ranks_resumes_when_the_global_batch_stays(tmp_path):
    """The batch rule: ranks and accumulation may change (the ZeRO state is resharded at load), the
    global batch only with --allow_batch_change; train_batch_size in the JSON keeps it."""
    saved_cfg = C.parse_args(BASE)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    engine = {"world_size": 2, "gradient_accumulation_steps": 1, "global_batch": 8}
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / "run_config.json").write_text(json.dumps({**saved_cfg.to_dict(), "deepspeed": ds, "engine": engine}))
    assert check_resume(saved_cfg, ds=ds, world_size=2, checkpoint_dir=ckpt) == []
    with pytest.raises(UsageError, match=r"global batch \(micro x accumulation x ranks\): saved 8, now 4") as e:
        check_resume(saved_cfg, ds=ds, world_size=1, checkpoint_dir=ckpt)
    assert "set train_batch_size 8 in --ds_config in place of gradient_accumulation_steps" in str(e.value)
    assert "--allow_batch_change continues with the new global batch" in str(e.value)
    keep = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8}
    assert check_resume(saved_cfg, ds=keep, world_size=1, checkpoint_dir=ckpt) == [
        "resume: gradient accumulation 1 -> 2",
        "resume: world size 2 -> 1",
    ]
    allowed = C.parse_args(BASE + ["--allow_batch_change"])
    assert check_resume(allowed, ds=ds, world_size=1, checkpoint_dir=ckpt) == [
        "resume: global batch (micro x accumulation x ranks) 8 -> 4",
        "resume: run.allow_batch_change False -> True",
        "resume: world size 2 -> 1",
    ]
    with pytest.raises(UsageError, match=r"deepspeed.train_micro_batch_size_per_gpu: saved 4, now 2"):
        check_resume(allowed, ds={**keep, "train_micro_batch_size_per_gpu": 2}, world_size=2, checkpoint_dir=ckpt)


def test_a_run_saved_before_a_knob_existed_resumes_at_its_default(tmp_path):
    saved = C.parse_args(BASE).to_dict()
    del saved["model"]["allow_tokenizer_mismatch"]  # a knob this run's version did not have yet
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / "run_config.json").write_text(json.dumps({**saved, "engine": {"world_size": 2}}))
    assert check_resume(C.parse_args(BASE), ds={}, world_size=2, checkpoint_dir=ckpt) == []
    with pytest.raises(UsageError, match=r"model.allow_tokenizer_mismatch: saved False, now True"):
        check_resume(C.parse_args(BASE + ["--allow_tokenizer_mismatch"]), ds={}, world_size=2, checkpoint_dir=ckpt)


def test_math_flags_cover_every_section():
    """Every knob says whether it changes the math; the operational ones are the few the resume rule allows."""
    operational = {
        f"{s}.{f.name}" for s, cls in C.SECTIONS.items() for f in cli.knob_fields(cls) if not f.metadata["math"]
    }
    assert operational >= {"run.save_every", "run.log_every", "run.export_dir", "run.stop_after_step"}
    assert not operational & {
        "run.seed",
        "schedule.max_steps",
        "schedule.lr",
        "data.data",
        "data.data_weights",
        "model.model_config",
        "model.tokenizer",
        "objective.objective",
    }
    assert all(dataclasses.is_dataclass(cls) for cls in C.SECTIONS.values())
