"""``torch``: the CPU attention backend, batched over requests with no per-request Python loop.

Every request's keys are gathered into a padded ``[kv_heads, B, W, dim]`` block (``W`` =
the longest request, or the whole ``req_to_token`` row under graph capture); one fused
SDPA call (explicit float32 matmuls when a logit cap is set) attends over it with one
mask carrying padding, causality, the sliding window and the verify mask; outputs are
scattered back to the ragged token order. Correct for every mode hal defines and within
reach of SGLang's torch-native backend; dedicated CPU kernels come separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, device_lens, host_lens
from hal.deprecation import moved_names
from hal.kernels.reference import kv_csr, kv_scales, step_token_table
from hal.kv_cache import kv_storage
from hal.kv_dtypes import kv_scaled
from hal.kv_layouts import HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR, pool_kv_layout

__all__ = ["PlainTorchBackend"]


@dataclass
class TorchMetadata:
    """Per-step metadata. ``W``: padded KV width; ``Q``: padded query length; ``T``: query tokens."""

    path: ClassVar[str] = "plain_torch"
    width: int  # W, a host int fixed in out_graph
    max_q: int  # Q
    num_tokens: int  # T
    slots: torch.Tensor | None = None  # int64 [B, W], KV slot of each key (padding slot past kv_len)
    kv_valid: torch.Tensor | None = None  # bool [B, W]
    q_pos: torch.Tensor | None = None  # int64 [B, Q], position of each query
    q_index: torch.Tensor | None = None  # int64 [B, Q], row of each query in q (T for padding)
    custom_mask: torch.Tensor | None = None  # bool [B, Q, W] (TARGET_VERIFY only)
    kv_layout: str = TOKEN_MAJOR  # the pool's (hal.kv_layouts): token-major buffers or head-major pages

    # SGLang's names for the same data (its attention kit and tools inspect them), built when read.
    @property
    def kv_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of each request's keys (its query tokens included)."""
        if self.kv_valid is None:
            return None
        rows = torch.arange(self.slots.shape[0], device=self.slots.device)
        return kv_csr(self.kv_valid.sum(1), rows, req_to_token=self.slots).indptr

    @property
    def kv_indices(self) -> torch.Tensor | None:
        """int32: the KV slot of every key, request after request (CSR over ``kv_indptr``)."""
        if self.slots is None:
            return None
        rows = torch.arange(self.slots.shape[0], device=self.slots.device)
        return kv_csr(self.kv_valid.sum(1), rows, req_to_token=self.slots).indices

    @property
    def qo_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of each request's query tokens."""
        return None if self.q_index is None else _indptr((self.q_index < self.num_tokens).sum(1))

    def fill(self, fb: ForwardBatch) -> None:
        """The in-graph half of the plan: the device tensors above, from the batch's device tensors only."""
        device = fb.seq_lens.device
        q_lens, kv_lens = device_lens(fb)
        prefix = kv_lens - q_lens
        q_start = torch.cumsum(q_lens, 0) - q_lens
        k_pos = torch.arange(self.width, device=device)
        q_off = torch.arange(self.max_q, device=device)
        rows = request_slots(fb, self.width).long()
        self.kv_layout = pool_kv_layout(fb.token_to_kv_pool)
        self.kv_valid = k_pos[None, :] < kv_lens[:, None]
        self.slots = torch.where(self.kv_valid, rows, 0)  # padding reads slot 0, the padding page
        self.q_pos = prefix[:, None] + q_off[None, :]
        q_valid = q_off[None, :] < q_lens[:, None]
        self.q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], self.num_tokens)
        if fb.forward_mode.is_target_verify():
            # request b's block is [q_len, kv_len] row-major, at the sum of earlier blocks
            sizes = q_lens * kv_lens
            mask_start = torch.cumsum(sizes, 0) - sizes
            flat = mask_start[:, None, None] + q_off[None, :, None] * kv_lens[:, None, None] + k_pos[None, None, :]
            inside = q_valid[:, :, None] & self.kv_valid[:, None, :]
            custom = fb.spec_info.custom_mask
            flat = torch.where(inside, flat, 0).clamp(max=max(custom.numel() - 1, 0))
            self.custom_mask = inside & custom[flat]
        else:
            self.custom_mask = None

    def attend(self, q, k_buffer, v_buffer, layer, scratch: Scratch, sinks=None, out=None) -> torch.Tensor:
        """:func:`attend_padded` over this plan."""
        return attend_padded(q, k_buffer, v_buffer, self, layer, scratch, sinks, out)


