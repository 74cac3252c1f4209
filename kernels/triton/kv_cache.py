"""Small KV-cache kernels: store new K/V, build the flat slot list, compute positions.

All three are CUDA-graph safe: grids depend on shapes only, loops run to bounds read on
the device, and nothing is synchronised or allocated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_kv, device_function, f32_to_fp8, kv_format, kv_storage
from .sizing import write_kv_heads

__all__ = ["write_kv", "build_kv_indices", "compute_positions"]

_BLOCK = 512  # elements per loop step of the index kernels


@triton.jit
def _write_kv_kernel(
    k_buf_ptr,
    v_buf_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    k_scale,
    v_scale,
    kv_heads,
    head_dim,
    v_head_dim,
    stride_kbs,
    stride_kbh,
    stride_kbd,
    stride_vbs,
    stride_vbh,
    stride_vbd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr,
    WRITE_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < kv_heads) & (slot >= 0)  # a negative slot (-1, a padding token) writes nothing

    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_h[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    dst = k_buf_ptr + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :] * stride_kbd
    tl.store(dst, _stored(k, k_buf_ptr, KV_FP8, k_scale), mask=mask)

    if WRITE_V:
        offs_dv = tl.arange(0, BLOCK_DV)
        mask = mask_h[:, None] & (offs_dv < v_head_dim)[None, :]
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :] * stride_vd, mask=mask)
        dst = v_buf_ptr + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_dv[None, :] * stride_vbd
        tl.store(dst, _stored(v, v_buf_ptr, KV_FP8, v_scale), mask=mask)


@device_function
def _stored(x, buf_ptr, KV_FP8: tl.constexpr, scale):
    """``x`` as the pool stores it: fp8 bytes of ``x / scale`` (saturating), else ``x`` in the pool's dtype."""
    if KV_FP8 == 0:
        return x.to(tl.float32).to(buf_ptr.dtype.element_ty)
    else:
        return f32_to_fp8(x.to(tl.float32) / scale, KV_FP8)


