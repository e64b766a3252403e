"""Downstream evaluation: fine-tune a model on each task with several fixed seeds, score it with the
task's official metric, and tabulate mean and spread (JSON + Markdown).

Data comes from local files only (`tasks.py`); metrics from `scoring.py`.
A model folder from the trainer (BertForPreTraining) or any HF BERT folder gets a fresh classification
head for each task and seed; the seed fixes the head's initialisation, dropout and data order.

Shape legend: B examples per batch, L tokens, C classes (or tags).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from pipeline.data.masking import IGNORE_INDEX
from pipeline.data.padding import pad_right
from pipeline.evaluation.downstream import scoring as M
from pipeline.evaluation.downstream.tasks import (
    CLASSIFY,
    GLUE_TASKS,
    TAGGING_TASKS,
    TASK_CHOICES,
    Examples,
    GlueTask,
    TaggedSentences,
    TaskSpec,
    classify_spec,
    classify_task,
    read_glue_task,
    read_tagging_task,
)
from pipeline.evaluation.models import resolve_device
from pipeline.hardware import slow_bf16_reason
from pipeline.modeling.param_groups import param_groups
from preprocessing.cli import knob
from preprocessing.errors import UsageError

_WARNED: set[str] = set()  # slow-bf16 warnings already given in this process


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2,3, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


@dataclass
class FinetuneConfig:
    """Fine-tuning settings shared by every task of one command; one knob per flag of pipeline/finetune.py."""

    epochs: float = knob(3.0, "training epochs per task and seed")
    lr: float = knob(2e-5, "peak learning rate (linear warm-up and decay)")
    batch_size: int = knob(32, "training examples per step")
    eval_batch_size: int = knob(128, "examples per evaluation forward pass")
    max_seq_len: int = knob(128, "tokens per example (pairs are cut longest-first)")
    warmup_ratio: float = knob(0.1, "share of the steps spent warming up")
    weight_decay: float = knob(0.01, "AdamW weight decay (not on biases and LayerNorm, as in pre-training)")
    max_grad_norm: float = knob(1.0, "gradient clipping")
    seeds: tuple[int, ...] = knob((1, 2, 3), "comma-separated seeds; results are averaged", parse=_seeds)
    max_train_samples: Optional[int] = knob(None, "use only the first N training examples (quick runs)")
    max_eval_samples: Optional[int] = knob(None, "use only the first N examples of each eval split")
    device: str = knob("auto", "auto (cuda when available), cpu, cuda, ...")
    bf16: bool = knob(False, "bf16 autocast (GPU, or a CPU with AVX-512; elsewhere far slower than fp32)")
    max_skipped_share: float = knob(
        0.01, "fail when a split skips more than this share of its rows (too few columns, unknown labels)"
    )

    def validate(self) -> None:
        """UsageError naming the flag of any value that cannot be meant (non-finite included)."""
        for flag in ("epochs", "lr", "batch_size", "eval_batch_size", "max_seq_len", "max_grad_norm"):
            if not 0 < getattr(self, flag) < math.inf:
                raise UsageError(f"--{flag} must be > 0 and finite (got {getattr(self, flag)})")
        for flag in ("warmup_ratio", "max_skipped_share"):
            if not 0 <= getattr(self, flag) <= 1:
                raise UsageError(f"--{flag} must be between 0 and 1 (got {getattr(self, flag)})")
        if not 0 <= self.weight_decay < math.inf:
            raise UsageError(f"--weight_decay must be >= 0 and finite (got {self.weight_decay})")
        for flag in ("max_train_samples", "max_eval_samples"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise UsageError(f"--{flag} must be >= 1 (got {getattr(self, flag)})")
        repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if repeated:
            raise UsageError(
                f"--seeds {','.join(map(str, self.seeds))}: seed(s) {repeated} repeated; a repeated seed is the same "
                f"run again and would shrink the reported spread; give distinct seeds"
            )


@dataclass
class EncodedSplit:
    """Tokenised examples of one split; `gold` keeps what the metric compares against."""

    features: list[dict[str, list[int]]]
    labels: list  # class index / float per example, or tag ids per token (-100 = none)
    gold: list  # labels, or gold tag strings per sentence
    word_index: list[list[int]] = field(default_factory=list)  # tagging: token -> word (-1 = not a first subtoken)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class PreparedTask:
    name: str  # e.g. "cola", "ner (msra)"
    kind: str  # "classification" | "regression" | "tagging"
    num_labels: int
    metrics: tuple[str, ...]
    train: EncodedSplit
    evals: dict[str, EncodedSplit]
    positive: int = 1  # F1 class index
    tags: list[str] = field(default_factory=list)
    scheme: str = ""


def _cap(n: int, cap: Optional[int]) -> int:
    return n if cap is None else min(n, cap)


def encode_pairs(ex: Examples, *, tokenizer, max_seq_len: int, limit: Optional[int]) -> EncodedSplit:
    """Tokenise single sentences or pairs; pairs are cut longest-first. Cut examples are counted."""
    n = _cap(len(ex), limit)
    a, b = ex.text_a[:n], (ex.text_b[:n] if ex.text_b is not None else None)
    enc = tokenizer(a, b, truncation=True, max_length=max_seq_len)
    full_len = tokenizer(a, b, truncation=False)["input_ids"]
    counts = {
        "examples": n,
        "truncated": sum(len(x) > max_seq_len for x in full_len),
        "left_out_by_max_samples": len(ex) - n,
        **{f"skipped_{k}": v for k, v in ex.skipped.items()},
    }
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc]
    features = [{k: enc[k][i] for k in keys} for i in range(n)]
    return EncodedSplit(features, ex.labels[:n], ex.labels[:n], counts=counts)


def encode_tagging(
    data: TaggedSentences, *, tokenizer, tag_ids: dict[str, int], max_seq_len: int, limit: Optional[int]
) -> EncodedSplit:
    """Tokenise pre-split tokens; the first subtoken of each word carries its tag, other subtokens -100.

    Words cut off by max_seq_len, and words the tokenizer turns into nothing (e.g. a lone space
    character), get no prediction: they are scored as "O" and counted.
    """
    n = _cap(len(data.tokens), limit)
    enc = tokenizer(data.tokens[:n], is_split_into_words=True, truncation=True, max_length=max_seq_len)
    features, labels, word_index = [], [], []
    counts = {
        "sentences": n,
        "words": 0,
        "words_without_prediction": 0,
        "sentences_truncated": 0,
        "tags_unseen_in_train": 0,
        "left_out_by_max_samples": len(data.tokens) - n,
    }
    for i in range(n):
        words = enc.word_ids(i)
        first: list[int] = []
        lab: list[int] = []
        seen = set()
        for w in words:
            if w is None or w in seen:
                first.append(-1)
                lab.append(IGNORE_INDEX)
                continue
            seen.add(w)
            first.append(w)
            tag = data.tags[i][w]
            if tag not in tag_ids:  # an eval tag the training file never had: unpredictable, still scored
                counts["tags_unseen_in_train"] += 1
            lab.append(tag_ids.get(tag, IGNORE_INDEX))
        n_words = len(data.tokens[i])
        counts["words"] += n_words
        counts["words_without_prediction"] += n_words - len(seen)
        cut = len(enc["input_ids"][i]) >= max_seq_len and max(seen, default=-1) < n_words - 1
        counts["sentences_truncated"] += int(cut)
        keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc]
        features.append({k: enc[k][i] for k in keys})
        labels.append(lab)
        word_index.append(first)
    return EncodedSplit(features, labels, data.tags[:n], word_index=word_index, counts=counts)


def check_skipped(ex: Examples, *, max_share: float) -> None:
    """Say on stderr how many rows of a split were skipped and why; past `max_share` of its rows a
    score would describe another dataset: a UsageError naming the file and the flag."""
    skipped = sum(ex.skipped.values())
    if not skipped:
        return
    total = skipped + len(ex)
    why = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(ex.skipped.items()))
    line = f"{ex.path}: {skipped} of {total} rows skipped ({why}); scores use the other {len(ex)}"
    if skipped / total > max_share:
        raise UsageError(
            f"{line}: more than --max_skipped_share {max_share:g} of the split; fix the file (is it the "
            f"task's own TSV?) or raise --max_skipped_share"
        )
    print(f"warning: {line}", file=sys.stderr)


def prepare_task(name: str, *, folder: Path, tokenizer, cfg: FinetuneConfig, kind: str = "builtin") -> PreparedTask:
    """Read and tokenise one task: a GLUE name (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli),
    chnsenti, ner / cws (CoNLL files), or with kind "classify" any label<TAB>text folder."""
    if name in GLUE_TASKS or kind == CLASSIFY:
        task: GlueTask = classify_task(name, folder) if kind == CLASSIFY else GLUE_TASKS[name]
        train, evals = read_glue_task(task, folder)
        for split in (train, *evals.values()):
            check_skipped(split, max_share=cfg.max_skipped_share)
        enc = lambda ex, cap: encode_pairs(ex, tokenizer=tokenizer, max_seq_len=cfg.max_seq_len, limit=cap)
        return PreparedTask(
            name=name,
            kind="regression" if task.labels is None else "classification",
            num_labels=1 if task.labels is None else len(task.labels),
            metrics=task.metrics,
            train=enc(train, cfg.max_train_samples),
            evals={k: enc(v, cfg.max_eval_samples) for k, v in evals.items()},
            positive=task.labels.index(task.positive) if "f1" in task.metrics else 1,
        )
    if name in TAGGING_TASKS:
        train, evals, tags, scheme = read_tagging_task(folder)
        tag_ids = {t: i for i, t in enumerate(tags)}
        enc = lambda d, cap: encode_tagging(
            d, tokenizer=tokenizer, tag_ids=tag_ids, max_seq_len=cfg.max_seq_len, limit=cap
        )
        return PreparedTask(
            name=f"{name} ({folder.name})",
            kind="tagging",
            num_labels=len(tags),
            metrics=("f1", "precision", "recall"),
            train=enc(train, cfg.max_train_samples),
            evals={k: enc(v, cfg.max_eval_samples) for k, v in evals.items()},
            tags=tags,
            scheme=scheme,
        )
    raise UsageError(f"--task {name}: unknown task; {TASK_CHOICES}")


def collate(split: EncodedSplit, *, idx: list[int], pad_id: int, kind: str) -> dict[str, torch.Tensor]:
    """Right-padded batch of the examples `idx`: input_ids_BL, attention_mask_BL, token_type_ids_BL, labels."""
    out = {}
    for key, fill in (("input_ids", pad_id), ("token_type_ids", 0), ("attention_mask", 0)):
        if key in split.features[idx[0]]:
            out[key] = torch.from_numpy(pad_right([split.features[i][key] for i in idx], fill=fill))
    if kind == "tagging":
        out["labels"] = torch.from_numpy(pad_right([split.labels[i] for i in idx], fill=IGNORE_INDEX))
    else:
        out["labels"] = torch.tensor(
            [split.labels[i] for i in idx], dtype=torch.float32 if kind == "regression" else torch.long
        )
    return out


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_model(model_dir: Path, task: PreparedTask):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    if task.kind == "tagging":
        return AutoModelForTokenClassification.from_pretrained(
            model_dir,
            num_labels=task.num_labels,
            id2label=dict(enumerate(task.tags)),
            label2id={t: i for i, t in enumerate(task.tags)},
        )
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir,
        num_labels=task.num_labels,
        problem_type="regression" if task.kind == "regression" else "single_label_classification",
    )


@torch.no_grad()
def predict(
    model, *, split: EncodedSplit, task: PreparedTask, pad_id: int, cfg: FinetuneConfig, device: torch.device
) -> list:
    """Class index / float per example, or tag strings per sentence (words without a prediction: "O")."""
    model.eval()
    preds: list = []
    for start in range(0, len(split.features), cfg.eval_batch_size):
        idx = list(range(start, min(start + cfg.eval_batch_size, len(split.features))))
        batch = collate(split, idx=idx, pad_id=pad_id, kind=task.kind)
        batch.pop("labels")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float()
        if task.kind == "regression":
            preds += logits[:, 0].tolist()
        elif task.kind == "classification":
            preds += logits.argmax(-1).tolist()
        else:
            best_BL = logits.argmax(-1).tolist()
            for row, i in enumerate(idx):
                tags = ["O"] * len(split.gold[i])
                for pos, w in enumerate(split.word_index[i]):
                    if w >= 0:
                        tags[w] = task.tags[best_BL[row][pos]]
                preds.append(tags)
    return preds


def score(task: PreparedTask, *, preds: list, gold: list) -> dict[str, float]:
    """The task's official metrics (fractions, not percentages)."""
    if task.kind == "tagging":
        return M.span_f1(gold, pred=preds, scheme=task.scheme)
    fns = {
        "accuracy": lambda: M.accuracy(preds, gold),
        "f1": lambda: M.f1_binary(preds, gold=gold, positive=task.positive),
        "macro_f1": lambda: M.macro_f1(preds, gold),
        "mcc": lambda: M.matthews_corrcoef(preds, gold),
        "pearson": lambda: M.pearson(preds, gold),
        "spearman": lambda: M.spearman(preds, gold),
    }
    return {m: fns[m]() for m in task.metrics}


