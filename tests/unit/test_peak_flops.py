"""MFU's denominator: each GPU's dense 16-bit peak by its CUDA name, the most specific entry first."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.metrics import device_peak_flops, peak_for_name


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),  # SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L40", 181),
    ],
)
def test_peak_by_device_name(name, tflops):
    assert peak_for_name(name) == tflops * 1e12


def test_unknown_devices_and_cpu_have_no_peak():
    assert peak_for_name("Some Future GPU") is None
    assert device_peak_flops(torch.device("cpu"), dtype=torch.bfloat16) is None
    assert device_peak_flops(torch.device("cpu"), dtype=torch.bfloat16, override_tflops=100) == 100e12
