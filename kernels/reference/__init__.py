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
* Attention sinks (gpt-oss): ``sinks`` ``[q_heads]`` is a learned logit per query head.
  Each query row's softmax runs over its (capped, masked) scores plus one more column
  holding ``sinks[h]``, which is then dropped: the denominator gains ``exp(sinks[h] - m)``
  with ``m = max(max_j score_j, sinks[h])`` and the weights no longer sum to 1. A row
  with no visible key outputs zeros (all its mass is on the sink).
* Scaled KV caches (the rows of ``hal.kernels.kv_dtypes`` with ``scaled``: fp8 ``float8_e4m3fn`` /
  ``float8_e5m2``): a write stores ``clamp(x.float() / scale, -max, max)`` in the storage dtype
  (saturating, as vLLM's ``scaled_fp8_quant``), a read gives ``stored.float() * scale``, with the
  layer's ``k_scale`` for keys and ``v_scale`` for values (None: 1.0). A cache in a model dtype
  ignores the scales. Queries stay in the model dtype.
* Padding tokens: a query token whose ``out_cache_loc`` is -1 writes no KV (:func:`store` skips negative
  slots); its output row is unspecified and the caller ignores it. It belongs to a padding request (all of
  whose query tokens are padding), which reads in-pool slots only (hal's padding row 0: the padding slot).
* Request tables: a request's slots come from ``req_to_token`` (int32 ``[rows, max_context]``, the slot of
  every token) or from ``req_to_page`` (int32 ``[rows, max_pages]``, a block table: token ``i`` of the
  request is slot ``req_to_page[row, i // page_size] * page_size + i % page_size``). Both are indexed by
  ``req_pool_indices``; :func:`step_token_table` and :func:`step_page_table` turn either into the other
  for the rows of one step, and :func:`kv_csr` builds the CSR indices backends plan with from either.
* MLA (latent attention): the value buffer is a view of the key buffer's first
  ``kv_lora_rank`` columns (the latent); a write stores the key only (latent and rope
  part) and the value is read through the view. Nothing else about it is special: it is
  MQA with ``v_head_dim != head_dim``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hal.kernels.kv_dtypes import find_kv_dtype, kv_scaled

__all__ = [
    "paged_attention",
    "attention_mask",
    "write_kv",
    "build_kv_indices",
    "step_token_table",
    "step_page_table",
    "KVIndices",
    "kv_csr",
    "compute_positions",
    "batch_attention",
    "tolerance",
    "kv_scaled",
    "kv_scales",
    "quantize_kv",
    "dequantize_kv",
    "shares_storage",
    "overlaps",
    "store",
]


def __getattr__(name: str):
    # A deprecated name (kernels import nothing of hal.deprecation, so the warning is spelled as warn_renamed's).
    if name == "is_fp8":
        warnings.warn(
            "hal.kernels.reference.is_fp8 is deprecated since hal 0.3.0 and goes in 0.5.0: use "
            "hal.kernels.kv_dtypes.kv_scaled (see CHANGELOG.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        return kv_scaled
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """``x`` as stored in a cache of ``dtype``: a scaled dtype (fp8) saturates ``x.float() / scale``; other
    dtypes cast ``x`` (the row's ``quantize`` in ``hal.kernels.kv_dtypes``)."""
    row = find_kv_dtype(dtype)
    return x.to(dtype) if row is None else row.quantize(x, scale)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What a cache entry means, in ``dtype``: ``stored * scale`` for a scaled dtype (fp8), ``stored`` as is
    otherwise (the row's ``dequantize``)."""
    row = find_kv_dtype(stored.dtype)
    return stored.to(dtype) if row is None else row.dequantize(stored, scale, dtype)


def shares_storage(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether ``v_buffer`` is a view of ``k_buffer`` (an MLA pool: the value is the key's latent)."""
    return v_buffer.data_ptr() == k_buffer.data_ptr() and v_buffer.shape[-1] <= k_buffer.shape[-1]


def overlaps(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the memory ``a`` and ``b`` span (first to last element, through their strides) overlaps; reads no
    device memory. False where either is None, empty or on another device."""
    if b is None or a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


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
    """``buffer[loc[i]] = values[i]`` (already in ``buffer.dtype``) for every ``loc[i] >= 0``; a negative slot (-1, a
    padding token) writes nothing: its row goes to slot 0 carrying slot 0's own bytes, so every slot keeps its
    content and no shape depends on the data (graph-recordable, no host sync). A one-byte float (fp8) is written as
    bytes, as SGLang's pools do: some devices and torch versions have no fp8 index_put. (vLLM's cache kernels skip
    ``slot_idx < 0`` the same way: vllm-project/vllm ``csrc/cache_kernels.cu``, ``PAD_SLOT_ID = -1``.)"""
    if buffer.dtype.is_floating_point and buffer.dtype.itemsize == 1:
        buffer, values = buffer.view(torch.uint8), values.view(torch.uint8)
    loc = loc.long()
    skip = (loc < 0).view(-1, *[1] * (values.dim() - 1))
    buffer[loc.clamp(min=0)] = torch.where(skip, buffer[:1], values)


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


def _column_lookup(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``table[rows[i], cols[i]]`` (any broadcastable shapes); a column past the table's width reads 0."""
    inside = cols < table.shape[1]
    return torch.where(inside, table[rows, cols.clamp(max=max(table.shape[1] - 1, 0))], 0)


def step_token_table(
    rows: torch.Tensor,
    width: int,
    *,
    req_to_token: torch.Tensor | None = None,
    req_to_page: torch.Tensor | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """int32 ``[len(rows), width]``: the slot of tokens ``0 .. width - 1`` of each request row ``rows[b]``, in
    batch order, from ``req_to_token`` (its rows gathered) or, when that is None, from ``req_to_page`` (each page
    id expanded to its ``page_size`` slots). Columns past the given table's width hold 0.

    Graph-recordable: no host read, the shape is ``width`` (a host int: the step's longest context, or a
    captured graph's fixed width); the cost is ``len(rows) * width``.
    """
    pos = torch.arange(width, device=rows.device)
    if req_to_token is not None:
        return _column_lookup(req_to_token, rows.long()[:, None], pos[None, :]).to(torch.int32)
    pages = _column_lookup(req_to_page, rows.long()[:, None], (pos // page_size)[None, :]).long()
    return (pages * page_size + pos % page_size).to(torch.int32)


def step_page_table(
    rows: torch.Tensor,
    num_pages: int,
    page_size: int,
    *,
    req_to_token: torch.Tensor | None = None,
    req_to_page: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 ``[len(rows), num_pages]``: the page ids of pages ``0 .. num_pages - 1`` of each request row
    ``rows[b]``, in batch order (a block table, as vLLM's and the NPU ops read it), from ``req_to_page`` (its rows
    gathered) or, when that is None, from ``req_to_token`` (the page of each page's first token:
    ``req_to_token[row, j * page_size] // page_size``, which assumes page-aligned rows). Columns past the given
    table's width hold 0.

    Graph-recordable: no host read, the shape is ``num_pages`` (a host int); the cost is ``len(rows) * num_pages``.
    """
    cols = torch.arange(num_pages, device=rows.device)[None, :]
    if req_to_page is not None:
        return _column_lookup(req_to_page, rows.long()[:, None], cols).to(torch.int32)
    first = _column_lookup(req_to_token, rows.long()[:, None], cols * page_size)
    return torch.div(first, page_size, rounding_mode="floor").to(torch.int32)


class KVIndices(NamedTuple):
    """CSR indices of a batch's keys, as FlashInfer, SGLang's and vLLM's backends plan with.

    ``indptr``: int32 ``[B + 1]``, 0 then the running sum of each request's entries; ``indices``: int32, the
    entries request after request (KV slots, or page ids per page); ``last_page_len``: int32 ``[B]`` keys in each
    request's last page (``1 .. page_size``; 0 for a request without keys), page granularity only (else None).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor | None = None


def kv_csr(
    kv_lens: Sequence[int] | torch.Tensor,
    rows: torch.Tensor,
    *,
    req_to_token: torch.Tensor | None = None,
    req_to_page: torch.Tensor | None = None,
    page_size: int = 1,
    kv_start: Sequence[int] | torch.Tensor | None = None,
    per_page: bool = False,
) -> KVIndices:
    """The one builder of a batch's CSR key indices, from either request table (see the module docstring).

    Request ``b`` (request table row ``rows[b]``) reads keys ``kv_start[b] .. kv_lens[b] - 1`` (``kv_start`` None:
    0). Token granularity (``per_page=False``): ``kv_indptr`` / ``kv_indices`` (each key's KV slot), SGLang's
    names. Page granularity (``per_page=True``, every page from the first, ``kv_start`` not taken):
    ``kv_page_indptr`` / ``kv_page_indices`` (page ids) / ``kv_last_page_len``, FlashInfer's plan inputs.
    Give exactly one of ``req_to_token`` / ``req_to_page``; the page ids of a token table are read from each
    page's first token (page-aligned rows).

    ``indptr`` and ``last_page_len`` are on ``kv_lens``'s device (a list: the host, what ``plan`` calls take);
    ``indices`` on the table's. The cost is proportional to the keys (pages) read. Not graph-recordable: the
    entry count sizes the output (one host read when ``kv_lens`` is a device tensor); the graph form, into fixed
    buffers, is :func:`build_kv_indices`.
    """
    if (req_to_token is None) == (req_to_page is None):
        raise ValueError("kv_csr: give exactly one of req_to_token and req_to_page")
    table = req_to_token if req_to_token is not None else req_to_page
    lens = torch.as_tensor(kv_lens, dtype=torch.int64)
    if per_page:
        start = torch.zeros_like(lens)
        counts = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")
    else:
        start = torch.zeros_like(lens) if kv_start is None else torch.as_tensor(kv_start, dtype=torch.int64)
        counts = (lens - start).clamp(min=0)
    indptr = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    total = int(indptr[-1])
    req = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), counts, output_size=total)
    pos = torch.arange(total, device=lens.device) - indptr[req] + start[req]
    where = torch.stack([req, pos]).to(table.device)  # one copy to the table's device
    row, pos = rows.to(table.device).long()[where[0]], where[1]
    if per_page:
        if req_to_page is not None:
            indices = _column_lookup(req_to_page, row, pos)
        else:
            indices = torch.div(_column_lookup(req_to_token, row, pos * page_size), page_size, rounding_mode="floor")
        last = torch.where(lens > 0, (lens - 1) % page_size + 1, 0).to(torch.int32)
        return KVIndices(indptr.to(torch.int32), indices.to(torch.int32), last)
    if req_to_token is not None:
        indices = _column_lookup(req_to_token, row, pos)
    else:
        indices = _column_lookup(req_to_page, row, pos // page_size).long() * page_size + pos % page_size
    return KVIndices(indptr.to(torch.int32), indices.to(torch.int32))


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
    sinks: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What ``layer`` outputs for ``batch``: ``[T, q_heads * v_head_dim]`` in ``q.dtype``.

    ``batch`` is any object with SGLang's forward-batch fields (``forward_mode``,
    ``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``, ``spec_info``,
    ``req_to_token_pool``, or None there and a block table in ``req_to_page_pool``);
    ``layer`` any object with RadixAttention's fields. ``q`` is
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
    rows, token_pool = batch.req_pool_indices, getattr(batch, "req_to_token_pool", None)
    if token_pool is not None:
        table = token_pool.req_to_token
    else:  # a block table only: the batch's token rows, in batch order
        pages = batch.req_to_page_pool
        width = int(kv_lens.max()) if len(kv_lens) else 0
        table = step_token_table(rows, width, req_to_page=pages.req_to_page, page_size=pages.page_size)
        rows = torch.arange(len(kv_lens), device=table.device)
    out = paged_attention(
        q.reshape(tokens, layer.tp_q_head_num, layer.head_dim),
        k_buffer,
        v_buffer,
        table,
        rows,
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
    if kv_cache_dtype is not None and kv_scaled(kv_cache_dtype) and dtype == torch.float32:
        return {"atol": 1e-2, "rtol": 1e-2}
    return {
        torch.float32: {"atol": 2e-4, "rtol": 1e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
        torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    }[dtype]
