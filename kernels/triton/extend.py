"""Extend (prefill) attention: new query tokens over a cached prefix plus themselves.

One program computes ``BLOCK_M`` query rows of one request and one query head (grid
``(batch, q_heads, cdiv(max_extend_len, BLOCK_M))``) with an online softmax in two
passes: first over the prefix, gathered from the paged pool through ``kv_indices``,
then over the request's new keys, read straight from ``k``/``v``. Tiles that the causal
rule or the sliding window hide entirely are skipped by the loop bounds; the rest is
masked element by element. An attention sink joins each row's denominator after both
passes (``exp(sink - m)``). A head dim that is not a power of two is tiled as a main part
plus a rest (MLA's 576: 512 + 64). An fp8 pool is read as bytes, decoded and scaled, and the
new tokens are then read from the pool too (at ``new_kv_loc``), as stored, so that they
weigh what the cache says they are.
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
    device_function,
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
from .sizing import extend_blocks

__all__ = ["extend_attention"]


@device_function
def _online_softmax_step(s, visible, v, m_i, l_i, acc, PV_DTYPE: tl.constexpr, PV_IEEE: tl.constexpr):
    """Fold one tile of scores ``s`` [M, N] (``visible`` [M, N]) and values ``v`` [N, DV] in.

    Safe for rows that have seen no visible key yet: their max stays ``-inf`` and their
    sums stay zero.
    """
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p, v, PV_DTYPE, PV_IEEE)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    k_buf_ptr,
    v_buf_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    mask_ptr,
    mask_indptr_ptr,
    new_loc_ptr,
    sinks_ptr,
    scale,
    logit_cap,
    k_scale,
    v_scale,
    sliding_window,
    head_dim,
    v_head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kbs,
    stride_kbh,
    stride_kbd,
    stride_vbs,
    stride_vbh,
    stride_vbd,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,  # the causal rule, only when there is no custom mask
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr,
    NEW_FROM_POOL: tl.constexpr,  # the new tokens' K/V read at new_loc from the pool, not from k/v
    HAS_SINKS: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    QK_IEEE: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    PV_IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    kv_head = head // GROUP

    q_start = tl.load(qo_indptr_ptr + r).to(tl.int64)
    extend_len = (tl.load(qo_indptr_ptr + r + 1) - q_start).to(tl.int32)
    if m_start >= extend_len:
        return
    kv_start = tl.load(kv_indptr_ptr + r).to(tl.int64)
    prefix_len = (tl.load(kv_indptr_ptr + r + 1) - kv_start).to(tl.int32)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < v_head_dim
    rows = q_start + offs_m

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)
    if BLOCK_DPE > 0:  # the rest of the head dim (MLA: the rope part)
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < head_dim
        q_pe = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_dpe[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_dpe[None, :],
            other=0.0,
        ).to(tl.float32)
    else:
        offs_dpe, mask_dpe, q_pe = offs_d, mask_d, q  # unused
    if USE_MASK:
        # Row i of request r's mask block starts at mask_indptr[r] + i * seq_len.
        mask_row = tl.load(mask_indptr_ptr + r).to(tl.int64) + offs_m.to(tl.int64) * (prefix_len + extend_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Pass 1: the cached prefix. Every prefix key precedes every new query, so only the
    # custom mask and the window can hide one; the window's left edge for this block's
    # first row bounds the loop.
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + m_start - sliding_window, 0)
    for start in range(lo, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slot = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_row = k_buf_ptr + slot[None, :] * stride_kbs + kv_head * stride_kbh
        s = score_tile(
            q, q_pe, k_row, stride_kbd, offs_d, mask_d, offs_dpe, mask_dpe, mask_n, k_scale,
            BLOCK_DPE, KV_FP8, QK_DTYPE, QK_IEEE,
        )  # fmt: skip
        s = s * scale
        if USE_CAP:
            s = soft_cap(s, logit_cap)
        visible = mask_m[:, None] & mask_n[None, :]
        if USE_MASK:
            bits = tl.load(mask_ptr + mask_row[:, None] + offs_n[None, :], mask=visible, other=0)
            visible = visible & (bits != 0)
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] >= q_pos[:, None] - sliding_window)
        v_row = v_buf_ptr + slot[:, None] * stride_vbs + kv_head * stride_vbh
        v = load_kv(v_row + offs_dv[None, :] * stride_vbd, mask_n[:, None] & mask_dv[None, :], KV_FP8, v_scale)
        m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc, PV_DTYPE, PV_IEEE)

    # Pass 2: the new tokens themselves (extend-relative index j, position prefix_len + j).
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(m_start - sliding_window, 0)
    hi = extend_len
    if CAUSAL:
        hi = tl.minimum(extend_len, m_start + BLOCK_M)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k_rows = q_start + offs_n
        if NEW_FROM_POOL:
            slot = tl.load(new_loc_ptr + k_rows, mask=mask_n, other=0).to(tl.int64)
            k_row = k_buf_ptr + slot[None, :] * stride_kbs + kv_head * stride_kbh
            v_row = v_buf_ptr + slot[:, None] * stride_vbs + kv_head * stride_vbh
            s = score_tile(
                q, q_pe, k_row, stride_kbd, offs_d, mask_d, offs_dpe, mask_dpe, mask_n, k_scale,
                BLOCK_DPE, KV_FP8, QK_DTYPE, QK_IEEE,
            )  # fmt: skip
        else:
            k_row = k_ptr + k_rows[None, :] * stride_kt + kv_head * stride_kh
            v_row = v_ptr + k_rows[:, None] * stride_vt + kv_head * stride_vh
            s = score_tile(
                q, q_pe, k_row, stride_kd, offs_d, mask_d, offs_dpe, mask_dpe, mask_n, 1.0,
                BLOCK_DPE, 0, QK_DTYPE, QK_IEEE,
            )  # fmt: skip
        s = s * scale
        if USE_CAP:
            s = soft_cap(s, logit_cap)
        visible = mask_m[:, None] & mask_n[None, :]
        if USE_MASK:
            bits = tl.load(mask_ptr + mask_row[:, None] + (prefix_len + offs_n)[None, :], mask=visible, other=0)
            visible = visible & (bits != 0)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] - sliding_window)
        mask_v = mask_n[:, None] & mask_dv[None, :]
        if NEW_FROM_POOL:
            v = load_kv(v_row + offs_dv[None, :] * stride_vbd, mask_v, KV_FP8, v_scale)
        else:
            v = load_kv(v_row + offs_dv[None, :] * stride_vd, mask_v, 0, 1.0)
        m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc, PV_DTYPE, PV_IEEE)

    if HAS_SINKS:  # the sink's softmax column, dropped from the output: it only joins the denominator
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp(m_i - m_fin)
        l_i = l_i * alpha + tl.exp(sink - m_fin)
        acc = acc * alpha[:, None]
    # Rows that saw no visible key have acc == 0 (and l_i == 0 without a sink): they store zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    scale: float,
    max_extend_len: int,
    causal: bool = True,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    arch: str | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    new_kv_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ragged new tokens over their cached prefix and over themselves.

    Request ``r`` has ``E = qo_indptr[r+1] - qo_indptr[r]`` new tokens (rows
    ``qo_indptr[r]:qo_indptr[r+1]`` of ``q``/``k``/``v``/``out``) and a cached prefix of
    ``P = kv_indptr[r+1] - kv_indptr[r]`` tokens stored at pool slots
    ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``. New token ``i`` sits at position
    ``P + i``; key ``j`` (prefix ``0..P-1``, then new ``P..P+E-1``) is visible to it iff

    * ``custom_mask`` is given: ``custom_mask[mask_indptr[r] + i * (P + E) + j]`` is set;
      otherwise, when ``causal``: ``j <= P + i``; otherwise always;
    * and, when ``sliding_window >= 0``: ``j >= P + i - sliding_window``.

    Scores are ``(q . k) * scale``, then ``logit_cap * tanh(score / logit_cap)`` when
    ``logit_cap > 0``; query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
    With ``sinks``, each head's softmax also runs over ``sinks[h]``, whose column is then
    dropped. A row with no visible key stores zeros. ``k``/``v`` are only read: writing
    them to the pool is :func:`write_kv`'s job. The launch is CUDA-graph safe.

    An fp8 pool (``float8_e4m3fn`` / ``float8_e5m2``) is read as ``stored * k_scale`` /
    ``stored * v_scale``, the new tokens included: they are read from the pool at
    ``new_kv_loc`` (already written there), not from ``k``/``v``. MLA's pool passes the
    value buffer as a view of the key buffer's latent columns (and ``v`` likewise of ``k``).

    Args:
        q: ``[num_tokens, q_heads, head_dim]``, fp32/fp16/bf16.
        k: ``[num_tokens, kv_heads, head_dim]``, the new keys (None with ``new_kv_loc``).
        v: ``[num_tokens, kv_heads, v_head_dim]``, the new values (None with ``new_kv_loc``).
        out: ``[num_tokens, q_heads, v_head_dim]``, written in its own dtype, any strides (an engine's padded
            rows).
        k_buffer: ``[num_slots, kv_heads, head_dim]``, the key pool holding the prefixes (float or fp8).
        v_buffer: ``[num_slots, kv_heads, v_head_dim]``, the value pool, same dtype.
        qo_indptr: int32/int64 ``[batch + 1]``, row offsets of each request's new tokens.
        kv_indptr: int32/int64 ``[batch + 1]``, offsets of each prefix in ``kv_indices``.
        kv_indices: int32/int64, pool slots of the prefixes, concatenated.
        scale: softmax scale.
        max_extend_len: a host-side upper bound of every ``E``; sizes the grid. Rows of a
            request past it are not computed.
        causal: the causal rule (ignored when ``custom_mask`` is given).
        sliding_window: ``W >= 0`` keeps keys ``P + i - W .. P + i``; ``-1`` is off.
        logit_cap: tanh soft cap; ``0`` disables it.
        custom_mask: flat bool/uint8 (nonzero = visible), per request a row-major
            ``[E, P + E]`` block; replaces the causal rule.
        mask_indptr: int32/int64 ``[batch + 1]`` (at least ``[batch]``), start of each
            request's block in ``custom_mask``. Computed from the indptrs on the device
            when ``None``.
        block_m: query rows per program (power of two >= 16); ``None`` for the default.
        block_n: keys per tile (power of two >= 16); ``None`` for the default.
        arch: the GPU's architecture (``sm_90``...): picks the default tiles (``sizing.extend_blocks``).
        sinks: ``[q_heads]`` float sink logits (gpt-oss), or None.
        k_scale, v_scale: dequantisation scales of an fp8 pool (ignored for other dtypes).
        new_kv_loc: int32/int64 ``[num_tokens]``, the pool slots of the new tokens: read them
            from the pool (required for an fp8 pool; None: from ``k``/``v``).

    Returns:
        ``out``.
    """
    num_tokens, q_heads, head_dim = q.shape
    _, kv_heads, _ = k_buffer.shape
    v_head_dim = v_buffer.shape[-1]
    if k_buffer.shape[1:] != (kv_heads, head_dim) or v_buffer.shape[1:] != (kv_heads, v_head_dim):
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)} do not match q")
    fp8 = kv_format(k_buffer)
    if fp8 and new_kv_loc is None:
        raise ValueError("an fp8 pool needs new_kv_loc: the new tokens are read as stored, from the pool")
    if new_kv_loc is None:
        expected = ((num_tokens, kv_heads, head_dim), (num_tokens, kv_heads, v_head_dim))
        if k is None or v is None or (tuple(k.shape), tuple(v.shape)) != expected:
            raise ValueError(
                f"k {None if k is None else tuple(k.shape)} / v {None if v is None else tuple(v.shape)} must be "
                f"[{num_tokens}, {kv_heads}, {head_dim}] / [{num_tokens}, {kv_heads}, {v_head_dim}]"
            )
    elif new_kv_loc.shape != (num_tokens,):
        raise ValueError(f"new_kv_loc must be [{num_tokens}], got {tuple(new_kv_loc.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if out.shape != (num_tokens, q_heads, v_head_dim):
        raise ValueError(f"out must be {(num_tokens, q_heads, v_head_dim)}, got {tuple(out.shape)}")
    if qo_indptr.shape[0] != kv_indptr.shape[0]:
        raise ValueError("qo_indptr and kv_indptr must both have batch + 1 entries")
    new_kv = () if new_kv_loc is not None else (("k", k), ("v", v))
    for name, t in (("q", q), ("out", out), *new_kv):
        check_float(name, t)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_kv(name, t)
    if k_buffer.dtype != v_buffer.dtype:
        raise TypeError(f"k_buffer and v_buffer must share a dtype, got {k_buffer.dtype} / {v_buffer.dtype}")
    check_sinks(sinks, q_heads)
    if new_kv_loc is not None:  # never read from k/v: any tensor of the right rank stands in
        k = v = out
    batch = qo_indptr.shape[0] - 1
    if batch <= 0 or num_tokens == 0 or max_extend_len <= 0:
        return out

    use_mask = custom_mask is not None
    if use_mask:
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)
        if mask_indptr is None:
            extend_lens = qo_indptr[1:] - qo_indptr[:-1]
            block_sizes = extend_lens * (extend_lens + kv_indptr[1:] - kv_indptr[:-1])
            mask_indptr = torch.nn.functional.pad(torch.cumsum(block_sizes, 0), (1, 0))
    else:
        custom_mask = mask_indptr = qo_indptr  # never read

    block_d, block_dpe = split_head_dim(head_dim)
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    # an fp8 pool is dequantised into the query's dtype for the dots (fp8 values are exact there)
    qk_dtype, qk_ieee = dot_config(q.dtype) if fp8 else dot_config(q.dtype, k.dtype, k_buffer.dtype)
    pv_dtype, pv_ieee = dot_config(q.dtype) if fp8 else dot_config(v.dtype, v_buffer.dtype)
    default_m, default_n, num_warps, num_stages = extend_blocks(
        arch, max(block_d, block_dv), sizing_dtype(qk_dtype, pv_dtype)
    )
    block_m = block_m or default_m
    block_n = block_n or default_n
    launch = {} if INTERPRETING else {"num_warps": num_warps, "num_stages": num_stages}
    grid = (batch, q_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k,
        v,
        out,
        kv_storage(k_buffer),
        kv_storage(v_buffer),
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        mask_indptr,
        qo_indptr if new_kv_loc is None else new_kv_loc,  # never read without it
        qo_indptr if sinks is None else sinks,  # never read without sinks
        float(scale),
        float(logit_cap),
        float(k_scale),
        float(v_scale),
        int(sliding_window),
        head_dim,
        v_head_dim,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *k_buffer.stride(),
        *v_buffer.stride(),
        GROUP=q_heads // kv_heads,
        CAUSAL=bool(causal) and not use_mask,
        USE_WINDOW=sliding_window >= 0,
        USE_CAP=logit_cap > 0,
        USE_MASK=use_mask,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        KV_FP8=fp8,
        NEW_FROM_POOL=new_kv_loc is not None,
        HAS_SINKS=sinks is not None,
        QK_DTYPE=qk_dtype,
        QK_IEEE=qk_ieee,
        PV_DTYPE=pv_dtype,
        PV_IEEE=pv_ieee,
        **launch,
    )
    return out
