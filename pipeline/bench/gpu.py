"""GPU benchmark for a bare, offline GPU machine (JSON out): torch and transformers only, no DeepSpeed,
streaming or Ray, no network.

    python -m pipeline.bench.gpu [--out bench_gpu.json]      # on the GPU machine
    python -m pipeline.bench.gpu --tiny                      # anywhere: tiny model, a smoke run

It times the trainer's own step (pipeline.training.step.train_step: the objective's loss terms, the
non-finite guard, the FLOPs model behind MFU) on synthetic samples through the trainer's collator,
with the bare engine (pipeline.bench.engine): bf16 weights with fp32 masters and fp32 gradient
accumulation, AdamW fused, clipping and schedule, all read from the shipped deepspeed_configs/zero2.json
(micro-batch from --micro), as DeepSpeed's engine runs them on one GPU minus ZeRO's bookkeeping. The
encoder is compiled as the trainer compiles it on CUDA (--compile auto) and, for comparison, eager.

Jobs (BERT-base, L = 128, micro-batch 128 by default), each eager and compiled:
- mlm_packed, taco: packed blocks of documents, cut at [SEP] (the trainer's default);
- mlm_packed_sequence: the same blocks attended whole (--packed_attention sequence);
- mlm_nsp, tacl: NSP pairs as one unpadded stream (varlen attention); mlm_nsp_padded: the same padded.
Per job: tokens/s over >= 3 timing windows (median, min, max), MFU against the device's peak and a
measured bf16 GEMM ceiling, the step-time split (data, forward, loss, backward, optimizer; CUDA events,
in a separate window), host syncs per step, and peak memory (reset per job). The JSON is rewritten
after every job and a failing job records its error without losing the others. Targets: MLM >= 50%
MFU, TaCL >= 0.75x and TACO >= 0.95x MLM's tokens/s (compiled, the trainer's setting).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from preprocessing import cli

TARGETS = {"mlm_mfu": 0.50, "tacl_over_mlm_tokens": 0.75, "taco_over_mlm_tokens": 0.95}
# bert-base-uncased's special ids: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103.
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
PHASES = ("data", "forward", "loss", "backward", "optimizer")
REPO = Path(__file__).resolve().parents[2]
# name: (objective, data: "packed" | "nsp", collator option)
JOBS = {
    "mlm_packed": ("mlm", "packed", "document"),
    "taco": ("taco", "packed", "document"),
    "mlm_packed_sequence": ("mlm", "packed", "sequence"),
    "mlm_nsp": ("mlm", "nsp", "remove"),
    "tacl": ("tacl", "nsp", "remove"),
    "mlm_nsp_padded": ("mlm", "nsp", "keep"),
}


def synthetic_samples(n: int, *, seq_len: int, vocab: int, nsp: bool, seed: int) -> list[dict[str, Any]]:
    """Samples shaped as the builder writes them. NSP: [CLS] A [SEP] B [SEP], 10% of them shorter (as
    BERT's short-sequence probability makes them); packed: exactly seq_len tokens, [CLS] then documents
    of 20-120 tokens each followed by [SEP] (Wikipedia paragraphs are about that long)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = seq_len if not nsp or rng.random() >= 0.1 else int(rng.integers(16, seq_len))
        ids = rng.integers(1000, vocab, length).astype(np.int64)
        types = np.zeros(length, np.int64)
        ids[0] = CLS
        if nsp:
            cut = int(rng.integers(4, length - 4))
            ids[cut], ids[-1] = SEP, SEP
            types[cut + 1 :] = 1
        else:
            end = int(rng.integers(0, 120))  # where the document running into this block ends
            while end < length:
                if end > 0:
                    ids[end] = SEP
                end += int(rng.integers(20, 121))
        sample = {"input_ids": ids, "token_type_ids": types, "word_starts": np.ones(length, np.uint8)}
        sample.update(sample_id=i, epoch=0, lang="en")
        if nsp:
            sample["nsp_label"] = int(rng.integers(0, 2))
        out.append(sample)
    return out


def collated_batches(
    *, micro: int, count: int, seq_len: int, vocab: int, data: str, option: str, pin: bool
) -> list[dict]:
    """`count` micro-batches through the trainer's collator (pipeline.data.collator)."""
    from pipeline.data.collator import MaskingCollator
    from pipeline.data.masking import MaskingSpec

    nsp = data == "nsp"
    spec = MaskingSpec(mask_token_id=MASK, special_ids=(PAD, UNK, CLS, SEP, MASK), vocab_size=vocab)
    col = MaskingCollator(
        spec=spec,
        pad_id=PAD,
        seed=0,
        nsp=nsp,
        max_seq_len=seq_len,
        padding="keep" if option == "keep" else "remove",
        document_sep_id=SEP if option == "document" else None,
    )
    samples = synthetic_samples(micro * count, seq_len=seq_len, vocab=vocab, nsp=nsp, seed=int(nsp))
    batches = [col(samples[k * micro : (k + 1) * micro]) for k in range(count)]
    if pin:
        batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    return batches


def gemm_tflops(device: torch.device, *, n: int, repeats: int) -> Optional[float]:
    """A bf16 n x n GEMM's achieved TFLOP/s: the ceiling MFU is also reported against."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def ds_config(path: Path, *, micro: int) -> dict[str, Any]:
    """The shipped DeepSpeed JSON, resolved as the trainer resolves it for one rank, at `micro`."""
    from pipeline.training.config import ScheduleArgs
    from pipeline.training.ds_config import load_ds_json, resolve_ds_config

    raw = {**load_ds_json(str(path)), "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1}
    raw.pop("train_batch_size", None)
    schedule = ScheduleArgs(max_steps=100_000, lr=1e-4, warmup_steps=100)
    return resolve_ds_config(raw, schedule=schedule, world_size=1, path=str(path))


def build_program(objective_name: str, *, nsp: bool, model_spec: str, ds: dict, compile: bool, device: torch.device):
    """The trainer's StepProgram for one rank, on the bare engine (pipeline.training.trainer.setup's
    choices: the student, TaCL's teacher in the engine's dtype and compiled alike, the guard)."""
    from transformers import BertForPreTraining

    from pipeline import objectives
    from pipeline.bench.engine import BareEngine
    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.encoder import Encoder
    from pipeline.modeling.param_groups import param_groups
    from pipeline.modeling.student import Student
    from pipeline.modeling.teacher import build_teacher
    from pipeline.training.config import ObjectiveArgs
    from pipeline.training.metrics import FlopsModel
    from pipeline.training.nonfinite import NonfiniteGuard
    from pipeline.training.step import StepProgram

    objective = objectives.get(objective_name)
    torch.manual_seed(0)
    cfg = bert_config(model_spec, vocab_size=30522)
    cfg.attention_probs_dropout_prob = 0.0  # the trainer's --attention_dropout default
    student = Student(BertForPreTraining(cfg), compile=compile)
    teacher = build_teacher(student, dtype=torch.float32, device=device) if objective.needs_teacher else None
    engine = BareEngine(student, ds=ds, param_groups=param_groups(student), device=device)
    guard = NonfiniteGuard(device)
    guard.install(student)
    return StepProgram(
        engine=engine,
        objective=objective,
        args=ObjectiveArgs(objective=objective_name),
        nsp=nsp,
        teacher=Encoder(teacher.to(engine.dtype), compile=compile) if teacher is not None else None,
        guard=guard,
        flops=FlopsModel.of(cfg, teacher=teacher is not None),
        device=device,
        seed=0,
        accum=engine.gradient_accumulation_steps(),
    )


class _Clock:
    """Phase times of a step: CUDA events on a GPU (read once, after the window), wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def split(self) -> dict[str, float]:
        """Seconds per phase, summed over the window."""
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if name != "start":
                out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(program, batches: list[dict], *, warmup: int, steps: int, windows: int) -> dict[str, Any]:
    """tokens/s per timing window (median, min, max), MFU, step split, host syncs, peak memory."""
    from pipeline.training.metrics import Meter, device_peak_flops
    from pipeline.training.state import TrainState
    from pipeline.training.step import Batches, train_step

    device, state = program.device, TrainState()
    data, meter = Batches(batches), Meter(program.objective.metric_keys(nsp=program.nsp), device)
    program.engine.train()
    t0 = time.perf_counter()
    for _ in range(warmup):
        train_step(program, state, data, meter)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    seconds, tokens, flops = [], [], []
    for _ in range(windows):
        meter.counts = dict.fromkeys(meter.COUNTS, 0.0)
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(program, state, data, meter)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        tokens.append(meter.counts["tokens"])
        flops.append(meter.counts["flops"])
    syncs = _host_syncs(lambda: train_step(program, state, data, meter), device=device, steps=steps)
    clock = _Clock(device)
    for _ in range(steps):
        clock.mark("start")
        train_step(program, state, data, meter, mark=clock.mark)
    split = {name: s / steps for name, s in clock.split().items()}
    rates = [t / s for t, s in zip(tokens, seconds)]
    median = sorted(range(windows), key=lambda i: rates[i])[windows // 2]
    peak = device_peak_flops(device, dtype=torch.bfloat16)
    tflops = flops[median] / seconds[median] / 1e12
    values, _, _ = meter.reduce()
    return {
        "tokens_per_s": rates[median],
        "tokens_per_s_windows": rates,
        "spread": (max(rates) - min(rates)) / rates[median],
        "step_s": seconds[median] / steps,
        "tflops_per_s": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "step_split_s": split,
        "host_syncs_per_step": syncs,
        "mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss": values["loss"],
        "warmup_s": warmup_s,  # compilation included
    }


def _host_syncs(step: Callable[[], Any], *, device: torch.device, steps: int) -> Optional[float]:
    """Host syncs per step in steady state: torch warns once per synchronizing call in "warn" mode."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return sum("synchroniz" in str(w.message).lower() for w in caught) / steps


def run_job(name: str, *, compile: bool, a: argparse.Namespace, ds: dict, device: torch.device) -> dict[str, Any]:
    objective, data, option = JOBS[name]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    batches = collated_batches(
        micro=a.micro, count=8, seq_len=a.seq_len, vocab=30522, data=data, option=option, pin=device.type == "cuda"
    )
    program = build_program(objective, nsp=data == "nsp", model_spec=a.model, ds=ds, compile=compile, device=device)
    result = measure(program, batches, warmup=a.warmup, steps=a.steps, windows=a.windows)
    result["tokens_per_sequence"] = sum(b["num_tokens"] for b in batches) / sum(b["num_sequences"] for b in batches)
    return result


def figures(runs: dict[str, dict], mode: str) -> dict[str, Optional[float]]:
    def tok(name: str) -> Optional[float]:
        r = runs.get(f"{name}/{mode}", {})
        return r.get("tokens_per_s")

    def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
        return x / y if x and y else None

    mlm = runs.get(f"mlm_packed/{mode}", {})
    return {
        "mlm_mfu": mlm.get("mfu"),
        "tacl_over_mlm_tokens": ratio(tok("tacl"), tok("mlm_nsp")),
        "taco_over_mlm_tokens": ratio(tok("taco"), tok("mlm_packed")),
        "varlen_over_padded_nsp_tokens": ratio(tok("mlm_nsp"), tok("mlm_nsp_padded")),
        "documents_over_sequence_tokens": ratio(tok("mlm_packed"), tok("mlm_packed_sequence")),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = cli.bench_parser(
        __doc__.split("\n")[0],
        smoke="the tiny model, L=64, a few steps (runs on CPU)",
        smoke_flag="--tiny",
        out="also write the JSON here (rewritten after every job)",
    )
    p.add_argument("--model", default="base", help="a preset of pipeline.modeling.bert_config")
    p.add_argument("--micro", type=int, default=128, help="sequences per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="steps per timing window")
    p.add_argument("--windows", type=int, default=3, help="timing windows (median kept, spread reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", choices=("both", "on", "off"), default="both", help="eager, compiled, or both")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, among {', '.join(JOBS)}")
    p.add_argument("--ds_config", default=str(REPO / "deepspeed_configs" / "zero2.json"))
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_len, a.model, a.micro, a.steps, a.windows, a.warmup = 64, "tiny", 8, 2, 3, 1
    unknown = set(a.jobs.split(",")) - set(JOBS)
    if unknown:
        p.error(f"--jobs: unknown {sorted(unknown)}; expected among {', '.join(JOBS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ds = ds_config(Path(a.ds_config), micro=a.micro)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[a.compile]
    result = _header(a, device, ds)
    for compile in modes:  # eager first: its figures are in the JSON before any compilation
        for name in a.jobs.split(","):
            key = f"{name}/{'compiled' if compile else 'eager'}"
            try:
                result["runs"][key] = run_job(name, compile=compile, a=a, ds=ds, device=device)
            except Exception as e:  # one job's failure must not lose the others' figures
                result["runs"][key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            _finish(result, device, out=a.out, final=False)
    result["gemm_bf16_tflops"] = gemm_tflops(device, n=8192, repeats=20)
    _finish(result, device, out=a.out, final=True)
    return 0


def _header(a: argparse.Namespace, device: torch.device, ds: dict) -> dict[str, Any]:
    return {
        "benchmark": "bench_gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "engine": "bare (pipeline.bench.engine): the trainer's train_step with DeepSpeed's bf16 numbers for one "
        "rank (bf16 weights, fp32 masters and gradient accumulation, fused AdamW, clipping), minus ZeRO's "
        "bookkeeping",
        "setup": {
            "model": a.model,
            "seq_len": a.seq_len,
            "micro_batch": a.micro,
            "steps_per_window": a.steps,
            "windows": a.windows,
            "warmup": a.warmup,
            "ds_config": a.ds_config,
            "dtype": "bfloat16" if ds.get("bf16", {}).get("enabled") else "float32",
        },
        "runs": {},
        "targets": TARGETS,
    }


def _finish(result: dict[str, Any], device: torch.device, *, out: Optional[str], final: bool) -> None:
    runs = result["runs"]
    ceiling = result.get("gemm_bf16_tflops")
    for r in runs.values():
        if ceiling and "tflops_per_s" in r:
            r["mfu_of_gemm_ceiling"] = r["tflops_per_s"] / ceiling
    result["figures"] = {mode: figures(runs, mode) for mode in ("eager", "compiled")}
    shown = result["figures"]["compiled"] if any(k.endswith("/compiled") for k in runs) else result["figures"]["eager"]
    result["meets_target"] = {k: (shown[k] >= t) if shown.get(k) is not None else None for k, t in TARGETS.items()}
    result["complete"] = final
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if final:
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
