"""Helpers shared by the Triton kernels: interpreter detection, dot dtypes, the logit cap."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


#: True when this process runs Triton kernels through the CPU interpreter
#: (``TRITON_INTERPRET=1`` was set before this module was imported). Decided by what
#: ``triton.jit`` actually produced, so it cannot disagree with how kernels run.
INTERPRETING: bool = type(_probe).__name__ == "InterpretedFunction"

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_config(*dtypes: torch.dtype) -> tuple[tl.dtype, bool]:
    """The operand dtype of ``tl.dot`` for tiles loaded from tensors of ``dtypes``.

    Returns ``(dtype, ieee)``. On a GPU, 16-bit inputs of one dtype are multiplied in
    that dtype (tensor cores, fp32 accumulation); anything else (fp32, mixed dtypes) in
    fp32 with IEEE precision (no TF32). The interpreter always gets fp32: it computes
    bf16 arithmetic on raw bits.
    """
    if not INTERPRETING and len(set(dtypes)) == 1 and dtypes[0] in (torch.float16, torch.bfloat16):
        return _TL_DTYPES[dtypes[0]], False
    return tl.float32, True


def sizing_dtype(*dot_dtypes: tl.dtype) -> str:
    """The dtype name the sizing tables take for dots in ``dot_dtypes``: ``"fp32"`` unless all are one 16-bit type."""
    names = {str(d) for d in dot_dtypes}
    return names.pop() if len(names) == 1 and names <= {"bf16", "fp16"} else "fp32"


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _TL_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


@triton.jit
def dot(a, b, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with operands cast to ``DOT_DTYPE``, accumulated in fp32."""
    if IEEE:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` in fp32, through ``exp`` of a non-positive argument only."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)
