"""Paged decode attention with split-KV (flash-decoding), one query token per request.

Stage 1 (grid ``(batch, kv_heads * head_blocks, num_kv_splits)``): one program takes a
block of ``BLOCK_H`` query heads that share one KV head (the GQA group, cut into
``head_blocks`` blocks of at most ``BLOCK_H`` rows, padded to at least 16 so that
``tl.dot`` maps onto tensor cores) and one contiguous share of the request's KV tokens.
Each KV tile is therefore read once per head block rather than once per query head. It
writes the share's normalised partial output and its natural-log LSE.

Stage 2 (grid ``(batch, q_heads)``): merges the splits of one (request, head), weighting
each split by ``exp(lse_s - max lse)``, one split's row at a time.

An attention sink joins the denominator in stage 2, once per row (``exp(sink - m)``, ``m``
the max over the splits' LSEs and the sink). A head dim that is not a power of two is tiled
as a main part and a rest (576, MLA's latent 512 + rope 64: 512 + 64 lanes). An fp8 pool is
read as bytes, decoded and scaled (``_common.load_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRETING,
    check_float,
    check_kv,
    check_sinks,
    dot,
    dot_config,
    kv_format,
    kv_storage,
    load_kv,
    score_tile,
    sizing_dtype,
    soft_cap,
    split_head_dim,
)
from .sizing import decode_blocks

__all__ = ["decode_attention"]


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    logit_cap,
    k_scale,
    v_scale,
    num_kv_splits,
    head_dim,
    v_head_dim,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    QK_IEEE: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    PV_IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    kv_len = (tl.load(kv_indptr_ptr + b + 1) - kv_start).to(tl.int32)
    split_len = tl.cdiv(kv_len, num_kv_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    head = (kv_head * GROUP + offs_h).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < v_head_dim

    # Padded head rows load zeros: their scores stay finite and they are never stored.
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)
    if BLOCK_DPE > 0:  # the rest of the head dim (MLA: the rope part)
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < head_dim
        q_pe = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_dpe[None, :] * stride_qd,
            mask=mask_h[:, None] & mask_dpe[None, :],
            other=0.0,
        ).to(tl.float32)
    else:
        offs_dpe, mask_dpe, q_pe = offs_d, mask_d, q  # unused

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    # Every tile holds at least one valid token, so the running max is finite after it.
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slot = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_row = k_buf_ptr + slot[None, :] * stride_ks + kv_head * stride_kh
        s = score_tile(
            q, q_pe, k_row, stride_kd, offs_d, mask_d, offs_dpe, mask_dpe, mask_n, k_scale,
            BLOCK_DPE, KV_FP8, QK_DTYPE, QK_IEEE,
        )  # fmt: skip
        s = s * scale  # [BLOCK_H, BLOCK_N]
        if USE_CAP:
            s = soft_cap(s, logit_cap)
        s = tl.where(mask_n[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(
            v_buf_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :] * stride_vd,
            mask_n[:, None] & mask_dv[None, :],
            KV_FP8,
            v_scale,
        )
        acc = acc * alpha[:, None] + dot(p, v, PV_DTYPE, PV_IEEE)
        m_i = m_new

    # An empty split (hi <= lo) leaves l_i == 0: it stores zeros and lse = -inf.
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))

    part = b * stride_pb + head * stride_ph + split * stride_ps
    tl.store(
        part_out_ptr + part[:, None] + offs_dv[None, :] * stride_pd,
        out,
        mask=mask_h[:, None] & mask_dv[None, :],
    )
    tl.store(part_lse_ptr + b * stride_lb + head * stride_lh + split * stride_ls, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    num_kv_splits,
    v_head_dim,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    stride_od,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_kv_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < v_head_dim

    lse_row = part_lse_ptr + b * stride_lb + h * stride_lh
    lse = tl.load(lse_row + offs_s * stride_ls, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no token at all: every weight is exp(-inf) = 0
    denom = tl.sum(tl.exp(lse - m), 0)
    if HAS_SINKS:  # the sink's column of the softmax, dropped from the output: only the denominator
        denom += tl.exp(sink - m)
    # one split's row at a time: a [splits, v_head_dim] tile would not fit in registers at MLA's 512
    out = tl.zeros([BLOCK_DV], dtype=tl.float32)
    part_row = part_out_ptr + b * stride_pb + h * stride_ph + offs_dv * stride_pd
    for s in range(0, num_kv_splits):
        w = tl.exp(tl.load(lse_row + s * stride_ls) - m)
        out += w * tl.load(part_row + s * stride_ps, mask=mask_dv, other=0.0)
    out = out / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_dv * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_dv,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    scale: float,
    logit_cap: float = 0.0,
    num_kv_splits: int,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    block_n: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    arch: str | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per request over a paged KV cache.

    Request ``b`` attends to the KV slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, in
    order, with no further masking (a sliding window is applied by the caller, who
    passes only the windowed slots). Query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)``. Scores are ``(q . k) * scale``, then
    ``logit_cap * tanh(score / logit_cap)`` when ``logit_cap > 0``. With ``sinks``, each
    head's softmax runs over its scores and ``sinks[h]``, whose column is then dropped. A
    request with no slot gets a zero output. An fp8 pool (``float8_e4m3fn`` / ``float8_e5m2``)
    is read as ``stored * k_scale`` (keys) / ``stored * v_scale`` (values); MLA's pool passes
    the value buffer as a view of the key buffer's latent columns.

    The launch is CUDA-graph safe: no host synchronisation, no allocation, grid sizes
    from shapes and ``num_kv_splits`` only.

    Args:
        q: ``[batch, q_heads, head_dim]``, fp32/fp16/bf16.
        k_buffer: ``[num_slots, kv_heads, head_dim]``, the key pool (a float dtype above or fp8).
        v_buffer: ``[num_slots, kv_heads, v_head_dim]``, the value pool, same dtype.
        out: ``[batch, q_heads, v_head_dim]``, written in its own dtype, any strides (an engine's padded rows).
        kv_indptr: int32/int64 ``[batch + 1]``, offsets into ``kv_indices``.
        kv_indices: int32/int64 ``[>= kv_indptr[-1]]``, pool slots of the keys.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        logit_cap: tanh soft cap of the scaled scores; ``0`` disables it.
        num_kv_splits: how many shares each request's tokens are cut into
            (``ceil(len / num_kv_splits)`` tokens each; trailing shares may be empty).
        partial_out: fp32 ``[batch, q_heads, >= num_kv_splits, v_head_dim]``, scratch:
            each share's normalised output.
        partial_lse: fp32 ``[batch, q_heads, >= num_kv_splits]``, scratch: each share's
            natural-log sum of exp of its scores (``-inf`` for an empty share).
        block_n: tokens per stage-1 tile (power of two >= 16); ``None`` for the default.
        sinks: ``[q_heads]`` float sink logits (gpt-oss), or None.
        k_scale, v_scale: dequantisation scales of an fp8 pool (ignored for other dtypes).
        arch: the GPU's architecture (``sm_90``...): picks the default tiles (``sizing.decode_blocks``).

    Returns:
        ``out``.
    """
    batch, q_heads, head_dim = q.shape
    num_slots, kv_heads, k_dim = k_buffer.shape
    v_head_dim = v_buffer.shape[-1]
    if k_dim != head_dim or v_buffer.shape[:2] != (num_slots, kv_heads):
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)}/v_buffer {tuple(v_buffer.shape)} do not match q")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if out.shape != (batch, q_heads, v_head_dim):
        raise ValueError(f"out must be {(batch, q_heads, v_head_dim)}, got {tuple(out.shape)}")
    if kv_indptr.shape[0] != batch + 1:
        raise ValueError(f"kv_indptr must have batch + 1 = {batch + 1} entries, got {kv_indptr.shape[0]}")
    if num_kv_splits < 1:
        raise ValueError("num_kv_splits must be >= 1")
    if partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise TypeError("partial_out and partial_lse must be float32")
    if (
        partial_out.shape[:2] != (batch, q_heads)
        or partial_out.shape[2] < num_kv_splits
        or partial_out.shape[3] != v_head_dim
        or partial_lse.shape[:2] != (batch, q_heads)
        or partial_lse.shape[2] < num_kv_splits
    ):
        raise ValueError(
            f"partial_out {tuple(partial_out.shape)} / partial_lse {tuple(partial_lse.shape)} must be "
            f"[{batch}, {q_heads}, >={num_kv_splits}, {v_head_dim}] / [{batch}, {q_heads}, >={num_kv_splits}]"
        )
    for name, t in (("q", q), ("out", out)):
        check_float(name, t)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_kv(name, t)
    if k_buffer.dtype != v_buffer.dtype:
        raise TypeError(f"k_buffer and v_buffer must share a dtype, got {k_buffer.dtype} / {v_buffer.dtype}")
    check_sinks(sinks, q_heads)
    if batch == 0:
        return out

    group = q_heads // kv_heads
    block_d, block_dpe = split_head_dim(head_dim)
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    fp8 = kv_format(k_buffer)
    # an fp8 pool is dequantised into the query's dtype for the dots (fp8 values are exact there)
    qk_dtype, qk_ieee = dot_config(q.dtype) if fp8 else dot_config(q.dtype, k_buffer.dtype)
    pv_dtype, pv_ieee = dot_config(q.dtype if fp8 else v_buffer.dtype)
    block_h, default_n, num_warps, num_stages = decode_blocks(
        arch, max(block_d, block_dv), sizing_dtype(qk_dtype, pv_dtype), group
    )
    block_n = block_n or default_n
    head_blocks = triton.cdiv(group, block_h)
    launch = {} if INTERPRETING else {"num_warps": num_warps, "num_stages": num_stages}
    _decode_split_kernel[(batch, kv_heads * head_blocks, num_kv_splits)](
        q,
        kv_storage(k_buffer),
        kv_storage(v_buffer),
        kv_indptr,
        kv_indices,
        partial_out,
        partial_lse,
        float(scale),
        float(logit_cap),
        float(k_scale),
        float(v_scale),
        num_kv_splits,
        head_dim,
        v_head_dim,
        *q.stride(),
        *k_buffer.stride(),
        *v_buffer.stride(),
        *partial_out.stride(),
        *partial_lse.stride(),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        USE_CAP=logit_cap > 0,
        KV_FP8=fp8,
        QK_DTYPE=qk_dtype,
        QK_IEEE=qk_ieee,
        PV_DTYPE=pv_dtype,
        PV_IEEE=pv_ieee,
        **launch,
    )
    _decode_merge_kernel[(batch, q_heads)](
        partial_out,
        partial_lse,
        out,
        partial_lse if sinks is None else sinks,  # never read without sinks
        num_kv_splits,
        v_head_dim,
        *partial_out.stride(),
        *partial_lse.stride(),
        *out.stride(),
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_DV=block_dv,
        HAS_SINKS=sinks is not None,
        **({} if INTERPRETING else {"num_warps": 4}),
    )
    return out
