"""The oracle: dense, fp32-accumulated attention over a paged KV cache.

This module *defines* what every backend must compute. It is written to be obviously
right, not fast: one request at a time, everything widened to float32 (float64 when
asked), no tricks.

Semantics shared by every backend (SGLang's conventions):

* Request ``r`` has ``seq_lens[r]`` tokens in total; its query tokens are the last
  ``extend_lens[r]`` of them (decode: 1; extend: the new tokens after a cached prefix
  of ``seq_lens[r] - extend_lens[r]``). Query ``i`` of request ``r`` sits at position
  ``p = prefix + i``.
* Keys/values of request ``r`` are slots ``req_to_token[req_pool_indices[r], :seq_len]``
  of the pool buffers (the new tokens already written).
* Causal: key ``j`` is visible to query ``p`` iff ``j <= p``. Non-causal (encoder or
  cross attention): every key of the request is visible.
* Sliding window ``W >= 0``: additionally ``j >= p - W`` (``W + 1`` keys at most;
  SGLang's ``sliding_window_size`` and FlashInfer's ``window_left``). ``-1`` is off.
* Custom mask (TARGET_VERIFY): a flat bool tensor, for each request row-major
  ``[extend_len, seq_len]`` (True = visible), concatenated over requests; it replaces
  the causal rule. The window still applies on top of it.
* Scores are ``(q . k) * scale``; with ``logit_cap > 0`` they become
  ``logit_cap * tanh(score / logit_cap)`` before the softmax.
* GQA/MQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
* A query with no visible key (possible only with a custom mask) outputs zeros.
* Attention sinks (gpt-oss): ``sinks`` ``[q_heads]`` is a learned logit per query head.
  Each query row's softmax runs over its (capped, masked) scores plus one more column
  holding ``sinks[h]``, which is then dropped: the denominator gains ``exp(sinks[h] - m)``
  with ``m = max(max_j score_j, sinks[h])`` and the weights no longer sum to 1. A row
  with no visible key outputs zeros (all its mass is on the sink).
* fp8 KV cache (``float8_e4m3fn`` / ``float8_e5m2``): a write stores
  ``clamp(x.float() / scale, -finfo.max, finfo.max).to(fp8)`` (saturating, as vLLM's
  ``scaled_fp8_quant``), a read gives ``stored.float() * scale``, with the layer's
  ``k_scale`` for keys and ``v_scale`` for values (None: 1.0). A cache in a model dtype
  ignores the scales. Queries stay in the model dtype.
* MLA (latent attention): the value buffer is a view of the key buffer's first
  ``kv_lora_rank`` columns (the latent); a write stores the key only (latent and rope
  part) and the value is read through the view. Nothing else about it is special: it is
  MQA with ``v_head_dim != head_dim``.
"""

from __future__ import annotations

import torch

__all__ = [
    "paged_attention",
    "attention_mask",
    "write_kv",
    "batch_attention",
    "tolerance",
    "is_fp8",
    "kv_scales",
    "quantize_kv",
    "dequantize_kv",
    "shares_storage",
    "store",
]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an fp8 KV-cache dtype (``float8_e4m3fn``, ``float8_e5m2``): scaled on write and read."""
    return dtype.is_floating_point and dtype.itemsize == 1


def kv_scales(layer) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of ``layer`` as floats (None: 1.0).

    Reads SGLang's ``k_scale_float`` / ``v_scale_float`` where the layer has them (a
    ``RadixAttention``), else ``k_scale`` / ``v_scale`` (hal's ``AttentionLayer``: floats).
    """

    def one(kind: str) -> float:
        value = getattr(layer, f"{kind}_scale_float", None)
        if value is None:
            value = getattr(layer, f"{kind}_scale", None)
        return 1.0 if value is None else float(value)

    return one("k"), one("v")


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: fp8 saturates ``x.float() / scale``; other dtypes cast ``x``."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What a cache entry means, in ``dtype``: ``stored * scale`` for fp8, ``stored`` as is otherwise."""
    out = stored.to(dtype)
    return out * scale if is_fp8(stored.dtype) and scale != 1.0 else out


