"""The product's own commands, run as a user runs them, each into its stage's folder with its output in
the stage's log: the shard builder, pipeline/train.py under torchrun (one DeepSpeed rank), analyze.py and
finetune.py (one command for all the models to fine-tune). What the experiment adds to each is the few
values that vary per run. The curve's checkpoints are exported with export.py's function, in this process
(a command each would pay its imports again for a few seconds of work)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from pipeline.evaluation.downstream.tasks import CLASSIFY, TaskSpec
from pipeline.experiments.mini.settings import CONFIGS, HELDOUT_SAMPLES, REPO, MiniConfig
from pipeline.experiments.mini.stages import Stage, run_logged


def _script(*parts: str) -> str:
    return str(REPO.joinpath(*parts))


def build_shards(
    cfg: MiniConfig, stage: Stage, *, text: Path, tokenizer: Path, fmt: str, lang: str, env: dict, split: str = "train"
) -> dict:
    """One builder run (Ray on this machine) on TEXT/SPLIT_LANG.txt (the pre-training text, or the
    held-out documents) into stage.dir/mds, then checked (and its counts read) as the trainer will read
    it (pipeline.data.shards.inspect_data)."""
    from pipeline.data.shards import inspect_data

    cmd = [
        sys.executable, _script("preprocessing", "build_shards.py"),
        "--input", f"{lang}:{text / f'{split}_{lang}.txt'}",
        "--output", str(stage.dir / "mds"),
        "--tokenizer", str(tokenizer),
        "--format", fmt,
        "--max_seq_len", str(cfg.text.max_seq_len),
        "--num_workers", "2",
        "--seed", str(cfg.text.seed),
        "--overwrite",
        "--no_progress",
    ]  # fmt: skip
    run_logged(cmd, log=stage.log, env=env)
    # Local shards are verified in place: nothing is written under the cache root.
    manifest = inspect_data([str(stage.dir / "mds")], cache_root=str(stage.dir / "cache")).sources[0].manifest
    c = manifest.counts
    return {
        k: getattr(c, k) for k in ("documents_written", "documents_skipped", "samples", "tokens_in_samples", "shards")
    }


def arm_config(arm: str) -> Path:
    """The train.py --config file of one arm (settings.ARMS)."""
    return CONFIGS / f"{arm}.yaml"


def train(
    cfg: MiniConfig,
    stage: Stage,
    *,
    arm: str,
    data: list[Path],
    heldout: dict[str, Path],
    steps: int,
    save_every: int,
    env: dict,
    init_from: Optional[Path] = None,
) -> dict:
    """One pre-training run of `arm` into stage.dir/run, its final student exported to stage.dir/export:
    the arm's --config file and the DeepSpeed config, plus what varies per run. At every checkpoint the
    trainer evaluates the first HELDOUT_SAMPLES samples of each language's held-out shards (`heldout`:
    language -> folder), logged as eval/LANG/... in RUN/metrics.jsonl (read by `heldout_figures`)."""
    source = ["--init_from", str(init_from)] if init_from else ["--model_config", cfg.model_config()]
    # torchrun --standalone: one process, a free rendezvous port, the environment the trainer expects.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        _script("pipeline", "train.py"),
        "--config", str(arm_config(arm)),
        "--ds_config", str(cfg.ds_config),
        *[x for d in data for x in ("--data", str(d))],
        *source,
        "--seed", str(cfg.text.seed),
        "--max_steps", str(steps),
        "--warmup_steps", str(round(cfg.pretrain.warmup_share * steps)),
        "--log_every", str(max(1, steps // 50)),
        "--save_every", str(save_every),
        "--keep_checkpoints", str(steps // save_every + 1),
        "--save_dir", str(stage.dir / "run"),
        "--export_dir", str(stage.dir / "export"),
        *[x for lang, folder in heldout.items() for x in ("--eval_data", f"{lang}={folder}")],
        "--eval_every", str(save_every),
        "--eval_samples", str(HELDOUT_SAMPLES),
        "--eval_health_every", "0",  # the representation analysis is analyze.py's, on the exported models
    ]  # fmt: skip
    run_logged(cmd, log=stage.log, env=env)
    return {**summarise_run(stage.dir / "run"), "heldout": heldout_figures(stage.dir / "run", langs=list(heldout))}


def heldout_figures(run: Path, *, langs: list[str]) -> dict[str, dict]:
    """{step: {lang: {accuracy, cross_entropy, masked, samples}}}: the trainer's held-out evaluation of
    each language (eval/LANG/mlm_acc, mlm_loss, masked, samples) at every step it evaluated."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    fields = {"accuracy": "mlm_acc", "cross_entropy": "mlm_loss", "masked": "masked", "samples": "samples"}
    return {
        str(r["step"]): {lang: {k: r[f"eval/{lang}/{f}"] for k, f in fields.items()} for lang in langs}
        for r in rows
        if f"eval/{langs[0]}/mlm_loss" in r
    }


