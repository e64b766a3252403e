"""The Slurm launchers without a cluster: syntax, headers against the scripts' own defaults, dry
runs outside an allocation, and the bash helpers against straightforward Python references
(host lists, the per-task rank mapping against pipeline.distributed.env_from_slurm)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc  # every test here starts a process (the slow tier)

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sh"))
JOBS = {"taco_64gpu.sh": (8, 8), "tacl_8gpu.sh": (1, 8), "build_shards_ray.sh": (4, None)}


def outside_slurm_env(**knobs: str) -> dict[str, str]:
    """An environment with no job and no cluster configuration: a login node without Slurm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    # The project's environment active, as on a login node: `python` is its interpreter (the dry run
    # asks the trainer for the resolved configuration).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(knobs)
    return env


def run_script(name: str, **knobs: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM / name)],
        env=outside_slurm_env(**knobs),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def bash(snippet: str, **env: str) -> str:
    r = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {SLURM / 'common.sh'}; {snippet}"],
        env=outside_slurm_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_scripts_pass_shellcheck():
    # From the repository root, where the scripts' `source "$REPO/slurm/..."` resolve.
    r = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout


def sbatch_headers(script: Path) -> dict[str, str]:
    """#SBATCH options as sbatch reads them: up to the first command line."""
    out = {}
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


@pytest.mark.parametrize("name", sorted(JOBS))
def test_headers_match_the_scripts_defaults(name):
    """The sizes a dry run and a self-submission assume are the ones sbatch reads."""
    h = sbatch_headers(SLURM / name)
    text = (SLURM / name).read_text()
    nodes, gpus = JOBS[name]
    assert h["nodes"] == str(nodes) and f"DEFAULT_NODES={nodes}" in text
    assert h["output"] == "logs/%x-%j.out" and h["time"]
    if gpus is not None:  # the training jobs: one task per GPU, pre-emption warning, requeue
        assert h["ntasks-per-node"] == h["gpus-per-node"] == str(gpus) and f"DEFAULT_GPUS_PER_NODE={gpus}" in text
        assert h["cpus-per-task"] and h["mem-per-cpu"]
        assert f"DEFAULT_CPUS_PER_TASK={h['cpus-per-task']}" in text
        assert h["signal"] == "USR1@180" and "requeue" in h and h["open-mode"] == "append"


