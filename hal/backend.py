"""``AttentionBackend``: SGLang's attention-backend contract, member for member.

Metadata is prepared in two halves so that one code path serves eager runs and graph
capture/replay (see ``hal.graph``):

* ``init_forward_metadata_out_graph(fb, in_capture=False)``: host-side work (lists,
  ``.item()``, dynamic shapes, planning), outside any graph; runs before every replay.
* ``init_forward_metadata_in_graph(fb)``: static-shape device work only, recorded into
  the graph at capture and replayed by it. No ``.item()`` / ``.cpu()`` / ``.tolist()``
  and no allocation whose shape depends on batch contents.

``init_forward_metadata(fb)`` (eager) is the two in order.

The base class is cut by job, as vLLM keeps declarations, metadata builder and kernel call apart:

* what a backend declares (``name``, ``dtypes``, ``page_sizes``, ``supports_*`` (``supports_padding_slots``
  since 0.3: -1 in ``out_cache_loc``), ``requires_page_aligned_slots``, ``option_defaults``: class
  attributes, plugin API 2) is read into a frozen :class:`hal.declaration.BackendDeclaration`
  (:meth:`AttentionBackend.declaration`), which selection reads (:meth:`unsupported_reasons`);
* SGLang's contract, member for member as the seed defines it, is this module;
* the forward prologue (batch-field and input checks, the metadata stamp, the KV write or read-back,
  the fused fast path and the output shape) is :mod:`hal.prologue`, a base of this class;
* what later SGLang releases added to their base class (0.5.21's ``shared_read_ends``, ``verify_mask``,
  ``data_type``...) lives with the SGLang integration, :mod:`hal.integrations.sglang_members`.

``helper_ops`` is the one place ``support_triton()`` is read. Batches are read by SGLang's field names (any
object that has them: see ``hal.batch``), pools through the protocols of ``hal.kv_cache``. ``forward`` uses the
metadata the last ``init_forward_metadata_out_graph`` prepared (SGLang's contract); a cheap stamp (mode,
batch size, a step counter) catches metadata left from another step.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.batch import validate_batch, validation_level
from hal.capability import DeviceCapability
from hal.declaration import BackendDeclaration
from hal.deprecation import warn_renamed
from hal.errors import ConfigError, InvalidBatchError, expect
from hal.prologue import (
    ForwardPrologue,
    forward_output,
    fused_forward_disabled,
    fused_forward_enabled,
    fused_forward_env,
)
from hal.validation import check_batch_fields, check_forward_fields

if TYPE_CHECKING:
    from hal.batch import ForwardBatch
    from hal.config import AttentionConfig
    from hal.layer import AttentionLayer

_SGLANG_MEMBERS = "hal.integrations.sglang_members"  # where SGLang 0.5.21's members moved (0.3.0)

__all__ = [
    "AttentionBackend",
    "BackendDeclaration",
    "helper_ops_for",
    "fused_forward_disabled",
    "fused_forward_enabled",
]


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


class AttentionBackend(ForwardPrologue):
    """Base class of attention backends (SGLang's ``AttentionBackend``): the seed's contract, the declared
    support (:meth:`declaration`) and, from :class:`hal.prologue.ForwardPrologue`, the forward prologue."""

    _hal_contract = True  # its forward_* are the contract's stubs, not wrapped by the prologue

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
    # out_cache_loc may hold -1 (a padding token: no KV written, output row unspecified); hal 0.3. False for a
    # backend that does not declare it (a plugin written before): full validation refuses such a batch for it.
    supports_padding_slots: ClassVar[bool] = False
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
        self._fused_env = fused_forward_env()  # HAL_FUSED_FORWARD, read (and checked) when the backend is created

    forward_metadata: Any = None  # set per step by set_forward_metadata (SGLang reads it off any backend)

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def declaration(cls) -> BackendDeclaration:
        """What this backend class declares it supports (its class attributes), as selection reads it."""
        return BackendDeclaration.of(cls)

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
        mode = getattr(forward_batch, "forward_mode", None)
        if not hasattr(mode, "is_decode"):
            check_forward_fields(forward_batch)  # names the missing or mistyped field
        if mode.is_idle():
            empty = isinstance(q, torch.Tensor) and q.shape[0] == 0
            expect(empty, InvalidBatchError, "q.shape", getattr(q, "shape", q), "no tokens in an IDLE batch")
            return forward_output(q.new_empty(0, layer.tp_q_head_num, layer.v_head_dim), q, layer)
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
        stricter = self.requires_page_aligned_slots or not self.supports_padding_slots
        if getattr(forward_batch, "validate", None) == level and not (level == "full" and stricter):
            check_batch_fields(forward_batch)  # presence and types only: a field changed since construction
            return
        validate_batch(
            forward_batch,
            level,
            page_aligned=self.requires_page_aligned_slots,
            padding_slots=None if self.supports_padding_slots else self.name or type(self).__name__,
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

    # -- moved out of the core ------------------------------------------------------------
    def __getattr__(self, name: str):
        """SGLang 0.5.21's members (``shared_read_ends``, ``verify_mask``, ``data_type``...) moved to the SGLang
        integration (:class:`hal.integrations.sglang_members.SGLangMembers`) in 0.3.0: read through a backend
        instance they still answer as before, with a ``DeprecationWarning`` naming the new place."""
        # the deprecation shim names its target as a string (as hal.deprecation.moved_names): the core does not
        # depend on the integration, only this path to it, which goes in 0.4.0
        sglang_members = importlib.import_module(_SGLANG_MEMBERS)
        if name not in sglang_members.MEMBERS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warn_renamed(
            f"{type(self).__name__}.{name} (SGLang 0.5.21's member on a hal backend)",
            f"hal.integrations.sglang_members.sglang_members(backend).{name}",
            since="0.3.0",
        )
        return getattr(sglang_members.sglang_members(self), name)
