"""What this machine's CPU does natively, where that changes what a run should ask of it.

PyTorch runs bf16 matmuls on the CPU through oneDNN only where the CPU has AVX-512 (with or without
its BF16 and AMX extensions). Elsewhere (AVX2-only CPUs: many AMD EPYC and older Intel parts) bf16
falls back to reference kernels: on a 2-core AVX2 AMD EPYC one training step of a 4 x 256 BERT
(32 x 128 tokens) took 24.6x as long in bf16 weights as in fp32 and 25.1x under bf16 autocast
(`python -m pipeline.bench.precision`).
"""

from __future__ import annotations

import torch


def cpu_bf16_native() -> bool:
    """True where this CPU runs bf16 matmuls through oneDNN (AVX-512, AVX512-BF16 or AMX)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None:  # a torch without the probe: judge by the vector ISA it dispatches to
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return bool(probe())


def slow_bf16_reason(device: torch.device | str, *, native: bool | None = None) -> str | None:
    """Why bf16 on `device` will be far slower than fp32, or None where it is not (any GPU, or a CPU
    that runs bf16 natively). `native` overrides the CPU probe (tests)."""
    if torch.device(device).type != "cpu":
        return None
    if cpu_bf16_native() if native is None else native:
        return None
    return (
        f"this CPU has no native bf16 (PyTorch dispatches to {torch.backends.cpu.get_cpu_capability()}; "
        "oneDNN's bf16 needs AVX-512), so bf16 runs on reference kernels, about 25x slower than fp32 "
        "(measured on an AVX2 AMD EPYC)"
    )