def test_taco_dry_run_prints_the_64_rank_command():
    r = run_script("taco_64gpu.sh", DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    (srun,) = [line for line in out.splitlines() if line.startswith("+ srun")]
    assert "--kill-on-bad-exit=1 --nodes=8 --ntasks=64 --ntasks-per-node=8 --cpus-per-task=8" in srun
    assert f"bash {SLURM}/task_env.sh python {REPO}/pipeline/train.py" in srun
    assert f"--ds_config {REPO}/deepspeed_configs/zero2_64gpu.json --objective taco --data data/shards" in srun
    assert "--model_config base --max_steps 62500 --save_dir runs/taco-64gpu --resume auto" in srun
    assert "--lr 1e-3 --warmup_steps 3750" in srun  # the recipe for its global batch (docs/scaling.md)
    # Cores per task, and no per-task GPU binding: every task sees its node's GPUs and the rank picks
    # one (--gpu-bind=closest gave local ranks 0 and 4 of a 2-socket node the same GPU).
    assert "--cpu-bind=cores bash" in srun and "--gpu-bind" not in srun and "--gpus-per-task" not in srun
    assert "GPU binding: none (no srun --gpu-bind): every task sees the 8 GPU(s) of its node" in out
    assert "WORLD_SIZE=64 LOCAL_WORLD_SIZE=8" in out and "MASTER_ADDR=node001" in out
    assert "global batch 16384 = micro 128 x accumulation 2 x 64 ranks" in out
    resolved = json.loads(out[out.index("{", out.index("resolved configuration")) : out.rindex("}") + 1])
    assert resolved["schedule"] == {
        "max_steps": 62500,
        "lr": 0.001,
        "warmup_steps": 3750,
        "schedule": "linear",
        "decay_steps": None,
        "max_time": None,
    }
    assert resolved["run"]["save_every"] == 1000 and resolved["run"]["seed"] == 0  # the trainer's defaults
    assert "node node008: RANK 56..63, LOCAL_RANK 0..7 -> GPU 0..7" in out


def test_taco_dry_run_follows_the_knobs():
    r = run_script(
        "taco_64gpu.sh",
        DRY_RUN="1",
        NODES="2",
        GPUS_PER_NODE="4",
        DATA="a,s3://b/c",
        DATA_WEIGHTS="0.3,0.7",
        MAX_STEPS="10",
        CPU_MODE="1",
        EXTRA_ARGS="--lr 3e-4 --log_every 1",
    )
    assert r.returncode == 0, r.stderr
    (srun,) = [line for line in r.stdout.splitlines() if line.startswith("+ srun")]
    assert "--nodes=2 --ntasks=8 --ntasks-per-node=4" in srun
    assert "--data a --data s3://b/c --data_weights 0.3,0.7" in srun
    assert "--max_steps 10" in srun and srun.endswith("--lr 3e-4 --log_every 1")
    assert "CPU mode" in r.stdout and "--cpu-bind" not in srun and "GPU binding" not in r.stdout
    assert "node node002: RANK 4..7, LOCAL_RANK 0..3\n" in r.stdout


def test_wandb_settings_reach_the_ranks_and_the_key_is_never_printed():
    r = run_script(
        "taco_64gpu.sh",
        DRY_RUN="1",
        REPORT_TO="tensorboard,wandb",
        WANDB_PROJECT="tokencl-test",
        WANDB_MODE="offline",
        WANDB_API_KEY="not-to-be-printed",
    )
    assert r.returncode == 0, r.stderr
    (srun,) = [line for line in r.stdout.splitlines() if line.startswith("+ srun")]
    # --export=ALL: the batch shell's variables reach the tasks even where SLURM_EXPORT_ENV says otherwise.
    assert "--cpus-per-task=8 --export=ALL" in srun and "--report_to tensorboard,wandb" in srun
    assert "W&B: WANDB_API_KEY=(set) WANDB_MODE=offline WANDB_PROJECT=tokencl-test (passed to every task)" in r.stdout
    assert "not-to-be-printed" not in r.stdout + r.stderr
    resolved = json.loads(
        r.stdout[r.stdout.index("{", r.stdout.index("resolved configuration")) :].rsplit("}", 1)[0] + "}"
    )
    assert resolved["run"]["report_to"] == ["tensorboard", "wandb"]


@pytest.mark.parametrize(
    "knob,value,message",
    [
        ("MAX_STEPS", "ten", "MAX_STEPS=ten is not a whole number"),
        ("NODES", "0", "NODES=0 must be >= 1"),
        ("DIST_TIMEOUT_S", "soon", "DIST_TIMEOUT_S=soon is not a number"),
        ("SAVE_EVERY", "0", "SAVE_EVERY=0 must be >= 1"),
    ],
)
def test_bad_knobs_exit_2_naming_the_variable(knob, value, message):
    r = run_script("taco_64gpu.sh", DRY_RUN="1", **{knob: value})
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_tacl_dry_run_prints_the_paper_setting():
    r = run_script("tacl_8gpu.sh", DRY_RUN="1")
    assert r.returncode == 2 and "INIT_FROM is not set" in r.stderr
    r = run_script("tacl_8gpu.sh", DRY_RUN="1", INIT_FROM="/models/bert-base-uncased")
    assert r.returncode == 0, r.stderr
    (srun,) = [line for line in r.stdout.splitlines() if line.startswith("+ srun")]
    assert "--nodes=1 --ntasks=8 --ntasks-per-node=8" in srun
    assert "--objective tacl --data data/tacl_nsp256 --init_from /models/bert-base-uncased --max_steps 150000" in srun
    assert "--model_config" not in srun and "--resume auto" in srun
    assert "global batch 256 = micro 32 x accumulation 1 x 8 ranks" in r.stdout


def test_build_dry_run_prints_a_worker_start_per_node():
    r = run_script(
        "build_shards_ray.sh",
        DRY_RUN="1",
        NODES="3",
        INPUTS="en:/d/*.txt zh:/d/z.jsonl",
        OUTPUT="/o",
        CPUS_PER_NODE="16",
    )
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    (head,) = [c for c in cmds if "ray start --head" in c]
    workers = [c for c in cmds if "ray start --address" in c]
    assert "--nodelist=node001 " in head and "--num-cpus=16" in head and "--port=30345" in head
    assert [re.search(r"--nodelist=(\S+)", w).group(1) for w in workers] == ["node002", "node003"]
    assert all("--address=node001:30345" in w for w in workers)
    (builder,) = [c for c in cmds if "build_shards.py" in c]
    assert "--input 'en:/d/*.txt' --input zh:/d/z.jsonl --output /o" in builder  # globs left to the builder
    assert "--ray_address node001:30345" in builder


def test_build_requires_inputs_and_output():
    r = run_script("build_shards_ray.sh", DRY_RUN="1", OUTPUT="/o")
    assert r.returncode == 2 and "INPUTS is empty" in r.stderr
    r = run_script("build_shards_ray.sh", DRY_RUN="1", INPUTS="en:/x")
    assert r.returncode == 2 and "OUTPUT is empty" in r.stderr


def test_build_passes_only_the_knobs_set_and_prints_the_builders_defaults():
    """The builder's defaults live in preprocessing/config.py alone: the launcher passes a knob only
    when it is set, and the dry run prints what the builder resolves (its --print_config)."""
    from preprocessing.config import BuildConfig

    text = (SLURM / "build_shards_ray.sh").read_text()
    assert not re.search(r"\$\{(VOCAB_SIZE|FORMAT|MAX_SEQ_LEN|SEED|EVAL_SHARE|NUM_WORKERS):=", text)
    r = run_script("build_shards_ray.sh", DRY_RUN="1", NODES="1", INPUTS="en:/d/a.txt", OUTPUT="/o", MAX_SEQ_LEN="256")
    assert r.returncode == 0, r.stderr
    (builder,) = [c for c in r.stdout.splitlines() if c.startswith("+ ") and "build_shards.py" in c]
    assert "--train_tokenizer wordpiece --max_seq_len 256 --ray_address" in builder
    assert not {"--seed", "--vocab_size", "--format", "--eval_share", "--num_workers"} & set(builder.split())
    start = r.stdout.index("{", r.stdout.index("resolved configuration"))
    resolved = json.loads(r.stdout[start : r.stdout.rindex("}") + 1])["build"]
    defaults = BuildConfig(inputs=["x"], output="o")
    assert resolved["max_seq_len"] == 256 and resolved["inputs"] == ["en:/d/a.txt"]
    assert (resolved["seed"], resolved["vocab_size"], resolved["format"]) == (
        defaults.seed,
        defaults.vocab_size,
        defaults.format,
    )


def test_build_refuses_what_the_builder_refuses_before_submitting():
    """No DRY_RUN: the script would submit itself, but asks the builder first (on the login node)."""
    for knob, value, message in (
        ("MAX_SEQ_LEN", "4", "--max_seq_len 4: must be between 5"),
        ("TRAIN_TOKENIZER", "bpe", "argument --train_tokenizer: invalid choice: 'bpe'"),
        ("NUM_WORKERS", "0", "--num_workers 0: must be at least 1"),
    ):
        r = run_script("build_shards_ray.sh", INPUTS="en:/d/a.txt", OUTPUT="/o", **{knob: value})
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "the shard builder refuses these settings" in r.stderr and "sbatch" not in r.stdout


def _expand_reference(hostlist: str) -> list[str]:
    """Slurm's host-list syntax, straightforwardly: items split on commas outside brackets, every
    bracket group a list of numbers or ranges (zero padding as written), the groups' product."""
    import itertools

    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, group, text, group, ..., text
        choices = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                choices.append([part])
                continue
            numbers = []
            for r in part.split(","):
                lo, _, hi = r.partition("-")
                numbers += [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi or lo) + 1)]
            choices.append(numbers)
        hosts += ["".join(p) for p in itertools.product(*choices)]
    return hosts