def request_slots(fb: ForwardBatch, width: int) -> torch.Tensor:
    """int32 ``[B, width]``: the KV slot of tokens ``0 .. width - 1`` of each of the step's requests, from the
    request table the batch carries (``req_to_token``, else the block table ``req_to_page``; graph-recordable)."""
    tokens = getattr(fb, "req_to_token_pool", None)
    if tokens is not None:
        return tokens.req_to_token[fb.req_pool_indices.long(), :width]
    pages = fb.req_to_page_pool
    return step_token_table(fb.req_pool_indices, width, req_to_page=pages.req_to_page, page_size=pages.page_size)


def table_width(fb: ForwardBatch) -> int:
    """Tokens a row of the batch's request table holds (a captured graph's KV width)."""
    tokens = getattr(fb, "req_to_token_pool", None)
    if tokens is not None:
        return tokens.req_to_token.shape[1]
    return fb.req_to_page_pool.req_to_page.shape[1] * fb.req_to_page_pool.page_size


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


class PlainTorchBackend(AttentionBackend):
    """The plain torch path of the ``torch`` backend (no compiled kernels); see the module docstring."""

    name = "torch"
    supports_padding_slots = True  # -1 in out_cache_loc: no KV written (docs/porting.md)
    dtypes = frozenset({"fp32", "bf16"})
    kv_cache_dtypes = frozenset({"fp32", "bf16", "fp8_e4m3", "fp8_e5m2"})
    supports_mla = True
    supports_sinks = True
    needs_cpu_seq_lens = True
    reads_new_kv = False  # every key, the new tokens' included, is read from the cache

    def __init__(self, capability, config=None, **options):
        super().__init__(capability, config, **options)
        self.graph_max_q = 1
        self.scratch = Scratch()

    def support_triton(self) -> bool:
        return True

    # -- metadata ----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # A captured batch's shapes are fixed: KV padded to the whole req_to_token row,
        # queries to max_num_tokens // max_bs.
        self.graph_max_q = max(1, max_num_tokens // max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def plan_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        """The padded widths (no sync for a graph batch)."""
        if fb.forward_mode.is_idle():  # forward() returns without attention: nothing to prepare
            self.plan.set_metadata(None, fb, fused=False)
            return
        tokens = fb.out_cache_loc.shape[0]
        if self.plan.is_graph_batch(fb, in_capture):
            width = table_width(fb)
            max_q = tokens // fb.batch_size if fb.forward_mode.is_target_verify() else self.graph_max_q
        else:
            lens = host_lens(fb)
            width, max_q = max(lens.kv, default=0), max(lens.query, default=0)
        self.plan.set_metadata(TorchMetadata(width=width, max_q=max_q, num_tokens=tokens), fb, fused=False)

    def plan_in_graph(self, fb: ForwardBatch) -> None:
        if not fb.forward_mode.is_idle():
            self.plan.metadata_for(fb).fill(fb)

    # -- run: the plan's own path (the compiled backend's plans read the pool with its kernels) ------------------
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, sinks=None):
        """``q`` ``[T, Hq, D]`` after the checked steps, ``sinks`` ``[Hq]`` or None -> ``[T, Hq, Dv]`` in q's dtype,
        written into ``out`` when given. Every key, the new tokens' included, is read from the cache (``k``/``v``
        are not used). The pool's K and V are read in its layout (:func:`hal.kv_cache.kv_storage`)."""
        k_buffer, v_buffer, _ = kv_storage(forward_batch.token_to_kv_pool, layer.layer_id)
        return self.forward_metadata.attend(q, k_buffer, v_buffer, layer, self.scratch, sinks, out)

    run_extend = run_mixed = run_decode


