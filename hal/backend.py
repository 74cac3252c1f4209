"""``AttentionBackend``: SGLang's attention-backend contract, member for member.

A step is *plan, then run* (FlashInfer's ``plan()`` / ``run()``, vLLM's metadata builder / impl). The names an
engine calls are *edges*, plain code in this class; what a backend implements are the *steps* behind them:

* plan, in two halves so that one code path serves eager runs and graph capture/replay (see ``hal.graph``):
  ``init_forward_metadata_out_graph(fb, in_capture=False)`` (host-side work, outside any graph, before every step
  and replay) checks the batch, gives it the request tables the backend reads (:class:`hal.batch.RequestTables`)
  and runs the backend's ``plan_out_graph``; ``init_forward_metadata_in_graph(fb)`` (static-shape device work,
  recorded into a graph and replayed by it) runs the backend's ``plan_in_graph``. ``init_forward_metadata(fb)``
  (eager) is the two in order. Every entry path (eager, hal's ``GraphRunner``, SGLang's graph runner, vLLM's eager
  and full-graph steps, vllm-ascend's) reaches the backend's plan through these edges only.
* run: ``forward`` and the seed's ``forward_decode`` / ``_extend`` / ``_mixed``: the checks every path shares
  (``hal.prologue``), then the fused call or the checked path ending in the backend's ``run_decode`` /
  ``run_extend`` / ``run_mixed``.

A backend implements the plan and the run steps; it never wraps or re-implements the edges.

What a backend supports (``name``, ``dtypes``, ``page_sizes``, ``supports_*``...: class attributes) is read
through :meth:`AttentionBackend.declaration` only. What later SGLang releases added to their base class lives
with the SGLang integration, :mod:`hal.integrations.sglang_members`.

``helper_ops`` is the one place ``support_triton()`` is read. Batches are read by SGLang's field names (any
object that has them: see ``hal.batch``), pools through the protocols of ``hal.kv_cache``. ``forward`` uses the
metadata the last ``init_forward_metadata_out_graph`` prepared (SGLang's contract); a cheap stamp (mode,
batch size, a step counter) catches metadata left from another step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.batch import RequestTables, validate_batch, validation_level
from hal.capability import DeviceCapability
from hal.declaration import BackendDeclaration
from hal.errors import ConfigError, InvalidBatchError, expect
from hal.kv_cache import kv_storage
from hal.modes import step_kind
from hal.plugin_compat import adapt_backend
from hal.prologue import (
    ForwardSteps,
    check_output_buffer,
    fused_forward_disabled,
    fused_forward_enabled,
    fused_forward_env,
    step_facts,
    write_output,
)
from hal.validation import check_batch_fields, check_forward_fields, check_input_dtypes

if TYPE_CHECKING:
    from hal.batch import ForwardBatch
    from hal.config import AttentionConfig
    from hal.layer import AttentionLayer

__all__ = [
    "AttentionBackend",
    "BackendDeclaration",
    "helper_ops_for",
    "fused_forward_disabled",
    "fused_forward_enabled",
]


def helper_ops_for(backend: AttentionBackend) -> ModuleType:
    """The kernel package whose ``write_kv`` / ``build_kv_indices`` / ``compute_positions`` serve ``backend``:
    :mod:`hal.kernels.triton` when ``backend.support_triton()`` and its device has a Triton target,
    else :mod:`hal.kernels.reference`. The one place ``support_triton()`` is read."""
    if backend.support_triton() and backend.capability.triton_target:
        from hal.kernels import triton as ops
    else:
        from hal.kernels import reference as ops
    return ops


class AttentionBackend(ForwardSteps):
    """Base class of attention backends (SGLang's ``AttentionBackend``): the seed's contract, the declared
    support (:meth:`declaration`), the engine-facing forward edges and, from :class:`hal.prologue.ForwardSteps`,
    the steps they run."""

    _hal_contract = True  # the engine-facing names here are the edges (hal.plugin_compat finds this class by it)

    # -- SGLang's class attributes -------------------------------------------------------
    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    supports_ragged_verify_graph: bool = False
    needs_cpu_seq_lens: bool = True
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    # -- what the backend supports: read into declaration(), which selection reads ----------
    name: ClassVar[str] = ""
    dtypes: ClassVar[frozenset[str]] = frozenset({"fp32", "bf16", "fp16"})
    page_sizes: ClassVar[frozenset[int] | None] = None  # None: any power of two
    head_dims: ClassVar[frozenset[int] | None] = None  # None: any
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_cap: ClassVar[bool] = True
    supports_non_causal: ClassVar[bool] = True
    supports_custom_mask: ClassVar[bool] = True
    supports_graph: ClassVar[bool] = True
    supports_mla: ClassVar[bool] = False  # v_head_dim != head_dim (MLA's latent layout is that case)
    supports_sinks: ClassVar[bool] = False  # forward(..., sinks=) (gpt-oss attention sinks)
    kv_cache_dtypes: ClassVar[frozenset[str] | None] = None  # KV cache dtype names; None: the same as ``dtypes``
    # Token i of a request must sit at offset i % page_size of its page (kernels that read whole pages).
    requires_page_aligned_slots: ClassVar[bool] = False
    # out_cache_loc may hold -1 (a padding token: no KV written, output row unspecified). False for a backend that
    # does not declare it (a plugin that predates padding slots): full validation refuses such a batch for it.
    supports_padding_slots: ClassVar[bool] = False
    # The KV pool layouts (hal.kv_layouts) the kernels read in place, preferred first.
    kv_layouts: ClassVar[tuple[str, ...]] = ("token_major",)
    # The request tables the kernels read: "token" (req_to_token), "page" (a block table, req_to_page) or both;
    # the plan step derives the other (hal.batch.RequestTables), once per step, for a backend that reads only one.
    reads_tables: ClassVar[frozenset[str]] = frozenset({"token"})
    # Backend-specific constructor options and their defaults (``Selection.create(**options)``).
    option_defaults: ClassVar[Mapping[str, Any]] = {}

    def __new__(cls, *args, **kwargs):
        """An instance of the class hal runs for ``cls``: ``cls`` itself, or, for a class written against an older
        plugin API that came through no registry, its adapter (:func:`hal.plugin_compat.adapt_backend`, made once)."""
        return super().__new__(adapt_backend(cls))

    def __init__(self, capability: DeviceCapability, config: AttentionConfig | None = None, **options):
        """``config``: the model this backend serves (layers, max context, max batch), for planning;
        ``options``: ``validate`` (``off``/``cheap``/``full``, default ``HAL_VALIDATE``) and the
        backend's own ``option_defaults``. Unknown options are a ``ConfigError``."""
        declared = self.declaration()
        unknown = sorted(set(options) - set(declared.option_defaults) - {"validate"})
        expect(
            not unknown,
            ConfigError,
            f"{declared.name} options",
            unknown,
            f"options of this backend: {sorted({'validate', *declared.option_defaults})}",
        )
        self.declared = declared  # what this backend's class declares, read once: the forward path reads it
        self.capability = capability
        self.config = config
        self.device = capability.torch_device
        self.validation = validation_level(options.pop("validate", None))
        self.options = {**declared.option_defaults, **options}
        self.forward_metadata: Any = None
        self._metadata_stamp: tuple | None = None
        self._step = 0
        self._graph_batches: set[tuple[str, int]] = set()
        self._fused_env = fused_forward_env()  # HAL_FUSED_FORWARD, read (and checked) when the backend is created

    forward_metadata: Any = None  # set per step by set_forward_metadata (SGLang reads it off any backend)

    @functools.cached_property
    def declared(self) -> BackendDeclaration:
        """This backend's :meth:`declaration`, read once (set in ``__init__``; computed here for a plugin class
        whose ``__init__`` does not call the base class's)."""
        return self.declaration()

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def declaration(cls) -> BackendDeclaration:
        """What this backend class declares it supports (its class attributes), as selection reads it."""
        return BackendDeclaration.of(cls)

    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        """Reasons this backend cannot run on this device at all (missing library...); empty: it can."""
        return []

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        """What a user must know about this backend here, though nothing stops it (``hal info`` shows them)."""
        return ["emulated: correct, but its speed means nothing"] if capability.emulated else []

    @classmethod
    def unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``capability``; empty means it can.

        Starts with :meth:`unavailable_reasons`, then checks the declared features.
        """
        return cls._declared_unsupported_reasons(config, capability)

    @classmethod
    def _declared_unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """:meth:`unavailable_reasons`, then the reasons the declaration (:meth:`declaration`) gives."""
        declared = cls.declaration()
        reasons = list(cls.unavailable_reasons(capability))
        reasons += declared.unsupported_reasons(config, capability)
        reasons += cls.model_feature_reasons(config)
        return reasons + declared.graph_reasons(config, capability)

    @classmethod
    def routes(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """The kernels and tile or task choices (routes) batches of ``config`` may take here; ``hal check``
        reports each route no conformance case reached. Empty (the default): one route, nothing to report."""
        return []

    def route_of(self, forward_batch: ForwardBatch, layer: AttentionLayer) -> list[str]:
        """The routes of :meth:`routes` the last forward of ``forward_batch`` on ``layer`` took (called by
        the conformance suite after the forward, under the same host threads; may read host values)."""
        return []

    @classmethod
    def model_feature_reasons(cls, config: AttentionConfig) -> list[str]:
        """Why this backend cannot serve ``config``'s attention sinks or KV cache dtype (empty: it can)."""
        return cls.declaration().model_feature_reasons(config)

    @classmethod
    def format_kv_pages(cls, capability: DeviceCapability, kv_layout: str, pages: torch.Tensor) -> torch.Tensor:
        """A freshly allocated KV buffer of a ``kv_layout`` pool in the storage format this backend's kernels read
        on ``capability`` (``Selection.create_kv_pool`` calls it once per buffer; default: as allocated)."""
        return pages

    # -- SGLang's metadata contract: the engine-facing edges of the plan step ---------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager entry point: :meth:`init_forward_metadata_out_graph` then :meth:`init_forward_metadata_in_graph`."""
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Host-side per-step planning, outside any graph (``in_capture=True`` before a capture); runs before every
        eager step and every graph replay. Returns None.

        The edge every entry path goes through (eager, hal's ``GraphRunner``, SGLang's and vLLM's graph steps):
        :meth:`check_batch`, then the request tables this backend declares it reads (``reads_tables``) given to the
        batch where it carries only the other form (:class:`hal.batch.RequestTables`: sized to the step, or a
        captured graph's persistent buffer refilled in place), then the backend's :meth:`plan_out_graph`.
        """
        self.check_batch(forward_batch)
        graph = not forward_batch.forward_mode.is_idle() and self.is_graph_batch(forward_batch, in_capture)
        self._request_tables.prepare(forward_batch, graph)
        self.plan_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Graph-recordable, static-shape device planning, replayed by the graph: the edge over the backend's
        :meth:`plan_in_graph`. Returns None."""
        self.plan_in_graph(forward_batch)

    # -- the plan steps a backend implements ----------------------------------------------------------
    def plan_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """The backend's host-side plan of a step (plugin API 3's ``init_forward_metadata_out_graph``): the batch is
        checked and carries the request tables the backend reads. May read host mirrors and fix every shape; must
        end with ``self.set_forward_metadata(meta, forward_batch)`` (the run steps read ``self.forward_metadata``).
        A captured graph's static batch (:meth:`is_graph_batch`) must use buffers made by
        :meth:`init_cuda_graph_state` or at capture, never fresh tensors the graph reads. Returns None."""

    def plan_in_graph(self, forward_batch: ForwardBatch) -> None:
        """The backend's device-side plan of a step (plugin API 3's ``init_forward_metadata_in_graph``): fills the
        device tensors of the metadata :meth:`plan_out_graph` set, from the batch's device tensors only: no
        ``.item()`` / ``.tolist()`` / ``.cpu()``, no ``int()`` of a tensor, no data-dependent shape, no allocation
        sized from tensor data (``hal lint`` checks). Recorded into a captured graph. Returns None."""

    @functools.cached_property
    def _request_tables(self) -> RequestTables:
        """The request tables this backend reads, derived per step where a batch lacks them (its graph buffers)."""
        return RequestTables(self.declared.reads_tables)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every buffer a captured graph reads, for up to ``max_bs`` requests and
        ``max_num_tokens`` query tokens. Returns None. Called once, before any capture;
        a backend that declares ``supports_graph`` must implement it."""
        raise NotImplementedError()

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: ForwardBatch):
        """Create forward metadata whose tensor addresses a breakable graph captures.

        Returns the metadata object (the engine keeps it and hands it back to
        ``prepare_forward_metadata_for_breakable_cuda_graph_replay``). Only for backends
        that set ``use_captured_forward_metadata_for_breakable_cuda_graph``.
        """
        raise NotImplementedError()

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self,
        capture_metadata,
        forward_batch: ForwardBatch,
        *,
        static_forward_batch: ForwardBatch | None = None,
    ) -> None:
        """Refresh captured metadata in place for this batch and make it the active metadata.

        Writes into ``capture_metadata``'s tensors (same addresses) and calls
        ``set_forward_metadata``; returns None.
        """
        raise NotImplementedError()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value of the padding requests of a replayed batch: returns the int 0 or 1.

        1 when a kernel needs at least one key per request (the padding request then reads
        the padding slot); a backend that declares ``supports_graph`` must implement it.
        """
        raise NotImplementedError()

    def on_after_cuda_graph_warmup(self) -> None:
        """Undo what the warm-up pass mutated, between warm-up and capture."""

    def get_verify_buffers_to_fill_after_draft(self) -> list:
        """Buffers of verify kernels (tree mask, positions) a draft step fills; ``[None, None]``: none."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs: int | None) -> None:
        """Recompute metadata that depends on the buffers above once the draft filled them.

        Returns None. Only for backends whose ``get_verify_buffers_to_fill_after_draft``
        returns buffers.
        """
        raise NotImplementedError()

    # -- forward: the engine-facing edges (plain code: checks, then the fused call or the checked path) -------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        out: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of one layer: ``q`` ``[T, q_heads * head_dim]`` or ``[T, q_heads, head_dim]``,
        ``k``/``v`` the new tokens' keys and values likewise (SGLang's ``RadixAttention`` hands
        ``[T, H, D]`` views; with ``save_kv_cache=False`` the cache holds the truth: the new tokens are
        read from it and k/v, which may then be None as SGLang allows, are not used).
        ``sinks=`` (``[q_heads]`` float, gpt-oss) reaches the run step as ``sinks=``; an MLA layer's ``v`` may
        be None (the value is the key's latent).

        ``out``: the engine's output buffer, ``[R, q_heads * v_head_dim]`` or ``[R, q_heads, v_head_dim]`` with
        ``R >= T``, in ``q.dtype`` (vLLM's ``output``): rows ``[:T]`` are written (by the kernel itself where the
        backend's run step takes ``out=``), rows past ``T`` are never touched, and ``out[:T]`` is returned.
        Without it: a new ``[T, q_heads * v_head_dim]`` tensor in ``q.dtype``.

        Routes on ``forward_mode``: IDLE returns an empty output; DECODE runs the decode step; MIXED runs
        the mixed step where this backend's device has a fused mixed kernel (``capability.fused_mixed``, set by
        the NPU); everything else runs the extend step. Each step is :meth:`forward_decode`,
        :meth:`forward_extend`, :meth:`forward_mixed`: the checks, then the fused call or the checked path
        (``hal.prologue``).
        """
        mode = getattr(forward_batch, "forward_mode", None)
        if not hasattr(mode, "is_decode"):
            check_forward_fields(forward_batch)  # names the missing or mistyped field
        if mode.is_idle():
            empty = isinstance(q, torch.Tensor) and q.shape[0] == 0
            expect(empty, InvalidBatchError, "q.shape", getattr(q, "shape", q), "no tokens in an IDLE batch")
            rows = None if out is None else check_output_buffer(out, q, layer, 0)
            return write_output(q.new_empty(0, layer.tp_q_head_num, layer.v_head_dim), q, layer, rows)
        kind = step_kind(mode, self.capability.fused_mixed)
        return self._forward(kind, q, k, v, layer, forward_batch, save_kv_cache, out, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        """DECODE (one query token per request), as :meth:`forward` runs it: the checks, then the fused call or
        the checked path ending in :meth:`run_decode`. Returns as :meth:`forward`."""
        return self._forward("decode", q, k, v, layer, forward_batch, save_kv_cache, out, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        """New tokens after a cached prefix (EXTEND, MIXED without ``fused_mixed``, TARGET_VERIFY, DRAFT_EXTEND),
        as :meth:`forward` runs them, ending in :meth:`run_extend`. Returns as :meth:`forward`."""
        return self._forward("extend", q, k, v, layer, forward_batch, save_kv_cache, out, kwargs)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        """A MIXED batch in one call (where ``capability.fused_mixed``), ending in :meth:`run_mixed`."""
        return self._forward("mixed", q, k, v, layer, forward_batch, save_kv_cache, out, kwargs)

    def _forward(self, kind: str, q, k, v, layer, forward_batch, save_kv_cache, out, kwargs) -> torch.Tensor:
        """One forward step, in order: the checks every path shares, then the fused call where the plan chose it
        and this call allows it, else the checked path and ``run_<kind>``; the result through :func:`write_output`."""
        check_forward_fields(forward_batch)
        self.check_model_features(layer, forward_batch, kwargs.get("sinks"))
        self.check_layer(layer)
        self.metadata_for(forward_batch)
        self.check_input_dtypes(q, k, v, layer, forward_batch)
        if out is not None:
            k_store, v_store, _ = kv_storage(forward_batch.token_to_kv_pool, layer.layer_id)  # in any layout
            out = check_output_buffer(out, q, layer, q.shape[0], k, v, k_store, v_store)
        facts = step_facts(type(self))
        if self._fused_for(self._metadata_stamp[3], k, v, save_kv_cache):
            extra = {"out": out} if facts.fused_takes_out else {}
            result = self.run_fused(q, k, v, layer, forward_batch, save_kv_cache, **extra, **kwargs)
            if result is not None:
                return write_output(result, q, layer, out)
        q, k, v = self.prepare_forward(q, k, v, layer, forward_batch, save_kv_cache)
        extra = {"out": out} if facts.run_takes_out[kind] else {}
        result = getattr(self, f"run_{kind}")(q, k, v, layer, forward_batch, save_kv_cache, **extra, **kwargs)
        return write_output(result, q, layer, out)

    def check_input_dtypes(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch) -> None:
        """``InvalidBatchError`` / ``UnsupportedError`` for a ``q``/``k``/``v`` dtype the layer, the backend's
        config and its declaration do not allow (runs before either path)."""
        check_input_dtypes(
            q,
            k,
            v,
            layer=layer,
            config=self.config,
            declaration=self.declared,
            kv_dtype=forward_batch.token_to_kv_pool.dtype,
        )

    # -- the run steps a backend implements ---------------------------------------------------
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """DECODE: one query token per request. Returns ``[T, q_heads, v_head_dim]`` (or flat), any float dtype
        (the base class casts to ``q.dtype``); with an ``out`` parameter in its signature it receives the
        caller's buffer (``[T, q_heads, v_head_dim]`` view, or None) and writes there.

        Receives (after the checked path's steps, :meth:`prepare_forward`) ``q`` ``[T, q_heads, head_dim]``
        (``T = batch_size``) and ``k``/``v`` ``[T, kv_heads, dim]`` in ``q.dtype``, already written
        at ``out_cache_loc`` of ``layer.layer_id`` (None only when ``save_kv_cache`` is False and
        the backend declares ``reads_new_kv = False``); ``self.forward_metadata`` is this step's
        plan. Attends over each request's ``seq_lens`` keys.
        """
        raise NotImplementedError()

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """New tokens after a cached prefix (EXTEND, MIXED without ``fused_mixed``, TARGET_VERIFY,
        DRAFT_EXTEND); rows in ``q``'s order. Inputs and output as :meth:`run_decode`, ``T`` = the batch's query
        tokens; TARGET_VERIFY applies ``spec_info.custom_mask`` instead of the causal rule (docs/porting.md,
        "Masks").
        """
        raise NotImplementedError()

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """A MIXED batch (chunked prefills and decodes) in one call, reached where ``capability.fused_mixed``
        (the npu device). Inputs and output as :meth:`run_extend`.
        """
        raise NotImplementedError()

    # -- SGLang's helpers ----------------------------------------------------------------
    def support_triton(self) -> bool:
        """Whether the helper ops around attention may use Triton kernels with this backend."""
        return True

    def get_indexer_metadata(self, layer_id: int, forward_batch: ForwardBatch):
        """Sparse-attention indexer metadata (DeepSeek-V3.2's native sparse attention); None: no indexer.

        A backend with an indexer would return what its indexer kernels read for this step:
        per request the KV slots of its tokens (block table), sequence and query lengths with
        their cumulative offsets, the page size and the top-k index buffers attention gathers
        from. No hal backend has one (docs/porting.md, section 12): None, so the engine runs
        dense attention.
        """
        return None

    # -- shared by the backends --------------------------------------------------------
    def check_batch(self, forward_batch: ForwardBatch) -> None:
        """Validate ``forward_batch`` at this backend's level, with what this backend needs (page-aligned
        slots). Call it first in ``init_forward_metadata_out_graph``; hal's own batches already passed
        their construction level, so only an engine's batch or a stricter level costs anything."""
        level = self.validation
        declared = self.declared
        stricter = declared.requires_page_aligned_slots or not declared.supports_padding_slots
        if getattr(forward_batch, "validate", None) == level and not (level == "full" and stricter):
            check_batch_fields(forward_batch)  # presence and types only: a field changed since construction
            return
        validate_batch(
            forward_batch,
            level,
            page_aligned=declared.requires_page_aligned_slots,
            padding_slots=None if declared.supports_padding_slots else declared.name,
        )

    def is_graph_batch(self, forward_batch: ForwardBatch, in_capture: bool = False) -> bool:
        """Whether ``forward_batch`` is a captured graph's static batch (use the fixed graph buffers).

        hal's ``GraphRunner`` marks its batches (``graph_static``); an engine's runner is recognised
        by ``in_capture=True`` at capture, and at replay by the (mode, batch size) it captured.
        """
        key = (forward_batch.forward_mode.name, forward_batch.batch_size)
        if in_capture:
            self._graph_batches.add(key)
            return True
        marked = getattr(forward_batch, "graph_static", None)
        return marked if marked is not None else key in self._graph_batches

    @property
    def helper_ops(self) -> ModuleType:
        """The positions / kv-indices / KV-write ops for this backend: a kernel package (:func:`helper_ops_for`)."""
        return helper_ops_for(self)
