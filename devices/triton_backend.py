"""``triton``: the attention backend over :mod:`hal.kernels.triton`, on any device with a Triton target.

Shared by the devices that run Triton (it lives beside them, in no device's package, so no
device package imports another): CUDA and ROCm compile the kernels; the CPU runs them under
``TRITON_INTERPRET=1``, for correctness only. Metadata follows the contract: ``out_graph`` takes the host-side
numbers (split count, longest extend) and allocates (or, under graph capture, slices
the preallocated buffers); ``in_graph`` fills ``kv_indptr`` / ``kv_indices`` on the device
with the helper ops, which are Triton kernels exactly when ``support_triton()`` and the
device's Triton target allow.

Model features: MLA (one latent KV head, ``head_dim`` 576 / ``v_head_dim`` 512, the value a
view of the key's latent columns) runs in the same kernels, which tile a head dim that is not a
power of two as a main part plus a rest (512 + 64); attention sinks join the softmax denominator
(decode: once, in the split merge); an fp8 pool (e4m3fn, e5m2) is written quantised by
``write_kv`` (saturating, the layer's ``k_scale`` / ``v_scale``) and read as bytes, decoded by
bit manipulation and scaled, so it needs no hardware fp8 conversion (Triton has it only on
sm_89+) and runs under the interpreter exactly (whose own fp32 -> fp8 cast flushes
subnormals). Over an fp8 pool the extend kernel reads the new tokens from the pool too, as
stored, like every other key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, device_lens, host_lens
from hal.capability import DeviceCapability
from hal.errors import GraphCaptureError
from hal.kernels.reference import kv_scales
from hal.kernels.triton.sizing import (
    TILE_CHOICES,
    TILES_ENV,
    UNTABLED_TILES,
    TileChoice,
    decode_splits,
    extend_blocks,
    extend_tiles_of,
    tile_choice,
)
from hal.kv_dtypes import DTYPE_FAMILIES, kv_scaled

__all__ = ["TritonBackend"]


@dataclass
class TritonMetadata:
    """One step's metadata. ``B``: batch; every tensor on the device."""

    num_kv_splits: int
    max_extend_len: int
    kv_indptr: torch.Tensor  # [B + 1]; decode: all keys, extend: the cached prefix
    kv_indices: torch.Tensor  # pool slots, concatenated
    kv_end: torch.Tensor | None = None  # int64 [B], keys per request in kv_indices
    qo_indptr: torch.Tensor | None = None  # [B + 1], extend modes
    custom_mask: torch.Tensor | None = None
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # decode, per window


def _extend_tiles(arch: str | None, head_dim: int, v_head_dim: int, dtype: str, tiles: TileChoice) -> str:
    """The extend kernel's (BLOCK_M, BLOCK_N) for these head dims and the cache's dtype name: the forced ``tiles``,
    else as ``extend_attention`` picks it (dots run in 16-bit only when everything is one 16-bit dtype)."""
    block = max(16, 1 << (max(head_dim, v_head_dim) - 1).bit_length())
    block_m, block_n = tiles.extend or extend_blocks(arch, block, dtype if dtype in ("bf16", "fp16") else "fp32")[:2]
    return f"extend: {block_m}x{block_n} tiles"


