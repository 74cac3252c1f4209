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
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch

from hal.batch import validation_level
from hal.capability import DeviceCapability
from hal.declaration import BackendDeclaration
from hal.deprecation import warn_renamed
from hal.errors import ConfigError, InvalidBatchError, expect
from hal.kv_cache import kv_storage
from hal.modes import step_kind
from hal.plan import Plan
from hal.plugin_compat import adapt_backend
from hal.prologue import (
    ForwardSteps,
    Steps,
    check_output_buffer,
    fused_forward_disabled,
    fused_forward_enabled,
    fused_forward_env,
    helper_ops_for,
    step_facts,
    write_output,
)
from hal.validation import check_forward_fields

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


class AttentionBackend(ForwardSteps):
    """Base class of attention backends (SGLang's ``AttentionBackend``). Its public names, in four groups:

    * **what an engine calls** (SGLang's contract, member for member): ``init_forward_metadata``,
      ``init_forward_metadata_out_graph`` / ``init_forward_metadata_in_graph`` (the plan's edges), ``forward`` and
      ``forward_decode`` / ``forward_extend`` / ``forward_mixed`` (the run's edges), ``init_cuda_graph_state``,
      ``get_cuda_graph_seq_len_fill_value``, ``on_after_cuda_graph_warmup``,
      ``init_forward_metadata_for_breakable_cuda_graph_capture`` /
      ``prepare_forward_metadata_for_breakable_cuda_graph_replay``, ``get_verify_buffers_to_fill_after_draft`` /
      ``update_verify_buffers_to_fill_after_draft``, ``support_triton``, ``get_indexer_metadata`` and SGLang's class
      attributes ``prefill_attention_backend_str``, ``decode_attention_backend_str``,
      ``supports_ragged_verify_graph``, ``needs_cpu_seq_lens``,
      ``use_captured_forward_metadata_for_breakable_cuda_graph``; ``forward_metadata`` is the current step's
      metadata (an instance attribute);
    * **what a port implements**: the plan steps ``plan_out_graph`` / ``plan_in_graph``, the run steps
      ``run_decode`` / ``run_extend`` / ``run_mixed`` (``run_fused`` optionally), the step hooks it may override
      (``check_layer``, ``check_inputs``, ``save_kv``, ``fused_forward_ready``) and what selection and reports ask
      (``unavailable_reasons``, ``unsupported_reasons``, ``notes``, ``routes``, ``route_of``, ``format_kv_pages``);
    * **the declaration**: :meth:`declaration`, one frozen :class:`hal.declaration.BackendDeclaration` (a port gives
      it as class attributes of the same names, ``name``, ``dtypes``, ``supports_*``..., read once into it);
    * **the helpers of the steps**: ``plan`` (:class:`hal.plan.Plan`: ``set_metadata``, which every plan ends with,
      ``metadata_for``, ``is_graph_batch``, ``check_batch``, ``path``) and ``steps`` (:class:`hal.prologue.Steps`:
      ``helper_ops``, ``forward_paths``, the checks and the checked path's steps).

    The names these helpers had on the class before hal 0.4 (``set_forward_metadata``, ``metadata_for``,
    ``helper_ops``, the declared attributes...) still answer on an instance, with a ``DeprecationWarning`` naming
    the new place.
    """

    _hal_contract = True  # the engine-facing names here are the edges (hal.plugin_compat finds this class by it)

    # -- SGLang's class attributes -------------------------------------------------------
    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    supports_ragged_verify_graph: bool = False
    needs_cpu_seq_lens: bool = True
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    def __new__(cls, *args, **kwargs):
        """An instance of the class hal runs for ``cls``: ``cls`` itself, or, for a class written against an older
        plugin API that came through no registry, its adapter (:func:`hal.plugin_compat.adapt_backend`, made once)."""
        return super().__new__(adapt_backend(cls))

    def __init__(self, capability: DeviceCapability, config: AttentionConfig | None = None, **options):
        """``config``: the model this backend serves (layers, max context, max batch), for planning;
        ``options``: ``validate`` (``off``/``cheap``/``full``, default ``HAL_VALIDATE``) and the
        backend's own ``option_defaults``. Unknown options are a ``ConfigError``."""
        declared = self.__dict__["_declared"] = self.declaration()
        unknown = sorted(set(options) - set(declared.option_defaults) - {"validate"})
        expect(
            not unknown,
            ConfigError,
            f"{declared.name} options",
            unknown,
            f"options of this backend: {sorted({'validate', *declared.option_defaults})}",
        )
        self.capability = capability
        self.config = config
        self.device = capability.torch_device
        self.validation = validation_level(options.pop("validate", None))
        self.options = {**declared.option_defaults, **options}
        self.forward_metadata: Any = None  # the current step's (SGLang reads it off any backend)
        self._fused_env = fused_forward_env()  # HAL_FUSED_FORWARD, read (and checked) when the backend is created

    @functools.cached_property
    def _declared(self) -> BackendDeclaration:
        """This backend's :meth:`declaration`, read once (the forward path reads it)."""
        return self.declaration()

    @property
    def plan(self) -> Plan:
        """The plan state and the helpers of the plan steps (:class:`hal.plan.Plan`)."""
        return self._hal_plan

    @property
    def steps(self) -> Steps:
        """The helpers of the forward steps (:class:`hal.prologue.Steps`)."""
        return self._hal_steps

    # hal's own reads go through these, so that a port's own member named ``plan`` or ``steps`` changes nothing of hal
    @functools.cached_property
    def _hal_plan(self) -> Plan:
        return Plan(self)

    @functools.cached_property
    def _hal_steps(self) -> Steps:
        return Steps(self)

    def __getattr__(self, name: str):
        """The names the helpers had on the class before hal 0.4, answered from their new place with a warning."""
        moved = _MOVED.get(name)
        if moved is None:
            if name == "forward_metadata":  # a plugin whose __init__ does not call the base class's
                return None
            if name in _DECLARED:
                warn_renamed(f"{type(self).__qualname__}.{name}", f"backend.declaration().{name}", since="0.4.0")
                return getattr(self.declaration(), name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        owner, new = moved
        warn_renamed(f"{type(self).__qualname__}.{name}", f"backend.{owner}.{new}" if owner else new, since="0.4.0")
        return getattr(getattr(self, f"_hal_{owner}"), new) if owner else self._declared

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def declaration(cls) -> BackendDeclaration:
        """What this backend class declares it supports: one frozen :class:`BackendDeclaration`, read from the class
        attributes of its field names (a port's input; absent ones take the field's default), as selection, the
        forward path and ``hal info`` read it."""
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
        reasons += declared.model_feature_reasons(config)
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
        ``plan.check_batch`` (on the tables the engine gave: a captured graph's table hal derived at an earlier step is
        withdrawn first), then the request tables this backend declares it reads (``reads_tables``) given to the
        batch where it carries only the other form (:class:`hal.batch.RequestTables`: sized to the step, or a
        captured graph's persistent buffer refilled in place), then the backend's :meth:`plan_out_graph`.
        """
        plan = self._hal_plan
        plan.tables.withdraw(forward_batch)  # a graph's table derived at an earlier step: checked on what was given
        plan.check_batch(forward_batch)
        graph = not forward_batch.forward_mode.is_idle() and plan.is_graph_batch(forward_batch, in_capture)
        plan.tables.prepare(forward_batch, graph)
        self.plan_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Graph-recordable, static-shape device planning, replayed by the graph: the edge over the backend's
        :meth:`plan_in_graph`. Returns None."""
        self.plan_in_graph(forward_batch)

    # -- the plan steps a backend implements ----------------------------------------------------------
    def plan_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """The backend's host-side plan of a step (plugin API 3's ``init_forward_metadata_out_graph``): the batch is
        checked and carries the request tables the backend reads. May read host mirrors and fix every shape; must
        end with ``self.plan.set_metadata(meta, forward_batch)`` (the run steps read ``self.forward_metadata``).
        A captured graph's static batch (``self.plan.is_graph_batch``) must use buffers made by
        :meth:`init_cuda_graph_state` or at capture, never fresh tensors the graph reads. Returns None."""

    def plan_in_graph(self, forward_batch: ForwardBatch) -> None:
        """The backend's device-side plan of a step (plugin API 3's ``init_forward_metadata_in_graph``): fills the
        device tensors of the metadata :meth:`plan_out_graph` set, from the batch's device tensors only: no
        ``.item()`` / ``.tolist()`` / ``.cpu()``, no ``int()`` of a tensor, no data-dependent shape, no allocation
        sized from tensor data (``hal lint`` checks). Recorded into a captured graph. Returns None."""

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
        steps, plan = self._hal_steps, self._hal_plan
        check_forward_fields(forward_batch)
        steps.check_model_features(layer, forward_batch, kwargs.get("sinks"))
        self.check_layer(layer)
        plan.metadata_for(forward_batch)
        steps.check_input_dtypes(q, k, v, layer, forward_batch)
        if out is not None:
            k_store, v_store, _ = kv_storage(forward_batch.token_to_kv_pool, layer.layer_id)  # in any layout
            out = check_output_buffer(out, q, layer, q.shape[0], k, v, k_store, v_store)
        facts = step_facts(type(self))
        if steps.fused_for(plan.stamp[3], k, v, save_kv_cache):
            extra = {"out": out} if facts.fused_takes_out else {}
            result = self.run_fused(q, k, v, layer, forward_batch, save_kv_cache, **extra, **kwargs)
            if result is not None:
                return write_output(result, q, layer, out)
        q, k, v = steps.prepare_forward(q, k, v, layer, forward_batch, save_kv_cache)
        extra = {"out": out} if facts.run_takes_out[kind] else {}
        result = getattr(self, f"run_{kind}")(q, k, v, layer, forward_batch, save_kv_cache, **extra, **kwargs)
        return write_output(result, q, layer, out)

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


# Old public names of the class and their new places: (attribute of the backend holding it, its name there); an
# empty owner: the backend's declaration itself.
_MOVED = {
    "set_forward_metadata": ("plan", "set_metadata"),
    "metadata_for": ("plan", "metadata_for"),
    "planned_path": ("plan", "path"),
    "is_graph_batch": ("plan", "is_graph_batch"),
    "check_batch": ("plan", "check_batch"),
    "helper_ops": ("steps", "helper_ops"),
    "forward_paths": ("steps", "forward_paths"),
    "check_model_features": ("steps", "check_model_features"),
    "check_input_dtypes": ("steps", "check_input_dtypes"),
    "prepare_forward": ("steps", "prepare_forward"),
    "new_kv_from_cache": ("steps", "new_kv_from_cache"),
    "declared": ("", "backend.declaration()"),
}
_DECLARED = frozenset(f.name for f in fields(BackendDeclaration)) | {"model_feature_reasons"}
