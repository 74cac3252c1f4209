"""The CPU device's capability: always available, fp32 and bf16, its vector features, Triton interpreted."""

from __future__ import annotations

import platform

import torch

from hal.capability import DeviceCapability, cpu_memory, host_cpu_name, library_version, triton_interpreter_status
from hal.kernels.cpu import cpu_features

__all__ = ["cpu_capability"]


def cpu_capability() -> DeviceCapability:
    reasons = {
        "fp16": "fp16 matmul on CPUs is ~1000x slower than fp32; hal never runs fp16 on the CPU",
        "fp8": "no fp8 attention kernels on the CPU",
    }
    target, why_not = triton_interpreter_status()  # the CPU runs Triton only interpreted
    if why_not:
        reasons["triton"] = why_not
    name = host_cpu_name()
    return DeviceCapability(
        type="cpu",
        available=True,
        torch_type="cpu",
        count=1,
        name=name,
        vendor=name.split()[0] if name else "",
        arch=platform.machine(),
        memory_bytes=cpu_memory(),
        dtypes=("fp32", "bf16"),
        graph="eager_guard",
        triton_target=target,
        libraries={"torch": torch.__version__, "triton": library_version("triton") or ""},
        reasons=reasons,
        features=tuple(cpu_features()["flags"]),
    )
