"""Training metrics: the FLOPs model and MFU, the device peak table, the interval meter, and the
rank-0 writers (JSONL, TensorBoard, tqdm).

FLOPs per micro-batch (docs/objectives.md's per-token formula, summed over the batch's real tokens):
    6 * N_layers * T + 12 * n_layers * D * sum_i(L_i^2) + 6 * (D * V + N_head) * M
T real (non-pad) tokens, L_i the real length of sequence i, M masked positions (the MLM head runs
only there), N_layers the encoder-layer parameters, N_head the head's transform. TaCL adds the
teacher's forward, a third of the encoder's training cost: 2 * N_layers * T + 4 * n_layers * D *
sum_i(L_i^2). The losses themselves are negligible. MFU = FLOPs / s / (peak per device * devices).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline import distributed
from preprocessing.errors import UsageError

# Dense bf16/fp16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name().
# The first match wins, so more specific names come first.
PEAK_FLOPS_16BIT: list[tuple[str, float]] = [
    ("GH200", 989e12),
    ("H200", 989e12),
    # Dense bf16 per card form factor: the PCIe and NVL H100s run at lower clocks than the SXM one.
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
    ("3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
]


def device_peak_flops(
    device: torch.device, *, dtype: torch.dtype, override_tflops: Optional[float] = None
) -> Optional[float]:
    """Peak FLOP/s of one device for `dtype`, or None where we do not know it (CPU, fp32, an
    unlisted GPU): MFU is then reported as null rather than guessed."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> Optional[float]:
    """Dense 16-bit peak FLOP/s of a GPU by its CUDA name (the first, most specific, entry that the
    name contains), or None."""
    for key, peak in PEAK_FLOPS_16BIT:
        if key in name:
            return peak
    return None


@dataclass(frozen=True)
class FlopsModel:
    """The per-batch FLOPs formula above, for one model shape and objective."""

    layer_params: int
    head_params: int
    n_layers: int
    hidden: int
    vocab: int
    teacher: bool

    @classmethod
    def of(cls, config: Any, *, teacher: bool) -> FlopsModel:
        """The model of a BertConfig (with TaCL's teacher forward or not)."""
        from pipeline.modeling.bert_config import non_embedding_params

        layer_params, head_params = non_embedding_params(config)
        return cls(
            layer_params=layer_params,
            head_params=head_params,
            n_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            teacher=teacher,
        )

    def batch_flops(self, *, tokens: int, sum_len_sq: int, masked: int) -> float:
        attn = 12 * self.n_layers * self.hidden * sum_len_sq
        f = 6 * self.layer_params * tokens + attn + 6 * (self.hidden * self.vocab + self.head_params) * masked
        if self.teacher:
            f += 2 * self.layer_params * tokens + attn / 3
        return float(f)


