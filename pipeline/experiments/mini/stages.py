"""Stages of the experiment that a re-run with the same settings keeps instead of redoing.

A stage is a folder under OUT with `stage.json`: the settings it was made with and what it produced,
written last. A re-run skips a stage whose stage.json holds the same settings, and redoes (after
clearing the folder) one whose settings changed or that never finished, so an interrupted experiment
continues where it stopped and a changed knob reruns exactly what depends on it. Stages that one command
does together (run_stages: the fine-tuning of every model) are kept or redone each on its own, and the
ones to redo run as one command.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

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


def _kept(folder: Path, settings: dict) -> Optional[dict]:
    """The stage's result when its stage.json holds these settings, else None."""
    marker = folder / MARKER
    if marker.is_file():
        saved = json.loads(marker.read_text())
        if saved.get("settings") == settings:
            return saved["result"]
    return None


def _start(folder: Path, settings: dict) -> Stage:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return Stage(folder, settings)


def _finish(stage: Stage, result: dict, *, wall_s: float) -> dict:
    result = {**_jsonable(result), "wall_s": round(wall_s, 1)}
    marker = {"settings": stage.settings, "result": result}
    (stage.dir / MARKER).write_text(json.dumps(marker, indent=1, ensure_ascii=False))
    return result


def run_stage(folder: Path, settings: dict, work: Callable[[Stage], dict], *, name: str, say=print) -> dict:
    """work(stage) -> result dict, once per settings; returns the result (from stage.json when kept).
    `name` is how the progress lines call the stage (its path under OUT)."""
    return run_stages({name: folder}, {name: settings}, lambda todo: {name: work(todo[name])}, say=say)[name]


def run_stages(
    folders: dict[str, Path], settings: dict[str, dict], work: Callable[[dict[str, Stage]], dict], *, say=print
) -> dict[str, dict]:
    """Stages that one piece of work does together (one command for all of them), keyed by name: those
    done before with the same settings are kept; work({name: stage}) does the others at once and returns
    each one's result. Their wall_s is the work's time shared out evenly. Returns every result, in order."""
    results, todo = {}, {}
    for name, folder in folders.items():
        wanted = _jsonable(settings[name])
        results[name] = _kept(folder, wanted)
        if results[name] is not None:
            say(f"[mini] {name}: kept (done before with the same settings)")
        else:
            todo[name] = _start(folder, wanted)
    if todo:
        t0 = time.time()
        done = work(todo)
        share = (time.time() - t0) / len(todo)
        for name, stage in todo.items():
            results[name] = _finish(stage, done[name], wall_s=share)
            say(f"[mini] {name}: done in {results[name]['wall_s']:.0f} s")
    return results


def run_logged(cmd: list[str], *, log: Path, env: dict) -> None:
    """A subprocess (in this process's working folder, so that relative paths mean what they meant on
    the command line) with its output in `log`; a failure raises with the log's tail (a bug or a broken
    input, not something to continue past)."""
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {rc}); log {log}:\n{tail}")
