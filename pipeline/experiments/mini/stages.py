"""Stages of the experiment that a re-run with the same settings keeps instead of redoing.

A stage is a folder under OUT with `stage.json`: the settings it was made with and what it produced,
written last. A re-run skips a stage whose stage.json holds the same settings, and redoes (after
clearing the folder) one whose settings changed or that never finished, so an interrupted experiment
continues where it stopped and a changed knob reruns exactly what depends on it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "stage.json"


@dataclass
class Stage:
    dir: Path
    settings: dict

    @property
    def log(self) -> Path:
        return self.dir / "log.txt"


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def run_stage(folder: Path, settings: dict, work: Callable[[Stage], dict], *, name: str, say=print) -> dict:
    """work(stage) -> result dict, once per settings; returns the result (from stage.json when kept).
    `name` is how the progress lines call the stage (its path under OUT)."""
    settings = _jsonable(settings)
    marker = folder / MARKER
    if marker.is_file():
        saved = json.loads(marker.read_text())
        if saved.get("settings") == settings:
            say(f"[mini] {name}: kept (done before with the same settings)")
            return saved["result"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.time()
    result = _jsonable(work(Stage(folder, settings)))
    result["wall_s"] = round(time.time() - t0, 1)
    marker.write_text(json.dumps({"settings": settings, "result": result}, indent=1, ensure_ascii=False))
    say(f"[mini] {name}: done in {result['wall_s']:.0f} s")
    return result


def run_logged(cmd: list[str], *, log: Path, env: dict) -> None:
    """A subprocess (in this process's working folder, so that relative paths mean what they meant on
    the command line) with its output in `log`; a failure raises with the log's tail (a bug or a broken
    input, not something to continue past)."""
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {rc}); log {log}:\n{tail}")
