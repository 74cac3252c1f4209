"""The porting kit's example device as hal 0.4's first form shipped it (plugin API 3: its backend implements the plan
as ``init_forward_metadata_out_graph`` / ``init_forward_metadata_in_graph``, calls ``self.check_batch`` and
``self.set_forward_metadata``), kept unchanged but for the device name: hal must run it (adapted at the door)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hal import AttentionBackend, Device, DeviceCapability
from hal.batch import device_lens, host_lens
from hal.graph import EagerGraph, Graph


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
    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:
        self.check_batch(fb)  # validates an engine's batch at this backend's level (hal's own: already done)
        if fb.forward_mode.is_idle():
            self.set_forward_metadata(None, fb)
            return
        tokens = fb.out_cache_loc.shape[0]
        if self.is_graph_batch(fb, in_capture):  # a captured graph's static batch: shapes fixed for every replay
            width = fb.req_to_token_pool.req_to_token.shape[1]
            max_q = tokens // fb.batch_size if fb.forward_mode.is_target_verify() else self.graph_max_q
        else:
            lens = host_lens(fb)  # (prefix, query) per request from the host mirrors, per mode
            width, max_q = max(lens.kv), max(lens.query)
        self.set_forward_metadata(ToyMetadata(width, max_q, tokens), fb)

    def init_forward_metadata_in_graph(self, fb) -> None:
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
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


def toy_capability(index: int | None = None) -> DeviceCapability:
    """What toy card ``index`` is (None: the current one; there is one). Never raises: what is missing is a reason."""
    if os.environ.get("HAL_TOY_DISABLE", "0") not in ("", "0"):
        return DeviceCapability(
            type="api3toy", available=False, reasons={"device": "HAL_TOY_DISABLE is set: no toy card in this machine"}
        )
    if index not in (None, 0):
        return DeviceCapability(
            type="api3toy", available=False, reasons={"device": f"api3toy:{index}: there is one toy card"}
        )
    return DeviceCapability(
        type="api3toy",
        available=True,
        torch_type="cpu",  # the torch device its tensors live on: a real plugin names its own ("xpu", "mlu"...)
        index=0,
        count=1,
        name="Toy Accelerator (CPU tensors)",
        vendor="hal example",
        arch="toy1",
        memory_bytes=None,
        dtypes=("fp32", "bf16"),
        graph="eager_guard",
        triton_target=None,
        libraries={"torch": torch.__version__},
        emulated=True,  # its speed means nothing: say so, hal info shows it
        fused_mixed=False,  # MIXED batches go to forward_extend (True: to forward_mixed, one fused kernel)
        reasons={
            "fp16": "toy has no fp16 units",
            "fp8": "toy has no fp8 units",
            "triton": "no Triton compiler targets toy",
        },
    )


class ToyDevice(Device):
    name = "api3toy"
    priority = -10  # below cpu (0): a pretend device never wins automatic selection
    plugin_api = 3  # the hal plugin API this package is written for (CHANGELOG.md)

    def probe(self, index: int | None = None) -> DeviceCapability:
        return toy_capability(index)

    def backends(self):
        return [ToyBackend]

    def make_graph(self, capability: DeviceCapability) -> Graph:
        return EagerGraph()


device = ToyDevice()
