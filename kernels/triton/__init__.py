"""Triton attention kernels over a paged KV cache (CUDA, ROCm; CPU via ``TRITON_INTERPRET=1``).

Semantics are those of :mod:`hal.kernels.reference` (causal rule, sliding window
``p - W <= j <= p``, tanh logit cap on the scaled scores, custom mask for
TARGET_VERIFY, GQA head mapping, zeros for a query with no visible key).

Public functions, all writing into preallocated outputs and free of host
synchronisation, so that they can be captured in a CUDA graph:

* :func:`decode_attention` — one query token per request, split-KV (two kernels).
* :func:`extend_attention` — ragged new tokens over a cached prefix and themselves.
* :func:`write_kv` — store new K/V at pool slots.
* :func:`build_kv_indices` — flatten ``req_to_token`` rows into ``kv_indices``.
* :func:`compute_positions` — positions of the new tokens of each request.
* :func:`is_available` — whether Triton can run here, and why not; never raises.

Conventions:

* Floats: fp32, fp16 or bf16; scores, softmax and accumulation are fp32, results are
  stored in the output's dtype. On a GPU, 16-bit inputs meet in tensor-core dots
  (softmax weights rounded to the value dtype before ``P @ V``, as FlashAttention
  does); fp32 inputs use IEEE fp32 dots (no TF32).
* Indices (indptrs, slots, pool rows, lengths): int32 or int64 tensors on the
  device. Any strides are accepted.
* Interpreter: set ``TRITON_INTERPRET=1`` before this package is first imported (the
  choice is fixed when ``triton.jit`` decorates the kernels); then every kernel runs
  on CPU tensors, slowly (~3 ms per loop step per program).

Importing this package does not import Triton; the kernels are loaded on first use,
so ``is_available`` works where Triton is missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

__all__ = [
    "decode_attention",
    "extend_attention",
    "write_kv",
    "build_kv_indices",
    "compute_positions",
    "is_available",
]

_LAZY = {
    "decode_attention": ".decode",
    "extend_attention": ".extend",
    "write_kv": ".kv_cache",
    "build_kv_indices": ".kv_cache",
    "compute_positions": ".kv_cache",
}

if TYPE_CHECKING:
    from .decode import decode_attention
    from .extend import extend_attention
    from .kv_cache import build_kv_indices, compute_positions, write_kv


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _interpret_requested() -> bool:
    common = sys.modules.get(__name__ + "._common")
    if common is not None:  # the kernels exist already: what matters is how they were built
        return bool(common.INTERPRETING)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def is_available() -> tuple[bool, str]:
    """Whether these kernels can run in this process, with the reason.

    Returns ``(True, "<backend> target ...")`` when Triton imports and has an active
    driver target (``triton.runtime.driver.active.get_current_target()``), or
    ``(True, "interpreter ...")`` when ``TRITON_INTERPRET=1`` (kernels run on CPU
    tensors). Otherwise ``(False, reason)``. Never raises; initialises at most the
    driver Triton itself would pick.
    """
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton does not import: {type(exc).__name__}: {exc}"
    version = getattr(triton, "__version__", "?")
    if _interpret_requested():
        return True, f"interpreter (TRITON_INTERPRET=1, triton {version}): kernels run on CPU tensors"
    try:
        target = triton.runtime.driver.active.get_current_target()
    except Exception as exc:
        return False, f"triton {version} has no active driver target: {type(exc).__name__}: {exc}"
    if target is None:
        return False, f"triton {version} reports no current target"
    backend = getattr(target, "backend", "?")
    arch = getattr(target, "arch", "?")
    return True, f"{backend} target (arch {arch}, triton {version})"
