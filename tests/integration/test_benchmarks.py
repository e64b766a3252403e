"""The benchmark scripts still run and print their JSON (smoke runs; the figures are measured by
running the scripts themselves, not here: tests assert behaviour, benchmarks measure)."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.hardware import cpu_bf16_native
from tests.conftest import REPO

pytestmark = [pytest.mark.timeout(600), pytest.mark.multiproc]


def _run(args: list[str], tmp_path) -> dict:
    """`python -m MODULE ARGS` from a folder outside the repository, as a user would run it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def test_bench_losses_quick(tmp_path):
    report = _run(
        ["pipeline.bench.losses", "--quick", "--threads", "1", "--repeats", "2", "--bert_repeats", "1"], tmp_path
    )
    for name in ("taco_loss", "taco_upstream", "tacl_loss", "tacl_upstream", "bert_base_mlm_step"):
        assert report["results"][name]["time_s"] > 0
        assert report["results"][name]["peak_mb"] >= 0
    assert report["summary"]["taco_speedup_vs_upstream"] > 0
    assert "taco_loss_share_of_bert_step" in report["summary"]


def test_bench_gpu_deepspeed_tiny_runs_on_cpu(tmp_path):
    """The whole-stack GPU benchmark keeps a CPU path with the tiny model, so it cannot rot where no GPU is."""
    out = tmp_path / "gpu.json"
    report = _run(
        ["pipeline.bench.gpu_deepspeed", "--tiny", "--work_dir", str(tmp_path / "w"), "--out", str(out)], tmp_path
    )
    assert json.loads(out.read_text()) == report
    assert set(report["runs"]) >= {"mlm_packed", "mlm_nsp", "tacl", "taco"}
    for run in report["runs"].values():
        assert run["tokens_per_s"] > 0 and run["mfu"] is None  # no peak FLOPs known for a CPU
    assert set(report["figures"]) == {"mlm_mfu", "tacl_over_mlm_tokens", "taco_over_mlm_tokens"}


