"""Reading W&B's offline run files back with wandb's own reader (`wandb leet inspect --json`, which
prints one JSON object per record of a .wandb transaction log)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class OfflineRun:
    """One process's .wandb file: its run id, config, history rows (W&B's _step and the logged keys)."""

    path: Path
    run_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def read_offline_runs(root: Path) -> list[OfflineRun]:
    """Every offline run file under `root`, in the order the processes started (the folder names
    begin with the start time, as `wandb sync` orders them)."""
    files = sorted(root.glob("**/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    return [read_offline_run(f) for f in files]


def read_offline_run(path: Path) -> OfflineRun:
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"wandb leet inspect {path}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    run = OfflineRun(path=path)
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        kind = rec.get("type")
        if kind == "run":
            run.run_id = rec["run"]["run_id"]
            run.config = rec["run"].get("config", {}).get("update", {})
        elif kind == "config":
            run.config.update(rec["config"].get("update", {}))
        elif kind == "history":
            run.history.append(rec["history"]["item"])
        elif kind == "exit":
            run.exit_code = rec["exit"].get("exit_code", 0)
    return run
