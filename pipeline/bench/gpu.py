"""GPU benchmark for a bare, offline GPU machine (JSON out): torch and transformers only, no DeepSpeed,
streaming or Ray, no network.

    python -m pipeline.bench.gpu [--out bench_gpu.json]            # on the GPU machine
    python -m pipeline.bench.gpu --tiny                            # anywhere: tiny model, a smoke run
    python -m pipeline.bench.gpu --wheelhouse DIR                  # here, beforehand: wheels to carry

It runs the trainer's own pieces on synthetic samples: the masking collator (pipeline.data.collator),
the student with its encoder and masked-only head (pipeline.modeling), the objectives' loss terms
(pipeline.training.objectives.compute_losses) and the FLOPs model behind MFU (pipeline.training.metrics).
What differs from `pipeline/train.py`: no DeepSpeed engine (one GPU: ZeRO-2 would partition nothing),
torch's fused AdamW directly, and bf16 by autocast over fp32 weights instead of bf16 weights with fp32
masters. Per objective (MLM on packed and on NSP batches, TACO, TaCL) it reports tokens/s, MFU against
the device's peak and against a measured bf16 GEMM ceiling, the step-time split (data, forward, loss,
backward, optimizer; CUDA events) and the host syncs per step (torch.cuda.set_sync_debug_mode).
BERT-base, L = 128, micro-batch 128 by default. Targets: MLM >= 50% MFU, TaCL >= 0.75x and TACO >= 0.95x
MLM's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

TARGETS = {"mlm_mfu": 0.50, "tacl_over_mlm_tokens": 0.75, "taco_over_mlm_tokens": 0.95}
# bert-base-uncased's special ids: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103.
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
PHASES = ("data", "forward", "loss", "backward", "optimizer")


def synthetic_samples(n: int, *, seq_len: int, vocab: int, nsp: bool, seed: int) -> list[dict[str, Any]]:
    """Samples shaped as the builder writes them. NSP: [CLS] A [SEP] B [SEP], 10% of them shorter (as
    BERT's short-sequence probability makes them); packed: exactly seq_len tokens."""
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
            ids[rng.integers(1, length, 2)] = SEP  # document boundaries inside the stream
        sample = {"input_ids": ids, "token_type_ids": types, "word_starts": np.ones(length, np.uint8)}
        sample.update(sample_id=i, epoch=0, lang="en")
        if nsp:
            sample["nsp_label"] = int(rng.integers(0, 2))
        out.append(sample)
    return out


def collated_batches(*, micro: int, count: int, seq_len: int, vocab: int, nsp: bool, pin: bool) -> list[dict]:
    from pipeline.data.collator import MaskingCollator
    from pipeline.data.masking import MaskingSpec

    spec = MaskingSpec(mask_token_id=MASK, special_ids=(PAD, UNK, CLS, SEP, MASK), vocab_size=vocab)
    col = MaskingCollator(spec=spec, pad_id=PAD, seed=0, nsp=nsp, max_seq_len=seq_len)
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


class _Clock:
    """Phase times of a step: CUDA events on a GPU (read once, after the run), wall time on CPU."""

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
        """Seconds per phase, summed over every marked step."""
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if name == "start":
                continue
            out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def run_objective(
    objective: str,
    *,
    nsp: bool,
    batches: list[dict],
    model_spec: str,
    device: torch.device,
    steps: int,
    warmup: int,
    compile: bool = False,
) -> dict[str, Any]:
    from transformers import BertForPreTraining

    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.encoder import Encoder
    from pipeline.modeling.param_groups import param_groups
    from pipeline.modeling.student import Student
    from pipeline.modeling.teacher import build_teacher
    from pipeline.training.config import ObjectiveArgs
    from pipeline.training.metrics import FlopsModel, device_peak_flops
    from pipeline.training.objectives import compute_losses
    from pipeline.training.trainer import to_device

    torch.manual_seed(0)
    cfg = bert_config(model_spec, vocab_size=30522)
    student = Student(BertForPreTraining(cfg), compile=compile).to(device).train()
    # TaCL's frozen teacher: the student's initial encoder, in bf16 on a GPU (the engine's dtype), run
    # by the same encoder code.
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = (
        Encoder(build_teacher(student, dtype=teacher_dtype, device=device), compile=compile)
        if objective == "tacl"
        else None
    )
    opt = torch.optim.AdamW(param_groups(student), lr=1e-4, fused=device.type == "cuda")
    prep = SimpleNamespace(cfg=SimpleNamespace(objective=ObjectiveArgs(objective=objective)), use_nsp=nsp)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    flops_model = FlopsModel.of(cfg, teacher=teacher is not None)

    def step(k: int, clock: Optional[_Clock]) -> None:
        mark = clock.mark if clock else (lambda _: None)
        mark("start")
        batch = batches[k % len(batches)]
        dev = to_device(batch, device)
        mark("data")
        gen = torch.Generator().manual_seed(k)
        with autocast:
            out = student(dev, with_embeddings=objective == "taco", with_nsp=nsp)
            mark("forward")
            res = compute_losses(prep, out, dev, teacher=teacher, generator=gen)
        mark("loss")
        res.total.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0, foreach=device.type == "cuda")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")

    for k in range(warmup):
        step(k, None)
    sync = device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    # Host syncs in steady state: torch warns once per synchronizing call in "warn" mode.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sync:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        for k in range(warmup, warmup + steps):
            step(k, None)
        if sync:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    syncs = sum("synchronizing" in str(w.message).lower() for w in caught) / steps if sync else None
    clock = _Clock(device)
    for k in range(warmup + steps, warmup + 2 * steps):
        step(k, clock)
    split = {name: s / steps for name, s in clock.split().items()}
    used = [batches[k % len(batches)] for k in range(warmup, warmup + steps)]
    tokens = sum(b["num_tokens"] for b in used)
    flops = sum(
        flops_model.batch_flops(tokens=b["num_tokens"], sum_len_sq=b["sum_len_sq"], masked=b["num_masked"])
        for b in used
    )
    peak = device_peak_flops(device, dtype=torch.bfloat16)
    return {
        "tokens_per_s": tokens / elapsed,
        "step_s": elapsed / steps,
        "tflops_per_s": flops / elapsed / 1e12,
        "mfu": flops / elapsed / peak if peak else None,
        "step_split_s": split,
        "host_syncs_per_step": syncs,
        "mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if sync else None,
    }