def memory_gb(device: torch.device) -> tuple[float, str]:
    """(peak memory in GiB, what it measures): the CUDA caching allocator's peak on a GPU, the
    process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda_max_allocated"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / 2**20, "cpu_max_rss"


class Meter:
    """Sums over the micro-batches of a logging interval. The loss terms stay on the device (adding
    them reads nothing back); the counts are host numbers. `reduce` averages the terms over the
    finite micro-batches of all ranks and sums the counts: one collective and one device read, at
    log steps only (every rank calls it on the same steps). A term no finite micro-batch measured
    (every one of the interval was skipped) is NaN, never 0: metrics.jsonl writes it as null."""

    COUNTS = ("tokens", "samples", "flops")

    def __init__(self, keys: list[str], device: torch.device) -> None:
        self.keys = list(keys)
        self.device = device
        self.last_step_finite = True  # as of the last reduce: did its last step have a finite micro-batch?
        self._restart()

    def _restart(self) -> None:
        self.sums = torch.zeros(len(self.keys) + 1, dtype=torch.float64, device=self.device)  # + finite count
        self.step_ok = torch.zeros((), dtype=torch.float64, device=self.device)  # finite micro-batches, this step
        self._step_of_ok = -1  # the value of `steps` that step_ok counts for
        self.counts = dict.fromkeys(self.COUNTS, 0.0)
        self.micro = 0
        self.steps = 0
        self.t0 = time.perf_counter()
        self.excluded = 0.0  # seconds spent on other things (checkpoints) inside the interval

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def add(
        self, values: dict[str, torch.Tensor], *, ok: torch.Tensor, tokens: int, samples: int, flops: float
    ) -> None:
        """One micro-batch: its terms (device or CPU scalars) count where `ok` (a device bool) holds."""
        terms = torch.stack([values[k].to(self.device, torch.float64) for k in self.keys] + [ok.to(torch.float64)])
        self.sums += torch.where(ok, terms, torch.zeros_like(terms))
        if self._step_of_ok != self.steps:  # the first micro-batch of an optimizer step (the loop counts steps)
            self.step_ok, self._step_of_ok = torch.zeros_like(self.step_ok), self.steps
        self.step_ok = self.step_ok + ok.to(torch.float64)
        for k, v in (("tokens", tokens), ("samples", samples), ("flops", flops)):
            self.counts[k] += v
        self.micro += 1

    def reduce(self) -> tuple[dict[str, float], float, int]:
        """({term: mean over the finite micro-batches of all ranks, count: sum over ranks}, seconds, steps)
        since the last reduce."""
        elapsed, steps = max(time.perf_counter() - self.t0 - self.excluded, 1e-9), self.steps
        counts = torch.tensor([self.counts[k] for k in self.COUNTS], dtype=torch.float64).to(self.device)
        summed = distributed.sum_over_ranks(torch.cat([self.sums, self.step_ok.reshape(1), counts])).tolist()
        n = len(self.keys)
        terms, finite, last_ok, totals = summed[:n], summed[n], summed[n + 1], summed[n + 2 :]
        out = {k: v / finite if finite else float("nan") for k, v in zip(self.keys, terms)}
        out.update(zip(self.COUNTS, totals))
        self.last_step_finite = last_ok > 0
        self._restart()
        return out, elapsed, steps

    def grad_norm(self, value: Any) -> Optional[float]:
        """The engine's global gradient norm as a float: NaN when every micro-batch of the last step
        was skipped (its gradient was zeroed, so the norm says nothing); None when it has none."""
        if value is None:
            return None
        return float(value) if self.last_step_finite else float("nan")


def _truncate_jsonl(path: Path, *, last_step: int) -> list[dict[str, Any]]:
    """Keep the lines of steps <= last_step: a resumed run rewrites what came after its checkpoint.
    Returns the records kept."""
    if not path.exists():
        return []
    lines, kept = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash that caused the resume
        if record.get("step", 0) <= last_step:
            lines.append(line)
            kept.append(record)
    path.write_text("".join(k + "\n" for k in lines))
    return kept


class MetricsWriter:
    """RUN/metrics.jsonl, and the `report_to` sinks: RUN/tensorboard/, a W&B run
    (pipeline.training.wandb_sink). Rank 0 only; other ranks get a writer that does nothing. On resume,
    lines after the resumed step are dropped so every step appears once, and TensorBoard purges them;
    W&B keeps the steps it has and gets the ones it lacks. `run_config` is the resolved configuration
    (W&B's run config); `new_run` (--resume none) starts a new W&B run even in a folder that had one."""

    def __init__(
        self,
        save_dir: Path,
        *,
        enabled: bool,
        resume_step: int,
        trace: bool,
        report_to: tuple[str, ...] = ("tensorboard",),
        run_config: Optional[dict[str, Any]] = None,
        new_run: bool = False,
    ) -> None:
        self.enabled = enabled
        self.path = save_dir / "metrics.jsonl"
        self.trace_path = save_dir / "sample_trace.jsonl" if trace else None
        self._tb = self._wandb = None
        self._f = self._trace = None
        if not enabled:
            return
        save_dir.mkdir(parents=True, exist_ok=True)
        kept = _truncate_jsonl(self.path, last_step=resume_step)
        self._f = open(self.path, "a", buffering=1)
        if self.trace_path is not None:
            _truncate_jsonl(self.trace_path, last_step=resume_step)
            self._trace = open(self.trace_path, "a", buffering=1)
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = resume_step + 1 if resume_step else None
                self._tb = SummaryWriter(str(save_dir / "tensorboard"), purge_step=purge)
            except ImportError:  # tensorboard is a dependency; a broken install should not stop training
                from pipeline.training import log

                log.warning("tensorboard unavailable: metrics go to metrics.jsonl only")
        if "wandb" in report_to:
            from pipeline.training.wandb_sink import WandbSink

            self._wandb = WandbSink(save_dir, config=run_config or {}, new_run=new_run, resume_step=resume_step)
            for record in kept:  # what an earlier process wrote here but W&B lacks
                self._wandb.log(record)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record. A non-finite number (a term no finite micro-batch measured) is null in
        JSON, absent from TensorBoard and W&B."""
        if not self.enabled:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._write(self._f, self.path, json.dumps(record) + "\n")
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(tag(k), v, step)
        if self._wandb is not None:
            self._wandb.log(record)

    def trace(self, step: int, sample_ids: list[list[int]]) -> None:
        if self.enabled and self._trace is not None:
            self._write(self._trace, self.trace_path, json.dumps({"step": step, "sample_ids": sample_ids}) + "\n")

    def _write(self, f: Any, path: Path, line: str) -> None:
        """One line (flushed: the files are line-buffered). A full disk is a one-line error naming the
        file; the run's checkpoints are untouched, and a resume drops the cut line."""
        try:
            f.write(line)
        except OSError as e:
            from pipeline.training import checkpoint

            if not checkpoint.is_out_of_space(e):
                raise
            found = checkpoint.latest_checkpoint(self.path.parent)
            kept = f"the last checkpoint, {found[1]}, is intact" if found else "no checkpoint was saved yet"
            raise UsageError(
                f"no space left on the device (ENOSPC) while writing {path}; {kept}: free space and resume "
                f"with --resume auto"
            ) from None

    def close(self, *, failed: bool = False) -> None:
        """`failed`: the run ended with an exception (W&B marks the run failed; a pre-empted run is not)."""
        for f in (self._f, self._trace):
            if f is not None:
                try:
                    f.close()
                except OSError as e:  # the flush of a line a full disk refused: reported already
                    from pipeline.training import checkpoint

                    if not checkpoint.is_out_of_space(e):
                        raise
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close(failed=failed)


def tag(key: str) -> str:
    """A metrics line's field as TensorBoard and W&B name it: training fields under train/, the held-out
    evaluation's as they are (eval/...)."""
    return key if "/" in key else f"train/{key}"


def progress_bar(*, enabled: bool, total: int, initial: int):
    """A tqdm bar on rank 0 (None elsewhere)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
