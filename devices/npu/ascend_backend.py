"""``ascend``: the attention backend over torch_npu's attention ops (``hal.kernels.npu``).

The backend plans a step (its metadata, with the :class:`~hal.devices.npu.metadata.StepFacts` routing reads), then
runs each layer through the op its route names: ``routing.py`` chooses, per step and chip generation, with no state
of the backend's (the ops' limits: ``hal.kernels.npu.limits``, their sources: ``hal.kernels.npu.contracts``; the
table: docs/hardware-contracts.md); the backend owns its captured graph tasks (``graph_tasks.GraphTasks``).

* DECODE: ``npu_fused_infer_attention_score`` (TND, paged) where it serves the layer (A2/A3/A5), a window as band
  mode 4 with a padding row per request (the op ignores the band at one query token), and so a request over more
  than 262144 keys (the op's Q_S = 1 limit; 310P's ATB calls go in pieces of <= 2048 requests); otherwise
  ``_npu_paged_attention`` (:func:`~hal.kernels.npu.paged_decode`), or with a window
  ``_npu_paged_attention_splitfuse`` (:func:`~hal.kernels.npu.paged_mixed`) with a windowed mask.
* EXTEND / DRAFT_EXTEND: FIA (:func:`~hal.kernels.npu.paged_prefill`, ``sparse_mode`` 3 causal / 4 window /
  0 non-causal) when it can serve the layer (page size a multiple of 128 in [128, 512], head dim 128 or 192 on
  A2/A3, ``hal.kernels.npu.limits.FIA_TND_HEAD_DIMS``, a multiple of 16 <= 512 on A5, as vllm-ascend sends there:
  ``fia_head_dim_reason``); otherwise splitfuse, whose mask carries causal / window /
  non-causal. ``notes()`` and ``extend_route(config)`` declare it.
* 310P: the ATB ops read FRACTAL_NZ caches and an NZ splitfuse mask. A ``fractal_nz`` pool (the layout this
  backend prefers there: ``kv_layouts``, allocated NZ once by ``format_kv_pages``) is read in place and written with
  ``_npu_reshape_and_cache``, as vllm-ascend's 310P runner does; a token-major (ND) pool is written with
  ``npu_scatter_nd_update_`` and read through a per-layer NZ copy of the batch's pages (``_nz_caches``).
* TARGET_VERIFY: splitfuse with hal's custom mask (per request ``[draft, seq_len + draft]``).
* MIXED: ``run_mixed``, one call for the whole batch (decodes and chunked prefills): FIA where it serves the layer,
  else splitfuse; ``run_extend`` sends a MIXED batch down the same path.

Latent MLA (A2/A3; ``MLA_OFF`` says why not on A5 / 310P), over ``hal.MLAKVPool``'s one ``[slots, 1,
kv_lora_rank + rope]`` cache: the KV write is ``_npu_reshape_and_cache_siso`` (ATB, key only) on A2,
``npu_scatter_nd_update_`` on A3; DECODE without a window is ``_npu_paged_attention_mla`` on that cache in place (as
SGLang's NPU backend, which concatenates its two caches first); every other step is
``npu_fused_infer_attention_score_v2`` with ``query_rope`` / ``key_rope`` (as vllm-ascend's ``mla_v1.py`` absorbed
path): TND, sparse mode 3, 4 (band) for windows, 9 (tree mask) for TARGET_VERIFY, over the batch's pages copied
apart into latent and rope caches (``mla_split``: FIA takes them as two contiguous tensors). Attention sinks
(``forward(..., sinks=)``): ``npu_fused_infer_attention_score_v2`` with ``learnable_sink`` for decode, extend and
mixed steps on A2/A3 (its product table) and A5 (vllm-ascend calls it there with no device gate:
``attention_v1.py``; SGLang ``forward_extend``/``forward_decode``); verify with sinks, and sinks on 310P, are refused
with the reason.
fp8 KV caches are off with a reason per generation (``_fp8_reason``).

KV writes use the NPU ops (``save_kv``, the op ``routing.kv_write_op`` names: ``npu_scatter_pa_kv_cache``;
``_npu_reshape_and_cache`` into a 310P FRACTAL_NZ pool; ``npu_scatter_nd_update_`` into a 310P token-major pool and
for MLA on A3; ``_npu_reshape_and_cache_siso`` for MLA on A2), not the helper ops: they are what vllm-ascend and
SGLang write the paged cache with on Ascend, and take slots cast on the device. The helper ops (``helper_ops``:
positions, kv indices for an engine) stay consistent with that choice: ``support_triton()`` is True only on a
device with a Triton NPU target (triton-ascend), so everything else gets the torch versions.

Host/device split: the ops take per-request lengths on the host, so ``init_forward_metadata_out_graph``
keeps them as Python lists (the wrappers make the CPU int32 tensors / lists the ops take) and
builds the splitfuse masks (once per batch per variant, other windows lazily);
``init_forward_metadata_in_graph`` only gathers the block table on the device (a static shape).
Eager steps also check, with one host read, that every request's token ``i`` sits at offset
``i % page_size`` of its page, as the block tables assume; a batch laid out otherwise (SGLang's
attention kit builds such layouts; its paged allocator never does) is served through a
page-aligned scratch copy of its keys and values (``AscendMetadata.relayout``).
``forward`` reads no device tensor on the host, except outside any graph: the first layer with a new window in a
TARGET_VERIFY batch, whose mask copies the custom mask to the host, and an eager MLA verify step, which checks
its custom mask against FIA's tree mask (``_tree_mask``).
Under the emulation each op runs as one opaque launch (``_EmulatedOps``): hal's eager-graph guard
checks this backend's code, not the emulation's CPU internals.

Graphs: a captured decode step bakes the host lengths in. On a real NPU the attention task is
captured in a task group and its lengths are re-issued before every replay (``GraphTasks``) with torch_npu's
graph task update API (``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``ExternalEvent``), as vllm-ascend does for ``_npu_paged_attention`` (at 182b75e:
vllm_ascend/attention/attention_v1.py ``AscendAttentionBackendImpl.update_graph_params``, L545-608, called through
vllm_ascend/compilation/acl_graph.py ``update_full_graph_params``; capture side ``full_graph_pa``, L1215-1279; API
doc: op-plugin 517f2e7
``docs/zh/custom_APIs/torch_npu-npu/torch_npu-npu-graph_task_group_begin.md``).
That path is unverified without hardware. Under the emulation the graph is hal's checked eager
graph, whose replay re-runs the step and so reads the refreshed lists.
"""

