"""The bare engine: what DeepSpeed's engine does for one rank, in plain torch, for a machine without
DeepSpeed (the bare GPU benchmark, pipeline.bench.gpu) and for in-process tests of the step.

It reads the same DeepSpeed JSON and keeps the same numbers: the weights in the JSON's precision (bf16
for the shipped zero2.json) with fp32 master weights and fp32 gradient accumulation, AdamW with the
JSON's betas, eps and weight decay (torch's fused AdamW on CUDA, as `"torch_adam": true, "fused": true`
asks DeepSpeed for), clipping at `gradient_clipping`, the run's learning-rate schedule (the JSON's
WarmupLR / WarmupDecayLR by pipeline.training.schedule, as the trainer computes it), and the same calls
(pipeline.training.step). What it leaves out is ZeRO's bookkeeping: with one rank there is nothing to
partition, reduce or gather, so this is the step DeepSpeed's engine runs on one GPU minus its buckets
and hooks. fp16 (loss scaling) is not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.training.schedule import ScheduleLR, shape_from_json


class BareEngine:
    """`engine(batch, **kw)`, `backward(loss)`, `step()`, `get_lr()` over `module` (see the module
    docstring). `ds`: a resolved DeepSpeed config (pipeline.training.ds_config.resolve_ds_config)."""

    def __init__(self, module: torch.nn.Module, *, ds: dict[str, Any], param_groups: list[dict], device: torch.device):
        if ds.get("fp16", {}).get("enabled"):
            raise ValueError("BareEngine: fp16 (dynamic loss scaling) is not supported; use a bf16 or fp32 config")
        self.device = device
        self.dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32
        self.module = module.to(device=device, dtype=self.dtype)
        self.micro = int(ds["train_micro_batch_size_per_gpu"])
        self.accum = int(ds.get("gradient_accumulation_steps") or 1)
        self.clip = float(ds.get("gradient_clipping") or 0.0)
        self.params = [p for g in param_groups for p in g["params"]]
        # fp32 masters where the weights are 16-bit (DeepSpeed's bf16 optimizer keeps them the same way).
        self.masters = [p.detach().float().clone() for p in self.params] if self.dtype != torch.float32 else self.params
        for m in self.masters:
            m.grad = torch.zeros_like(m, dtype=torch.float32)
        groups = [{**g, "params": self.masters[i : i + len(g["params"])]} for i, g in _offsets(param_groups)]
        opt = ds.get("optimizer", {}).get("params", {})
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=float(opt.get("lr", 1e-4)),
            betas=tuple(opt.get("betas", (0.9, 0.999))),
            eps=float(opt.get("eps", 1e-8)),
            weight_decay=float(opt.get("weight_decay", 0.0)),
            fused=fused,
            foreach=None if fused else True,
        )
        self.scheduler = _schedule(self.optimizer, ds.get("scheduler"))
        self.micro_steps = 0

    # -- what the step calls ------------------------------------------------------------------------

    def __call__(self, batch: dict[str, Any], **kw: Any) -> dict[str, torch.Tensor]:
        return self.module(batch, **kw)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()
        if self.masters is not self.params:  # accumulate the 16-bit gradients in fp32, as DeepSpeed does
            # (a parameter the objective does not use, e.g. the NSP head on packed blocks, has none)
            pairs = [(m.grad, p.grad) for m, p in zip(self.masters, self.params) if p.grad is not None]
            torch._foreach_add_([m for m, _ in pairs], [g for _, g in pairs])
            for p in self.params:
                p.grad = None

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accum:
            return
        grads = [m.grad for m in self.masters]
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip, foreach=True)
        self.optimizer.step()
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.masters)
        torch._foreach_zero_(grads)
        self.scheduler.step()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- what the trainer reads back from DeepSpeed's engine ----------------------------------------

    def train(self) -> None:
        self.module.train()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro

    def gradient_accumulation_steps(self) -> int:
        return self.accum


def _offsets(groups: list[dict]) -> list[tuple[int, dict]]:
    out, start = [], 0
    for g in groups:
        out.append((start, g))
        start += len(g["params"])
    return out


def _schedule(optimizer: torch.optim.Optimizer, sched: Any) -> ScheduleLR:
    """The JSON's WarmupLR / WarmupDecayLR at the numbers written into it (pipeline.training.schedule:
    the trainer's rates for the same JSON), or a constant rate without a scheduler."""
    shape = shape_from_json(sched, peak=float(optimizer.defaults["lr"]))
    total = int(((sched or {}).get("params") or {}).get("total_num_steps", 1))
    return ScheduleLR(optimizer, shape, total=total)
