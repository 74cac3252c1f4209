"""A plain-torch backend as a porter would write it, and mutants of it: one realistic porting mistake each.

``Ported`` computes attention the way paged kernels do (a block table per request, the
last page's length, a per-request padded score matrix) in vectorized plain torch, with
graph support (static shapes in ``in_graph``). It passes the conformance suite. Each
mutant overrides one hook with one mistake a porter makes; ``hal check`` must fail it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from hal.backend import AttentionBackend
from hal.batch import host_lens
from hal.capability import DeviceCapability
from hal.devices.cpu import device as cpu_device
from hal.devices.cpu.compiled_backend import CompiledBackend
from hal.kernels import cpu as cpu_kernels
from hal.kernels.reference import kv_scales, quantize_kv, shares_storage
from hal.kv_dtypes import kv_scaled
from hal.kv_layouts import HEAD_MAJOR, pool_kv_layout
from hal.registry import Device


@dataclass
class Meta:
    width: int  # W: keys per request (padded)
    max_q: int  # Q: query tokens per request (padded)
    num_tokens: int
    bs: int = 0
    slots: torch.Tensor | None = None  # [B, W]
    valid: torch.Tensor | None = None  # [B, W]
    q_pos: torch.Tensor | None = None  # [B, Q]
    q_index: torch.Tensor | None = None  # [B, Q] row of q (num_tokens for padding)
    prefix: torch.Tensor | None = None  # [B]
    custom: torch.Tensor | None = None  # [B, Q, W]


def _device_lens(fb) -> tuple[torch.Tensor, torch.Tensor]:
    mode, seq = fb.forward_mode, fb.seq_lens.long()
    if mode.is_decode():
        return torch.ones_like(seq), seq
    if mode.is_target_verify():
        return torch.full_like(seq, fb.spec_info.draft_token_num), seq + fb.spec_info.draft_token_num
    return fb.extend_seq_lens.long(), seq


class Ported(AttentionBackend):
    """The control: a correct port."""

    name = "ported"
    dtypes = frozenset({"fp32", "bf16"})
    kv_cache_dtypes = frozenset({"fp32", "bf16", "fp8_e4m3", "fp8_e5m2"})
    supports_mla = True
    supports_sinks = True
    supports_padding_slots = True  # its write is the base class's, which skips -1

    # -- metadata ----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_bs = max_bs

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:
        self.check_batch(fb)
        if fb.forward_mode.is_idle():
            self.set_forward_metadata(None, fb)
            return
        lens = host_lens(fb)
        q_lens, kv_lens = lens.query, lens.kv
        static = getattr(fb, "graph_static", False)
        width = fb.req_to_token_pool.max_context_len if static else max(kv_lens)
        max_q = max(q_lens)  # a captured verify step: its fixed draft count
        self.set_forward_metadata(Meta(width, max_q, sum(q_lens), fb.batch_size), fb)

    def init_forward_metadata_in_graph(self, fb) -> None:
        if fb.forward_mode.is_idle():
            return
        self.fill(self.metadata_for(fb), fb)

    def query_lens(self, fb):
        return _device_lens(fb)

    def fill(self, meta: Meta, fb) -> None:
        device = fb.seq_lens.device
        ps = fb.token_to_kv_pool.page_size
        q_lens, kv_lens = self.query_lens(fb)
        prefix = kv_lens - q_lens
        k_pos = torch.arange(meta.width, device=device)
        q_off = torch.arange(meta.max_q, device=device)
        rows = self.rows(fb)
        page_of = k_pos // ps
        meta.slots = self.slots(fb, rows, k_pos, ps)  # [B, W]
        num_pages, last_len = self.pages(kv_lens, ps)
        meta.valid = (page_of[None, :] < num_pages[:, None] - 1) | (
            (page_of[None, :] == num_pages[:, None] - 1) & (k_pos % ps < last_len[:, None])
        )
        meta.slots = torch.where(meta.valid, meta.slots, 0)
        meta.prefix = prefix
        meta.q_pos = self.positions(fb, prefix, q_off)
        q_start = torch.cumsum(q_lens, 0) - q_lens
        q_valid = q_off[None, :] < q_lens[:, None]
        meta.q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], meta.num_tokens)
        meta.custom = self.custom_mask(fb, q_lens, kv_lens, q_off, k_pos, q_valid, meta.valid)

    def rows(self, fb):
        return fb.req_pool_indices.long()

    def slots(self, fb, rows, k_pos, ps):
        """The slot of every key: ``req_to_token`` itself (no page alignment assumed)."""
        return fb.req_to_token_pool.req_to_token[rows][:, k_pos].long()

    def pages(self, kv_lens, ps):
        num_pages = (kv_lens + ps - 1) // ps
        return num_pages, kv_lens - (num_pages - 1) * ps

    def positions(self, fb, prefix, q_off):
        return prefix[:, None] + q_off[None, :]

    def custom_mask(self, fb, q_lens, kv_lens, q_off, k_pos, q_valid, kv_valid):
        if not fb.forward_mode.is_target_verify():
            return None
        sizes = q_lens * kv_lens
        start = torch.cumsum(sizes, 0) - sizes
        flat = start[:, None, None] + self.mask_offset(q_off, k_pos, q_lens, kv_lens)
        inside = q_valid[:, :, None] & kv_valid[:, None, :]
        mask = fb.spec_info.custom_mask
        return inside & mask[torch.where(inside, flat, 0).clamp(max=mask.numel() - 1)]

    def mask_offset(self, q_off, k_pos, q_lens, kv_lens):
        return q_off[None, :, None] * kv_lens[:, None, None] + k_pos[None, None, :]  # row-major [q, kv]

    # -- forward -----------------------------------------------------------------------
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def save_kv(self, layer, fb, k, v) -> None:  # the prologue's KV-write hook
        self.write(layer, fb, k, v)

    def write(self, layer, fb, k, v) -> None:
        AttentionBackend.save_kv(self, layer, fb, k, v)

    def buffers(self, layer, fb):
        return fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)

    def visible(self, meta: Meta, layer, fb) -> torch.Tensor:
        k_pos = torch.arange(meta.width, device=meta.slots.device)
        vis = meta.valid[:, None, :]
        if meta.custom is not None:
            vis = vis & meta.custom
        elif self.causal(layer, fb):
            vis = vis & (k_pos[None, None, :] <= meta.q_pos[:, :, None])
        if self.window(layer, fb) >= 0:
            vis = vis & (k_pos[None, None, :] >= meta.q_pos[:, :, None] - self.window(layer, fb))
        return vis

    def causal(self, layer, fb) -> bool:
        return layer.causal

    def window(self, layer, fb) -> int:
        return layer.sliding_window_size

    def scale(self, layer) -> float:
        return layer.scaling

    def scores(self, q_pad, keys, layer, fb):
        return torch.einsum("bqhd,bwhd->bhqw", q_pad, keys) * self.scale(layer)  # [B, Hq, Q, W]

    def cap(self, scores, layer, fb):
        if layer.logit_cap > 0:
            return layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        return scores

    def head_map(self, layer, device) -> torch.Tensor:
        return torch.arange(layer.tp_q_head_num, device=device) // layer.group_size

    def compute_dtype(self, q) -> torch.dtype:
        return torch.float32

    def keys_values(self, meta, layer, fb, k, v, kb, vb):
        return kb[meta.slots], vb[meta.slots]  # [B, W, Hkv, D]

    def finish(self, probs):
        return probs

    def softmax(self, scores, dtype):
        return torch.softmax(scores, dim=-1)

    def sink_softmax(self, scores, sinks, layer, fb):
        """Softmax of ``[B, Hq, Q, W]`` scores over one more column per head, ``sinks[h]``, then dropped."""
        column = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]

    def dequantize(self, keys, values, layer, cache_dtype):
        """float32 keys/values as gathered -> what they mean (an fp8 cache: times the layer's scales)."""
        if not kv_scaled(cache_dtype):
            return keys, values
        k_scale, v_scale = kv_scales(layer)
        return keys * k_scale, values * v_scale

    def attend(self, q, k, v, layer, fb, save_kv_cache, sinks=None):
        self._sinks = sinks is not None
        meta = self.forward_metadata  # the prologue checked q/k/v ([T, heads, dim] now) and wrote the KV
        tokens = meta.num_tokens
        kb, vb = self.buffers(layer, fb)
        dtype = self.compute_dtype(q)
        keys, values = self.keys_values(meta, layer, fb, k, v, kb, vb)
        heads = self.head_map(layer, q.device)
        keys, values = keys[:, :, heads].to(dtype), values[:, :, heads].to(dtype)  # [B, W, Hq, D]
        keys, values = self.dequantize(keys, values, layer, kb.dtype)
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.q_index].to(dtype)  # [B, Q, Hq, D]
        scores = self.scores(q_pad, keys, layer, fb)
        scores = self.cap(scores, layer, fb)
        vis = self.visible(meta, layer, fb)[:, None]  # [B, 1, Q, W]
        scores = scores.masked_fill(~vis, float("-inf"))
        probs = self.softmax(scores, q.dtype) if sinks is None else self.sink_softmax(scores, sinks, layer, fb)
        probs = torch.where(vis.any(-1, keepdim=True), probs, 0.0)  # no visible key: zeros (NaN elsewhere stays)
        probs = self.finish(probs)
        out = self.combine(probs, values, meta, fb)  # [B, Q, Hq, Dv]
        result = q.new_zeros(tokens + 1, layer.tp_q_head_num, layer.v_head_dim)
        result.index_copy_(0, meta.q_index.flatten(), out.reshape(-1, *out.shape[2:]).to(result.dtype))
        return self.output(result[:tokens], layer, fb)

    def combine(self, probs, values, meta, fb):
        return torch.einsum("bhqw,bwhd->bqhd", probs, values)

    def output(self, out, layer, fb):
        return out.reshape(out.shape[0], -1)


