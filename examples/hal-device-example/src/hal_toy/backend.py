"""``ToyBackend``: attention for the toy device in plain torch, written against hal's contract.

The metadata protocol (``docs/porting.md``, "The metadata protocol"):

* ``plan_out_graph(fb)`` runs on the host before every step (and before every graph replay), reached through
  the base class's ``init_forward_metadata_out_graph`` once the batch is checked and carries the token table
  this backend reads: it reads host lengths and fixes every shape, then calls ``set_forward_metadata(meta, fb)``;
* ``plan_in_graph(fb)`` fills the device tensors of that metadata from the
  batch's device tensors only (recorded into a graph and replayed: no ``.item()``, no
  ``.tolist()``, no shape that depends on tensor values);
* ``forward_*`` attend over the cache: the base class's prologue already checked the inputs,
  looked the metadata up (``self.forward_metadata``) and wrote the new tokens' K/V (unless
  ``save_kv_cache=False``), and it hands q, k, v over as ``[T, heads, dim]``.

Every request is padded to ``W`` keys and ``Q`` queries; one mask carries padding,
causality (or the verify mask), and the sliding window; outputs return to the ragged
token order. It reads a batch through SGLang's field names only, so an engine's own batch
object works as well as ``hal.ForwardBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal import AttentionBackend
from hal.batch import device_lens, host_lens


@dataclass
class ToyMetadata:
    width: int  # W: keys per request, padded (host int, fixed in out_graph)
    max_q: int  # Q: queries per request, padded
    num_tokens: int  # T: query tokens of the batch
    slots: torch.Tensor | None = None  # int64 [B, W]: KV slot of each key (padding slot past the request's keys)
    kv_valid: torch.Tensor | None = None  # bool [B, W]
    q_pos: torch.Tensor | None = None  # int64 [B, Q]: position of each query in its request
    q_index: torch.Tensor | None = None  # int64 [B, Q]: row of each query in q (T for padding)
    custom_mask: torch.Tensor | None = None  # bool [B, Q, W]: TARGET_VERIFY only


class ToyBackend(AttentionBackend):
    # What it serves: unsupported_reasons() turns these into the reasons it cannot serve a config.
    name = "toy"
    dtypes = frozenset({"fp32", "bf16"})  # strings: "fp32", "bf16", "fp16", "fp8"
    page_sizes = frozenset({16, 64})
    supports_mla = True  # v_head_dim != head_dim
    requires_page_aligned_slots = False  # slots are read one by one; pages need not be whole
    # hal >= 0.3: out_cache_loc may hold -1 (a padding token, no KV written). The base class's KV write skips it and
    # this backend reads slots through req_to_token only, never out_cache_loc; hal 0.2 ignores the attribute.
    supports_padding_slots = True
    reads_new_kv = False  # reads every key from the cache: k/v may stay None with save_kv_cache=False
    needs_cpu_seq_lens = True

    def __init__(self, capability, config=None, **options):
        super().__init__(capability, config, **options)  # config: the model served; options: validate=...
        self.graph_max_q = 1

    def support_triton(self) -> bool:
        return False  # toy has no Triton: hal's helper ops (KV write...) take their torch versions

    # -- graphs ------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_max_q = max(1, max_num_tokens // max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padding requests of a replayed batch have one key (their slot is the padding slot)

    # -- metadata ----------------------------------------------------------------------
    def plan_out_graph(self, fb, in_capture: bool = False) -> None:
        if fb.forward_mode.is_idle():
            self.plan.set_metadata(None, fb)
            return
        tokens = fb.out_cache_loc.shape[0]
        if self.plan.is_graph_batch(fb, in_capture):  # a captured graph's static batch: shapes fixed for every replay
            width = fb.req_to_token_pool.req_to_token.shape[1]
            max_q = tokens // fb.batch_size if fb.forward_mode.is_target_verify() else self.graph_max_q
        else:
            lens = host_lens(fb)  # (prefix, query) per request from the host mirrors, per mode
            width, max_q = max(lens.kv), max(lens.query)
        self.plan.set_metadata(ToyMetadata(width, max_q, tokens), fb)

    def plan_in_graph(self, fb) -> None:
        if fb.forward_mode.is_idle():
            return
        meta = self.plan.metadata_for(fb)
        q_lens, kv_lens = device_lens(fb)  # query tokens and keys per request, from device tensors only
        k_pos = torch.arange(meta.width, device=self.device)
        q_off = torch.arange(meta.max_q, device=self.device)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long(), : meta.width].long()
        meta.kv_valid = k_pos[None, :] < kv_lens[:, None]
        meta.slots = torch.where(meta.kv_valid, rows, 0)  # slot 0: the padding page, never a request's
        meta.q_pos = (kv_lens - q_lens)[:, None] + q_off[None, :]
        q_valid = q_off[None, :] < q_lens[:, None]
        q_start = torch.cumsum(q_lens, 0) - q_lens
        meta.q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], meta.num_tokens)
        meta.custom_mask = None
        if fb.forward_mode.is_target_verify():
            # request b's mask is [q_len, kv_len] row-major, after the masks of requests 0..b-1
            sizes = q_lens * kv_lens
            flat = (torch.cumsum(sizes, 0) - sizes)[:, None, None] + q_off[None, :, None] * kv_lens[:, None, None]
            flat = flat + k_pos[None, None, :]
            inside = q_valid[:, :, None] & meta.kv_valid[:, None, :]
            mask = fb.spec_info.custom_mask
            flat = torch.where(inside, flat, 0).clamp(max=max(mask.numel() - 1, 0))
            meta.custom_mask = inside & mask[flat]

    # -- forward -----------------------------------------------------------------------
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(self, q, k, v, layer, fb, save_kv_cache: bool) -> torch.Tensor:
        """q ``[T, Hq, D]`` -> ``[T, Hq * Dv]``; the new tokens' K/V are in the cache already (the prologue)."""
        meta = self.forward_metadata
        pool = fb.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        group = layer.tp_q_head_num // layer.tp_k_head_num  # query head h reads KV head h // group
        keys = k_buffer[meta.slots].float().repeat_interleave(group, dim=2)  # [B, W, Hq, D]
        values = v_buffer[meta.slots].float().repeat_interleave(group, dim=2)  # [B, W, Hq, Dv]
        tokens = meta.num_tokens
        q_pad = torch.cat([q.float(), q.new_zeros(1, *q.shape[1:], dtype=torch.float32)])[meta.q_index]
        scores = torch.einsum("bqhd,bwhd->bhqw", q_pad, keys) * layer.scaling
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        k_pos = torch.arange(meta.width, device=q.device)[None, None, :]
        visible = meta.kv_valid[:, None, :]  # [B, 1 or Q, W]
        if meta.custom_mask is not None:  # the verify mask replaces the causal rule
            visible = visible & meta.custom_mask
        elif layer.causal:  # decoder self-attention; encoder-only and cross attention see every key
            visible = visible & (k_pos <= meta.q_pos[:, :, None])
        if layer.sliding_window_size >= 0:  # keys p - W .. p, on top of any mask
            visible = visible & (k_pos >= meta.q_pos[:, :, None] - layer.sliding_window_size)
        visible = visible[:, None]  # [B, 1, Q, W]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)  # no visible key: zeros (NaN inputs stay NaN)
        out = torch.einsum("bhqw,bwhd->bqhd", probs, values)  # [B, Q, Hq, Dv]
        result = q.new_empty(tokens + 1, layer.tp_q_head_num, layer.v_head_dim)
        result.index_copy_(0, meta.q_index.flatten(), out.reshape(-1, *out.shape[2:]).to(q.dtype))
        return result[:tokens].reshape(tokens, -1)