def attend_padded(
    q, k_buffer, v_buffer, meta: TorchMetadata, layer, scratch: Scratch, sinks=None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Ragged queries ``[T, Hq, D]`` over padded gathered keys; returns ``[T, Hq, Dv]`` in q's dtype (``out``, a
    ``[T, Hq, Dv]`` view of the caller's buffer, when given). ``k_buffer`` / ``v_buffer``: token-major
    ``[num_slots, kv_heads, dim]``, or head-major pages ``[num_pages, kv_heads, page_size, dim]`` where
    ``meta.kv_layout`` says so (gathered alike).

    Keys and values are gathered KV-head-major (``[Hkv, B * W, D]``, one ``index_select``
    per KV head into reused buffers: a plain row copy, ~7x faster than advanced indexing
    into a fresh tensor here), so each (KV head, request) block is one contiguous matrix.
    Without a logit cap, torch's fused SDPA attends over them with one mask carrying
    padding, causality, window and verify mask; with one, explicit float32 matmuls and a
    softmax do (SDPA has no soft cap), and so with attention ``sinks`` (``[Hq]``: one more
    logit per head in each softmax denominator). An fp8 cache is dequantised (times the
    layer's ``k_scale`` / ``v_scale``) into float32 blocks as it is gathered; an MLA value
    buffer (a strided view of the key buffer's latent) is gathered like any other.
    """
    dest = out
    batch, width = meta.slots.shape
    max_q, tokens = meta.max_q, meta.num_tokens
    kv_heads, group = layer.tp_k_head_num, layer.group_size
    head_dim, v_dim = layer.head_dim, layer.v_head_dim
    q_pad = torch.cat([q, q.new_zeros(1, q.shape[1], head_dim)])[meta.q_index]  # [B, Q, Hq, D]
    k_pos = torch.arange(width, device=q.device)
    visible = meta.kv_valid[:, None, :]  # [B, 1 or Q, W]
    if meta.custom_mask is not None:
        visible = visible & meta.custom_mask
    elif layer.causal:
        visible = visible & (k_pos[None, None, :] <= meta.q_pos[:, :, None])
    if layer.sliding_window_size >= 0:
        visible = visible & (k_pos[None, None, :] >= meta.q_pos[:, :, None] - layer.sliding_window_size)
    flat = meta.slots.flatten()
    # SDPA takes the cache dtype (it accumulates in float32; on these head-major blocks its bf16
    # decode measured faster than fp32); the explicit path (cap, sinks) and fp8 caches compute in float32.
    explicit = layer.logit_cap > 0 or sinks is not None
    dtype = torch.float32 if explicit or kv_scaled(k_buffer.dtype) else k_buffer.dtype
    k_scale, v_scale = kv_scales(layer)
    keys = scratch.gather("k", k_buffer, flat, dtype, k_scale, meta.kv_layout).view(kv_heads, batch, width, head_dim)
    values = scratch.gather("v", v_buffer, flat, dtype, v_scale, meta.kv_layout).view(kv_heads, batch, width, v_dim)
    if explicit:
        out = _attend_explicit(q_pad.float(), keys, values, visible, layer, sinks)
    else:
        out = F.scaled_dot_product_attention(
            q_pad.to(dtype).transpose(1, 2),  # [B, Hq, Q, D]
            keys.transpose(0, 1),  # [B, Hkv, W, D], each (request, head) block contiguous
            values.transpose(0, 1),
            attn_mask=visible[:, None],
            scale=layer.scaling,
            enable_gqa=group > 1,
        )
        out = out.transpose(1, 2)  # [B, Q, Hq, Dv]
    # A query with no visible key outputs zeros (SDPA gives NaN there); NaN from q or the cache stays NaN.
    out = out.masked_fill_(~visible.any(-1)[:, :, None, None], 0.0)
    result = q.new_empty(tokens + 1, kv_heads * group, v_dim)  # row T takes the padding queries
    result.index_copy_(0, meta.q_index.flatten(), out.reshape(batch * max_q, -1, v_dim).to(q.dtype))
    # the padded queries' rows are scattered, so a caller's buffer takes one copy of the real rows
    return result[:tokens] if dest is None else dest.copy_(result[:tokens])


def _attend_explicit(q_pad, keys, values, visible, layer, sinks=None) -> torch.Tensor:
    """float32 ``[B, Q, Hq, D]`` queries over ``[Hkv, B, W, D]`` keys -> ``[B, Q, Hq, Dv]``, with the layer's
    tanh logit cap (if any) and ``sinks`` ``[Hq]`` (if given) in the softmax denominator."""
    batch, max_q = q_pad.shape[:2]
    kv_heads, _, width, head_dim = keys.shape
    group, v_dim = layer.group_size, values.shape[-1]
    rows = group * max_q  # query rows per (KV head, request): the group's heads x padded queries
    q_rows = q_pad.view(batch, max_q, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)  # [Hkv, B, G, Q, D]
    q_rows = q_rows.reshape(kv_heads * batch, rows, head_dim)
    keys = keys.reshape(kv_heads * batch, width, head_dim)
    scores = torch.bmm(q_rows, keys.transpose(1, 2)).mul_(layer.scaling)  # [Hkv * B, G * Q, W]
    if layer.logit_cap > 0:
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    scores = scores.view(kv_heads, batch, group, max_q, width).masked_fill_(~visible[None, :, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)  # rows with no visible key are NaN: attend_padded zeroes them
    else:  # softmax over [scores..., sink], the sink column dropped
        sink = sinks.float().view(kv_heads, 1, group, 1, 1)
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)
        probs = torch.exp(scores - top)
        probs = probs / (probs.sum(-1, keepdim=True) + torch.exp(sink - top))
    out = torch.bmm(probs.view(kv_heads * batch, rows, width), values.reshape(kv_heads * batch, width, v_dim))
    return out.view(kv_heads, batch, group, max_q, v_dim).permute(1, 3, 0, 2, 4).reshape(batch, max_q, -1, v_dim)


class Scratch:
    """Reused gather buffers: fresh large allocations cost more than the gather itself on CPUs."""

    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _buffer(self, name: str, dtype: torch.dtype, numel: int, device) -> torch.Tensor:
        buf = self.buffers.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self.buffers[(name, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def gather(
        self,
        name: str,
        pool: torch.Tensor,
        slots: torch.Tensor,
        dtype: torch.dtype,
        scale: float = 1.0,
        kv_layout: str = TOKEN_MAJOR,
    ) -> torch.Tensor:
        """``pool[slots]`` KV-head-major, as ``dtype``: ``[kv_heads, len(slots), dim]``; an fp8 ``pool`` is
        dequantised (times ``scale``, as ``hal.kernels.reference.dequantize_kv``). ``pool``: token-major
        ``[num_slots, kv_heads, dim]``, or pages ``[num_pages, kv_heads, page_size, dim]`` (``kv_layout``
        head_major or amx_packed: the ``"v"`` gather reads V's order), slot ``s`` at page ``s // page_size``,
        offset ``s % page_size``."""
        kv_heads, dim = pool.shape[1], pool.shape[-1]
        n = slots.numel()
        out = self._buffer(name, pool.dtype, kv_heads * n * dim, pool.device).view(kv_heads, n, dim)
        if kv_layout not in (TOKEN_MAJOR, HEAD_MAJOR):
            out.copy_(KV_LAYOUTS[kv_layout].reader(name == "v")(pool, slots, kv_heads).transpose(0, 1))
        elif kv_layout == HEAD_MAJOR:
            page_size = pool.shape[2]
            page, offset = slots // page_size, slots % page_size
            for h in range(kv_heads):
                out[h] = pool[:, h][page, offset]
        else:
            for h in range(kv_heads):
                torch.index_select(pool[:, h], 0, slots, out=out[h])
        if pool.dtype == dtype:
            return out
        wide = self._buffer(name, dtype, out.numel(), pool.device).view(out.shape).copy_(out)
        return wide.mul_(scale) if kv_scaled(pool.dtype) and scale != 1.0 else wide


__getattr__ = moved_names(__name__, {"TorchBackend": "hal.devices.cpu.torch_backend:PlainTorchBackend"})
