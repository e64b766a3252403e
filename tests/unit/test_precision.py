"""Where bf16 is slow: the CPU probe and the reason the trainer and fine-tuning give (the miniature's
fall-back to fp32: tests/experiments/mini/test_units.py)."""

from __future__ import annotations

import platform

import pytest
import torch

from pipeline.hardware import cpu_bf16_native, slow_bf16_reason


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX-512 rule is x86's")
def test_probe_follows_the_vector_isa():
    # oneDNN runs bf16 where the CPU has AVX-512 (BW/VL/DQ), the same test ATen's AVX512 dispatch makes.
    assert cpu_bf16_native() == torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def test_reason_only_for_a_cpu_without_native_bf16():
    assert slow_bf16_reason("cuda", native=False) is None
    assert slow_bf16_reason(torch.device("cpu"), native=True) is None
    why = slow_bf16_reason("cpu", native=False)
    assert "no native bf16" in why and "AVX-512" in why and torch.backends.cpu.get_cpu_capability() in why
    assert (slow_bf16_reason("cpu") is None) == cpu_bf16_native()