HOSTLISTS = [
    "n1",
    "n[1-2]",
    "n[1-3]",
    "gpu[001-003,007],cpu1",
    "a[08-11],b[1],c",
    "x-y[9-10]",
    "a1,b2",
    "gpu[01-02]-ib",
    "gpu[01-02,05]-ib",
    "rack1-n[001-002]",
    "rack[1-2]-n[01-02],login-[7]",
]


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_hostlist_expansion_without_slurm(hostlist, monkeypatch):
    got = bash(f"expand_hostlist '{hostlist}'", PATH="/usr/bin:/bin").split()
    assert got == _expand_reference(hostlist)
    import shutil as sh

    from pipeline.distributed import first_host

    monkeypatch.setattr(sh, "which", lambda name, *a, **k: None)  # no scontrol: the trainer's own parser
    assert first_host(hostlist) == got[0]


def test_first_host_fallback_keeps_the_text_after_the_brackets(monkeypatch):
    import shutil as sh

    from pipeline.distributed import first_host

    monkeypatch.setattr(sh, "which", lambda name, *a, **k: None)  # no scontrol: the parser
    assert first_host("gpu[01-02]-ib") == "gpu01-ib"
    assert first_host("gpu[01-02,05]-ib") == "gpu01-ib"
    assert first_host("n[1-3]") == "n1"
    assert first_host("a1,b2") == "a1"
    assert first_host("rack1-n[001-002]") == "rack1-n001"
    assert first_host("rack[1-2]-n[01-02]") == "rack1-n01"
    with pytest.raises(ValueError, match="cannot parse"):
        first_host(",n1")