# The case families each forced choice reruns (``conformance_paths``), chosen by what the choice changes:
# a tile changes the extend kernel's loop bounds and masks per tile (the causal bound, the window's left edge, the
# custom mask and its blind rows, long extends across many tiles) and decode's key tile; a split count changes the
# shares and their merge (empty shares, sinks and windows in the merge, MLA's wide rows, graphs whose split count
# is fixed at capture). One split is what the interpreter and small batches take by themselves: its path reruns the
# cases that split on the default path (long contexts, graphs sized by the request table's width).
TILE_FAMILIES = ("basic", "window", "non_causal", "non_causal_window", "verify_tree", "page_boundaries")
SPLIT_FAMILIES = ("basic", "window", "sinks", "mla", "v_head_dim", "large_logits", "page_boundaries", "graph")
ONE_SPLIT_FAMILIES = ("paged", "graph")


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_padding_slots = True  # -1 in out_cache_loc: no KV written (docs/porting.md)
    dtypes = frozenset({"fp32", "bf16", "fp16"})
    kv_cache_dtypes = frozenset({"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"})  # fp8: decoded in software
    supports_mla = True
    supports_sinks = True
    needs_cpu_seq_lens = True  # kv_indices is sized by seq_lens_sum outside graphs

    option_defaults = {"tiles": None}  # one of sizing.TILE_CHOICES (None: HAL_TRITON_TILES, else "auto")

    def __init__(self, capability: DeviceCapability, config=None, **options):
        super().__init__(capability, config, **options)
        self.tiles = tile_choice(self.options["tiles"])
        self.graph_max_bs: int | None = None
        self.graph_buffers: dict[str, torch.Tensor] = {}
        # decode's split count fills the device's compute units (None, e.g. the CPU interpreter: LEGACY_MAX_SPLITS)
        self.sm_count = capability.compute_units

    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        if not capability.triton_target:
            return [f"no Triton target: {capability.reasons.get('triton', 'unknown')}"]
        return []

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        if capability.triton_interpreted:
            return ["runs interpreted (TRITON_INTERPRET=1): for correctness only, orders of magnitude slow"]
        return super().notes(capability)

    @classmethod
    def routes(cls, config, capability: DeviceCapability) -> list[str]:
        """Decode with one share of the keys or split-KV; the extend kernel's tile for this head dim (the one
        ``HAL_TRITON_TILES`` forces, under a tile path of ``hal check``)."""
        splits = tile_choice().splits
        decode = ["decode: one split"] if splits == 1 else ["decode: split-KV"] if splits else []
        tiles = _extend_tiles(capability.arch, config.head_dim, config.v_head_dim, config.dtype_name, tile_choice())
        return (decode or ["decode: one split", "decode: split-KV"]) + [tiles]

    @classmethod
    def conformance_paths(cls, capability: DeviceCapability) -> list[dict]:
        """Every forced tile choice (``sizing.TILE_CHOICES`` but ``auto``) as a ``hal check`` path
        (``hal.conformance.paths``) under ``HAL_TRITON_TILES``. On an architecture the sizing tables cover, a
        ``tiles=`` choice none of its table rows holds is unreached: only tabled tiles are compiled and sized
        for its shared memory (``hal.kernels.triton.compile_check``); the interpreter and untabled targets run
        every one."""
        tabled = extend_tiles_of(capability.arch)
        paths = []
        for name, choice in TILE_CHOICES.items():
            if choice.splits:
                families = ONE_SPLIT_FAMILIES if choice.splits == 1 else SPLIT_FAMILIES
                paths.append({"name": name, "env": {TILES_ENV: name}, "families": families, "modes": ("DECODE",)})
            elif choice.extend is None:  # auto: the default path
                continue
            elif tabled is not None and choice.extend not in tabled:
                why = f"the sizing table of {capability.arch} never picks {name}: not compiled nor sized for it"
                paths.append({"name": name, "unreached": why})
            elif tabled is None and choice.extend in UNTABLED_TILES:
                why = (
                    f"not run apart: outside the sizing tables ({capability.arch or 'the interpreter'}) the default "
                    f"path takes {name} itself (its route counts the cases)"
                )
                paths.append({"name": name, "unreached": why})
            else:
                paths.append({"name": name, "env": {TILES_ENV: name}, "families": TILE_FAMILIES})
        return paths

    def route_of(self, forward_batch: ForwardBatch, layer) -> list[str]:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return []
        if mode.is_decode():
            splits = self.plan.metadata_for(forward_batch).num_kv_splits
            return ["decode: split-KV" if splits > 1 else "decode: one split"]
        dtype = DTYPE_FAMILIES.get(forward_batch.token_to_kv_pool.dtype, "fp32")
        return [_extend_tiles(self.capability.arch, layer.head_dim, layer.v_head_dim, dtype, self.tiles)]

    def support_triton(self) -> bool:
        return True

    # -- metadata ----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_max_bs = max_bs
        self.graph_buffers = {}  # sized on the first capture, when req_to_token's width is known

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _buffer(self, graph: bool, name: str, size: int, dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        """For a graph's static batch, the first ``size`` elements of a fixed (zero-initialised) buffer;
        otherwise a new tensor, zeroed when ``zeros``."""
        if not graph:
            return (torch.zeros if zeros else torch.empty)(size, dtype=dtype, device=self.device)
        buf = self.graph_buffers.get(name)
        if buf is None or buf.numel() < size:
            raise GraphCaptureError(
                f"graph buffer {name} holds {0 if buf is None else buf.numel()} < {size}: "
                "call init_cuda_graph_state with the largest captured batch size first"
            )
        return buf[:size]

    def plan_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if fb.forward_mode.is_idle():  # forward() returns without attention: nothing to prepare
            self.plan.set_metadata(None, fb)
            return
        bs, graph = fb.batch_size, self.plan.is_graph_batch(fb, in_capture)
        width = fb.req_to_token_pool.req_to_token.shape[1]
        if graph and not self.graph_buffers and self.graph_max_bs is not None:
            self.graph_buffers = {
                "kv_indptr": torch.zeros(self.graph_max_bs + 1, dtype=torch.int32, device=self.device),
                "kv_indices": torch.zeros(self.graph_max_bs * width, dtype=torch.int32, device=self.device),
            }
        kv_heads = self.config.tp_k_head_num if self.config is not None else 8
        if graph:  # fixed at capture: every replay launches the same grid over buffers of the same size
            splits = self._splits(bs, kv_heads, width) if fb.forward_mode.is_decode() else 1
            keys = bs * width
            max_extend = fb.out_cache_loc.shape[0] // bs
        else:
            lens = host_lens(fb)
            if fb.forward_mode.is_decode():
                keys = sum(lens.kv)
                splits = self._splits(bs, kv_heads, max(lens.kv, default=1))
            else:
                keys, splits = sum(lens.prefix), 1
            max_extend = max(lens.query, default=0)
        meta = TritonMetadata(
            num_kv_splits=splits,
            max_extend_len=max_extend,
            kv_indptr=self._buffer(graph, "kv_indptr", bs + 1, torch.int32, zeros=True),  # [0] stays 0
            kv_indices=self._buffer(graph, "kv_indices", keys, torch.int32),
        )
        self.plan.set_metadata(meta, fb)

    def _splits(self, batch: int, kv_heads: int, max_kv_len: int) -> int:
        """Decode's share count: the forced one (``tiles``), else sized for the device's compute units."""
        return self.tiles.splits or decode_splits(batch, kv_heads, max_kv_len, self.sm_count)

    def plan_in_graph(self, fb: ForwardBatch) -> None:
        mode = fb.forward_mode
        if mode.is_idle():
            return
        meta = self.plan.metadata_for(fb)
        q_lens, kv_lens = device_lens(fb)
        # decode reads every key from the cache; the extend kernel reads the new tokens from k/v
        meta.kv_end = kv_lens if mode.is_decode() else kv_lens - q_lens
        # kv_indptr[0] is 0 from its allocation: writing it here (kv_indptr[0] = 0) would be a host-to-device
        # copy with a stream sync on CUDA, which graph capture refuses
        torch.cumsum(meta.kv_end, 0, out=meta.kv_indptr[1:])
        self.steps.helper_ops.build_kv_indices(
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            None,
            meta.kv_end,
            meta.kv_indptr,
            meta.kv_indices,
        )
        if not mode.is_decode():
            meta.qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(q_lens, 0, out=meta.qo_indptr[1:])
            meta.custom_mask = fb.spec_info.custom_mask if mode.is_target_verify() else None

    def _window_indices(self, fb: ForwardBatch, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode ``(kv_indptr, kv_indices)`` keeping each request's last ``window + 1`` keys."""
        meta = self.plan.metadata_for(fb)
        if window not in meta.windows:
            start = (meta.kv_end - 1 - window).clamp(min=0)
            indptr = torch.zeros_like(meta.kv_indptr)
            torch.cumsum(meta.kv_end - start, 0, out=indptr[1:])
            indices = torch.empty_like(meta.kv_indices)
            self.steps.helper_ops.build_kv_indices(
                fb.req_to_token_pool.req_to_token, fb.req_pool_indices, start, meta.kv_end, indptr, indices
            )
            meta.windows[window] = (indptr, indices)
        return meta.windows[window]

    # -- forward -----------------------------------------------------------------------
    def save_kv(self, layer, forward_batch: ForwardBatch, k: torch.Tensor, v) -> None:
        """The Triton ``write_kv`` for every pool: fp8 quantised with the layer's scales, MLA's key only."""
        from hal.kernels import triton as kernels

        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        kernels.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v, *kv_scales(layer))

    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        """The split-KV decode kernel; its merge stage writes ``out`` (the caller's ``[T, Hq, Dv]`` view, any row
        strides) in place, or a new tensor where ``out`` is None."""
        from hal.kernels import triton as kernels

        meta = self.forward_metadata
        kv_indptr, kv_indices = meta.kv_indptr, meta.kv_indices
        if layer.sliding_window_size >= 0:
            kv_indptr, kv_indices = self._window_indices(forward_batch, layer.sliding_window_size)
        bs, heads = q.shape[0], layer.tp_q_head_num
        splits = meta.num_kv_splits
        out = q.new_empty(bs, heads, layer.v_head_dim) if out is None else out
        partial_out = torch.empty(bs, heads, splits, layer.v_head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(bs, heads, splits, dtype=torch.float32, device=q.device)
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        k_scale, v_scale = kv_scales(layer)
        kernels.decode_attention(
            q,
            k_buffer,
            v_buffer,
            out,
            kv_indptr,
            kv_indices,
            scale=layer.scaling,
            logit_cap=layer.logit_cap,
            num_kv_splits=splits,
            partial_out=partial_out,
            partial_lse=partial_lse,
            sinks=_contiguous(kwargs.get("sinks")),
            k_scale=k_scale,
            v_scale=v_scale,
            arch=self.capability.arch,
            block_n=self.tiles.decode_n,
        )
        return out

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        """The extend kernel; it writes ``out`` (the caller's ``[T, Hq, Dv]`` view, any row strides) in place, or a
        new tensor where ``out`` is None."""
        from hal.kernels import triton as kernels

        meta = self.forward_metadata  # the kernel reads the new tokens from k/v (read back by the prologue)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim) if out is None else out
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        k_scale, v_scale = kv_scales(layer)
        # the new tokens read at their slots, as stored, from an fp8 pool or when the engine wrote them
        # (save_kv_cache=False: the cache, not k/v, is what they are); MLA without v: the key's latent
        from_pool = kv_scaled(k_buffer.dtype) or not save_kv_cache
        new_kv_loc = forward_batch.out_cache_loc if from_pool else None
        if v is None and k is not None:
            v = k[..., : layer.v_head_dim]
        kernels.extend_attention(
            q,
            k,
            v,
            out,
            k_buffer,
            v_buffer,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            scale=layer.scaling,
            max_extend_len=meta.max_extend_len,
            causal=layer.causal,
            sliding_window=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            custom_mask=meta.custom_mask,
            arch=self.capability.arch,
            block_m=self.tiles.extend and self.tiles.extend[0],
            block_n=self.tiles.extend and self.tiles.extend[1],
            sinks=_contiguous(kwargs.get("sinks")),
            k_scale=k_scale,
            v_scale=v_scale,
            new_kv_loc=new_kv_loc,
        )
        return out

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        return self.run_extend(q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)


def _contiguous(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as the kernels read them (a no-op for the usual contiguous ``[Hq]`` parameter)."""
    return None if sinks is None else sinks.contiguous()