# ----------------------------------------------------------------------------- the mutants


class WindowOffByOne(Ported):
    """Window of W keys instead of W + 1 (``j > p - W``)."""

    def window(self, layer, fb):
        w = layer.sliding_window_size
        return w - 1 if w > 0 else w


class WindowDroppedInMixed(Ported):
    def window(self, layer, fb):
        return -1 if fb.forward_mode.is_mixed() else layer.sliding_window_size


class WindowDroppedInDecode(Ported):
    def window(self, layer, fb):
        return -1 if fb.forward_mode.is_decode() else layer.sliding_window_size


class WindowDroppedWithCustomMask(Ported):
    """The verify mask replaces causality, and (wrongly) the window too."""

    def window(self, layer, fb):
        return -1 if fb.forward_mode.is_target_verify() else layer.sliding_window_size


class CapDropped(Ported):
    def cap(self, scores, layer, fb):
        return scores


class CapDroppedInMixed(Ported):
    def cap(self, scores, layer, fb):
        return scores if fb.forward_mode.is_mixed() else super().cap(scores, layer, fb)


class CapBeforeScale(Ported):
    """``cap * tanh(q.k / cap) * scale`` instead of capping the scaled score."""

    def scale(self, layer):
        return 1.0

    def cap(self, scores, layer, fb):
        capped = super().cap(scores, layer, fb) if layer.logit_cap > 0 else scores
        return capped * layer.scaling


class CausalityFlipped(Ported):
    def causal(self, layer, fb):
        return not layer.causal


class NonCausalIgnoredInMixed(Ported):
    def causal(self, layer, fb):
        return True if fb.forward_mode.is_mixed() else layer.causal


