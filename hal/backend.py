"""``AttentionBackend``: SGLang's attention-backend contract, member for member.

Metadata is prepared in two halves so that one code path serves eager runs and graph
capture/replay (see ``hal.graph``):

* ``init_forward_metadata_out_graph(fb, in_capture=False)``: host-side work (lists,
  ``.item()``, dynamic shapes, planning), outside any graph; runs before every replay.
* ``init_forward_metadata_in_graph(fb)``: static-shape device work only, recorded into
  the graph at capture and replayed by it. No ``.item()`` / ``.cpu()`` / ``.tolist()``
  and no allocation whose shape depends on batch contents.

``init_forward_metadata(fb)`` (eager) is the two in order.

Beyond SGLang, a backend declares what it supports (``name``, ``dtypes``,
``page_sizes``, ``supports_*``, ``requires_page_aligned_slots``) and :meth:`unsupported_reasons`
turns that into the reasons it cannot serve a config; ``helper_ops`` is the one place
``support_triton()`` is read.

Batches are read by SGLang's field names (any object that has them: see ``hal.batch``),
pools through the protocols of ``hal.kv_cache``. ``forward`` uses the metadata the last
``init_forward_metadata_out_graph`` prepared (SGLang's contract); a cheap stamp (mode,
batch size, a step counter) catches metadata left from another step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.batch import validate_batch, validation_level
from hal.capability import DTYPE_NAMES, DeviceCapability
from hal.deprecation import warn_renamed
from hal.errors import ConfigError, InvalidBatchError, UnsupportedError, expect
from hal.kernels.reference import dequantize_kv, kv_scales, shares_storage, write_kv
from hal.kv_cache import kv_cache_dtype_name
from hal.kv_dtypes import kv_scaled

if TYPE_CHECKING:
    from hal.batch import ForwardBatch, SharedReadEnds
    from hal.config import AttentionConfig
    from hal.layer import AttentionLayer

__all__ = ["AttentionBackend", "helper_ops_for"]

_FORWARD_METHODS = ("forward_decode", "forward_extend", "forward_mixed")


def _with_prologue(method):
    """``method`` (a ``forward_*``) preceded by :meth:`AttentionBackend.prepare_forward` unless a caller
    on this backend already ran it for this call."""

    @functools.wraps(method)
    def forward_with_prologue(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if getattr(self, "_in_prologue_call", False):
            return method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        self.check_model_features(layer, forward_batch, kwargs.get("sinks"))  # sinks= / an fp8 pool: declared?
        q, k, v = self.prepare_forward(q, k, v, layer, forward_batch, save_kv_cache)
        self._in_prologue_call = True
        try:
            return method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            self._in_prologue_call = False

    forward_with_prologue._hal_prologue = True
    return forward_with_prologue


def _overrides_old_name(cls: type, name: str) -> bool:
    """Whether ``cls`` (a plugin written for API 1) overrides the deprecated classmethod ``name``."""
    return getattr(cls, name).__func__ is not getattr(AttentionBackend, name).__func__


def helper_ops_for(backend: AttentionBackend) -> ModuleType:
    """The kernel package whose ``write_kv`` / ``build_kv_indices`` / ``compute_positions`` serve ``backend``:
    :mod:`hal.kernels.triton` when ``backend.support_triton()`` and its device has a Triton target,
    else :mod:`hal.kernels.reference`. The one place ``support_triton()`` is read."""
    if backend.support_triton() and backend.capability.triton_target:
        from hal.kernels import triton as ops
    else:
        from hal.kernels import reference as ops
    return ops


class AttentionBackend:
    """Base class of attention backends (SGLang's ``AttentionBackend``)."""

    # -- SGLang's class attributes -------------------------------------------------------
    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    supports_ragged_verify_graph: bool = False
    needs_cpu_seq_lens: bool = True
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    # -- what the backend supports, read by unsupported_reasons() -------------------------
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
    # Backend-specific constructor options and their defaults (``Selection.create(**options)``).
    option_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, capability: DeviceCapability, config: AttentionConfig | None = None, **options):
        """``config``: the model this backend serves (layers, max context, max batch), for planning;
        ``options``: ``validate`` (``off``/``cheap``/``full``, default ``HAL_VALIDATE``) and the
        backend's own ``option_defaults``. Unknown options are a ``ConfigError``."""
        unknown = sorted(set(options) - set(self.option_defaults) - {"validate"})
        expect(
            not unknown,
            ConfigError,
            f"{self.name or type(self).__name__} options",
            unknown,
            f"options of this backend: {sorted({'validate', *self.option_defaults})}",
        )
        self.capability = capability
        self.config = config
        self.device = capability.torch_device
        self.validation = validation_level(options.pop("validate", None))
        self.options = {**self.option_defaults, **options}
        self.forward_metadata: Any = None
        self._metadata_stamp: tuple | None = None
        self._step = 0
        self._graph_batches: set[tuple[str, int]] = set()

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        """Reasons this backend cannot run on this device at all (missing library...); empty: it can.

        (Plugin API 1 called this ``available``; a backend overriding only that old name is still
        honoured, with a ``DeprecationWarning``.)
        """
        if _overrides_old_name(cls, "available"):
            warn_renamed(f"{cls.__qualname__}.available (overridden)", "unavailable_reasons")
            return list(cls.available(capability))
        return []

    @classmethod
    def available(cls, capability: DeviceCapability) -> list[str]:
        """Deprecated (0.2.0) name of :meth:`unavailable_reasons`: it returns reasons, not a bool."""
        warn_renamed(f"{cls.__qualname__}.available", "unavailable_reasons")
        if _overrides_old_name(cls, "available"):  # reached through super() from an old override
            return []
        return cls.unavailable_reasons(capability)

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        """What a user must know about this backend here, though nothing stops it (``hal info`` shows them)."""
        return ["emulated: correct, but its speed means nothing"] if capability.emulated else []

    @classmethod
    def unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``capability``; empty means it can.

        Starts with :meth:`unavailable_reasons`, then checks the declared features. (Plugin API 1
        called this ``validate``; a backend overriding only that old name is still honoured, with a
        ``DeprecationWarning``.)
        """
        if _overrides_old_name(cls, "validate"):
            warn_renamed(f"{cls.__qualname__}.validate (overridden)", "unsupported_reasons")
            return list(cls.validate(config, capability))
        return cls._declared_unsupported_reasons(config, capability)

    @classmethod
    def validate(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Deprecated (0.2.0) name of :meth:`unsupported_reasons`."""
        warn_renamed(f"{cls.__qualname__}.validate", "unsupported_reasons")
        if _overrides_old_name(cls, "validate"):  # reached through super() from an old override
            return cls._declared_unsupported_reasons(config, capability)
        return cls.unsupported_reasons(config, capability)

    @classmethod
    def _declared_unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """The reasons the class attributes (``dtypes``, ``page_sizes``, ``supports_*``) give."""
        reasons = list(cls.unavailable_reasons(capability))
        dtype = config.dtype_name
        if dtype not in cls.dtypes:
            reasons.append(f"dtype {dtype} not supported (supports {sorted(cls.dtypes)})")
        elif dtype not in capability.dtypes:
            reasons.append(f"device has no {dtype}: {capability.reasons.get(dtype, 'not listed')}")
        if cls.page_sizes is not None and config.page_size not in cls.page_sizes:
            reasons.append(f"page_size {config.page_size} not supported (supports {sorted(cls.page_sizes)})")
        if cls.head_dims is not None and config.head_dim not in cls.head_dims:
            reasons.append(f"head_dim {config.head_dim} not supported (supports {sorted(cls.head_dims)})")
        if config.v_head_dim != config.head_dim and not cls.supports_mla:
            reasons.append(f"v_head_dim {config.v_head_dim} != head_dim {config.head_dim} not supported")
        for wanted, supported, what in (
            (config.sliding_window_size >= 0, cls.supports_sliding_window, "sliding window"),
            (config.logit_cap > 0, cls.supports_logit_cap, "logit cap"),
            (config.non_causal, cls.supports_non_causal, "non-causal (encoder / cross) attention"),
            (config.custom_mask, cls.supports_custom_mask, "custom mask (TARGET_VERIFY)"),
        ):
            if wanted and not supported:
                reasons.append(f"{what} not supported")
        reasons += cls.model_feature_reasons(config)
        if config.graph and not cls.supports_graph:
            reasons.append("graph capture not supported")
        elif config.graph and not capability.graph:
            reasons.append(f"device has no graph capture: {capability.reasons.get('graph', 'not listed')}")
        return reasons

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
        reasons = []
        if getattr(config, "attention_sinks", False) and not cls.supports_sinks:
            reasons.append("attention sinks not supported")
        declared = cls.kv_cache_dtypes if cls.kv_cache_dtypes is not None else cls.dtypes
        kv_dtype = getattr(config, "kv_cache_dtype_name", config.dtype_name)
        if kv_dtype != config.dtype_name and kv_dtype not in declared:
            reasons.append(f"kv_cache_dtype {kv_dtype} not supported (supports {sorted(declared)})")
        return reasons

    # -- SGLang's metadata contract ----------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager entry point: ``out_graph`` then ``in_graph``."""
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Host-side per-step metadata, outside any graph (``in_capture=True`` before a capture).

        Runs before every eager step and every graph replay. May read host mirrors and fix
        every shape; must end with ``self.set_forward_metadata(meta, forward_batch)`` (the
        ``forward_*`` methods read it back with ``self.metadata_for(forward_batch)``). Returns None.
        """

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Graph-recordable, static-shape device work; replayed by the graph. Returns None.

        Fills the device tensors of the metadata ``out_graph`` set, from the batch's device
        tensors only: no ``.item()`` / ``.tolist()`` / ``.cpu()``, no ``int()`` of a tensor,
        no data-dependent shape, no allocation sized from tensor data (``hal lint`` checks).
        """

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

    # -- forward -----------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of one layer: ``q`` ``[T, q_heads * head_dim]`` or ``[T, q_heads, head_dim]``,
        ``k``/``v`` the new tokens' keys and values likewise (SGLang's ``RadixAttention`` hands
        ``[T, H, D]`` views; with ``save_kv_cache=False`` the cache holds the truth: the new tokens are
        read from it and k/v, which may then be None as SGLang allows, are not used); returns
        ``[T, q_heads * v_head_dim]`` in ``q.dtype``.
        ``sinks=`` (``[q_heads]`` float, gpt-oss) reaches ``forward_*`` as ``sinks=``; an MLA
        layer's ``v`` may be None (the value is the key's latent).

        Runs the prologue once (:meth:`prepare_forward`: layer and input checks, the metadata
        lookup, the KV write or read-back), then routes on ``forward_mode``: IDLE returns an
        empty output; DECODE goes to ``forward_decode``; MIXED goes to ``forward_mixed`` when
        this backend's device has a fused mixed kernel (``capability.fused_mixed``, set by the
        NPU); everything else goes to ``forward_extend``.
        """
        mode = forward_batch.forward_mode
        if mode.is_idle():
            expect(q.shape[0] == 0, InvalidBatchError, "q.shape", tuple(q.shape), "no tokens in an IDLE batch")
            return q.new_empty(0, layer.tp_q_head_num * layer.v_head_dim)
        if mode.is_decode():
            run = self.forward_decode
        elif mode.is_mixed() and self.capability.fused_mixed:
            run = self.forward_mixed
        else:
            run = self.forward_extend
        return run(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """DECODE: one query token per request. Returns ``[T, q_heads * v_head_dim]`` in ``q.dtype``.

        Receives (after the prologue, :meth:`prepare_forward`) ``q`` ``[T, q_heads, head_dim]``
        (``T = batch_size``) and ``k``/``v`` ``[T, kv_heads, dim]`` in ``q.dtype``, already written
        at ``out_cache_loc`` of ``layer.layer_id`` (None only when ``save_kv_cache`` is False and
        the backend declares ``reads_new_kv = False``); ``self.forward_metadata`` is this step's
        metadata. Attends over each request's ``seq_lens`` keys.
        """
        raise NotImplementedError()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """New tokens after a cached prefix (EXTEND, MIXED without ``fused_mixed``, TARGET_VERIFY,
        DRAFT_EXTEND). Returns ``[T, q_heads * v_head_dim]`` in ``q.dtype``, rows in ``q``'s order.

        Inputs as ``forward_decode`` (``[T, H, D]``, KV already written), ``T`` = the batch's query
        tokens; TARGET_VERIFY applies ``spec_info.custom_mask`` instead of the causal rule
        (docs/porting.md, "Masks").
        """
        raise NotImplementedError()

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """A MIXED batch (chunked prefills and decodes) in one call, reached where ``capability.fused_mixed``
        (the npu device). Inputs and output as ``forward_extend``.
        """
        raise NotImplementedError()

    # -- the forward prologue ----------------------------------------------------------
    # Every forward_* a subclass defines is wrapped (__init_subclass__) so that a direct call runs
    # prepare_forward first, exactly once per call: forward() -> forward_decode, forward_extend ->
    # forward_mixed and super().forward_* calls inside it do not repeat it.
    runs_prologue: ClassVar[bool] = True  # False: forward_* only delegate to backends that run their own
    reads_new_kv: ClassVar[bool] = True  # False: forward_* read the new tokens from the cache, never from k/v

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.runs_prologue:
            return
        for name in _FORWARD_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_hal_prologue", False):
                setattr(cls, name, _with_prologue(method))

    def prepare_forward(
        self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The forward prologue, in order: :meth:`check_layer`, :meth:`check_inputs` (nothing is
        written before both pass), :meth:`metadata_for`, then :meth:`save_kv` (or, with
        ``save_kv_cache=False``, the new tokens read back from the cache in place of k/v when the
        backend ``reads_new_kv``: the caller wrote the cache, and k/v may be None or stale).
        Returns ``q, k, v`` as ``[T, heads, dim]``, k/v in ``q.dtype``.
        """
        self.check_layer(layer)
        q, k, v = self.check_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        self.metadata_for(forward_batch)
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        elif self.reads_new_kv:
            k, v = (t.to(q.dtype) for t in self.new_kv_from_cache(layer, forward_batch))
        return q, k, v

    def check_layer(self, layer: AttentionLayer) -> None:
        """Raise ``UnsupportedError`` (or ``ConfigError``) for a layer feature this backend cannot run;
        the first step of the prologue. Default: nothing (selection already checked the config)."""

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
    def check_model_features(self, layer: AttentionLayer, forward_batch: ForwardBatch, sinks) -> None:
        """``UnsupportedError`` for ``sinks`` or an fp8 KV pool this backend does not declare; ``InvalidBatchError``
        for sinks that are not a float ``[q_heads]`` tensor on the pool's device."""
        if sinks is not None:
            expect(
                self.supports_sinks, UnsupportedError, "sinks", "a tensor", f"None: {self.name} has no attention sinks"
            )
            heads, device = layer.tp_q_head_num, forward_batch.out_cache_loc.device
            expect(
                isinstance(sinks, torch.Tensor)
                and sinks.is_floating_point()
                and tuple(sinks.shape) == (heads,)
                and sinks.device == device,
                InvalidBatchError,
                "sinks",
                f"{sinks.dtype}{list(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor) else sinks,
                f"a float tensor [{heads}] (one logit per q head) on {device}",
            )
        dtype = forward_batch.token_to_kv_pool.dtype
        if kv_scaled(dtype):
            declared = self.kv_cache_dtypes if self.kv_cache_dtypes is not None else self.dtypes
            name = kv_cache_dtype_name(dtype)
            expect(
                name in declared, UnsupportedError, "KV cache dtype", name, f"one of {self.name}'s {sorted(declared)}"
            )

    def check_batch(self, forward_batch: ForwardBatch) -> None:
        """Validate ``forward_batch`` at this backend's level, with what this backend needs (page-aligned
        slots). Call it first in ``init_forward_metadata_out_graph``; hal's own batches already passed
        their construction level, so only an engine's batch or a stricter level costs anything."""
        level = self.validation
        if getattr(forward_batch, "validate", None) == level and not (
            level == "full" and self.requires_page_aligned_slots
        ):
            return
        validate_batch(forward_batch, level, page_aligned=self.requires_page_aligned_slots)

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

    def set_forward_metadata(self, metadata: Any, forward_batch: ForwardBatch) -> None:
        """Make ``metadata`` (built in ``out_graph`` for ``forward_batch``) the current one, stamped with this step."""
        self._step += 1
        self.forward_metadata = metadata
        self._metadata_stamp = (forward_batch.forward_mode.name, forward_batch.batch_size, self._step)
        try:
            forward_batch._hal_metadata_step = (id(self), self._step)
        except AttributeError:  # a batch with __slots__: the mode/size stamp still guards it
            pass

    def metadata_for(self, forward_batch: ForwardBatch) -> Any:
        """The current metadata, checked (cheaply) to belong to ``forward_batch``'s step.

        Any view of the step's batch passes (SGLang prepares metadata on one and runs forward
        with another); metadata never prepared, prepared for another mode or batch size, or for
        an earlier step of this very batch object is an ``InvalidBatchError``.
        """
        stamp = self._metadata_stamp
        mode, bs = forward_batch.forward_mode.name, forward_batch.batch_size
        owner, step = getattr(forward_batch, "_hal_metadata_step", (None, None))
        ok = stamp is not None and stamp[:2] == (mode, bs) and (owner != id(self) or step == stamp[2])
        expect(
            ok,
            InvalidBatchError,
            "forward_metadata",
            "missing" if stamp is None else f"prepared for {stamp[0]} x {stamp[1]} (step {stamp[2]})",
            f"this batch's ({mode} x {bs}): call init_forward_metadata(forward_batch) before forward",
        )
        return self.forward_metadata

    @property
    def helper_ops(self) -> ModuleType:
        """The positions / kv-indices / KV-write ops for this backend: a kernel package (:func:`helper_ops_for`)."""
        return helper_ops_for(self)

    def save_kv(self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v) -> None:
        """Write the new tokens' ``k``/``v`` (``[T, kv_heads, dim]``) at ``out_cache_loc``.

        An fp8 pool stores them quantised with the layer's scales, an MLA pool the key only
        (``v`` may be None), both as ``hal.kernels.reference.write_kv``.
        """
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if kv_scaled(k_buffer.dtype) or shares_storage(k_buffer, v_buffer):
            write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v, *kv_scales(layer))
            return
        self.helper_ops.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v)

    def new_kv_from_cache(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query tokens' keys and values read back from the cache (``save_kv_cache=False``), in the cache
        dtype (an fp8 cache: dequantised to float32)."""
        pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc.long()
        k, v = pool.get_key_buffer(layer.layer_id)[loc], pool.get_value_buffer(layer.layer_id)[loc]
        if not kv_scaled(k.dtype):
            return k, v
        k_scale, v_scale = kv_scales(layer)
        return dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)

    def check_inputs(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Check ``q``/``k``/``v`` against the layer, batch and pool; return them as ``[T, heads, dim]``.

        Each must be exactly ``[T, heads * dim]`` or ``[T, heads, dim]`` of the layer, one
        float dtype, on the pool's device; ``k``/``v`` may be None only with
        ``save_kv_cache=False``, ``v`` alone with an MLA pool (the value is the key's latent).
        Shapes only: no device read. Runs once per layer call, so
        the passing path builds no message.
        """
        tokens = forward_batch.out_cache_loc.shape[0]
        pool = forward_batch.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)  # the pool checks layer_id
        v_buffer = pool.get_value_buffer(layer.layer_id)
        kv_heads, head_dim, v_dim = layer.tp_k_head_num, layer.head_dim, layer.v_head_dim
        specs = ((q, layer.tp_q_head_num, head_dim), (k, kv_heads, head_dim), (v, layer.tp_v_head_num, v_dim))
        ok = (k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2]) == (kv_heads, head_dim, v_dim)
        latent_v = v is None and k is not None and shares_storage(k_buffer, v_buffer)  # MLA: v is k's latent
        ok = ok and (k is not None and v is not None or k is None and v is None and not save_kv_cache or latent_v)
        device, dtype = k_buffer.device, getattr(q, "dtype", None)
        shaped = []
        for t, heads, dim in specs:
            if t is None:
                shaped.append(None)
                continue
            if not (
                ok
                and isinstance(t, torch.Tensor)
                and t.dtype == dtype
                and t.device == device
                and (t.shape == (tokens, heads * dim) or t.shape == (tokens, heads, dim))
            ):
                ok = False
                break
            shaped.append(t.unflatten(1, (heads, dim)) if t.dim() == 2 else t)
        if not ok or dtype not in DTYPE_NAMES or not q.is_floating_point():
            self._explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, save_kv_cache)
        return shaped

    @staticmethod
    def _explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, save_kv_cache) -> None:
        """Raise the ``InvalidBatchError`` that names what :meth:`check_inputs` found wrong."""
        expect(
            (k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2])
            == (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            InvalidBatchError,
            "layer (kv heads, head_dim, v_head_dim)",
            (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            f"the KV pool's {(k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2])}",
        )
        if k is None or v is None:
            expect(
                k is None and v is None and not save_kv_cache or k is not None and shares_storage(k_buffer, v_buffer),
                InvalidBatchError,
                "k, v",
                "None",
                "tensors, or both None with save_kv_cache=False (the new tokens are then read from the cache)",
            )
        for name, t, heads, dim in (
            ("q", q, layer.tp_q_head_num, layer.head_dim),
            ("k", k, layer.tp_k_head_num, layer.head_dim),
            ("v", v, layer.tp_v_head_num, layer.v_head_dim),
        ):
            if t is None:
                continue
            expect(
                isinstance(t, torch.Tensor) and tuple(t.shape) in ((tokens, heads * dim), (tokens, heads, dim)),
                InvalidBatchError,
                f"{name}.shape",
                tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                f"[{tokens}, {heads * dim}] or [{tokens}, {heads}, {dim}] ({tokens} tokens in this batch)",
            )
            expect(
                t.dtype in DTYPE_NAMES and t.is_floating_point(),
                InvalidBatchError,
                f"{name}.dtype",
                t.dtype,
                "float32, bfloat16 or float16",
            )
            expect(t.device == k_buffer.device, InvalidBatchError, f"{name}.device", t.device, str(k_buffer.device))
        expect(
            False,
            InvalidBatchError,
            "q/k/v dtypes",
            (q.dtype, getattr(k, "dtype", None), getattr(v, "dtype", None)),
            "one dtype",
        )

    # -- SGLang 0.5.21's additions to the contract ----------------------------------------
    # Declared attributes (SGLang reads them off any backend without getattr). hal's backends opt
    # into none of SGLang's optional runner paths; each is a question SGLang asks the backend.
    data_type: torch.dtype | None = None  # compute dtype (SGLang's fp8 fuse-rope checks); the model's
    kv_cache_dtype: torch.dtype | None = None  # KV cache dtype, likewise
    attn_backend_list: list | None = None  # a wrapper's children, for metadata snapshot/restore
    forward_metadata: Any = None  # declared on the class too (set per step by set_forward_metadata)
    kv_index_translator = None  # SGLang's unified-pool translator: None, hal reads physical slots
    supports_draft_extend_metadata_staging: bool = False  # no staged DRAFT_EXTEND metadata
    extend_dummy_seqs_capped_by_req_pool: bool = False  # no per-request buffers sized at the request pool
    prefer_eager_mixed_prefill_under_dp_attention: bool = False
    supports_prefill_cuda_graph_max_context_size: bool = False  # no prefill graphs (max_seq_len_override)
    supports_full_cuda_graph_chunked_prefix: bool = False  # no chunked-prefix full-graph topology

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        """Whether ``init_forward_metadata_in_graph`` alone rebuilds a replayed DRAFT_EXTEND step's metadata
        (a replaying runner could then skip ``out_graph``). False: hal prepares DRAFT_EXTEND outside graphs."""
        return False

    def shared_read_ends(self, forward_mode) -> SharedReadEnds:
        """Where this backend's reads of scheduler-shared buffers end for ``forward_mode`` (hal's or
        SGLang's ForwardMode): UNKNOWN for every mode, so the engine fences the whole forward.

        hal's ``forward_*`` may read the request table and ``seq_lens`` again (the torch and NPU
        paths gather keys through ``req_to_token``), so no earlier end is declared; a backend
        audited for one overrides this.
        """
        from hal.batch import SharedReadEnds

        return SharedReadEnds.UNKNOWN

    def prepare_prefill_shared_read_snapshot(self, forward_batch: ForwardBatch, *, num_qo_tokens: int) -> None:
        """Copy late prefill reads before the engine publishes a PRE_REPLAY read-done; returns None.

        A no-op: it matters only to a backend that declares ``PRE_REPLAY`` (hal's do not).
        """

    def prepare_full_cuda_graph_chunked_prefix(self, forward_batch: ForwardBatch, *, in_capture: bool) -> None:
        """Chunked-prefix full-graph metadata; only for backends with ``supports_full_cuda_graph_chunked_prefix``."""
        from hal.errors import UnsupportedError

        raise UnsupportedError(
            f"{self.name or type(self).__name__}: chunked-prefix full CUDA graphs "
            "(supports_full_cuda_graph_chunked_prefix is False): run those prefills eagerly"
        )

    def validate_elastic_cuda_graph_recapture(self) -> None:
        """Check this backend can recapture its graphs at a new width (SGLang's elastic EP); returns None.

        A recapture reuses the buffers of ``init_cuda_graph_state``; a backend without graph support
        raises ``UnsupportedError``.
        """
        from hal.errors import UnsupportedError

        if not self.supports_graph:
            raise UnsupportedError(f"{self.name or type(self).__name__} does not capture graphs, so cannot recapture")

    @property
    def verify_mask(self):
        """The mask buffer a draft stage fills in place for TARGET_VERIFY, if the backend owns one: None,
        hal's backends read ``spec_info.custom_mask`` as the engine built it."""
        return None