def finetune_once(
    model_dir: Path, *, task: PreparedTask, tokenizer, cfg: FinetuneConfig, seed: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Fine-tune a fresh copy of the model on task.train with `seed`; metrics per eval split."""
    from transformers import get_linear_schedule_with_warmup

    set_seed(seed)
    model = load_model(model_dir, task).to(device)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=cfg.weight_decay), lr=cfg.lr)
    n = len(task.train.features)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup_ratio * total), total)
    gen = torch.Generator().manual_seed(seed)
    pad_id = tokenizer.pad_token_id
    step = 0
    model.train()
    # A bar on a terminal only: logs and tests get the per-task lines, not carriage returns.
    bar = tqdm(total=total, desc=f"{task.name} seed {seed}", unit="step", leave=False, disable=not sys.stderr.isatty())
    while step < total:
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, cfg.batch_size):
            if step >= total:
                break
            batch = collate(task.train, idx=order[start : start + cfg.batch_size], pad_id=pad_id, kind=task.kind)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
    bar.close()
    out = {}
    for split_name, split in task.evals.items():
        preds = predict(model, split=split, task=task, pad_id=pad_id, cfg=cfg, device=device)
        out[split_name] = score(task, preds=preds, gold=split.gold)
    out["_train"] = {"final_loss": float(loss.detach()), "steps": float(total)}
    return out


def headline(task: PreparedTask, metrics: dict[str, float]) -> float:
    """One number per task: the GLUE convention (mean of F1 and accuracy for MRPC/QQP, of Pearson and
    Spearman for STS-B, and so of accuracy and macro-F1 for a classify folder; otherwise the first
    metric); span F1 for tagging."""
    if task.kind == "tagging":
        return metrics["f1"]
    return sum(metrics[m] for m in task.metrics) / len(task.metrics)


def aggregate(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "per_seed": values,
    }


def evaluate_model(
    model_dir: Path, *, tasks: list[TaskSpec], cfg: FinetuneConfig, log=print, label: Optional[str] = None
) -> dict:
    """Every task x every seed for one model; `tasks`: TaskSpecs, or (name, folder) pairs of built-in
    tasks. Out: {task: {"splits": {split: {metric: {mean, std, per_seed}}}, "data": counts, "seeds": [...]}}."""
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: not a Hugging Face model folder (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = resolve_device(cfg.device)
    if cfg.bf16 and (why := slow_bf16_reason(device)) and why not in _WARNED:
        _WARNED.add(why)  # once per process, not once per model
        print(f"warning: --bf16 on {device}: {why}; drop --bf16 here", file=sys.stderr)
    results = {}
    for name, folder, kind in (TaskSpec(*t) for t in tasks):
        task = prepare_task(name, folder=folder, tokenizer=tokenizer, cfg=cfg, kind=kind)
        runs = []
        for seed in cfg.seeds:
            t0 = time.time()
            run = finetune_once(model_dir, task=task, tokenizer=tokenizer, cfg=cfg, seed=seed, device=device)
            for split in task.evals:
                run[split]["score"] = headline(task, run[split])
            log(
                f"[finetune] {label or model_dir.name} {task.name} seed {seed}: "
                + ", ".join(f"{s} {run[s]['score']:.4f}" for s in task.evals)
                + f" ({time.time() - t0:.0f} s)"
            )
            runs.append(run)
        splits = {}
        for split in task.evals:
            keys = [k for k in runs[0][split] if isinstance(runs[0][split][k], float)]
            splits[split] = {k: aggregate([r[split][k] for r in runs]) for k in keys}
        results[task.name] = {
            "folder": str(folder),
            "kind": task.kind,
            "metrics": list(task.metrics),
            "scheme": task.scheme or None,
            "seeds": list(cfg.seeds),
            "splits": splits,
            "data": {"train": task.train.counts, **{s: e.counts for s, e in task.evals.items()}},
        }
    return results


def results_markdown(results: dict, *, cfg: FinetuneConfig) -> str:
    """One row per task, split and metric; one column per model; mean ± std over seeds, x100."""
    models = list(results)
    lines = [
        f"Fine-tuning results (mean ± std over seeds {list(cfg.seeds)}; ×100). "
        f"epochs {cfg.epochs}, lr {cfg.lr}, batch {cfg.batch_size}, max_seq_len {cfg.max_seq_len}.",
        "",
        "| task | split | metric | " + " | ".join(models) + " |",
        "|---|---|---|" + "---|" * len(models),
    ]
    rows: dict[tuple[str, str, str], dict[str, str]] = {}
    for model, tasks in results.items():
        for task, r in tasks.items():
            for split, metrics in r["splits"].items():
                for metric in ["score", *r["metrics"]]:
                    if metric == "score" and (len(r["metrics"]) == 1 or r["kind"] == "tagging"):
                        continue
                    v = metrics[metric]
                    rows.setdefault((task, split, metric), {})[model] = f"{100 * v['mean']:.2f} ± {100 * v['std']:.2f}"
    for (task, split, metric), by_model in rows.items():
        lines.append(f"| {task} | {split} | {metric} | " + " | ".join(by_model.get(m, "") for m in models) + " |")
    return "\n".join(lines) + "\n"


def config_dict(cfg: FinetuneConfig) -> dict:
    return asdict(cfg)


def parse_task(arg: str) -> TaskSpec:
    """--task TASK:FOLDER (a built-in task) or NAME=classify:FOLDER (any label<TAB>text folder)."""
    spec = classify_spec(arg)
    if spec is not None:
        return spec
    name, sep, path = arg.partition(":")
    name = name.strip().lower().replace("-", "")
    if not sep or not path:
        raise UsageError(f"--task {arg!r}: expected TASK:FOLDER, e.g. cola:glue_data/CoLA, or NAME=classify:FOLDER")
    if name not in GLUE_TASKS and name not in TAGGING_TASKS:
        raise UsageError(f"--task {arg!r}: unknown task {name!r}; {TASK_CHOICES}")
    return TaskSpec(name, Path(path))


def run_finetuning(models: list[tuple[str, Path]], *, tasks: list[TaskSpec], cfg: FinetuneConfig, out: Path) -> dict:
    """Every model on every task; writes OUT/results.json and OUT/results.md (also printed)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized classifier weights" is expected for every task
    t0 = time.time()
    results = {label: evaluate_model(path, tasks=tasks, cfg=cfg) for label, path in models}
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config_dict(cfg),
        "models": {label: str(path) for label, path in models},
        "results": results,
        "wall_s": round(time.time() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    md = results_markdown(results, cfg=cfg)
    (out / "results.md").write_text(md, encoding="utf-8")
    print(md)
    return payload