class GqaModulo(Ported):
    """Query head h reads KV head ``h % kv_heads`` instead of ``h // group``."""

    def head_map(self, layer, device):
        return torch.arange(layer.tp_q_head_num, device=device) % layer.tp_k_head_num


class ScaleIgnored(Ported):
    """Recomputes ``head_dim ** -0.5`` instead of using ``layer.scaling``."""

    def scale(self, layer):
        return layer.head_dim**-0.5


class ScaleFromVHeadDim(Ported):
    def scale(self, layer):
        return layer.v_head_dim**-0.5


class PrefixIgnored(Ported):
    """Extend attends over the new tokens only (a prefill kernel without the cached prefix)."""

    def visible(self, meta, layer, fb):
        vis = super().visible(meta, layer, fb)
        if fb.forward_mode.is_decode():
            return vis
        k_pos = torch.arange(meta.width, device=vis.device)
        return vis & (k_pos[None, None, :] >= meta.prefix[:, None, None])


class LastPageLenModulo(Ported):
    """``last_page_len = kv_len % page_size``: 0 (an empty page) at an exact multiple."""

    def pages(self, kv_lens, ps):
        num_pages = (kv_lens + ps - 1) // ps
        return num_pages, kv_lens % ps


class PagesFloor(Ported):
    """``num_pages = kv_len // page_size``: the last, partial page is dropped."""

    def pages(self, kv_lens, ps):
        num_pages = kv_lens // ps
        return num_pages, torch.full_like(kv_lens, ps)


class MissedKvWrite(Ported):
    def write(self, layer, fb, k, v):
        pass


class MissedVWrite(Ported):
    def write(self, layer, fb, k, v):
        fb.token_to_kv_pool.get_key_buffer(layer.layer_id)[fb.out_cache_loc] = k.to(fb.token_to_kv_pool.dtype)


class WritesWhenSaveFalse(Ported):
    """Writes the caller's k/v into the cache even with ``save_kv_cache=False`` (the engine wrote it already)."""

    def check_inputs(self, q, k, v, layer, fb, save_kv_cache=True):
        q, k, v = super().check_inputs(q, k, v, layer, fb, save_kv_cache)
        if not save_kv_cache and k is not None and v is not None:
            self.save_kv(layer, fb, k, v)
        return q, k, v


class ReadsKvNotCache(Ported):
    """Attends over the k/v passed for the new tokens (a ragged prefill) instead of the cache."""

    def keys_values(self, meta, layer, fb, k, v, kb, vb):
        keys, values = super().keys_values(meta, layer, fb, k, v, kb, vb)
        k_pos = torch.arange(meta.width, device=keys.device)
        new = (k_pos[None, :] >= meta.prefix[:, None]) & meta.valid  # [B, W]
        q_start = meta.q_index[:, :1]
        index = torch.where(new, q_start + k_pos[None, :] - meta.prefix[:, None], 0)
        keys = torch.where(new[..., None, None], k[index], keys)
        values = torch.where(new[..., None, None], v[index], values)
        return keys, values


class VerifyMaskTransposed(Ported):
    def mask_offset(self, q_off, k_pos, q_lens, kv_lens):
        return k_pos[None, None, :] * q_lens[:, None, None] + q_off[None, :, None]  # column-major


class VerifyMaskIgnored(Ported):
    def custom_mask(self, fb, *args):
        return None


class VerifySeqLensIncludeDrafts(Ported):
    """Takes TARGET_VERIFY's seq_lens as counting the draft tokens too."""

    def query_lens(self, fb):
        q_lens, kv_lens = _device_lens(fb)
        if fb.forward_mode.is_target_verify():
            return q_lens, fb.seq_lens.long().clamp(min=1)
        return q_lens, kv_lens


class MixedRoutedAsDecode(Ported):
    """MIXED sent down the decode path, which skips the causal mask (one query sees every key)."""

    def causal(self, layer, fb):
        return False if fb.forward_mode.is_mixed() else layer.causal


class DraftExtendNotCausal(Ported):
    def causal(self, layer, fb):
        return False if fb.forward_mode.is_draft_extend() else layer.causal


class GraphStateKept(Ported):
    """Refills its graph metadata only when the padded batch size changes (a cached mask)."""

    def init_forward_metadata_in_graph(self, fb):
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
        if getattr(fb, "graph_static", False):
            cache = self.__dict__.setdefault("_kept", {})
            key = (fb.batch_size, meta.width)
            if key not in cache or getattr(self, "_last_bs", None) != fb.batch_size:
                self.fill(meta, fb)
                cache[key] = meta
            else:
                kept = cache[key]
                meta.slots, meta.valid, meta.q_pos, meta.q_index = kept.slots, kept.valid, kept.q_pos, kept.q_index
                meta.prefix, meta.custom = kept.prefix, kept.custom
            self._last_bs = fb.batch_size
            return
        self.fill(meta, fb)


class FreshMetadataInOutGraph(Ported):
    """Builds every metadata tensor in out_graph (fresh tensors each step) and reads them in the captured forward."""

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        super().init_forward_metadata_out_graph(fb, in_capture)
        if not fb.forward_mode.is_idle():
            self.fill(self.forward_metadata, fb)

    def init_forward_metadata_in_graph(self, fb):
        pass


class Batch1FastPathLayout(Ported):
    """A single-request fast path that returns heads-major ``[Hq, T, Dv]`` flattened."""

    def output(self, out, layer, fb):
        if fb.batch_size == 1:
            return out.transpose(0, 1).reshape(out.shape[0], -1)
        return super().output(out, layer, fb)


class LayerIdIgnored(Ported):
    def buffers(self, layer, fb):
        return fb.token_to_kv_pool.get_kv_buffer(0)


class LayerIdIgnoredOnWrite(Ported):
    def write(self, layer, fb, k, v):
        AttentionBackend.save_kv(self, replace(layer, layer_id=0), fb, k, v)


