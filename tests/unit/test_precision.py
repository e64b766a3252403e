"""Where bf16 is slow: the CPU probe, the reason the trainer and fine-tuning give, and the miniature's
fall-back to fp32 on a CPU without native bf16."""

from __future__ import annotations

import platform

import pytest
import torch

from pipeline.evaluation.mini.config import MiniConfig, native_precision
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


def _cfg(**kw) -> MiniConfig:
    return MiniConfig(out="mini", **kw)


def test_miniature_keeps_bf16_where_the_cpu_runs_it():
    cfg = _cfg()
    assert native_precision(cfg, bf16_native=True) == (cfg, [])


def test_miniature_falls_back_to_fp32_and_says_so():
    cfg, notes = native_precision(_cfg(), bf16_native=False)
    assert (cfg.bf16, cfg.ft_bf16) == (False, False)
    assert len(notes) == 1 and notes[0].startswith("pre-training and fine-tuning in fp32")
    # Pre-training on another device keeps its bf16; fine-tuning always runs on the CPU.
    cfg, notes = native_precision(_cfg(), bf16_native=False, pretrain_on_cpu=False)
    assert (cfg.bf16, cfg.ft_bf16) == (True, False) and notes[0].startswith("fine-tuning in fp32")
    # Already fp32: nothing to say.
    cfg = _cfg(bf16=False, ft_bf16=False)
    assert native_precision(cfg, bf16_native=False) == (cfg, [])
