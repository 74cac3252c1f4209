"""Helpers shared by the Triton kernels: interpreter detection, dot dtypes, the logit cap."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hal.kernels.kv_dtypes import find_kv_dtype, kv_scaled


@triton.jit
def _probe():
    pass


#: True when this process runs Triton kernels through the CPU interpreter
#: (``TRITON_INTERPRET=1`` was set before this module was imported). Decided by what
#: ``triton.jit`` actually produced, so it cannot disagree with how kernels run.
INTERPRETING: bool = type(_probe).__name__ == "InterpretedFunction"


def device_function(fn):
    """``triton.jit`` for a function the kernels call (never launched itself).

    Compiled, it is ``triton.jit(fn)``. Under the interpreter, Triton re-patches ``triton.language`` at every
    call of a jitted device function (``InterpretedFunction.__call__``: a few ms a call, the largest part of an
    interpreted step); the launching kernel has patched it for its whole grid already, so the interpreted body
    (Triton's own rewrite of ``fn``) is called directly."""
    jitted = triton.jit(fn)
    if not INTERPRETING:
        return jitted

    @functools.wraps(fn)
    def interpreted(*args, **kwargs):
        return jitted.rewrite()(*args, **kwargs)

    return interpreted


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


@device_function
def dot(a, b, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with operands cast to ``DOT_DTYPE``, accumulated in fp32."""
    if IEEE:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@device_function
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` in fp32, through ``exp`` of a non-positive argument only."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


# -- KV cache formats: fp8 as raw bytes --------------------------------------------------------------
# An fp8 pool reaches the kernels as its uint8 view and is decoded / encoded by bit manipulation
# below, so one code path is exact on every GPU and under the interpreter: Triton converts fp8e4nv
# in hardware only on sm_89+, and the interpreter (triton 3.7) flushes fp8 subnormals to zero on
# fp32 -> fp8. The pool's fp8 dtype is a constexpr of each kernel (``KV_FP8``): 0 none, 1 e4m3fn, 2 e5m2.
# Which dtypes are scaled is the KV-dtype table's (hal.kernels.kv_dtypes); which of those these kernels
# decode is theirs: the scaled rows they serve, by name.

KV_PLAIN, KV_E4M3, KV_E5M2 = 0, 1, 2
_SCALED_FORMATS = {"fp8_e4m3": KV_E4M3, "fp8_e5m2": KV_E5M2}


def kv_format(buffer: torch.Tensor) -> int:
    """The ``KV_FP8`` constexpr of a pool buffer: :data:`KV_E4M3`, :data:`KV_E5M2` or :data:`KV_PLAIN`
    (``ValueError`` for a scaled KV dtype these kernels do not decode)."""
    row = find_kv_dtype(buffer.dtype)
    if row is None or not row.scaled:
        return KV_PLAIN
    if row.name not in _SCALED_FORMATS:
        raise ValueError(f"KV cache dtype {row.name}: the Triton kernels decode {sorted(_SCALED_FORMATS)} only")
    return _SCALED_FORMATS[row.name]


def kv_storage(buffer: torch.Tensor) -> torch.Tensor:
    """What a kernel is handed for a pool buffer: a scaled (fp8) one as its bytes (a uint8 view, same strides)."""
    return buffer.view(torch.uint8) if kv_scaled(buffer.dtype) else buffer


def check_sinks(sinks: torch.Tensor | None, q_heads: int) -> None:
    """Sinks are None or a contiguous float ``[q_heads]`` tensor (one logit per query head)."""
    if sinks is not None and (
        tuple(sinks.shape) != (q_heads,) or not sinks.is_floating_point() or sinks.stride(0) != 1
    ):
        raise ValueError(f"sinks must be a contiguous float [{q_heads}] tensor, got {sinks.dtype}{list(sinks.shape)}")


def check_kv(name: str, t: torch.Tensor) -> None:
    if not kv_scaled(t.dtype):
        check_float(name, t)


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DPE)``: a head dim as a power-of-two main tile plus a power-of-two rest tile
    (0: none), so 576 (MLA: latent 512 + rope 64) costs 512 + 64 lanes, not 1024; 80 -> 64 + 16."""
    main = max(16, 1 << (max(head_dim, 1).bit_length() - 1))
    rest = head_dim - main
    return main, 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))