from __future__ import annotations

import math
import types

import torch

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, host_lens
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.deprecation import warn_renamed
from hal.errors import GraphCaptureError, UnsupportedError, expect
from hal.kernels import npu as npu_ops
from hal.kernels.reference import step_page_table
from hal.kv_cache import kv_pages, kv_rows, paged_view
from hal.kv_layouts import FRACTAL_NZ, TOKEN_MAJOR, pool_kv_layout
from hal.layer import AttentionLayer
from hal.validation import check_request_tables

from . import routing
from .emulated_ops import _op_dtype, _ops_for
from .graph_tasks import GRAPH_UPDATE_API, GraphTasks, stream_capturing
from .metadata import AscendMetadata, MaskKey, StepFacts
from .routing import FIA, FIA_V2, MLA_DECODE, PAGED, SPLITFUSE, Route

# Names of its parts that tests and plugins import from this module.
from .emulated_ops import _EmulatedOps, _owned  # noqa: F401  # isort: skip
from .graph_tasks import _CapturedTask  # noqa: F401  # isort: skip
from .routing import MLA_GENERATIONS, MLA_OFF, _fp8_reason, _mha_kv_write  # noqa: F401  # isort: skip

__all__ = ["AscendBackend", "AscendMetadata", "GRAPH_UPDATE_API"]


def _split_mla(pool, layer: AttentionLayer) -> bool:
    """Whether ``pool`` holds ``layer``'s MLA latent and rope part in two buffers (``mla_split``: SGLang's NPU MLA
    pool through ``hal.integrations.sglang_pools``) rather than hal's one joined buffer."""
    return layer.is_mla and bool(getattr(pool, "mla_split", False))


def _nz_pool(pool) -> bool:
    """Whether ``pool`` lays its pages out FRACTAL_NZ (read in place by 310P's ATB ops)."""
    return pool_kv_layout(pool) == FRACTAL_NZ


def _relayout(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: list[int], page_size: int, max_blocks: int
) -> torch.Tensor | None:
    """None when token ``i`` of every request sits at offset ``i % page_size`` of a page (what the ops read
    through a block table, and what SGLang's paged allocator produces); else the gather index of a scratch
    cache laid out that way, ``[B * max_blocks * page_size]`` pool slots (0, the padding slot, past a
    request's keys). One device-to-host read; eager steps only (a captured graph trusts the layout)."""
    width = max_blocks * page_size
    rows = req_to_token.index_select(0, req_pool_indices.long())[:, :width].long()
    if rows.shape[1] < width:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]))
    pos = torch.arange(width, device=rows.device)
    valid = pos[None, :] < torch.tensor(kv_lens, device=rows.device)[:, None]
    page_start = rows[:, pos - pos % page_size]
    aligned = (page_start % page_size == 0) & (rows == page_start + pos % page_size)
    if bool((aligned | ~valid).all()):
        return None
    return torch.where(valid, rows, 0).reshape(-1)


def _checked(route: Route) -> Route:
    """``route``, or the error that says why it cannot run."""
    if route.uncapturable:
        raise GraphCaptureError(
            f"ascend: {route.op} inside an NPUGraph capture would freeze its host lengths (no in-graph update "
            "is implemented for it); only decode without a sliding window is graph-capturable on a real NPU"
        )
    if route.refused:
        raise UnsupportedError(route.refused)
    return route


# ----------------------------------------------------------------------------- backend


