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

import torch
import torch.nn.functional as F

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, device_lens, host_lens
from hal.deprecation import moved_names
from hal.kernels.reference import kv_scales
from hal.kv_dtypes import kv_scaled

__all__ = ["PlainTorchBackend"]


@dataclass
class TorchMetadata:
    """Per-step metadata. ``W``: padded KV width; ``Q``: padded query length; ``T``: query tokens."""

    width: int  # W, a host int fixed in out_graph
    max_q: int  # Q
    num_tokens: int  # T
    slots: torch.Tensor | None = None  # int64 [B, W], KV slot of each key (padding slot past kv_len)
    kv_valid: torch.Tensor | None = None  # bool [B, W]
    q_pos: torch.Tensor | None = None  # int64 [B, Q], position of each query
    q_index: torch.Tensor | None = None  # int64 [B, Q], row of each query in q (T for padding)
    custom_mask: torch.Tensor | None = None  # bool [B, Q, W] (TARGET_VERIFY only)

    # SGLang's names for the same data (its attention kit and tools inspect them), built when read.
    @property
    def kv_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of each request's keys (its query tokens included)."""
        return None if self.kv_valid is None else _indptr(self.kv_valid.sum(1))

    @property
    def kv_indices(self) -> torch.Tensor | None:
        """int32: the KV slot of every key, request after request (CSR over ``kv_indptr``)."""
        return None if self.slots is None else self.slots[self.kv_valid].to(torch.int32)

    @property
    def qo_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of each request's query tokens."""
        return None if self.q_index is None else _indptr((self.q_index < self.num_tokens).sum(1))


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

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self.check_batch(fb)
        self.plan(fb, in_capture)

    def plan(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        """The host half of ``out_graph`` once the batch is checked: the padded widths (no sync for a graph batch)."""
        if fb.forward_mode.is_idle():  # forward() returns without attention: nothing to prepare
            self.set_forward_metadata(None, fb)
            return
        tokens = fb.out_cache_loc.shape[0]
        if self.is_graph_batch(fb, in_capture):
            width = fb.req_to_token_pool.req_to_token.shape[1]
            max_q = tokens // fb.batch_size if fb.forward_mode.is_target_verify() else self.graph_max_q
        else:
            lens = host_lens(fb)
            width, max_q = max(lens.kv, default=0), max(lens.query, default=0)
        self.set_forward_metadata(TorchMetadata(width=width, max_q=max_q, num_tokens=tokens), fb)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
        device = fb.seq_lens.device
        q_lens, kv_lens = device_lens(fb)
        prefix = kv_lens - q_lens
        q_start = torch.cumsum(q_lens, 0) - q_lens
        k_pos = torch.arange(meta.width, device=device)
        q_off = torch.arange(meta.max_q, device=device)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long(), : meta.width].long()
        meta.kv_valid = k_pos[None, :] < kv_lens[:, None]
        meta.slots = torch.where(meta.kv_valid, rows, 0)  # padding reads slot 0, the padding page
        meta.q_pos = prefix[:, None] + q_off[None, :]
        q_valid = q_off[None, :] < q_lens[:, None]
        meta.q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], meta.num_tokens)
        if fb.forward_mode.is_target_verify():
            # request b's block is [q_len, kv_len] row-major, at the sum of earlier blocks
            sizes = q_lens * kv_lens
            mask_start = torch.cumsum(sizes, 0) - sizes
            flat = mask_start[:, None, None] + q_off[None, :, None] * kv_lens[:, None, None] + k_pos[None, None, :]
            inside = q_valid[:, :, None] & meta.kv_valid[:, None, :]
            custom = fb.spec_info.custom_mask
            flat = torch.where(inside, flat, 0).clamp(max=max(custom.numel() - 1, 0))
            meta.custom_mask = inside & custom[flat]
        else:
            meta.custom_mask = None

    # -- forward -----------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def _forward(self, q, k, v, layer, fb: ForwardBatch, save_kv_cache: bool, sinks=None) -> torch.Tensor:
        """q ``[T, Hq, D]`` (the prologue ran), ``sinks`` ``[Hq]`` or None -> ``[T, Hq, Dv]`` in q's dtype.

        Every key, the new tokens' included, is read from the cache (``k``/``v`` are not used).
        """
        pool = fb.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        return attend_padded(q, k_buffer, v_buffer, self.forward_metadata, layer, self.scratch, sinks)


def attend_padded(q, k_buffer, v_buffer, meta: TorchMetadata, layer, scratch: Scratch, sinks=None) -> torch.Tensor:
    """Ragged queries ``[T, Hq, D]`` over padded gathered keys; returns ``[T, Hq, Dv]`` in q's dtype.

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
    keys = scratch.gather("k", k_buffer, flat, dtype, k_scale).view(kv_heads, batch, width, head_dim)
    values = scratch.gather("v", v_buffer, flat, dtype, v_scale).view(kv_heads, batch, width, v_dim)
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
    result = q.new_empty(tokens + 1, kv_heads * group, v_dim)
    result.index_copy_(0, meta.q_index.flatten(), out.reshape(batch * max_q, -1, v_dim).to(q.dtype))
    return result[:tokens]


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
        self, name: str, pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
    ) -> torch.Tensor:
        """``pool[slots]`` KV-head-major, as ``dtype``: ``[kv_heads, len(slots), dim]``; an fp8 ``pool`` is
        dequantised (times ``scale``, as ``hal.kernels.reference.dequantize_kv``)."""
        kv_heads, dim = pool.shape[1:]
        n = slots.numel()
        out = self._buffer(name, pool.dtype, kv_heads * n * dim, pool.device).view(kv_heads, n, dim)
        for h in range(kv_heads):
            torch.index_select(pool[:, h], 0, slots, out=out[h])
        if pool.dtype == dtype:
            return out
        wide = self._buffer(name, dtype, out.numel(), pool.device).view(out.shape).copy_(out)
        return wide.mul_(scale) if kv_scaled(pool.dtype) and scale != 1.0 else wide


__getattr__ = moved_names(__name__, {"TorchBackend": "hal.devices.cpu.torch_backend:PlainTorchBackend"})