class Bf16Accumulation(Ported):
    """The softmax denominator summed key by key in the input dtype (bf16): long contexts stall the sum."""

    def softmax(self, scores, dtype):
        if dtype == torch.float32:
            return super().softmax(scores, dtype)
        e = torch.exp(scores - scores.amax(-1, keepdim=True).clamp(min=-1e30))
        total = torch.zeros_like(e[..., :1], dtype=dtype)
        for j in range(e.shape[-1]):
            total = total + e[..., j : j + 1].to(dtype)
        return e / total.float()


class NanZeroed(Ported):
    """``nan_to_num`` over the probabilities: NaN in q or the cache silently becomes 0."""

    def finish(self, probs):
        return probs.nan_to_num(0.0)


class PaddingKeysVisible(Ported):
    """Keys past a request's length (the padded tail of its block) are not masked."""

    def visible(self, meta, layer, fb):
        saved = meta.valid
        meta.valid = torch.ones_like(saved)
        try:
            return super().visible(meta, layer, fb)
        finally:
            meta.valid = saved


class ReqPoolIndicesIgnored(Ported):
    """Request r's tokens read from row r of req_to_token instead of row req_pool_indices[r]."""

    def rows(self, fb):
        return torch.arange(fb.seq_lens.shape[0], device=fb.seq_lens.device)


class DecodePositionOffByOne(Ported):
    """The decode query sits at position seq_len (not seq_len - 1): the window is shifted by one."""

    def positions(self, fb, prefix, q_off):
        pos = super().positions(fb, prefix, q_off)
        return pos + 1 if fb.forward_mode.is_decode() else pos


class WriteLocFromSeqLens(Ported):
    """Writes the decode token at req_to_token[row, seq_len] (one past it) instead of out_cache_loc."""

    def write(self, layer, fb, k, v):
        if not fb.forward_mode.is_decode():
            return AttentionBackend.save_kv(self, layer, fb, k, v)
        rt = fb.req_to_token_pool.req_to_token
        loc = rt[fb.req_pool_indices.long(), fb.seq_lens.long()].long()
        kb, vb = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        kb[loc], vb[loc] = k.to(kb.dtype), v.to(vb.dtype)


class SoftmaxWithoutMax(Ported):
    """``exp(s) / sum(exp(s))`` without subtracting the row maximum: large logits overflow to inf / inf."""

    def softmax(self, scores, dtype):
        e = torch.exp(scores)
        return e / e.sum(-1, keepdim=True)


class CappedPathInCacheDtype(Ported):
    """With a logit cap, the scores and the cap are computed in the cache dtype (bf16), not float32."""

    def scores(self, q_pad, keys, layer, fb):
        if layer.logit_cap <= 0:
            return super().scores(q_pad, keys, layer, fb)
        low = fb.token_to_kv_pool.dtype
        return super().scores(q_pad.to(low), keys.to(low), layer, fb)

    def cap(self, scores, layer, fb):
        if layer.logit_cap <= 0:
            return scores
        return (layer.logit_cap * torch.tanh(scores / layer.logit_cap)).to(scores.dtype).float()


