"""Weights & Biases for a training run (`--report_to wandb`, rank 0 only): one W&B run per run folder,
continued by every requeued or resumed process, with each optimizer step logged once.

Identity. The W&B run id is drawn when a run folder starts training and kept in RUN/wandb.json. Every
later process of the run (a Slurm requeue, `--resume auto`) calls `wandb.init(id=..., resume="allow")`
with it, so W&B continues the same run. WANDB_RUN_ID, when set, wins. `--resume none` draws a new id:
a run folder deleted and started again never appends to its predecessor's W&B run, whose steps it
would repeat. So does a process with other settings than the ones RUN/wandb.json records
(`config.run_settings`) that would re-train steps the W&B run already has: a rerun with another --lr
before the first checkpoint is another training, not the continuation of the first one's W&B run (and
a resume from an earlier checkpoint with a new schedule, --resume last_finite, is a new trajectory).
The new run gets the lines of metrics.jsonl up to the resumed step first, so its history is whole.

Steps. W&B's step is our optimizer step, and W&B only takes steps that increase. A resumed process
re-trains the steps after its checkpoint, which the process before it may already have sent (it died
after logging, before saving). metrics.jsonl rewrites those lines; W&B cannot: online it drops a step
below the run's last one, and offline the second process's file would hold a second copy that
`wandb sync` uploads. So the sink sends only the steps W&B lacks. Online, the server says which (the
resumed run's starting step). Offline, RUN/wandb.json records the last step sent, after every send,
and whether the process finished its W&B run. For a re-trained step W&B keeps what the earlier
process sent; metrics.jsonl has the re-trained values (with an exact resume they agree but for
timings). Lines of metrics.jsonl that W&B lacks (W&B switched on mid-run, a process
killed between the two writes) are sent when the next process starts, before its first new step.
A process killed outright (SIGKILL, a lost node) may take with it what wandb had not yet written:
online the next process sends it again; offline that is unknowable, the next process warns, and
RUN/metrics.jsonl stays the complete record.

W&B's own environment variables apply: WANDB_MODE (offline: files under RUN/wandb/, uploaded later
with `wandb sync RUN/wandb/offline-run-*`), WANDB_PROJECT (default "tokencl"), WANDB_ENTITY,
WANDB_NAME (default the run folder's name), WANDB_DIR (default the run folder), WANDB_API_KEY.
System metrics (GPU, CPU, memory, network) are W&B's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from pathlib import Path
from typing import Any

from pipeline.training.config import run_settings
from preprocessing.errors import UsageError

STATE_FILE = "wandb.json"
DEFAULT_PROJECT = "tokencl"
EXTRA_HINT = "pip install 'tokencl[wandb]' (or pip install wandb)"


def check_available(report_to: tuple[str, ...]) -> None:
    """Pre-flight: `--report_to wandb` needs the wandb package (the `wandb` extra)."""
    if "wandb" in report_to and importlib.util.find_spec("wandb") is None:
        raise UsageError(
            f"--report_to {','.join(report_to)}: the wandb package is not installed; {EXTRA_HINT}, or drop wandb "
            f"from --report_to"
        )


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # none yet, or cut by a crash mid-write (the write is atomic, so only by hand)
    return state if isinstance(state, dict) else {}


def _write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)  # a process killed mid-write leaves the previous state, never half of one


class WandbSink:
    """The run's W&B run (rank 0). `log(record)` sends one metrics.jsonl record as W&B step
    record["step"], keys prefixed "train/" as in TensorBoard, unless W&B already has that step."""

    def __init__(self, save_dir: Path, *, config: dict[str, Any], new_run: bool, resume_step: int = 0) -> None:
        import wandb

        from pipeline.data.shards import run_key
        from pipeline.training import log

        self.state_path = save_dir / STATE_FILE
        state = {} if new_run else _read_state(self.state_path)
        settings = json.loads(json.dumps(run_settings(config), default=str))
        last = int(state.get("last_step", 0))
        if state.get("id") and resume_step < last and not os.environ.get("WANDB_RUN_ID"):
            before = state.get("settings") or {}
            differ = sorted(k for k in settings.keys() | before.keys() if settings.get(k) != before.get(k))
            if differ:
                shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
                log.info(
                    f"W&B: run {state['id']} holds steps up to {last} of a training with other settings ({shown}); "
                    f"this one trains from step {resume_step + 1}, so it gets a new W&B run"
                )
                state = {}
        run_id = os.environ.get("WANDB_RUN_ID") or state.get("id") or f"{run_key(str(save_dir))}-{secrets.token_hex(3)}"
        same = state.get("id") == run_id  # a WANDB_RUN_ID of another run starts from nothing
        self.last_sent = int(state.get("last_step", 0)) if same else 0
        closed = bool(state.get("closed", True)) if same else True
        env = os.environ
        try:
            self.run = wandb.init(
                id=run_id,
                resume="allow",
                config=config,
                # Passed only where the environment does not say: wandb's arguments override its variables.
                project=None if env.get("WANDB_PROJECT") else DEFAULT_PROJECT,
                name=None if env.get("WANDB_NAME") else save_dir.resolve().name,
                dir=None if env.get("WANDB_DIR") else str(save_dir),
            )
        except wandb.errors.Error as e:  # no credentials, unreachable server, a refused id
            raise UsageError(
                f"--report_to wandb: W&B did not start ({type(e).__name__}: {e}); log in with `wandb login` or set "
                f"WANDB_API_KEY, or run with WANDB_MODE=offline and upload later with `wandb sync`"
            ) from e
        mode = self.run.settings.mode
        if mode == "online":  # the server knows what it has: send what it lacks, whatever the file says
            self.last_sent = int(self.run.starting_step) - 1 if self.run.resumed else 0
        url = self.run.url if mode == "online" else None  # offline, asking for it prints a warning
        self.state = {"id": run_id, "last_step": self.last_sent, "closed": False, "project": self.run.project}
        self.state["url"] = url
        self.state["settings"] = settings
        _write_state(self.state_path, self.state)
        where = url or (f"files in {Path(self.run.dir).parent}" if mode == "offline" else "nothing recorded")
        resumed = f"; steps up to {self.last_sent} were sent by an earlier process" if self.last_sent else ""
        log.info(f"W&B run {run_id} ({mode}): {where}{resumed}")
        if mode == "offline" and not closed and self.last_sent:
            # wandb writes an offline run's file every few seconds and at finish: a killed process's file
            # may end before the step it last sent. Sending those steps again would make copies.
            log.warning(
                f"W&B: the previous process of run {run_id} did not finish (killed?); its offline file may lack "
                f"the last steps it sent (up to {self.last_sent}). RUN/metrics.jsonl has every step"
            )

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step <= self.last_sent:
            return
        from pipeline.training.metrics import tag

        data = {tag(k): v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(data, step=step, commit=True)  # written now, not when the next step comes
        self.last_sent = self.state["last_step"] = step
        _write_state(self.state_path, self.state)

    def close(self, *, failed: bool) -> None:
        """Finish the W&B run (written out; a pre-empted run is resumed by its next process)."""
        self.run.finish(exit_code=1 if failed else 0)
        self.state["closed"] = True
        _write_state(self.state_path, self.state)