def wheelhouse(folder: Path) -> int:
    """Download here what the bare machine lacks (numpy, pinned to ours) into `folder`, for
    `pip install --no-index --find-links folder` there. It has torch, transformers and tokenizers."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = f"numpy=={np.__version__}"
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(folder), spec]
    return subprocess.call(cmd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model, L=64, a few steps (runs on CPU)")
    p.add_argument("--micro", type=int, default=128, help="sequences per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile the encoder layers")
    p.add_argument("--wheelhouse", type=Path, help="download the wheels the bare machine needs into DIR and exit")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    if a.wheelhouse:
        return wheelhouse(a.wheelhouse)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq_len, model = 128, "base"
    if a.tiny:
        seq_len, model, a.micro, a.steps, a.warmup = 64, "tiny", 8, 2, 1
    batches = {
        nsp: collated_batches(micro=a.micro, count=8, seq_len=seq_len, vocab=30522, nsp=nsp, pin=device.type == "cuda")
        for nsp in (False, True)
    }
    jobs = {"mlm_packed": ("mlm", False), "taco": ("taco", False), "mlm_nsp": ("mlm", True), "tacl": ("tacl", True)}
    runs = {
        name: run_objective(
            obj,
            nsp=nsp,
            batches=batches[nsp],
            model_spec=model,
            device=device,
            steps=a.steps,
            warmup=a.warmup,
            compile=a.compile,
        )
        for name, (obj, nsp) in jobs.items()
    }
    ceiling = gemm_tflops(device, n=8192, repeats=20)
    for r in runs.values():
        r["mfu_of_gemm_ceiling"] = r["tflops_per_s"] / ceiling if ceiling else None
    tok = {k: v["tokens_per_s"] for k, v in runs.items()}
    figures = {
        "mlm_mfu": runs["mlm_packed"]["mfu"],
        "tacl_over_mlm_tokens": tok["tacl"] / tok["mlm_nsp"],
        "taco_over_mlm_tokens": tok["taco"] / tok["mlm_packed"],
    }
    result = {
        "benchmark": "bench_gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "setup": {
            "model": model,
            "seq_len": seq_len,
            "micro_batch": a.micro,
            "steps": a.steps,
            "warmup": a.warmup,
            "compile": a.compile,
        },
        "gemm_bf16_tflops": ceiling,
        "runs": runs,
        "figures": figures,
        "targets": TARGETS,
        "meets_target": {k: (v >= TARGETS[k]) if v is not None else None for k, v in figures.items()},
        "median_step_s": statistics.median(r["step_s"] for r in runs.values()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