class AscendBackend(AttentionBackend):
    name = "ascend"
    supports_padding_slots = True  # -1 in out_cache_loc: no KV written (docs/porting.md)
    dtypes = frozenset({"fp16", "bf16", "fp32"})  # fp32: the emulation only (unsupported_reasons says why)
    page_sizes = frozenset({16, 32, 64, 128, 256, 512})  # multiples of 16 (ATB), <= 512 (FIA)
    supports_logit_cap = False  # neither ATB PagedAttention nor FIA takes a soft cap
    supports_mla = True  # latent MLA (A2/A3): _npu_paged_attention_mla, FIA v2 with query_rope/key_rope
    kv_cache_dtypes = frozenset({"fp16", "bf16", "fp32"})  # no fp8: see _fp8_reason
    supports_sinks = True  # FIA v2's learnable_sink on A2/A3/A5 (routing refuses 310P), as SGLang and vllm-ascend
    needs_cpu_seq_lens = True  # the ops take per-request lengths on the host
    reads_new_kv = False  # every op reads the new tokens from the cache
    # The ops read token i at offset i % block_size of block i // block_size (block tables). An eager step
    # whose slots are laid out otherwise is re-laid out into a scratch cache (one host read, see _relayout);
    # a captured graph step trusts the layout, which SGLang's paged allocator and hal's guarantee.
    requires_page_aligned_slots = False
    reads_tables = frozenset({"token", "page"})  # the block table as given, or built from req_to_token's pages
    # 310P's ATB ops read FRACTAL_NZ caches in place; every generation reads token-major (ND) pages (on 310P through
    # a per-layer NZ copy). unsupported_reasons refuses fractal_nz off 310P, so elsewhere token_major is chosen.
    kv_layouts = (FRACTAL_NZ, TOKEN_MAJOR)

    @classmethod
    def format_kv_pages(cls, capability: DeviceCapability, kv_layout: str, pages: torch.Tensor) -> torch.Tensor:
        """A fractal_nz pool's buffer cast to ACL_FORMAT_FRACTAL_NZ once, when the pool is made (vllm-ascend's 310P
        runner allocates its caches so: ``torch_npu.empty_with_format(..., acl_format=ACL_FORMAT_FRACTAL_NZ)``)."""
        if kv_layout != FRACTAL_NZ:
            return pages
        return _ops_for(capability).npu_format_cast(pages, npu_ops.contracts.ACL_FORMAT_FRACTAL_NZ)

    def __init__(self, capability: DeviceCapability, config=None, **options):
        ops = _ops_for(capability)  # first: a real NPU without torch_npu is a clear error, not a torch one
        super().__init__(capability, config, **options)
        self.ops = ops
        self.generation = npu_ops.generation_of_arch(capability.arch)
        self.graph_tasks = GraphTasks(ops)  # the decode tasks captured on a real NPU, updated before each replay
        self.graph_max_bs: int | None = None
        self.graph_max_tokens = 0
        self._graph_width = 0
        self._graph_max_blocks = 0
        self._graph_block_table: torch.Tensor | None = None
        self._graph_masks: dict[MaskKey, torch.Tensor] = {}

    # -- what it serves: routing.py's tables ------------------------------------------
    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        return routing.unavailable_reasons(capability)

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        return [*super().notes(capability), *routing.notes(capability)]

    @classmethod
    def unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        reasons = super().unsupported_reasons(config, capability) + routing.unsupported_reasons(config, capability)
        return list(dict.fromkeys(reasons))

    @classmethod
    def routes(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        return routing.routes(config, capability)

    @classmethod
    def step_routes(cls, config: AttentionConfig, capability: DeviceCapability) -> dict[str, str]:
        """The op each kind of step of ``config`` runs on this generation (``""``: none can)."""
        return routing.step_routes(config, capability)

    @classmethod
    def extend_route(cls, config: AttentionConfig, capability: DeviceCapability) -> tuple[str, list[str]]:
        """``(op, reasons)``: the op EXTEND batches of ``config`` run, and why FIA does not serve them."""
        return routing.extend_route(config, capability)

    def route_of(self, forward_batch: ForwardBatch, layer: AttentionLayer) -> list[str]:
        if forward_batch.forward_mode.is_idle():
            return []
        meta = self.plan.metadata_for(forward_batch)
        return list(dict.fromkeys(meta.taken)) + (["relayout"] if meta.relayout is not None else [])

    @staticmethod
    def _took(meta: AscendMetadata, op: str, step: str | None = None) -> None:
        meta.taken.append(f"{step or meta.step}:{op}")

    def support_triton(self) -> bool:
        """Triton helper ops only with a Triton NPU target (triton-ascend); the KV write is the NPU op."""
        return bool(self.capability.triton_target)

    # -- graph state -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # The block table and mask buffers are sized on the first static batch, when req_to_token's width is known.
        self.graph_max_bs = max_bs
        # query rows of the largest captured batch: max_bs for decode, max_bs * draft for TARGET_VERIFY
        self.graph_max_tokens = max(max_bs, max_num_tokens)
        self._graph_width = self._graph_max_blocks = 0
        self._graph_block_table = None
        self._graph_masks = {}
        self.graph_tasks.clear()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _ensure_graph_buffers(self, fb: ForwardBatch) -> None:
        expect(
            self.graph_max_bs is not None and fb.batch_size <= self.graph_max_bs,
            GraphCaptureError,
            "static batch size",
            fb.batch_size,
            f"<= the max_bs given to init_cuda_graph_state ({self.graph_max_bs}); call it first",
        )
        tokens = fb.out_cache_loc.shape[0]
        expect(
            tokens <= self.graph_max_tokens,
            GraphCaptureError,
            "static batch tokens",
            tokens,
            f"<= the max_num_tokens given to init_cuda_graph_state ({self.graph_max_tokens})",
        )
        width = check_request_tables(fb)[2]
        if self._graph_block_table is None or width != self._graph_width:
            ps = fb.token_to_kv_pool.page_size
            self._graph_width, self._graph_max_blocks = width, -(-width // ps)
            self._graph_block_table = torch.zeros(
                self.graph_max_bs, self._graph_max_blocks, dtype=torch.int32, device=self.device
            )
            self._graph_masks = {}

    # -- the plan ----------------------------------------------------------------------
    def plan_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        pool = fb.token_to_kv_pool
        lens = host_lens(fb)
        q_lens, kv_lens = list(lens.query), lens.kv
        static = self.plan.is_graph_batch(fb, in_capture)
        if static:
            self._ensure_graph_buffers(fb)
            max_blocks = self._graph_max_blocks
        else:
            max_blocks = max(1, -(-max(kv_lens, default=1) // pool.page_size))
        mode = fb.forward_mode
        meta = AscendMetadata(
            batch_size=fb.batch_size,
            num_tokens=fb.out_cache_loc.shape[0],
            max_blocks=max_blocks,
            query_lens=q_lens,
            kv_lens=kv_lens,
            dtype=pool.dtype,
            graph_static=static,
            page_size=pool.page_size,
            custom_mask=self._custom_mask(fb, q_lens, kv_lens) if mode.is_target_verify() else None,
            facts=StepFacts(
                generation=self.generation,
                page_size=pool.page_size,
                dtype=pool.dtype,
                op_dtype=_op_dtype(pool.dtype, self.capability),
                long_kv=max(kv_lens, default=0) > npu_ops.contracts.FIA_DECODE_MAX_KV,
            ),
            step=routing.step_of(mode),
        )
        block_table = getattr(fb, "req_to_page_pool", None)  # page-aligned by construction: never re-laid out
        if not static and pool.page_size > 1 and fb.batch_size and block_table is None:
            meta.relayout = _relayout(
                fb.req_to_token_pool.req_to_token, fb.req_pool_indices, kv_lens, pool.page_size, max_blocks
            )
        if static:
            for key in self._graph_masks:  # the variants the captured layers use, refilled in place
                meta.masks[key] = self._fill_graph_mask(meta, key)
            if in_capture:
                self.graph_tasks.begin(fb.batch_size)
            elif self.graph_tasks.captured(fb.batch_size):
                self.graph_tasks.update(fb.batch_size, meta.kv_lens)
        elif mode.is_mixed():
            meta.masks[("causal", -1)] = self._build_mask(meta, ("causal", -1))
        elif mode.is_target_verify():
            meta.masks[("custom", -1)] = self._build_mask(meta, ("custom", -1))
        self.plan.set_metadata(meta, fb)

    def plan_in_graph(self, fb: ForwardBatch) -> None:
        meta = self.plan.metadata_for(fb)
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            meta.block_table = None
            return
        pages = getattr(fb, "req_to_page_pool", None)
        source = (
            {"req_to_page": pages.req_to_page}
            if pages is not None
            else {"req_to_token": fb.req_to_token_pool.req_to_token}
        )
        table = step_page_table(fb.req_pool_indices, meta.max_blocks, fb.token_to_kv_pool.page_size, **source)
        if meta.graph_static:
            meta.block_table = self._graph_block_table[: fb.batch_size]
            meta.block_table.copy_(table)
        elif meta.relayout is not None:  # the scratch cache's pages, request after request
            pages = torch.arange(fb.batch_size * meta.max_blocks, dtype=torch.int32, device=table.device)
            meta.block_table = pages.view(fb.batch_size, meta.max_blocks)
        else:
            meta.block_table = table
        if self.generation == "310P" and not _nz_pool(fb.token_to_kv_pool):  # the ops read an NZ copy (_nz_caches)
            meta.source_table = meta.block_table
            pages = torch.arange(fb.batch_size * meta.max_blocks, dtype=torch.int32, device=table.device)
            meta.block_table = pages.view(fb.batch_size, meta.max_blocks)

    # -- splitfuse masks ---------------------------------------------------------------
    def _build_mask(self, meta: AscendMetadata, key: MaskKey) -> torch.Tensor:
        kind, window = key
        return npu_ops.splitfuse_mask(
            meta.query_lens,
            meta.kv_lens,
            meta.dtype,
            self.device,
            causal=kind == "causal",
            sliding_window=window,
            custom_mask=meta.custom_mask if kind == "custom" else None,
        )

    @staticmethod
    def _custom_mask(fb: ForwardBatch, q_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
        """The step's flat verify mask: a graph's static batch holds it at the start of a larger fixed buffer."""
        return fb.spec_info.custom_mask.reshape(-1)[: sum(q * n for q, n in zip(q_lens, kv_lens))]

    def _fill_graph_mask(self, meta: AscendMetadata, key: MaskKey) -> torch.Tensor:
        """Rebuild ``key``'s mask into its fixed ``[max query rows, width]`` buffer (outside the graph)."""
        buf = self._graph_masks.get(key)
        if buf is None:
            buf = torch.empty(self.graph_max_tokens, self._graph_width, dtype=meta.dtype, device=self.device)
            self._graph_masks[key] = buf
        mask = self._build_mask(meta, key)
        rows = buf[: meta.num_tokens]
        # as vllm-ascend casts its mask (float16: float32's min becomes -inf; fill_ refuses a value out of range)
        value = npu_ops.splitfuse_mask_value(meta.dtype)
        rows.fill_(value if abs(value) <= torch.finfo(meta.dtype).max else math.copysign(math.inf, value))
        rows[:, : mask.shape[1]].copy_(mask)
        return rows

    def _mask(self, meta: AscendMetadata, key: MaskKey) -> torch.Tensor:
        """The splitfuse mask variant ``key`` of this batch, built on first use (a layer's window)."""
        mask = meta.masks.get(key)
        if mask is None:
            mask = self._fill_graph_mask(meta, key) if meta.graph_static else self._build_mask(meta, key)
            meta.masks[key] = mask
        return mask

    # -- checks and the KV write -------------------------------------------------------
    def check_layer(self, layer: AttentionLayer) -> None:
        if layer.logit_cap > 0:
            raise UnsupportedError(f"ascend: logit_cap = {layer.logit_cap}: the Ascend ops have no soft cap")
        if layer.v_head_dim != layer.head_dim and not layer.is_mla:
            raise UnsupportedError(
                f"ascend: v_head_dim {layer.v_head_dim} != head_dim {layer.head_dim} (not latent MLA)"
            )

    def check_inputs(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """The prologue's checks; a split MLA pool (latent and rope buffers apart) is checked as the one key it
        holds, through 0-slot stand-ins of the joined key's shape on the pool's device."""
        pool = forward_batch.token_to_kv_pool
        layout = pool_kv_layout(pool)
        if layout != TOKEN_MAJOR:  # no token-major buffers to check against: 0-slot stand-ins of the pool's shapes
            expect(
                layout == FRACTAL_NZ and self.generation == "310P" and not layer.is_mla,
                UnsupportedError,
                "ascend: KV pool layout",
                layout,
                f"{FRACTAL_NZ} on 310P (an MHA layer), or {TOKEN_MAJOR}: the ops of {self.generation} read those",
            )
            key, value = (
                pages.new_empty(0, pool.head_num, dim)
                for pages, dim in zip(kv_pages(pool, layer.layer_id), (pool.head_dim, pool.v_head_dim))
            )
            shapes = types.SimpleNamespace(get_key_buffer=lambda _: key, get_value_buffer=lambda _: value)
            batch = types.SimpleNamespace(out_cache_loc=forward_batch.out_cache_loc, token_to_kv_pool=shapes)
            return super().check_inputs(q, k, v, layer, batch, save_kv_cache)
        if not _split_mla(pool, layer):
            return super().check_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        latent, rope = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        key = latent.new_empty(0, latent.shape[1], latent.shape[2] + rope.shape[2])
        joined = types.SimpleNamespace(
            get_key_buffer=lambda _: key, get_value_buffer=lambda _: key[..., : latent.shape[2]]
        )
        batch = types.SimpleNamespace(out_cache_loc=forward_batch.out_cache_loc, token_to_kv_pool=joined)
        return super().check_inputs(q, k, v, layer, batch, save_kv_cache)

    def save_kv(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """The NPU's cache write (``routing.kv_write_op``), padding handled by each op's documented contract.

        * MHA on A2/A3/A5: ``npu_scatter_pa_kv_cache`` on the paged view (vllm-ascend's ``reshape_and_cache``).
        * MHA on 310P: ``_npu_reshape_and_cache`` into a FRACTAL_NZ pool's pages; ``npu_scatter_nd_update_`` of the
          rows into a token-major (ND) pool.
        * MLA, hal's one latent ++ rope cache: ``_npu_reshape_and_cache_siso`` on A2 (ATB's K_CACHE_V_BYPASS is
          documented for A2 only), ``npu_scatter_nd_update_`` on A3; SGLang's split MLA pool: two
          ``npu_scatter_nd_update_`` (latent, rope part), as SGLang writes it.

        ReshapeAndCache skips a negative slot and forbids a repeated one, so its padding (negative, and every token
        aimed at the padding slot: a captured graph's padding requests, an eager batch's padded tokens) is passed as
        -1. ``npu_scatter_pa_kv_cache``
        and ``npu_scatter_nd_update_`` take no negative or out-of-range slot, so padding is redirected to the pool's
        padding slot; a -1 row (a padding token: hal's contract writes no KV for it) carries that slot's own content,
        so the slot keeps it whichever of the repeated writes lands ("重复时不保证正确性"); a captured graph's
        padding requests (slot 0) leave it unspecified, and nothing reads it.
        """
        pool = fb.token_to_kv_pool
        meta = self.forward_metadata
        split = _split_mla(pool, layer)
        op = routing.kv_write_op(self.generation, pool_kv_layout(pool), mla=layer.is_mla, split_mla=split)
        slots, padding = fb.out_cache_loc, getattr(pool, "padding_slot", 0)  # SGLang pools: slot 0 too
        if op in ("_npu_reshape_and_cache_siso", "_npu_reshape_and_cache"):  # ATB's ReshapeAndCache
            slots = torch.where(slots == padding, -1, slots)  # eager or captured: nothing is written at the pad slot
            if op == "_npu_reshape_and_cache_siso":  # the key only, into hal's joined latent ++ rope cache
                cache = pool.get_key_buffer(layer.layer_id)
                npu_ops.write_latent(self.ops, k, cache.view(-1, pool.page_size, *cache.shape[1:]), slots)
            else:  # into the NZ pages in place (check_inputs admits them on 310P only)
                k_cache, v_cache = kv_pages(pool, layer.layer_id)
                npu_ops.write_kv(self.ops, k, v, k_cache, v_cache, slots)
            self._took(meta, op, "kv_write")
            return
        skip = (slots < 0)[:, None, None]
        slots = torch.where(slots < 0, padding, slots)

        def kept(buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:  # -1 rows: the padding slot's own bytes
            return torch.where(skip, buffer[padding].to(new.dtype), new)

        if op == "npu_scatter_nd_update_":  # rows into the pool's ND buffers
            rows = [(pool.get_key_buffer(layer.layer_id), k)]
            if split:
                rank = layer.kv_lora_rank
                rows = [
                    (pool.get_key_buffer(layer.layer_id), k[..., :rank]),
                    (pool.get_value_buffer(layer.layer_id), k[..., rank:]),
                ]
            elif not layer.is_mla:
                rows.append((pool.get_value_buffer(layer.layer_id), v))
            for buffer, new in rows:
                npu_ops.scatter_rows(self.ops, buffer, slots, kept(buffer, new))
        else:
            k_cache, v_cache = paged_view(pool, layer.layer_id)
            k, v = kept(pool.get_key_buffer(layer.layer_id), k), kept(pool.get_value_buffer(layer.layer_id), v)
            npu_ops.write_kv(self.ops, k, v, k_cache, v_cache, slots, scatter=True)
        self._took(meta, op, "kv_write")

    # -- the run: each layer through the op its route names ----------------------------
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        return self._attend(q, layer, forward_batch, "decode", kwargs.get("sinks"), out)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        mode = forward_batch.forward_mode
        if mode.is_mixed():  # reached when called directly (forward() sends MIXED to run_mixed on an NPU)
            return self.run_mixed(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, out=out, **kwargs)
        step = "target_verify" if mode.is_target_verify() else "extend"
        return self._attend(q, layer, forward_batch, step, kwargs.get("sinks"), out)

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        """Decodes and chunked prefills of a MIXED batch in one call: FIA (TND) where it serves the layer (A2/A3/A5,
        as vllm-ascend's chunked prefill), else ``_npu_paged_attention_splitfuse``."""
        return self._attend(q, layer, forward_batch, "mixed", kwargs.get("sinks"), out)

    def _attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, step: str, sinks, out) -> torch.Tensor:
        """``step`` of ``layer`` (``q``: ``[T, Hq, D]``): ``[T, Hq, Dv]`` in the cache's dtype, the caller's ``out``
        where the step's op writes it (the ATB ops, :func:`_atb_out`); FIA's have no output argument, and their
        result is copied into ``out`` by the base class."""
        meta, query, k_cache, v_cache = self._prepare(q, layer, fb)
        out = _atb_out(out, query)
        if layer.is_mla:
            return self._mla(meta, query, k_cache, v_cache, layer, fb.forward_mode, sinks, out)
        if sinks is not None:
            return self._sinks(meta, query, k_cache, v_cache, layer, step, sinks)
        return self._mha(meta, query, k_cache, v_cache, layer, step, out)

    def _prepare(self, q, layer: AttentionLayer, fb: ForwardBatch):
        """After the prologue: ``(meta, query [T, Hq, D] in the cache dtype, k_cache, v_cache)``.

        Every op reads the new tokens from the cache (``reads_new_kv = False``).
        """
        meta = self.forward_metadata
        pool = fb.token_to_kv_pool
        nz = _nz_pool(pool)
        k_cache, v_cache = kv_pages(pool, layer.layer_id)  # an NZ pool's pages are what the ops read
        if meta.relayout is not None:  # read through a page-aligned copy of the batch's keys and values
            k_rows, v_rows = kv_rows(pool, layer.layer_id, meta.relayout)
            k_cache, v_cache = (npu_ops.buffer_pages(rows, meta.page_size) for rows in (k_rows, v_rows))
            if nz:
                k_cache, v_cache = (npu_ops.nz_pages(self.ops, cache) for cache in (k_cache, v_cache))
        if layer.is_mla and not _split_mla(pool, layer):
            v_cache = None  # hal's MLA pool: the value is the key's latent, one cache
        if self.generation == "310P" and not nz:
            k_cache, v_cache = (self._nz_caches(meta, cache) for cache in (k_cache, v_cache))
        return meta, q.to(pool.dtype).contiguous(), k_cache, v_cache

    def _nz_caches(self, meta: AscendMetadata, cache: torch.Tensor) -> torch.Tensor:
        """310P: the batch's pages of the ND ``cache``, request after request, as the FRACTAL_NZ cache ATB reads there
        (``[B * max_blocks, heads * dim / 16, page, 16]``, a copy per layer; ``meta.block_table`` numbers them).
        vllm-ascend's 310P runner allocates its caches NZ; a token-major (ND) pool is read through this copy."""
        if meta.relayout is None:  # the relayout copy is already laid out request after request
            cache = cache.index_select(0, meta.source_table.reshape(-1).long())
        return npu_ops.nz_pages(self.ops, cache)

    def _mha(self, meta: AscendMetadata, query, k_cache, v_cache, layer: AttentionLayer, step: str, out):
        """An MHA layer without sinks through the op of its route (``routing.attention_route``); the ATB ops write
        ``out`` where given."""
        route = _checked(routing.attention_route(meta.facts, layer, step, stream_capturing(self.capability)))
        if route.op == FIA:  # a decode's window: band mode, padded to Q_S 2
            return self._fia(meta, query, k_cache, v_cache, layer, decode=route.decode)
        if route.op == SPLITFUSE:
            return self._splitfuse(meta, query, k_cache, v_cache, layer, route.mask, out)
        if route.captured:  # vllm-ascend's full-decode graph op: its host lengths are updated per replay
            out = torch.empty_like(query) if out is None else out
            call = dict(
                query=query,
                key_cache=k_cache,
                value_cache=v_cache,
                num_kv_heads=layer.tp_k_head_num,
                num_heads=query.shape[1],
                scale_value=float(layer.scaling),
                block_table=meta.block_table,
                out=out,
            )
            self.graph_tasks.capture(meta.batch_size, meta.kv_lens, call, longest=self._graph_width)
            self._took(meta, PAGED, "graph_decode")
            return out
        self._took(meta, PAGED)
        return npu_ops.paged_decode(
            self.ops,
            *(query, k_cache, v_cache, meta.block_table, meta.kv_lens),
            scale=layer.scaling,
            out=out,
            num_kv_heads=layer.tp_k_head_num,
            max_batch=self._atb_max_batch,
        )

    @property
    def _atb_max_batch(self) -> int | None:
        """Requests per ATB attention call: 310P takes "0<batch<=2048" (contracts: ``dtype_310p``), A2/A3 no limit."""
        return npu_ops.contracts.ATB_310P_MAX_BATCH if self.generation == "310P" else None

    def _fia(self, meta, query, k_cache, v_cache, layer: AttentionLayer, decode: bool = False) -> torch.Tensor:
        """FIA (TND, paged) over the batch: extend, a MIXED batch's decodes and chunks in one call, or a decode
        (one query token per request, which sees its whole context: no mask)."""
        self._took(meta, FIA)
        q_lens = [1] * meta.batch_size if decode else meta.query_lens
        window = layer.sliding_window_size
        return npu_ops.paged_prefill(
            self.ops,
            *(query, k_cache, v_cache, meta.block_table, q_lens, meta.kv_lens),
            scale=layer.scaling,
            causal=layer.causal and (not decode or window >= 0),
            sliding_window=window,
        )

    def _splitfuse(self, meta, query, k_cache, v_cache, layer: AttentionLayer, key: MaskKey, out) -> torch.Tensor:
        """``_npu_paged_attention_splitfuse`` over the batch with the mask variant ``key`` (NZ on 310P), into ``out``
        (a new tensor where None)."""
        mask = self._mask(meta, key)
        self._took(meta, SPLITFUSE)
        out = npu_ops.paged_mixed(
            self.ops,
            query,
            k_cache,
            v_cache,
            *(meta.block_table, meta.query_lens, meta.kv_lens),
            scale=layer.scaling,
            out=torch.empty_like(query) if out is None else out,
            mask=mask,
            nz=self.generation == "310P",
            num_kv_heads=layer.tp_k_head_num,
            max_batch=self._atb_max_batch,
        )
        if key[0] == "custom":
            # The additive mask is finite, so the op averages V over a row that sees no key;
            # hal's contract (and the other backends) give such a query zeros.
            blind = (mask == npu_ops.splitfuse_mask_value(mask.dtype)).all(dim=-1)
            out.masked_fill_(blind[:, None, None], 0.0)
        return out

    # -- attention sinks ---------------------------------------------------------------
    def _sinks(self, meta: AscendMetadata, query, k_cache, v_cache, layer: AttentionLayer, step: str, sinks):
        """FIA v2 with ``learnable_sink`` over the batch (a decode: one query token per request)."""
        route = _checked(routing.sink_route(meta.facts, layer, step, stream_capturing(self.capability)))
        self._took(meta, route.op)
        return npu_ops.paged_attention_sinks(
            self.ops,
            *(query, k_cache, v_cache, meta.block_table),
            [1] * meta.batch_size if route.decode else meta.query_lens,
            meta.kv_lens,
            sinks,
            scale=layer.scaling,
            causal=layer.causal,
            sliding_window=layer.sliding_window_size,
        )

    # -- MLA ---------------------------------------------------------------------------
    def _mla(self, meta: AscendMetadata, query, cache, rope, layer: AttentionLayer, mode, sinks=None, out=None):
        """Latent attention -> ``[T, Hq, kv_lora_rank]`` (``_npu_paged_attention_mla`` into ``out`` where given)
        over hal's one ``[blocks, page, 1, kv_lora_rank + rope]``
        ``cache`` (``rope`` None) or, from a split pool (SGLang's NPU MLA pool), the latent ``cache`` and ``rope``.

        The op is ``routing.mla_route``'s. ``_npu_paged_attention_mla`` reads the one cache as it is; FIA v2 takes the
        latent and rope parts as two contiguous caches, so from the one cache the batch's pages are copied apart
        first (``mla_split``, a read of the batch's context per layer); a split pool is read in place."""
        joined = rope is None
        capturing = stream_capturing(self.capability)
        step = routing.step_of(mode)
        route = _checked(routing.mla_route(meta.facts, layer, step, joined, sinks is not None, capturing))
        rank = layer.kv_lora_rank
        if route.op == MLA_DECODE:
            self._took(meta, MLA_DECODE)
            return npu_ops.mla_decode(
                self.ops, query, cache, meta.block_table, meta.kv_lens, kv_lora_rank=rank, scale=layer.scaling, out=out
            )
        table = meta.block_table
        if joined:
            pages = self._batch_pages(meta, cache)
            cache, rope = pages[..., :rank].contiguous(), pages[..., rank:].contiguous()
            table = torch.arange(pages.shape[0], dtype=torch.int32, device=pages.device).view(meta.batch_size, -1)
            meta.taken.append("mla_split")
        self._took(meta, FIA_V2)
        return npu_ops.mla_attention(
            self.ops,
            query,
            cache,
            rope,
            table,
            [1] * meta.batch_size if route.decode else meta.query_lens,
            meta.kv_lens,
            scale=layer.scaling,
            causal=layer.causal,
            sliding_window=layer.sliding_window_size,
            tree_mask=self._tree_mask(meta) if route.mask == ("tree", -1) else None,
        )

    @staticmethod
    def _batch_pages(meta: AscendMetadata, cache: torch.Tensor) -> torch.Tensor:
        """The batch's pages of ``cache``, request after request (``[B * max_blocks, page, 1, D]``, a copy)."""
        if meta.relayout is not None:  # the relayout copy is already laid out that way
            return cache
        return cache.index_select(0, meta.block_table.reshape(-1).long())

    def _tree_mask(self, meta: AscendMetadata) -> torch.Tensor:
        """FIA's flat treeMask (``sparse_mode`` 9, True = hidden) of this verify batch: each request's
        ``[draft, draft]`` block of hal's custom mask. FIA shows every draft token the whole prefix, so an eager
        step first checks, with one host read, that the custom mask does too (else ``UnsupportedError``)."""
        mask = meta.masks.get(("tree", -1))
        if mask is not None:
            return mask
        tree, prefix, offset = [], [], 0
        for q, n in zip(meta.query_lens, meta.kv_lens):
            rows = torch.arange(q) * n + offset
            tree.append((rows[:, None] + (n - q) + torch.arange(q)).reshape(-1))
            prefix.append((rows[:, None] + torch.arange(n - q)).reshape(-1))
            offset += q * n
        custom = meta.custom_mask
        # hal: allow-host-data the step's gather indices, built from host lengths; MLA verify is never captured
        tree_idx, prefix_idx = (torch.cat(x).to(custom.device) for x in (tree, prefix))
        # hal: allow-host-sync eager verify steps only (a captured step trusts the mask, as SGLang's EAGLE builds it)
        if not meta.graph_static and not bool(custom[prefix_idx].all()):
            raise UnsupportedError(
                "ascend: an MLA verify mask hides prefix keys from a draft token; FIA's tree mask (sparse_mode 9) "
                "shows every draft token the whole prefix"
            )
        mask = meta.masks[("tree", -1)] = ~custom[tree_idx]
        return mask


def _atb_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """``out`` (the caller's ``[T, Hq, Dv]`` view, or None) where the ATB attention ops can write it: contiguous, in
    the query's dtype (their binding hands ``out`` to ATB as it is: contracts, the ``out`` rows); else None."""
    return out if out is not None and out.is_contiguous() and out.dtype == query.dtype else None


def __getattr__(name: str):
    """``AscendRouting`` and ``NpuGraphTasks``, the mixins ``AscendBackend`` was once assembled from: deprecated
    since hal 0.4.0 (goes in 0.5.0). The routing is ``routing.py``'s functions, answered by ``AscendBackend``'s
    classmethods; the graph tasks are a :class:`~hal.devices.npu.graph_tasks.GraphTasks` the backend owns."""
    if name == "AscendRouting":
        warn_renamed(f"{__name__}.AscendRouting", f"{__name__}.AscendBackend", since="0.4.0")
        return AscendBackend
    if name == "NpuGraphTasks":
        warn_renamed(f"{__name__}.NpuGraphTasks", "hal.devices.npu.graph_tasks.GraphTasks", since="0.4.0")
        return GraphTasks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
