"""A toy device ported from the hal 0.1 README alone (its "Porting a new accelerator" section), unchanged.

Kept exactly as such a port looks: no plugin API declared; a ``Device`` with ``name``, ``priority``,
``probe()`` (no index) and ``backends()``; a backend whose ``__init__`` takes the capability only,
whose ``init_forward_metadata_out_graph`` reads the batch's 0.1 host lengths (``prefix_lens_cpu``,
``query_lens_cpu``, ``kv_lens_cpu``, ``num_tokens``) and assigns ``self.forward_metadata``, whose
``init_forward_metadata_in_graph`` calls ``forward_batch.device_lens()``, and whose ``forward_*``
check and write the KV themselves (``check_inputs``, ``save_kv``), as 0.1's base class asked.
Non-causal layers are declared off: 0.1's layers had only ``is_cross_attention``.
hal must run it through its deprecated names and pass ``hal check``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.backend import AttentionBackend
from hal.capability import DeviceCapability
from hal.registry import Device


@dataclass
class Meta:
    rows: list
    prefix: list
    query: list
    kv: list
    tokens: int
    lens: tuple = ()


class ReadmeBackend(AttentionBackend):
    name = "readme"
    dtypes = frozenset({"fp32", "bf16"})
    supports_non_causal = False
    supports_graph = False

    def __init__(self, capability):
        super().__init__(capability)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        fb = forward_batch
        self.forward_metadata = Meta(
            rows=fb.req_pool_indices.tolist(),
            prefix=list(fb.prefix_lens_cpu),
            query=list(fb.query_lens_cpu),
            kv=list(fb.kv_lens_cpu),
            tokens=fb.num_tokens,
        )

    def init_forward_metadata_in_graph(self, forward_batch):
        self.forward_metadata.lens = forward_batch.device_lens()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        q, k, v = self.check_inputs(q, k, v, layer, fb)
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        meta = self.forward_metadata
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        table = fb.req_to_token_pool.req_to_token
        group = layer.tp_q_head_num // layer.tp_k_head_num
        out = torch.zeros(meta.tokens, layer.tp_q_head_num, layer.v_head_dim)
        mask = fb.spec_info.custom_mask if fb.forward_mode.is_target_verify() else None
        start = mask_start = 0
        for row, prefix, n, kv in zip(meta.rows, meta.prefix, meta.query, meta.kv):
            slots = table[row, :kv].long()
            keys = k_buf[slots].float().repeat_interleave(group, dim=1)
            values = v_buf[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), keys) * layer.scaling
            if layer.logit_cap > 0:
                scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
            q_pos, k_pos = torch.arange(prefix, prefix + n)[:, None], torch.arange(kv)[None, :]
            if mask is not None:
                visible = mask[mask_start : mask_start + n * kv].view(n, kv).cpu()
                mask_start += n * kv
            else:
                visible = k_pos <= q_pos
            if layer.sliding_window_size >= 0:
                visible = visible & (k_pos >= q_pos - layer.sliding_window_size)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
            out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, values)
            start += n
        return out.reshape(meta.tokens, -1).to(q.dtype)


class ReadmeDevice(Device):
    name = "readmetoy"
    priority = -30

    def probe(self):
        return DeviceCapability(type="readmetoy", available=True, count=1, dtypes=("fp32", "bf16"), emulated=True)

    def backends(self):
        return [ReadmeBackend]


device = ReadmeDevice()