def test_bench_gpu_tiny_runs_on_cpu_without_deepspeed_streaming_or_ray(tmp_path):
    """The GPU benchmark for a bare machine imports none of DeepSpeed, streaming or Ray (the GPU machine has none)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = (
        "import sys; import pipeline.bench.gpu as b; b.main(['--tiny', '--compile', 'off', '--out', 'gpu.json']); "
        "print('LOADED', sorted(k for k in ('deepspeed', 'streaming', 'ray') if k in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "LOADED []" in proc.stdout
    report = json.loads((tmp_path / "gpu.json").read_text())
    from pipeline.bench.gpu import JOBS

    assert set(report["runs"]) == {f"{job}/eager" for job in JOBS} and report["complete"]
    for run in report["runs"].values():
        assert run["tokens_per_s"] > 0 and run["mfu"] is None and len(run["tokens_per_s_windows"]) >= 3
        assert set(run["step_split_s"]) == {"data", "forward", "loss", "backward", "optimizer"}
    assert set(report["figures"]["eager"]) >= {"mlm_mfu", "tacl_over_mlm_tokens", "taco_over_mlm_tokens"}
    assert report["figures"]["eager"]["taco_over_mlm_tokens"] > 0


def test_the_device_check_runs_its_stages_on_cpu(tmp_path):
    """`python -m pipeline.bench.device prepare` then `run` (here with --cpu: the tiny model, fp32), as a
    user with one GPU runs them: shards from the sample corpus, the bare benchmark, train.py under
    torchrun with DeepSpeed; the JSON after every stage."""
    carry = tmp_path / "carry"
    manifest = _run(
        ["pipeline.bench.device", "prepare", "--no_wheels", "--repeat", "2", "--carry", str(carry)], tmp_path
    )
    assert set(manifest["shards"]) == {"packed", "nsp"} and manifest["bytes"] < 64 * 2**20
    out = tmp_path / "out"
    report = _run(
        ["pipeline.bench.device", "run", "--cpu", "--carry", str(carry), "--out", str(out), "--train", "mlm_packed"],
        tmp_path,
    )
    assert json.loads((out / "device_check.json").read_text()) == report
    stages = report["stages"]
    assert list(stages) == ["install", "environment", "bare_benchmark", "train_mlm_packed"]
    assert stages["environment"]["deepspeed"] and stages["bare_benchmark"]["rc"] == 0
    assert stages["train_mlm_packed"]["rc"] == 0 and stages["train_mlm_packed"]["metrics"]["step"] == 8
    assert stages["train_mlm_packed"]["metrics"]["tokens_per_s"] > 0


def test_bench_evaluation_quick(tmp_path):
    report = _run(["pipeline.bench.evaluation", "--quick", "--work_dir", str(tmp_path / "w")], tmp_path)
    assert report["train_step_s"] > 0 and report["eval_s"] > 0 and report["eval_with_health_s"] > 0
    assert report["eval_share_of_training"] > 0 and report["target_at_most"] == 0.03


def test_bench_train_quick(tmp_path):
    report = _run(["pipeline.bench.train", "--quick", "--work_dir", str(tmp_path / "w")], tmp_path)
    assert set(report["ratios"]) == {"tacl_over_mlm", "taco_over_mlm", "masked_over_full_head", "loader_over_trainer"}
    assert all(value > 0 for value in report["ratios"].values())
    assert report["setup"]["cpu_bf16_native"] == cpu_bf16_native()  # read the ratios knowing which


@pytest.mark.corpora
def test_builder_benchmark_quick(tmp_path, corpora):
    report = _run(
        ["preprocessing.bench.builder", "--quick", "--corpora", str(corpora), "--work_dir", str(tmp_path / "w")],
        tmp_path,
    )
    assert set(report["langs"]) == {"en", "zh"}
    for lang in report["langs"].values():
        assert lang["b_builder"]["samples"] > 0
        assert all(value is not None for value in lang["ratios"].values())


def test_bench_loader_quick(tmp_path):
    report = _run(["pipeline.bench.loader", "--quick", "--work_dir", str(tmp_path / "w")], tmp_path)
    for fmt in ("packed", "nsp"):
        r = report[fmt]
        assert r["samples_per_s_per_worker"] > 0 and r["read_samples_per_s"] > 0 and r["collate_samples_per_s"] > 0
    assert report["samples_per_s_per_worker"] == min(report[f]["samples_per_s_per_worker"] for f in ("packed", "nsp"))


def test_bench_unpadded_quick(tmp_path):
    report = _run(["pipeline.bench.unpadded", "--quick", "--work_dir", str(tmp_path / "w")], tmp_path)
    assert 0 < report["real_over_padded_tokens"] <= 1
    assert report["padded_step_s"] > 0 and report["unpadded_step_s"] > 0
    assert report["target_at_most"] == pytest.approx(report["real_over_padded_tokens"] * 1.1, abs=2e-4)


def test_bench_shards_quick(tmp_path):
    report = _run(["pipeline.bench.shards", "--mb", "8", "--rounds", "1"], tmp_path)
    assert report["shard_bytes"] > 4e6 and report["hash_gb_per_s"] > 0


def test_bench_precision_quick(tmp_path):
    """Each precision is timed, and the JSON says whether this CPU runs bf16 natively."""
    report = _run(["pipeline.bench.precision", "--quick", "--threads", "1"], tmp_path)
    assert set(report["step_s"]) == {"fp32", "bf16_weights", "bf16_autocast"}
    assert all(s > 0 for s in report["step_s"].values())
    assert isinstance(report["cpu_bf16_native"], bool)
    # The printed step times are rounded, so the ratio recomputed from them agrees only to rounding.
    ratio = report["step_s"]["bf16_weights"] / report["step_s"]["fp32"]
    assert report["bf16_weights_over_fp32"] == pytest.approx(ratio, rel=0.02)
