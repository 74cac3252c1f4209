"""A third-party device written against hal 0.1 (plugin API 1), kept exactly as such a port looks.

It declares no plugin API, overrides ``available`` / ``validate`` (0.1's names), reads
``config.num_kv_heads`` and builds configs with ``num_q_heads=`` (0.1's keywords), and, like
SGLang's own backends, takes ``k``/``v`` as ``[T, H, D]``: it writes them into the cache itself.
hal 0.2 must run it through its deprecated names and pass ``hal check``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.backend import AttentionBackend
from hal.batch import device_lens, host_lens
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.registry import Device


@dataclass
class Meta:
    width: int
    max_q: int
    tokens: int
    slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    q_index: torch.Tensor | None = None


class LegacyBackend(AttentionBackend):
    name = "legacy"
    dtypes = frozenset({"fp32", "bf16"})
    supports_graph = False
    supports_custom_mask = False
    supports_mla = True

    def __init__(self, capability, config=None, **options):
        super().__init__(capability, config or AttentionConfig(num_q_heads=8, num_kv_heads=2), **options)

    @classmethod
    def available(cls, capability):
        return [] if capability.available else ["no legacy card"]

    @classmethod
    def validate(cls, config, capability):
        reasons = super().validate(config, capability)
        if config.num_kv_heads > 64:
            reasons.append(f"{config.num_kv_heads} kv heads: at most 64")
        return reasons

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.check_batch(fb)
        if fb.forward_mode.is_idle():
            return self.set_forward_metadata(None, fb)
        lens = host_lens(fb)
        meta = Meta(max(lens.kv, default=0), max(lens.query, default=0), fb.out_cache_loc.shape[0])
        self.set_forward_metadata(meta, fb)

    def init_forward_metadata_in_graph(self, fb):
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
        q_lens, kv_lens = device_lens(fb)
        k_pos = torch.arange(meta.width, device=q_lens.device)
        q_off = torch.arange(meta.max_q, device=q_lens.device)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long(), : meta.width].long()
        meta.valid = k_pos[None, :] < kv_lens[:, None]
        meta.slots = torch.where(meta.valid, rows, 0)
        meta.q_pos = (kv_lens - q_lens)[:, None] + q_off[None, :]
        q_start = torch.cumsum(q_lens, 0) - q_lens
        meta.q_index = torch.where(q_off[None, :] < q_lens[:, None], q_start[:, None] + q_off[None, :], meta.tokens)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        meta = self.metadata_for(fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if save_kv_cache:  # k/v are [T, kv_heads, dim], as SGLang's RadixAttention hands them
            assert k.dim() == 3 and v.dim() == 3, "this port expects k/v as [T, H, D]"
            k_buf[fb.out_cache_loc] = k.to(k_buf.dtype)
            v_buf[fb.out_cache_loc] = v.to(v_buf.dtype)
        dtype, q = q.dtype, q.view(q.shape[0], layer.tp_q_head_num, layer.head_dim).float()
        group = layer.tp_q_head_num // layer.tp_k_head_num
        keys = k_buf[meta.slots].float().repeat_interleave(group, dim=2)
        values = v_buf[meta.slots].float().repeat_interleave(group, dim=2)
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.q_index]
        scores = torch.einsum("bqhd,bwhd->bhqw", q_pad, keys) * layer.scaling
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        k_pos = torch.arange(meta.width, device=q.device)[None, None, :]
        vis = meta.valid[:, None, :]
        if layer.causal:
            vis = vis & (k_pos <= meta.q_pos[:, :, None])
        if layer.sliding_window_size >= 0:
            vis = vis & (k_pos >= meta.q_pos[:, :, None] - layer.sliding_window_size)
        vis = vis[:, None]
        probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1)
        probs = torch.where(vis.any(-1, keepdim=True), probs, 0.0)
        out = torch.einsum("bhqw,bwhd->bqhd", probs, values)
        result = q.new_empty(meta.tokens + 1, layer.tp_q_head_num, layer.v_head_dim)
        result.index_copy_(0, meta.q_index.flatten(), out.reshape(-1, *out.shape[2:]))
        return result[: meta.tokens].reshape(meta.tokens, -1).to(dtype)


class LegacyDevice(Device):
    name = "legacytoy"
    priority = -20

    def probe(self, index=None):
        return DeviceCapability(type="legacytoy", available=True, count=1, dtypes=("fp32", "bf16"), emulated=True)

    def backends(self):
        return [LegacyBackend]


device = LegacyDevice()