def shares_storage(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether ``v_buffer`` is a view of ``k_buffer`` (an MLA pool: the value is the key's latent)."""
    return v_buffer.data_ptr() == k_buffer.data_ptr() and v_buffer.shape[-1] <= k_buffer.shape[-1]


def attention_mask(
    prefix_len: int,
    extend_len: int,
    *,
    causal: bool = True,
    sliding_window: int = -1,
    custom_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Visibility of one request: bool ``[extend_len, prefix_len + extend_len]``."""
    seq_len = prefix_len + extend_len
    q_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    if custom_mask is not None:
        mask = custom_mask.reshape(extend_len, seq_len).to(device=device, dtype=torch.bool)
    elif causal:
        mask = k_pos <= q_pos
    else:
        mask = torch.ones(extend_len, seq_len, dtype=torch.bool, device=device)
    if sliding_window >= 0:
        mask = mask & (k_pos >= q_pos - sliding_window)
    return mask


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    scale: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    causal: bool = True,
    custom_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of ragged query tokens over a paged KV cache.

    Args:
        q: ``[num_tokens, q_heads, head_dim]``, the query tokens of all requests in
            order (``num_tokens == extend_lens.sum()``).
        k_buffer: ``[num_slots, kv_heads, head_dim]``, one layer's key pool.
        v_buffer: ``[num_slots, kv_heads, v_head_dim]``, one layer's value pool.
        req_to_token: int32 ``[max_reqs, max_context]``, slot of each token.
        req_pool_indices: ``[batch]``, the row of ``req_to_token`` of each request.
        seq_lens: ``[batch]``, total tokens per request (prefix + new).
        extend_lens: ``[batch]``, query tokens per request.
        custom_mask: flat bool, see the module docstring.
        sinks: ``[q_heads]`` sink logits (any float dtype), or None.
        k_scale, v_scale: dequantisation scales of an fp8 cache (ignored for other dtypes).
        acc_dtype: float32, or float64 for an independent high-precision check.

    Returns:
        ``[num_tokens, q_heads, v_head_dim]`` in ``q.dtype``.
    """
    num_tokens, q_heads, _ = q.shape
    kv_heads = k_buffer.shape[1]
    group = q_heads // kv_heads
    out = torch.zeros(num_tokens, q_heads, v_buffer.shape[-1], dtype=acc_dtype, device=q.device)
    q_start = mask_start = 0
    for r in range(len(seq_lens)):
        seq_len, extend_len = int(seq_lens[r]), int(extend_lens[r])
        prefix_len = seq_len - extend_len
        if extend_len == 0:
            continue
        slots = req_to_token[int(req_pool_indices[r]), :seq_len].long()
        k = dequantize_kv(k_buffer[slots], k_scale, acc_dtype).repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = dequantize_kv(v_buffer[slots], v_scale, acc_dtype).repeat_interleave(group, dim=1)
        qr = q[q_start : q_start + extend_len].to(acc_dtype)  # [E, Hq, D]
        scores = torch.einsum("ehd,shd->hes", qr, k) * scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        request_mask = None
        if custom_mask is not None:
            request_mask = custom_mask[mask_start : mask_start + extend_len * seq_len]
            mask_start += extend_len * seq_len
        mask = attention_mask(
            prefix_len,
            extend_len,
            causal=causal,
            sliding_window=sliding_window,
            custom_mask=request_mask,
            device=q.device,
        )
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        else:  # one more column per row, the head's sink logit, dropped after the softmax
            sink = sinks.to(acc_dtype)[:, None, None].expand(q_heads, extend_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[q_start : q_start + extend_len] = torch.einsum("hes,shd->ehd", probs, v)
        q_start += extend_len
    return out.to(q.dtype)


def write_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` (``[n, kv_heads, dim]``) at slots ``loc`` (``[n]``) as the pool stores them
    (:func:`quantize_kv`). An MLA pool (``v_buffer`` a view of ``k_buffer``) stores the key only:
    ``v`` (its latent) may be None and is not written."""
    store(k_buffer, loc, quantize_kv(k, k_buffer.dtype, k_scale))
    if not shares_storage(k_buffer, v_buffer):
        store(v_buffer, loc, quantize_kv(v, v_buffer.dtype, v_scale))


def store(buffer: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[loc] = values`` (already in ``buffer.dtype``); fp8 as bytes, as SGLang's pools do: some devices and
    torch versions have no fp8 index_put."""
    if is_fp8(buffer.dtype):
        buffer.view(torch.uint8)[loc.long()] = values.view(torch.uint8)
    else:
        buffer[loc.long()] = values


def batch_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer,
    batch,
    *,
    sinks: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What ``layer`` outputs for ``batch``: ``[T, q_heads * v_head_dim]`` in ``q.dtype``.

    ``batch`` is any object with SGLang's forward-batch fields (``forward_mode``,
    ``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``, ``spec_info``,
    ``req_to_token_pool``); ``layer`` any object with RadixAttention's fields. ``q`` is
    ``[T, q_heads * head_dim]`` or ``[T, q_heads, head_dim]``; ``k_buffer``/``v_buffer`` are
    the layer's pool buffers with the batch's new tokens already written (an fp8 cache is
    read with the layer's ``k_scale`` / ``v_scale``); ``sinks``: ``[q_heads]``. Lengths are read
    from the device tensors: this is the oracle, not a hot path.
    """
    mode, seq_lens = batch.forward_mode, batch.seq_lens.long().cpu()
    custom_mask = None
    if mode.is_decode():
        kv_lens, q_lens = seq_lens, torch.ones_like(seq_lens)
    elif mode.is_target_verify():
        draft = batch.spec_info.draft_token_num
        kv_lens, q_lens = seq_lens + draft, torch.full_like(seq_lens, draft)
        custom_mask = batch.spec_info.custom_mask
    else:
        kv_lens, q_lens = seq_lens, batch.extend_seq_lens.long().cpu()
    tokens = int(q_lens.sum())
    k_scale, v_scale = kv_scales(layer)
    out = paged_attention(
        q.reshape(tokens, layer.tp_q_head_num, layer.head_dim),
        k_buffer,
        v_buffer,
        batch.req_to_token_pool.req_to_token,
        batch.req_pool_indices,
        kv_lens,
        q_lens,
        scale=layer.scaling,
        logit_cap=layer.logit_cap,
        sliding_window=layer.sliding_window_size,
        causal=not layer.is_cross_attention and getattr(layer, "attn_type", "decoder") == "decoder",
        custom_mask=custom_mask,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        acc_dtype=acc_dtype,
    )
    return out.reshape(tokens, -1)


def tolerance(dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None) -> dict:
    """``torch.testing.assert_close`` tolerances for a backend's output in ``dtype`` against this oracle.

    With an fp8 cache (``kv_cache_dtype``) the oracle reads the very fp8 entries the backend
    reads, so the quantisation error is not in the comparison: the tolerance is the query
    dtype's, loosened for fp32 queries to allow a kernel that dequantises into bf16 / fp16
    (an fp8 value is exact there, its product with the scale rounds to 8 / 11 bits).
    """
    if kv_cache_dtype is not None and is_fp8(kv_cache_dtype) and dtype == torch.float32:
        return {"atol": 1e-2, "rtol": 1e-2}
    return {
        torch.float32: {"atol": 2e-4, "rtol": 1e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
        torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    }[dtype]