def summarise_run(run: Path) -> dict:
    """First and last logged values and the median throughput of a run (from RUN/metrics.jsonl)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]
    keys = [k for k in ("loss", "mlm_loss", "nsp_loss", "tc_loss", "tacl_loss", "mlm_acc") if k in rows[-1]]
    tps = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    return {
        "steps": rows[-1]["step"],
        "first": {k: rows[0].get(k) for k in keys},
        "last": {k: rows[-1].get(k) for k in keys},
        "tokens_per_s": tps[len(tps) // 2] if tps else None,
    }


def export_checkpoints(stage: Stage, steps: list[int]) -> dict[int, Path]:
    """HF folders of stage.dir/run's checkpoints at `steps` (as export.py writes them, into
    stage.dir/checkpoints_hf/step_N); the last step is the run's own export (train.py --export_dir
    exports that same checkpoint)."""
    from pipeline.training.hf_export import export

    run, paths = stage.dir / "run", {}
    for step in steps[:-1]:
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        if not ckpt.is_dir():
            kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
            raise RuntimeError(f"{run}: no checkpoint at step {step} (kept: {kept})")
        paths[step] = export(ckpt, stage.dir / "checkpoints_hf" / f"step_{step}")
    return {**paths, steps[-1]: stage.dir / "export"}


def analyze(cfg: MiniConfig, stage: Stage, models: dict[str, Path], *, text: Path, env: dict) -> dict:
    """analyze.py on held-out sentences of both languages, its report and figures in stage.dir:
    {"last_layer": {label: summary}, "figures": {name: path}}."""
    cmd = [
        sys.executable, _script("pipeline", "analyze.py"),
        *[x for label, path in models.items() for x in ("--model", f"{label}={path}")],
        "--data", str(text),
        "--out", str(stage.dir),
        "--pack_text",
        # 128 tokens hold several sentences of a document, so intra-sentence and intra-context differ.
        "--max_seq_len", "128",
        "--max_sequences", str(cfg.analysis.analysis_sequences),
        "--seed", str(cfg.text.seed),
        "--device", "cpu",
    ]  # fmt: skip
    run_logged(cmd, log=stage.log, env=env)
    metrics = json.loads((stage.dir / "metrics.json").read_text())
    return {
        "last_layer": {label: m["last_layer"] for label, m in metrics["models"].items()},
        "figures": {k: str(stage.dir / v) for k, v in metrics["figures"].items()},
    }


def task_flag(task: TaskSpec) -> str:
    """finetune.py's --task value of one task."""
    return f"{task.name}=classify:{task.folder}" if task.kind == CLASSIFY else f"{task.name}:{task.folder}"


def finetune(cfg: MiniConfig, out: Path, models: dict[str, Path], tasks: list[TaskSpec], *, env: dict) -> dict:
    """One finetune.py command for `models` (label -> HF folder) on `tasks` with the experiment's recipe,
    its output in `out`: {label: {"tasks": {task: {splits: {split: {metric: {mean, std, per_seed}}}, data,
    ...}}, "config": ...}}."""
    f = cfg.finetune
    cmd = [
        sys.executable, _script("pipeline", "finetune.py"),
        *[x for label, path in models.items() for x in ("--model", f"{label}={path}")],
        *[x for t in tasks for x in ("--task", task_flag(t))],
        "--out", str(out),
        "--epochs", str(f.ft_epochs),
        "--lr", str(f.ft_lr),
        "--batch_size", str(f.ft_batch),
        "--max_seq_len", str(f.ft_seq_len),
        "--seeds", ",".join(map(str, cfg.seeds)),
        "--max_train_samples", str(f.train_samples),
        *(["--max_eval_samples", str(f.eval_samples)] if f.eval_samples is not None else []),
        "--device", "cpu",
        *(["--bf16"] if f.ft_bf16 else []),
    ]  # fmt: skip
    run_logged(cmd, log=out / "log.txt", env=env)
    payload = json.loads((out / "results.json").read_text())
    return {label: {"tasks": payload["results"][label], "config": payload["config"]} for label in models}