def test_first_host_asks_scontrol_where_there_is_one(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "node-from-scontrol\\nother\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    from pipeline.distributed import first_host

    assert first_host("gpu[01-02]-ib") == "node-from-scontrol"
    fake.write_text("#!/bin/sh\nexit 1\n")  # installed but no controller reachable: the parser
    assert first_host("gpu[01-02]-ib") == "gpu01-ib"


def test_latest_checkpoint_step(tmp_path):
    assert bash(f"latest_checkpoint_step {tmp_path}").strip() == "-1"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000420\n")
    assert bash(f"latest_checkpoint_step {tmp_path}").strip() == "420"
    (tmp_path / "checkpoints" / "latest").write_text("global_step7")
    assert bash(f"latest_checkpoint_step {tmp_path}").strip() == "-1"


def test_port_from_job_is_stable_and_in_range():
    ports = [int(bash(f"port_from_job {j} 20000 20000")) for j in (0, 1, 19999, 20000, 123456)]
    assert ports == [20000, 20001, 39999, 20000, 23456]


def test_task_env_maps_slurm_like_the_trainer_does(tmp_path):
    """slurm/task_env.sh and pipeline.distributed.env_from_slurm() read the same Slurm variables the
    same way (the script sets them explicitly; the trainer's mapping is the fallback)."""
    slurm_vars = dict(
        SLURM_PROCID="13",
        SLURM_LOCALID="5",
        SLURM_NTASKS="16",
        SLURM_STEP_NUM_TASKS="16",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_STEP_TASKS_PER_NODE="8(x2)",
        SLURMD_NODENAME="gpu002",
        SLURM_JOB_NODELIST="gpu[001-002]",
        SLURM_JOB_ID="777",
    )
    scratch = tmp_path / "scratch"
    r = subprocess.run(
        ["bash", str(SLURM / "task_env.sh"), "env"],
        capture_output=True,
        text=True,
        env=outside_slurm_env(**slurm_vars, MASTER_ADDR="gpu001", MASTER_PORT="20777", JOB_SCRATCH=str(scratch)),
    )
    assert r.returncode == 0, r.stderr
    got = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and not line.startswith("["))
    assert "[slurm] node gpu002 task 13: RANK=13 LOCAL_RANK=5 WORLD_SIZE=16 LOCAL_WORLD_SIZE=8" in r.stdout
    assert got["TMPDIR"] == str(scratch) and scratch.is_dir()

    py = (
        "import os, json; from pipeline.distributed import env_from_slurm; env_from_slurm(); "
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR'); "
        "print(json.dumps({k: os.environ[k] for k in keys}))"
    )
    env = {
        k: v
        for k, v in outside_slurm_env(**slurm_vars).items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run([sys.executable, "-c", py], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        assert got[k] == expected[k], k
    assert expected["MASTER_ADDR"] == "gpu001" == got["MASTER_ADDR"]


def test_task_env_refuses_to_run_outside_srun():
    r = subprocess.run(
        ["bash", str(SLURM / "task_env.sh"), "true"], capture_output=True, text=True, env=outside_slurm_env()
    )
    assert r.returncode != 0 and "task_env.sh runs under srun" in r.stderr
