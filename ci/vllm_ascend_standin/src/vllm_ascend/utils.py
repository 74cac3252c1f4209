"""STAND-IN of ``vllm_ascend/utils.py``: the chip generation (from ``VLLM_ASCEND_STANDIN``; upstream reads the SoC
version through torch_npu) and the FRACTAL_NZ allocation its 310P runner makes."""

import os

import torch

ACL_FORMAT_FRACTAL_NZ = 29  # upstream utils.py, torch_npu's ACL format id


def is_310p() -> bool:
    """Whether the stand-in reports an Atlas 300I (Ascend 310P): ``VLLM_ASCEND_STANDIN=310P``."""
    return os.environ.get("VLLM_ASCEND_STANDIN", "").strip().upper() == "310P"


def empty_with_format(size, dtype, device, acl_format: int) -> torch.Tensor:
    """``torch_npu.empty_with_format``: torch_npu's where it is installed, else over hal's NPU emulation (the chip's
    stand-in on the CPU): a zeroed tensor cast to ``acl_format`` by its ``npu_format_cast``."""
    try:
        import torch_npu
    except ImportError:
        from hal.kernels.npu.emulation import torch_npu

        return torch_npu.npu_format_cast(torch.zeros(size, dtype=dtype, device=device), acl_format)
    return torch_npu.empty_with_format(size=size, dtype=dtype, device=device, acl_format=acl_format)