def write_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new keys and values in the pool: ``k_buffer[loc[i]] = k[i]``, same for ``v``
    (``hal.kernels.reference.write_kv``'s semantics and signature).

    A float pool stores the values cast to its dtype (through fp32). An fp8 pool
    (``float8_e4m3fn`` / ``float8_e5m2``) stores ``clamp(k / k_scale, -max, max)`` rounded
    to nearest even (``v`` with ``v_scale``), exactly as torch's cast. An MLA pool
    (``v_buffer`` a view of ``k_buffer``'s first columns) stores the key only; ``v`` may then
    be None. Slots in ``loc`` must be distinct (a repeated slot gets one of the writes,
    unspecified which); a negative slot (-1, a padding token) writes nothing, as vLLM's
    ``reshape_and_cache`` skips ``PAD_SLOT_ID``.

    Args:
        k_buffer: ``[num_slots, kv_heads, head_dim]``, fp32/fp16/bf16 or fp8, written in place.
        v_buffer: ``[num_slots, kv_heads, v_head_dim]``, same dtype, written in place.
        loc: int32/int64 ``[n]``, destination slots (-1: skip the row).
        k: ``[n, kv_heads, head_dim]``, fp32/fp16/bf16.
        v: ``[n, kv_heads, v_head_dim]`` (None for an MLA pool).
        k_scale, v_scale: quantisation scales of an fp8 pool (ignored for other dtypes).
    """
    n = loc.shape[0]
    _, kv_heads, head_dim = k_buffer.shape
    v_head_dim = v_buffer.shape[-1]
    write_v = not (v_buffer.data_ptr() == k_buffer.data_ptr() and v_head_dim <= head_dim)  # MLA: v is k's latent
    bad_v = v.shape != (n, kv_heads, v_head_dim) if v is not None else write_v
    if k.shape != (n, kv_heads, head_dim) or bad_v:
        raise ValueError(
            f"k {tuple(k.shape)} / v {None if v is None else tuple(v.shape)} must be [{n}, {kv_heads}, {head_dim}] / "
            f"[{n}, {kv_heads}, {v_head_dim}]"
        )
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_kv(name, t)
    check_float("k", k)
    if write_v:
        check_float("v", v)
    if n == 0:
        return
    v = v if write_v else k  # never read
    block_h = write_kv_heads(kv_heads, max(triton.next_power_of_2(head_dim), triton.next_power_of_2(v_head_dim)))
    _write_kv_kernel[(n, triton.cdiv(kv_heads, block_h))](
        kv_storage(k_buffer),
        kv_storage(v_buffer),
        loc,
        k,
        v,
        float(k_scale),
        float(v_scale),
        kv_heads,
        head_dim,
        v_head_dim,
        *k_buffer.stride(),
        *v_buffer.stride(),
        *k.stride(),
        *v.stride(),
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        KV_FP8=kv_format(k_buffer),
        WRITE_V=write_v,
    )


@triton.jit
def _build_kv_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    kv_start_ptr,
    kv_end_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    stride_req,
    stride_tok,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    start = 0
    if HAS_START:
        start = tl.load(kv_start_ptr + b).to(tl.int64)
    length = tl.load(kv_end_ptr + b).to(tl.int64) - start
    dst = tl.load(kv_indptr_ptr + b).to(tl.int64)
    src = req_to_token_ptr + row * stride_req
    for i in range(0, length, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(src + (start + offs) * stride_tok, mask=mask)
        tl.store(kv_indices_ptr + dst + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_start: torch.Tensor | None,
    kv_end: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> torch.Tensor:
    """Flatten each request's token slots into one list.

    For request ``b`` with ``row = req_pool_indices[b]``, writes
    ``req_to_token[row, kv_start[b]:kv_end[b]]`` to
    ``kv_indices[kv_indptr[b] : kv_indptr[b] + kv_end[b] - kv_start[b]]``. The caller
    computes ``kv_indptr`` (e.g. a ``cumsum`` of the lengths) and sizes ``kv_indices``;
    nothing else of ``kv_indices`` is written.

    Args:
        req_to_token: int32 ``[max_reqs, max_context]`` (any strides).
        req_pool_indices: int32/int64 ``[batch]``.
        kv_start: int32/int64 ``[batch]``, first token of each range; ``None`` means 0
            (e.g. a sliding window's first visible token for decode).
        kv_end: int32/int64 ``[batch]``, one past the last token (e.g. ``seq_lens``).
        kv_indptr: int32/int64 ``[>= batch]``, where each request's slots go.
        kv_indices: int32/int64, the output.

    Returns:
        ``kv_indices``.
    """
    batch = req_pool_indices.shape[0]
    if batch == 0:
        return kv_indices
    _build_kv_indices_kernel[(batch,)](
        req_to_token,
        req_pool_indices,
        kv_end if kv_start is None else kv_start,
        kv_end,
        kv_indptr,
        kv_indices,
        *req_to_token.stride(),
        HAS_START=kv_start is not None,
        BLOCK=_BLOCK,
    )
    return kv_indices


@triton.jit
def _positions_kernel(prefix_lens_ptr, seq_lens_ptr, start_loc_ptr, positions_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int64)
    length = tl.load(seq_lens_ptr + b).to(tl.int64)
    dst = tl.load(start_loc_ptr + b).to(tl.int64)
    for i in range(0, length, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(
            positions_ptr + dst + offs,
            (prefix + offs).to(positions_ptr.dtype.element_ty),
            mask=offs < length,
        )


def compute_positions(
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Positions of the new tokens: ``positions[extend_start_loc[b] + i] = extend_prefix_lens[b] + i``.

    For ``i < extend_seq_lens[b]``; other entries of ``positions`` are left alone.

    Args:
        extend_prefix_lens: int32/int64 ``[batch]``, cached tokens before the new ones.
        extend_seq_lens: int32/int64 ``[batch]``, new tokens per request.
        extend_start_loc: int32/int64 ``[batch]``, row of each request's first new token.
        positions: int32/int64 ``[>= num_tokens]``, the output.

    Returns:
        ``positions``.
    """
    batch = extend_seq_lens.shape[0]
    if batch == 0:
        return positions
    _positions_kernel[(batch,)](extend_prefix_lens, extend_seq_lens, extend_start_loc, positions, BLOCK=_BLOCK)
    return positions