@device_function
def fp8_to_f32(bits, KV_FP8: tl.constexpr):
    """fp8 bytes (any int tile) -> their exact fp32 values (subnormals, signed zeros, NaN; e5m2's inf)."""
    b = bits.to(tl.int32) & 0xFF
    mag = b & 0x7F
    if KV_FP8 == 1:  # e4m3fn: bias 7, 3 mantissa bits, 0x7F is NaN, no inf
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        v = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        v = tl.where(mag == 0x7F, float("nan"), v)
    else:  # e5m2: bias 15, 2 mantissa bits, 0x7C is inf, above it NaN
        normal = ((mag << 21) + (112 << 23)).to(tl.float32, bitcast=True)
        v = tl.where(mag < 4, mag.to(tl.float32) * 0.0000152587890625, normal)  # subnormal: m * 2^-16
        v = tl.where(mag >= 0x7C, tl.where(mag == 0x7C, float("inf"), float("nan")), v)
    return (v.to(tl.int32, bitcast=True) | ((b >> 7) << 31)).to(tl.float32, bitcast=True)


@device_function
def f32_to_fp8(x, KV_FP8: tl.constexpr):
    """fp32 -> fp8 bytes (uint8), saturating at the format's largest finite value, rounding to nearest
    even: torch's ``x.clamp(-max, max).to(float8_*)``."""
    if KV_FP8 == 1:
        LIMIT: tl.constexpr = 448.0
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        SUB_STEPS: tl.constexpr = 512.0  # 1 / 2^-9, the subnormal step
        SHIFT: tl.constexpr = 20  # 23 - 3 mantissa bits
        REBIAS: tl.constexpr = 960  # (127 - 7) << 3
    else:
        LIMIT: tl.constexpr = 57344.0
        MIN_NORMAL: tl.constexpr = 0.00006103515625  # 2^-14
        SUB_STEPS: tl.constexpr = 65536.0  # 1 / 2^-16
        SHIFT: tl.constexpr = 21  # 23 - 2
        REBIAS: tl.constexpr = 448  # (127 - 15) << 2
    u = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), LIMIT)
    # subnormals: a * SUB_STEPS < 2^23, rounded to an integer (ties to even) by adding and removing 2^23
    sub = ((tl.minimum(a, MIN_NORMAL) * SUB_STEPS + 8388608.0) - 8388608.0).to(tl.int32)
    ua = a.to(tl.int32, bitcast=True)
    normal = ((ua + ((1 << (SHIFT - 1)) - 1) + ((ua >> SHIFT) & 1)) >> SHIFT) - REBIAS
    bits = tl.where(a < MIN_NORMAL, sub, normal)
    bits = tl.where(x != x, 0x7F, bits) | (((u >> 31) & 1) << 7)
    return bits.to(tl.uint8)


@device_function
def load_kv(ptrs, mask, KV_FP8: tl.constexpr, scale):
    """A tile of a KV pool as fp32: a plain pool as is, an fp8 one (bytes) decoded and times ``scale``."""
    if KV_FP8 == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        return fp8_to_f32(tl.load(ptrs, mask=mask, other=0), KV_FP8) * scale


@device_function
def score_tile(
    q,
    q_pe,
    k_row,
    stride_d,
    offs_d,
    mask_d,
    offs_dpe,
    mask_dpe,
    mask_n,
    k_scale,
    BLOCK_DPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    QK_IEEE: tl.constexpr,
):
    """``q @ k^T`` (unscaled) of query rows ``q`` [M, BLOCK_D] (and ``q_pe`` [M, BLOCK_DPE], the rest of
    the head dim) against the keys whose row pointers are ``k_row`` [1, N]: fp32 [M, N]."""
    k = load_kv(k_row + offs_d[:, None] * stride_d, mask_d[:, None] & mask_n[None, :], KV_FP8, k_scale)
    s = dot(q, k, QK_DTYPE, QK_IEEE)
    if BLOCK_DPE > 0:
        k_pe = load_kv(k_row + offs_dpe[:, None] * stride_d, mask_dpe[:, None] & mask_n[None, :], KV_FP8, k_scale)
        s += dot(q_pe, k_pe, QK_DTYPE, QK_IEEE)
    return s
