"""The CPU emulation of torch_npu as the ascend backend calls it: each op one opaque launch, as the emulated chip."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hal.capability import DeviceCapability
from hal.errors import DeviceUnavailableError
from hal.kernels import npu as npu_ops
from hal.kernels import opaque_kernel

__all__ = ["_EmulatedOps", "_ops_for", "_op_dtype", "_owned"]


class _EmulatedOps:
    """:data:`hal.kernels.npu.emulation.torch_npu`, each op launched as one opaque kernel.

    Attributes are looked up on the emulation at call time, so patching
    ``emulation.torch_npu.<op>`` (tests counting calls) is seen.
    """

    is_emulation = True
    __name__ = "hal.kernels.npu.emulation.torch_npu (opaque launches)"

    def __init__(self, generation: str = "A2"):
        self.generation = generation  # the chip whose op availability and layouts the emulation enforces

    def __getattr__(self, name: str) -> Any:
        target = getattr(npu_ops.emulation.torch_npu, name)
        if not callable(target):
            return target

        @functools.wraps(target)
        def launch(*args, **kwargs):
            with opaque_kernel(), npu_ops.emulation.chip(self.generation):
                result = target(*args, **kwargs)
            return _owned(result) if name in _RETURN_OUTPUTS else result

        return launch


# ops that return new tensors (no out= argument)
_RETURN_OUTPUTS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_format_cast")


def _owned(result: Any) -> Any:
    """``result``'s tensors moved into tensors allocated in view of the caller's graph guard, as a real op's
    outputs come from the graph's memory pool: the opaque launch's own allocations are invisible to the guard,
    which would take a later read of them for a stale external tensor."""
    if isinstance(result, tuple):
        return tuple(_owned(x) for x in result)
    if not isinstance(result, torch.Tensor):
        return result
    owned = torch.empty(result.shape, dtype=result.dtype, device=result.device)
    with opaque_kernel():
        owned.copy_(result)
    if hasattr(result, "_hal_npu_format"):  # the emulated FRACTAL_NZ tag travels with the data
        owned._hal_npu_format = result._hal_npu_format
    return owned


def _ops_for(capability: DeviceCapability) -> Any:
    if capability.emulated:
        return _EmulatedOps(npu_ops.generation_of_arch(capability.arch) or "A2")
    module, why = npu_ops.load_torch_npu()
    if module is None:
        raise DeviceUnavailableError(f"the ascend backend needs torch_npu on a real NPU: {why}")
    why = npu_ops.load_atb()
    if why:
        raise DeviceUnavailableError(f"the ascend backend needs torch_npu's ATB ops: {why}")
    return module


def _op_dtype(dtype: torch.dtype, capability: DeviceCapability) -> torch.dtype:
    """The dtype whose op limits apply: the emulation computes fp32 where the real ops take bf16 (fp16 on 310P)."""
    if capability.emulated and dtype == torch.float32:
        return torch.float16 if npu_ops.generation_of_arch(capability.arch) == "310P" else torch.bfloat16
    return dtype
