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
  Non-causal layers too: the window bounds the past only, keys after the query stay
  visible (as SGLang's triton and FlashInfer backends compute it).
* Custom mask (TARGET_VERIFY): a flat bool tensor, for each request row-major
  ``[extend_len, seq_len]`` (True = visible), concatenated over requests; it replaces
  the causal rule. The window still applies on top of it.
* Scores are ``(q . k) * scale``; with ``logit_cap > 0`` they become
  ``logit_cap * tanh(score / logit_cap)`` before the softmax.
* GQA/MQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
* A query with no visible key (possible only with a custom mask) outputs zeros.
"""

from __future__ import annotations

import torch

__all__ = [
    "paged_attention",
    "attention_mask",
    "write_kv",
    "build_kv_indices",
    "compute_positions",
    "batch_attention",
    "tolerance",
]


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
        k = k_buffer[slots].to(acc_dtype).repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_buffer[slots].to(acc_dtype).repeat_interleave(group, dim=1)
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
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        out[q_start : q_start + extend_len] = torch.einsum("hes,shd->ehd", probs, v)
        q_start += extend_len
    return out.to(q.dtype)


def write_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store ``k``/``v`` (``[n, kv_heads, dim]``) at slots ``loc`` (``[n]``), cast to the pool dtype."""
    k_buffer[loc.long()] = k.to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_start: torch.Tensor | None,
    kv_end: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """``kv_indices[kv_indptr[b]:][: kv_end[b] - kv_start[b]] = req_to_token[req_pool_indices[b],
    kv_start[b] : kv_end[b]]`` for each request ``b`` (``kv_start`` None means 0).

    Graph-recordable (no host sync; every shape comes from the arguments); ``kv_indptr`` may be
    longer than ``B + 1`` (a captured graph's buffer) and entries past the last request's stay.
    """
    width = req_to_token.shape[1]
    pos = torch.arange(width, device=req_to_token.device)
    start = torch.zeros_like(kv_end) if kv_start is None else kv_start
    rows = req_to_token[req_pool_indices.long()]  # [B, width]
    valid = (pos[None, :] >= start[:, None]) & (pos[None, :] < kv_end[:, None])
    target = kv_indptr[: kv_end.numel(), None].long() + pos[None, :] - start[:, None]
    dump = kv_indices.numel()  # invalid entries land in one extra element, dropped below
    target = torch.where(valid, target, torch.full_like(target, dump))
    out = torch.cat([kv_indices, kv_indices.new_zeros(1)])  # entries past kv_indptr[-1] stay as they were
    out.scatter_(0, target.flatten(), rows.flatten().to(kv_indices.dtype))
    kv_indices.copy_(out[:dump])


def compute_positions(
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """``positions[extend_start_loc[b] + i] = extend_prefix_lens[b] + i`` for ``i < extend_seq_lens[b]``."""
    tokens = torch.arange(positions.numel(), device=positions.device)
    req = torch.searchsorted(extend_start_loc.long(), tokens, right=True) - 1
    pos = extend_prefix_lens.long()[req] + tokens - extend_start_loc.long()[req]
    positions.copy_(pos.to(positions.dtype))


def batch_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer,
    batch,
    *,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What ``layer`` outputs for ``batch``: ``[T, q_heads * v_head_dim]`` in ``q.dtype``.

    ``batch`` is any object with SGLang's forward-batch fields (``forward_mode``,
    ``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``, ``spec_info``,
    ``req_to_token_pool``); ``layer`` any object with RadixAttention's fields. ``q`` is
    ``[T, q_heads * head_dim]`` or ``[T, q_heads, head_dim]``; ``k_buffer``/``v_buffer`` are
    the layer's pool buffers with the batch's new tokens already written. Lengths are read
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
        acc_dtype=acc_dtype,
    )
    return out.reshape(tokens, -1)


def tolerance(dtype: torch.dtype) -> dict:
    """``torch.testing.assert_close`` tolerances for a backend's output in ``dtype`` against this oracle."""
    return {
        torch.float32: {"atol": 2e-4, "rtol": 1e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
        torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    }[dtype]
