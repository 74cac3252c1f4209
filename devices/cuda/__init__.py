"""The CUDA device (NVIDIA, and AMD through ROCm's torch): backends ``flashinfer`` then ``triton``.

Probing reads torch's CUDA runtime without creating a context beyond what
``torch.cuda.get_device_properties`` needs, and never raises.
"""

from __future__ import annotations

import importlib.util

import torch

from hal.capability import DeviceCapability, current_index, library_version, triton_status
from hal.graph import Graph, TorchGraph
from hal.registry import Device

__all__ = ["CudaDevice", "device", "cuda_capability", "TRITON_BACKENDS"]

TRITON_BACKENDS = ("cuda", "hip")
"""Triton's driver backends for this device: ROCm's torch device type is ``cuda`` too."""


def _unavailable(why: str) -> DeviceCapability:
    return DeviceCapability(
        type="cuda",
        available=False,
        torch_type="cuda",
        reasons={"device": why},
        libraries={"flashinfer": library_version("flashinfer-python") or ""},
    )


def cuda_capability(index: int | None = None) -> DeviceCapability:
    """Device ``index`` (None: the current CUDA device, as ``torch.cuda.set_device`` left it)."""
    if torch.version.cuda is None and torch.version.hip is None:
        return _unavailable(f"this torch build ({torch.__version__}) has no CUDA or ROCm support")
    try:
        count = torch.cuda.device_count()
    except Exception as exc:  # a broken driver is a reason, not a crash
        return _unavailable(f"CUDA runtime error: {type(exc).__name__}: {exc}")
    if count == 0:
        return _unavailable("no CUDA device visible (driver missing, or CUDA_VISIBLE_DEVICES hides them)")
    index = current_index("cuda") if index is None else index
    if not 0 <= index < count:
        return _unavailable(f"cuda:{index} does not exist: {count} device(s) visible")
    props = torch.cuda.get_device_properties(index)
    rocm = torch.version.hip is not None
    arch = props.gcnArchName.split(":")[0] if rocm else f"sm_{props.major}{props.minor}"
    reasons: dict[str, str] = {}
    dtypes = ["fp32", "fp16"]
    if rocm or props.major >= 8:
        dtypes.append("bf16")
    else:
        reasons["bf16"] = f"{arch} has no bf16 tensor cores (needs sm_80+)"
    if not rocm and (props.major, props.minor) >= (8, 9):
        dtypes.append("fp8")
    else:
        reasons["fp8"] = f"{arch} has no fp8 support hal uses (needs sm_89+)"
    target, why_not = triton_status("cuda", TRITON_BACKENDS)
    if why_not:
        reasons["triton"] = why_not
    flashinfer = library_version("flashinfer-python")
    kernels = ""
    if rocm:
        reasons["flashinfer"] = "FlashInfer is CUDA-only"
    elif flashinfer is None or importlib.util.find_spec("flashinfer") is None:
        reasons["flashinfer"] = "flashinfer-python is not installed (pip install 'hal-attention[cuda]')"
    else:  # installed is not usable: prebuilt kernels, or nvcc to JIT them, or neither
        from .flashinfer_env import flashinfer_kernels

        kernels, why_not = flashinfer_kernels()
        if why_not:
            reasons["flashinfer"] = why_not
    return DeviceCapability(
        type="cuda",
        available=True,
        collective_backend="nccl",  # RCCL answers to the same name on ROCm
        torch_type="cuda",
        index=index,
        count=count,
        name=props.name,
        vendor="AMD" if rocm else "NVIDIA",
        arch=arch,
        memory_bytes=props.total_memory,
        dtypes=tuple(dtypes),
        graph="cuda_graph",
        triton_target=target,
        libraries={
            "torch": torch.__version__,
            "cuda": torch.version.cuda or "",
            "hip": torch.version.hip or "",
            "triton": library_version("triton") or "",
            "flashinfer": flashinfer or "",
            "flashinfer_kernels": kernels,
        },
        reasons=reasons,
        compute_units=getattr(props, "multi_processor_count", None),
    )


class CudaDevice(Device):
    name = "cuda"
    priority = 100
    plugin_api = 4

    def probe(self, index: int | None = None) -> DeviceCapability:
        return cuda_capability(index)

    def backends(self):
        from hal.devices.triton_backend import TritonBackend

        from .flashinfer_backend import FlashInferBackend

        return [FlashInferBackend, TritonBackend]

    def make_graph(self, capability: DeviceCapability) -> Graph:
        return TorchGraph(torch.cuda, torch.cuda.CUDAGraph)


device = CudaDevice()