class SlotOffsetIgnored(Ported):
    """Reads whole pages: the slot of key ``j`` is ``page_of(j) * page_size + j % page_size`` (aligned only)."""

    def slots(self, fb, rows, k_pos, ps):
        page_ids = fb.req_to_token_pool.req_to_token[rows][:, (k_pos // ps) * ps].long() // ps
        return page_ids * ps + k_pos % ps


class StartLayerSubtractedTwice(Ported):
    """Indexes the pool with ``layer_id - start_layer`` through an accessor that already subtracts it."""

    def buffers(self, layer, fb):
        pool = fb.token_to_kv_pool
        return pool.get_kv_buffer(layer.layer_id - pool.start_layer)


class WindowIgnoredWhenNonCausal(Ported):
    """The window is applied only together with the causal mask."""

    def window(self, layer, fb):
        return layer.sliding_window_size if self.causal(layer, fb) else -1


class VerifyOutputHeadDim(Ported):
    """TARGET_VERIFY's output buffer sized with head_dim instead of v_head_dim."""

    def output(self, out, layer, fb):
        if fb.forward_mode.is_target_verify() and layer.v_head_dim != layer.head_dim:
            wide = out.new_zeros(out.shape[0], out.shape[1], layer.head_dim)
            wide[..., : min(layer.head_dim, layer.v_head_dim)] = out[..., : layer.head_dim]
            out = wide
        return super().output(out, layer, fb)


class NanZeroedInSpeculativeModes(Ported):
    """``nan_to_num`` in the TARGET_VERIFY / DRAFT_EXTEND path only."""

    def finish(self, probs):
        return probs.nan_to_num(0.0) if self._mode.is_target_verify() or self._mode.is_draft_extend() else probs

    def attend(self, q, k, v, layer, fb, save_kv_cache):
        self._mode = fb.forward_mode
        return super().attend(q, k, v, layer, fb, save_kv_cache)


class HeadDimTruncatedAt128(Ported):
    """A tile table whose largest head-dim tile is 128: dims past 128 are dropped from the scores."""

    def scores(self, q_pad, keys, layer, fb):
        return super().scores(q_pad[..., :128], keys[..., :128], layer, fb)


class ManyRequestsGqaModulo(Ported):
    """The all-heads task path (taken from 4 requests per thread on) maps query head h to KV head h % kv_heads."""

    def head_map(self, layer, device):
        if self._bs >= 4 * torch.get_num_threads():
            return torch.arange(layer.tp_q_head_num, device=device) % layer.tp_k_head_num
        return super().head_map(layer, device)

    def attend(self, q, k, v, layer, fb, save_kv_cache):
        self._bs = fb.batch_size
        return super().attend(q, k, v, layer, fb, save_kv_cache)


class LastQueryTileDropped(Ported):
    """Query tiles of 64 rows: the partial last tile of a request with more than 64 query tokens is not run."""

    def combine(self, probs, values, meta, fb):
        out = super().combine(probs, values, meta, fb)
        q_lens = (meta.q_index < meta.num_tokens).sum(1)  # [B]
        q_off = torch.arange(out.shape[1], device=out.device)
        dropped = (q_lens[:, None] > 64) & (q_off[None, :] >= (q_lens[:, None] // 64) * 64)
        return out.masked_fill(dropped[..., None, None], 0.0)


class SplitRemainderDropped(Ported):
    """Split-KV in chunks of 32 keys: the partial last chunk of a request longer than 32 keys is not read."""

    def visible(self, meta, layer, fb):
        vis = super().visible(meta, layer, fb)
        kv_lens = meta.valid.sum(1)  # [B]
        k_pos = torch.arange(meta.width, device=vis.device)
        read = (kv_lens[:, None] <= 32) | (k_pos[None, :] < (kv_lens[:, None] // 32) * 32)
        return vis & read[:, None, :]


MUTANTS: dict[str, type[Ported]] = {
    cls.__name__: cls
    for cls in (
        WindowOffByOne,
        WindowDroppedInMixed,
        WindowDroppedInDecode,
        WindowDroppedWithCustomMask,
        CapDropped,
        CapDroppedInMixed,
        CapBeforeScale,
        CausalityFlipped,
        NonCausalIgnoredInMixed,
        GqaModulo,
        ScaleIgnored,
        ScaleFromVHeadDim,
        PrefixIgnored,
        LastPageLenModulo,
        PagesFloor,
        MissedKvWrite,
        MissedVWrite,
        WritesWhenSaveFalse,
        ReadsKvNotCache,
        VerifyMaskTransposed,
        VerifyMaskIgnored,
        VerifySeqLensIncludeDrafts,
        MixedRoutedAsDecode,
        DraftExtendNotCausal,
        GraphStateKept,
        FreshMetadataInOutGraph,
        Batch1FastPathLayout,
        LayerIdIgnored,
        LayerIdIgnoredOnWrite,
        Bf16Accumulation,
        NanZeroed,
        PaddingKeysVisible,
        ReqPoolIndicesIgnored,
        DecodePositionOffByOne,
        WriteLocFromSeqLens,
        SoftmaxWithoutMax,
        CappedPathInCacheDtype,
        SlotOffsetIgnored,
        StartLayerSubtractedTwice,
        WindowIgnoredWhenNonCausal,
        VerifyOutputHeadDim,
        NanZeroedInSpeculativeModes,
        HeadDimTruncatedAt128,
        ManyRequestsGqaModulo,
        LastQueryTileDropped,
        SplitRemainderDropped,
    )
}
for _name, _cls in MUTANTS.items():
    _cls.name = _name.lower()


class MutantDevice(Device):
    """A plugin device serving the control and every mutant, each as a backend."""

    name = "mutants"
    plugin_api = 2
    priority = 1

    def __init__(self, backends=None):
        self._backends = backends if backends is not None else [Ported, *MUTANTS.values()]

    def probe(self) -> DeviceCapability:
        return DeviceCapability(
            type="mutants",
            available=True,
            torch_type="cpu",
            count=1,
            name="mutant backends (tests)",
            dtypes=("fp32", "bf16"),
            graph="eager_guard",
            emulated=True,
        )

    def backends(self):
        return list(self._backends)


# ----------------------------------------------------------------------------- MLA, attention sinks, fp8 KV caches


class LatentWithoutRope(Ported):
    """MLA: writes the latent (the value) but not the rope part of the key."""

    def write(self, layer, fb, k, v):
        kb, vb = self.buffers(layer, fb)
        if not shares_storage(kb, vb):
            return super().write(layer, fb, k, v)
        rank = vb.shape[-1]
        kb[fb.out_cache_loc, :, :rank] = quantize_kv(k[..., :rank], kb.dtype, kv_scales(layer)[0])


class MlaValueFromKeyTail(Ported):
    """MLA: reads the value as the key's last ``v_head_dim`` columns instead of its first (the latent)."""

    def keys_values(self, meta, layer, fb, k, v, kb, vb):
        if not shares_storage(kb, vb):
            return super().keys_values(meta, layer, fb, k, v, kb, vb)
        keys = kb[meta.slots]
        return keys, keys[..., -vb.shape[-1] :]


class SinksAfterNormalisation(Ported):
    """Divides the normalised weights by ``1 + exp(sink)``: the sink never meets the row's own max / sum."""

    def sink_softmax(self, scores, sinks, layer, fb):
        return torch.softmax(scores, dim=-1) / (1 + torch.exp(sinks.float()))[None, :, None, None]


class SinksPerKvHead(Ported):
    """Reads query head h's sink at its KV head's index (``sinks[h // group]``)."""

    def sink_softmax(self, scores, sinks, layer, fb):
        return super().sink_softmax(scores, sinks[self.head_map(layer, sinks.device)], layer, fb)


class SinksDroppedInDecode(Ported):
    """A decode kernel without sinks: DECODE steps ignore them."""

    def sink_softmax(self, scores, sinks, layer, fb):
        if fb.forward_mode.is_decode():
            return torch.softmax(scores, dim=-1)
        return super().sink_softmax(scores, sinks, layer, fb)


class Fp8ScaleAppliedTwice(Ported):
    """Dequantises an fp8 cache twice (the kernel and its caller both multiply by the scales)."""

    def dequantize(self, keys, values, layer, cache_dtype):
        keys, values = super().dequantize(keys, values, layer, cache_dtype)
        return super().dequantize(keys, values, layer, cache_dtype)


class Fp8KScaleOnly(Ported):
    """Dequantises the keys of an fp8 cache but not the values."""

    def dequantize(self, keys, values, layer, cache_dtype):
        return super().dequantize(keys, values, layer, cache_dtype)[0], values


class Fp8VScaledWithK(Ported):
    """Dequantises the values of an fp8 cache with ``k_scale``."""

    def dequantize(self, keys, values, layer, cache_dtype):
        return super().dequantize(keys, values, replace(layer, v_scale=layer.k_scale), cache_dtype)


class Fp8WriteNotScaled(Ported):
    """Casts new K/V straight to fp8 (no division by the scales) though reads multiply by them."""

    def write(self, layer, fb, k, v):
        kb, vb = self.buffers(layer, fb)
        if not kv_scaled(kb.dtype):
            return super().write(layer, fb, k, v)
        kb[fb.out_cache_loc] = quantize_kv(k, kb.dtype)
        if not shares_storage(kb, vb):
            vb[fb.out_cache_loc] = quantize_kv(v, vb.dtype)


class Fp8ReadNotDequantised(Ported):
    """Reads the fp8 entries as they are stored: no multiplication by the scales."""

    def dequantize(self, keys, values, layer, cache_dtype):
        return keys, values


for _cls in (
    LatentWithoutRope,
    MlaValueFromKeyTail,
    SinksAfterNormalisation,
    SinksPerKvHead,
    SinksDroppedInDecode,
    Fp8ScaleAppliedTwice,
    Fp8KScaleOnly,
    Fp8VScaledWithK,
    Fp8WriteNotScaled,
    Fp8ReadNotDequantised,
):  # the features of issue 19
    _cls.name = _cls.__name__.lower()
    MUTANTS[_cls.__name__] = _cls


# ----------------------------------------------------------------------------- issue 27: the paths and combinations


class NonCausalBandHidesLaterKeys(Ported):
    """Sinks and MLA on a non-causal windowed layer: the band also ends at the query (``next_tokens = 0``),
    hiding every later key."""

    def visible(self, meta, layer, fb):
        vis = super().visible(meta, layer, fb)
        if layer.causal or layer.sliding_window_size < 0 or not (self._sinks or layer.is_mla):
            return vis
        k_pos = torch.arange(meta.width, device=vis.device)
        return vis & (k_pos[None, None, :] <= meta.q_pos[:, :, None])


class MlaHeadPaddingStride(Ported):
    """MLA with a head count that is not a power of two: the output is computed for the heads padded to the next
    power of two and read back with the unpadded head stride (rows after the first mix heads of two tokens)."""

    def output(self, out, layer, fb):
        heads = layer.tp_q_head_num
        padded = 1 << (heads - 1).bit_length()
        if not layer.is_mla or padded == heads:
            return super().output(out, layer, fb)
        wide = out.new_zeros(out.shape[0], padded, out.shape[2])
        wide[:, :heads] = out
        return wide.reshape(-1)[: out.numel()].view(out.shape[0], -1)


# (FirstTokenSlotCheck, a port whose own batch check replaced hal's by a weaker one, is gone: since plugin API 4 the
# plan edge runs hal's check_batch before any port's plan, so a port can no longer weaken it.)


class VerifyMaskSizedByPrefix(Ported):
    """Reads each request's verify mask as draft x prefix (its start offsets too), not draft x (prefix + draft)."""

    def mask_offset(self, q_off, k_pos, q_lens, kv_lens):
        return q_off[None, :, None] * (kv_lens - q_lens)[:, None, None] + k_pos[None, None, :]


class GraphPaddingWriteRedirected(Ported):
    """Under a captured graph, padding tokens (slot 0) are redirected to slot -1 for a write that skips negative
    slots, but the write indexes with it: the pool's last slot is overwritten."""

    def write(self, layer, fb, k, v):
        if not getattr(fb, "graph_static", False):
            return super().write(layer, fb, k, v)
        loc = torch.where(fb.out_cache_loc == 0, -1, fb.out_cache_loc)
        kb, vb = self.buffers(layer, fb)
        k_scale, v_scale = kv_scales(layer)
        kb[loc] = quantize_kv(k, kb.dtype, k_scale)
        if not shares_storage(kb, vb):
            vb[loc] = quantize_kv(v, vb.dtype, v_scale)


class PaddingSlotWrapsToLastSlot(Ported):
    """Writes the new tokens with ``buffer[out_cache_loc] = k``: a padding token's -1 indexes the pool's last slot."""

    def write(self, layer, fb, k, v):
        kb, vb = self.buffers(layer, fb)
        k_scale, v_scale = kv_scales(layer)
        loc = self.write_slots(fb.out_cache_loc.long())
        kb[loc] = quantize_kv(k, kb.dtype, k_scale)
        if not shares_storage(kb, vb):
            vb[loc] = quantize_kv(v, vb.dtype, v_scale)

    def write_slots(self, loc):
        return loc


class PaddingSlotRedirectedToPage0(PaddingSlotWrapsToLastSlot):
    """Sends a -1 token's write to the padding slot 0 (as SGLang's graph padding writes) instead of writing nothing."""

    def write_slots(self, loc):
        return loc.clamp(min=0)


class PaddingSlotDropsNeighbour(Ported):
    """Skips -1 slots by compacting the slots but not the rows: after a padding token, each real token is written
    with the row before it (the first ``n`` rows go to the ``n`` real slots)."""

    def write(self, layer, fb, k, v):
        kb, vb = self.buffers(layer, fb)
        k_scale, v_scale = kv_scales(layer)
        loc = fb.out_cache_loc.long()
        real = loc[loc >= 0]
        kb[real] = quantize_kv(k[: real.numel()], kb.dtype, k_scale)
        if not shares_storage(kb, vb):
            vb[real] = quantize_kv(v[: real.numel()], vb.dtype, v_scale)


class Tiled32(Ported):
    """A port whose kernels tile head dims by 32: head dims 32..256 in steps of 32, ``v_head_dim`` too. Written
    before hal 0.3, it does not declare ``supports_padding_slots`` (its padding-slot cases are unreached)."""

    head_dims = frozenset(range(32, 257, 32))
    supports_padding_slots = False

    @classmethod
    def unsupported_reasons(cls, config, capability):
        reasons = super().unsupported_reasons(config, capability)
        if config.v_head_dim % 32:
            reasons.append(f"v_head_dim {config.v_head_dim}: the kernels tile head dims by 32")
        return reasons


class DraftExtendValuesFromKeys(Tiled32):
    """The tiled port's DRAFT_EXTEND path reads the values from the key buffer when ``v_head_dim != head_dim``."""

    def keys_values(self, meta, layer, fb, k, v, kb, vb):
        keys, values = super().keys_values(meta, layer, fb, k, v, kb, vb)
        if fb.forward_mode.is_draft_extend() and layer.v_head_dim < layer.head_dim:
            values = keys[..., : layer.v_head_dim]
        return keys, values


class DraftExtendValueTilesStopAtHeadDim(Tiled32):
    """The tiled port's DRAFT_EXTEND value tiles run to ``head_dim``: where ``v_head_dim > head_dim`` the value dims
    past it are never accumulated (zeros in the output); the other modes' tiles run to ``v_head_dim``."""

    def keys_values(self, meta, layer, fb, k, v, kb, vb):
        keys, values = super().keys_values(meta, layer, fb, k, v, kb, vb)
        if fb.forward_mode.is_draft_extend() and layer.v_head_dim > layer.head_dim:
            values = values.clone()
            values[..., layer.head_dim :] = 0
        return keys, values


for _cls in (
    NonCausalBandHidesLaterKeys,
    MlaHeadPaddingStride,
    VerifyMaskSizedByPrefix,
    GraphPaddingWriteRedirected,
    DraftExtendValuesFromKeys,
    PaddingSlotWrapsToLastSlot,
    PaddingSlotDropsNeighbour,
    PaddingSlotRedirectedToPage0,
    DraftExtendValueTilesStopAtHeadDim,  # issue 51
):  # issue 27
    _cls.name = _cls.__name__.lower()
    MUTANTS[_cls.__name__] = _cls
Tiled32.name = "tiled32"  # a second control: a correct port with tile constraints


# ----------------------------------------------------------------------------- mutants of the CPU backend's paths


class _FusedKept(CompiledBackend):
    """The CPU backend with a bug planted in a file of its own: the fused one-call forward stays on (overriding
    ``run_*``, which the fused call stands in for, would turn it off: each mutant class offers the fused call
    itself), so the bug lives only where the checked path runs."""

    def __init_subclass__(cls, **kwargs):
        cls.run_fused = CompiledBackend.run_fused
        super().__init_subclass__(**kwargs)


class CheckedPathCapScaled(_FusedKept):
    """The checked path passes the logit cap multiplied by the softmax scale to the kernel."""

    def run_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        if layer.logit_cap > 0:
            layer = replace(layer, logit_cap=layer.logit_cap * layer.scaling)
        return super().run_decode(q, k, v, layer, fb, save_kv_cache, **kwargs)

    run_extend = run_mixed = run_decode


class CheckedPathStartLayerTwice(_FusedKept):
    """The checked path reads the layer ``layer_id - start_layer`` through the accessor that subtracts it again."""

    def run_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        start = getattr(fb.token_to_kv_pool, "start_layer", 0)
        if start:
            layer = replace(layer, layer_id=max(start, layer.layer_id - start))
        return super().run_decode(q, k, v, layer, fb, save_kv_cache, **kwargs)

    run_extend = run_mixed = run_decode


class Avx2DecodeTailDropped(CompiledBackend):
    """The AVX2 kernel path scores decode keys 8 at a time and drops a request's partial last group: only on
    that ISA path (``HAL_CPU_ISA=avx2``), which an AVX-512 machine never takes by itself; on the fused and the
    checked path alike, as a kernel bug would be."""

    @contextlib.contextmanager
    def _tail_dropped(self, fb):
        meta = self.forward_metadata
        if cpu_kernels.isa() != "avx2" or not fb.forward_mode.is_decode() or getattr(meta, "kv_lens", None) is None:
            yield
            return
        kv_lens = meta.kv_lens
        meta.kv_lens = torch.where((kv_lens > 8) & (kv_lens % 8 != 0), kv_lens - kv_lens % 8, kv_lens)
        try:
            yield
        finally:
            meta.kv_lens = kv_lens

    def run_fused(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        with self._tail_dropped(fb):
            return super().run_fused(q, k, v, layer, fb, save_kv_cache, **kwargs)

    def run_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        with self._tail_dropped(fb):
            return super().run_decode(q, k, v, layer, fb, save_kv_cache, **kwargs)

    run_extend = run_mixed = run_decode


class _KernelBug(CompiledBackend):
    """The CPU backend with a kernel bug planted around its kernels (in a file of its own; the kernels untouched):
    :meth:`planted` changes what a kernel is handed (the query, the new K/V to write, the step's plan), on the fused
    call and on the checked path alike, as a bug in the kernel's C++ would."""

    @contextlib.contextmanager
    def planted(self, layer, fb, q=None, k=None, v=None):
        """``(q, k, v)`` as the buggy kernel would treat them (None stays None), the plan changed while it runs."""
        yield q, k, v

    def run_fused(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        with self.planted(layer, fb, q, k, v) as (q, k, v):
            return super().run_fused(q, k, v, layer, fb, save_kv_cache, **kwargs)

    def run_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        with self.planted(layer, fb, q) as (q, _, _):
            return super().run_decode(q, k, v, layer, fb, save_kv_cache, **kwargs)

    run_extend = run_mixed = run_decode

    def save_kv(self, layer, fb, k, v):
        with self.planted(layer, fb, None, k, v) as (_, k, v):
            super().save_kv(layer, fb, k, v)


def _first_other_isa() -> str | None:
    """The first ISA path this CPU runs that it does not take by default (an AMX Xeon: avx512_bf16; an AVX2 machine:
    amx_emulated), None where it runs one only."""
    runnable = cpu_kernels.runnable_isas()
    default = cpu_kernels.default_isa(runnable, cpu_kernels.cpu_features()["vendor"])
    return next((name for name in runnable if name != default), None)


class IsaBf16TailDropped(_KernelBug):
    """On the first ISA path the CPU does not take by default, the bf16 dot product drops its float32 tail: the
    query-key dims past the last multiple of 32 (head dim 80: MLA's rope part of 16). The default path, and fp32
    queries, are right, so only a run of that path with bf16 at such a head dim shows it."""

    tail_isa = _first_other_isa()

    @contextlib.contextmanager
    def planted(self, layer, fb, q=None, k=None, v=None):
        cut = layer.head_dim // 32 * 32
        if q is not None and q.dtype == torch.bfloat16 and cut < layer.head_dim and cpu_kernels.isa() == self.tail_isa:
            q = q.clone()
            q.reshape(-1, layer.head_dim)[:, cut:] = 0
        yield q, k, v


class BlockTableSecondPageTwice(_KernelBug):
    """The kernel's block-table walk reads a request's second page where its third belongs: a context of three pages
    or more, given as a block table (``req_to_page``), reads its second page twice. Token tables are right."""

    @contextlib.contextmanager
    def planted(self, layer, fb, q=None, k=None, v=None):
        meta = self.forward_metadata
        table = getattr(meta, "req_to_page", None)
        if table is None or table.shape[1] < 3:
            yield q, k, v
            return
        walked = table.clone()
        walked[:, 2] = table[:, 1]
        meta.req_to_page = walked
        try:
            yield q, k, v
        finally:
            meta.req_to_page = table


class HeadMajorWriteHeadsRolled(_KernelBug):
    """The KV write into head-major pages puts KV head ``h``'s row at head ``h + 1`` (mod the heads): the page
    offset is right, the head stride off by one head. Token-major pools are written right."""

    @contextlib.contextmanager
    def planted(self, layer, fb, q=None, k=None, v=None):
        if k is None or pool_kv_layout(fb.token_to_kv_pool) != HEAD_MAJOR:
            yield q, k, v
            return
        heads = layer.tp_k_head_num
        k, v = (t.reshape(t.shape[0], heads, -1).roll(1, dims=1).reshape(t.shape) for t in (k, v))
        yield q, k, v


CPU_MUTANTS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        CheckedPathCapScaled,
        CheckedPathStartLayerTwice,
        Avx2DecodeTailDropped,
        IsaBf16TailDropped,
        BlockTableSecondPageTwice,
        HeadMajorWriteHeadsRolled,
    )
}
for _name, _cls in CPU_MUTANTS.items():
    _cls.name = _name.lower()


class CpuMutantDevice(Device):
    """A plugin device serving the CPU backend's mutants on the CPU, with the CPU device's paths (ISAs)."""

    name = "cpu_mutants"
    plugin_api = 2
    priority = 1

    def probe(self) -> DeviceCapability:
        return cpu_device.probe()

    def backends(self):
        return list(CPU_MUTANTS.values())

    def conformance_paths(self, backend_cls, capability):
        return cpu_device.conformance_paths(backend_cls, capability)


# ----------------------------------------------------------------------------- mutants of the Triton tile choices

from hal.devices.triton_backend import TritonBackend  # noqa: E402
from hal.kernels.triton.sizing import extend_blocks, next_power_of_2  # noqa: E402


class ExtendGridOverBlockN(TritonBackend):
    """The extend launch counts its grid's query blocks with BLOCK_N instead of BLOCK_M: where BLOCK_M < BLOCK_N
    (the 16x32 tile, which the sm_80/sm_90 fp32 tables pick at head dim 256) the last query blocks of a long
    extend are never computed. The interpreter's own tiles (64x64, 64x32) hide it: only the ``tiles=16x32`` path
    of ``hal check`` shows it."""

    path, families = "tiles=16x32", ("page_boundaries",)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        block = max(16, next_power_of_2(max(layer.head_dim, layer.v_head_dim)))
        dots = "fp32" if q.dtype == torch.float32 else "bf16"
        block_m, block_n = self.tiles.extend or extend_blocks(self.capability.arch, block, dots)[:2]
        meta = self.forward_metadata
        rows = meta.max_extend_len
        meta.max_extend_len = min(rows, -(-rows // block_n) * block_m)  # cdiv(rows, BLOCK_N) blocks of BLOCK_M
        try:
            return super().run_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            meta.max_extend_len = rows


class SplitKvSinksDropped(TritonBackend):
    """Split-KV decode leaves the sinks out of the launch (the one-split launch passes them): the interpreter
    splits only requests of 256 keys and more, which no sinks case has; the ``splits=4`` path of ``hal check``
    splits every request."""

    path, families = "splits=4", ("sinks",)

    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.forward_metadata.num_kv_splits > 1:
            kwargs.pop("sinks", None)
        return super().run_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


TRITON_MUTANTS: dict[str, type] = {cls.__name__: cls for cls in (ExtendGridOverBlockN, SplitKvSinksDropped)}
for _name, _cls in TRITON_MUTANTS.items():
    _cls.name = _name.lower()


class TritonMutantDevice(Device):
    """A plugin device serving the Triton backend's mutants on the CPU (``TRITON_INTERPRET=1``); their paths are
    the backend's own (its tile choices)."""

    name = "triton_mutants"
    plugin_api = 2
    priority = 1

    def probe(self) -> DeviceCapability:
        return cpu_device.probe()

    def backends(self):
        return list(TRITON_MUTANTS.values())
