"""The pre-training runs of the miniature, through the real trainer (pipeline/train.py under torchrun,
DeepSpeed ZeRO-2 on one CPU rank), and the HF exports of their checkpoints.

Every run: the same DeepSpeed config (AdamW, linear warm-up over --warmup_share of its steps, then
linear decay to 0), learning rate, micro-batch, seed, and 1:1 English:Chinese mix (--data_weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from pipeline.evaluation.mini.config import REPO, MiniConfig
from pipeline.evaluation.mini.stages import Stage, run_logged


def ds_config(cfg: MiniConfig) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if cfg.bf16:
        ds["bf16"] = {"enabled": True}
    return ds


def pretrain(
    cfg: MiniConfig,
    stage: Stage,
    *,
    objective: str,
    data: list[Path],
    steps: int,
    save_every: int,
    env: dict,
    model_config: Optional[Path] = None,
    init_from: Optional[Path] = None,
    nsp: str = "off",
) -> dict:
    """One run into stage.dir/run, its final student exported to stage.dir/export."""
    (stage.dir / "ds_config.json").write_text(json.dumps(ds_config(cfg), indent=1))
    start = ["--model_config", str(model_config)] if model_config else ["--init_from", str(init_from)]
    # torchrun --standalone: one process, a free rendezvous port, the environment the trainer expects.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(REPO / "pipeline" / "train.py"),
        "--ds_config", str(stage.dir / "ds_config.json"),
        "--objective", objective,
        "--nsp", nsp,
        *[x for d in data for x in ("--data", str(d))],
        "--data_weights", ",".join("1" for _ in data),
        *start,
        "--max_steps", str(steps),
        "--lr", str(cfg.lr),
        "--warmup_steps", str(round(cfg.warmup_share * steps)),
        "--seed", str(cfg.seed),
        "--num_workers", "1",
        "--log_every", str(max(1, steps // 50)),
        "--save_every", str(save_every),
        "--keep_checkpoints", str(steps // save_every + 1),
        "--save_dir", str(stage.dir / "run"),
        "--export_dir", str(stage.dir / "export"),
        "--progress_bar", "off",
    ]  # fmt: skip
    run_logged(cmd, log=stage.log, env=env)
    return summarise_run(stage.dir / "run")


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


def export_checkpoints(run: Path, steps: list[int], out: Path) -> dict[int, Path]:
    """HF folders of the run's checkpoints at `steps` (out/step_N); the last is the run's own export."""
    from pipeline.training.hf_export import export

    paths = {}
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        if not ckpt.is_dir():
            kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
            raise RuntimeError(f"{run}: no checkpoint at step {step} (kept: {kept})")
        paths[step] = export(ckpt, out / f"step_{step}")
    return paths
