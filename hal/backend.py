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
``page_sizes``, ``supports_*``) and :meth:`validate` turns that into the reasons it
cannot serve a config; ``helper_ops`` is the one place ``support_triton()`` is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.capability import DTYPE_NAMES, DeviceCapability
from hal.errors import InvalidBatchError, expect

if TYPE_CHECKING:
    from hal.batch import ForwardBatch
    from hal.config import AttentionConfig
    from hal.layer import AttentionLayer
    from hal.ops import HelperOps

__all__ = ["AttentionBackend"]


class AttentionBackend:
    """Base class of attention backends (SGLang's ``AttentionBackend``)."""

    # -- SGLang's class attributes -------------------------------------------------------
    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    supports_ragged_verify_graph: bool = False
    needs_cpu_seq_lens: bool = True
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    # -- what the backend supports, read by validate() -----------------------------------
    name: ClassVar[str] = ""
    dtypes: ClassVar[frozenset[str]] = frozenset({"fp32", "bf16", "fp16"})
    page_sizes: ClassVar[frozenset[int] | None] = None  # None: any power of two
    head_dims: ClassVar[frozenset[int] | None] = None  # None: any
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_cap: ClassVar[bool] = True
    supports_non_causal: ClassVar[bool] = True
    supports_custom_mask: ClassVar[bool] = True
    supports_graph: ClassVar[bool] = True
    supports_mla: ClassVar[bool] = False  # v_head_dim != head_dim

    def __init__(self, capability: DeviceCapability):
        self.capability = capability
        self.device = capability.torch_device
        self.forward_metadata: Any = None

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def available(cls, capability: DeviceCapability) -> list[str]:
        """Reasons this backend cannot run on this device at all (missing library...)."""
        return []

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        """What a user must know about this backend here, though nothing stops it (``hal info`` shows them)."""
        return ["emulated: correct, but its speed means nothing"] if capability.emulated else []

    @classmethod
    def validate(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``capability``; empty means it can."""
        reasons = list(cls.available(capability))
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
        if config.graph and not cls.supports_graph:
            reasons.append("graph capture not supported")
        elif config.graph and not capability.graph:
            reasons.append(f"device has no graph capture: {capability.reasons.get('graph', 'not listed')}")
        return reasons

    # -- SGLang's metadata contract ----------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager entry point: ``out_graph`` then ``in_graph``."""
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Host-side per-step metadata, outside any graph (``in_capture=True`` before a capture)."""

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Graph-recordable, static-shape device work; replayed by the graph."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every buffer a captured graph reads, for up to ``max_bs`` requests."""
        raise NotImplementedError()

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: ForwardBatch):
        """Create forward metadata whose tensor addresses a breakable graph captures."""
        raise NotImplementedError()

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self,
        capture_metadata,
        forward_batch: ForwardBatch,
        *,
        static_forward_batch: ForwardBatch | None = None,
    ) -> None:
        """Refresh captured metadata in place for this batch and make it the active metadata."""
        raise NotImplementedError()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value of the padding requests of a replayed batch (0 or 1)."""
        raise NotImplementedError()

    def on_after_cuda_graph_warmup(self) -> None:
        """Undo what the warm-up pass mutated, between warm-up and capture."""

    def get_verify_buffers_to_fill_after_draft(self) -> list:
        """Buffers of verify kernels (tree mask, positions) a draft step fills; ``[None, None]``: none."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs: int | None) -> None:
        """Recompute metadata that depends on the buffers above once the draft filled them."""
        raise NotImplementedError()

    # -- forward -----------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of one layer: ``q`` ``[T, q_heads * head_dim]`` (or ``[T, q_heads, head_dim]``),
        ``k``/``v`` the new tokens' keys and values likewise; returns ``[T, q_heads * v_head_dim]``
        in ``q.dtype``.

        IDLE returns an empty output; DECODE goes to ``forward_decode``; MIXED goes to
        ``forward_mixed`` when this backend's device is an NPU (one fused op serves the
        batch there); everything else goes to ``forward_extend``.

        Unlike SGLang, ``k`` and ``v`` are always required (some kernels read the new tokens
        from them rather than from the cache); everything is checked before anything is
        written, and a bad call raises ``InvalidBatchError`` naming the field.
        """
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        q, k, v = self.check_inputs(q, k, v, layer, forward_batch)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if mode.is_mixed() and self.capability.type == "npu":
            return self.forward_mixed(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """One query token per request; same shapes as ``forward``."""
        raise NotImplementedError()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """New tokens after a cached prefix (EXTEND, MIXED off-NPU, TARGET_VERIFY, DRAFT_EXTEND)."""
        raise NotImplementedError()

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """A MIXED batch (chunked prefills and decodes) in one call; reached on NPUs."""
        raise NotImplementedError()

    def support_triton(self) -> bool:
        """Whether the helper ops around attention may use Triton kernels with this backend."""
        return True

    def get_indexer_metadata(self, layer_id: int, forward_batch: ForwardBatch):
        """Sparse-attention indexer metadata; None means this backend has no indexer."""
        return None

    # -- shared by the backends --------------------------------------------------------
    def set_forward_metadata(self, metadata: Any, forward_batch: ForwardBatch) -> None:
        """Make ``metadata`` (built in ``out_graph`` for ``forward_batch``) the active one."""
        self.forward_metadata = metadata
        self._metadata_batch = forward_batch

    def metadata_for(self, forward_batch: ForwardBatch) -> Any:
        """The active metadata, which must have been prepared for ``forward_batch`` (not a stale batch)."""
        expect(
            self.forward_metadata is not None and getattr(self, "_metadata_batch", None) is forward_batch,
            InvalidBatchError,
            "forward_metadata",
            "missing" if self.forward_metadata is None else "prepared for another batch",
            "this batch's: call init_forward_metadata(forward_batch) before forward",
        )
        return self.forward_metadata

    @property
    def helper_ops(self) -> HelperOps:
        """The positions / kv-indices / KV-write ops for this backend, Triton or torch (see ``hal.ops``)."""
        from hal.ops import helper_ops_for

        return helper_ops_for(self)

    def save_kv(self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' ``k``/``v`` (``[T, kv_heads, dim]``) at ``out_cache_loc``."""
        pool = forward_batch.token_to_kv_pool
        pool.check_kv(forward_batch.out_cache_loc, k, v, check_range=False)
        k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
        self.helper_ops.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v)

    def check_inputs(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch):
        """Check ``q``/``k``/``v`` against the layer, batch and pool; return them as ``[T, heads, dim]``."""
        tokens = forward_batch.num_tokens
        pool = forward_batch.token_to_kv_pool
        expect(
            0 <= layer.layer_id < pool.layer_num,
            InvalidBatchError,
            "layer.layer_id",
            layer.layer_id,
            f"a layer of the KV pool, in [0, {pool.layer_num})",
        )
        expect(
            (pool.head_num, pool.head_dim, pool.v_head_dim) == (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            InvalidBatchError,
            "layer (kv heads, head_dim, v_head_dim)",
            (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            f"the KV pool's {(pool.head_num, pool.head_dim, pool.v_head_dim)}",
        )
        shaped = []
        for name, t, heads, dim in (
            ("q", q, layer.tp_q_head_num, layer.head_dim),
            ("k", k, layer.tp_k_head_num, layer.head_dim),
            ("v", v, layer.tp_v_head_num, layer.v_head_dim),
        ):
            expect(isinstance(t, torch.Tensor), InvalidBatchError, name, type(t).__name__, "a tensor")
            expect(
                t.shape[0] == tokens and t.numel() == tokens * heads * dim,
                InvalidBatchError,
                f"{name}.shape",
                tuple(t.shape),
                f"[{tokens}, {heads * dim}] or [{tokens}, {heads}, {dim}] ({tokens} tokens in this batch)",
            )
            expect(
                t.dtype in DTYPE_NAMES and t.is_floating_point(),
                InvalidBatchError,
                f"{name}.dtype",
                t.dtype,
                "float32, bfloat16 or float16",
            )
            expect(t.device == pool.device, InvalidBatchError, f"{name}.device", t.device, str(pool.device))
            shaped.append(t.reshape(tokens, heads, dim))
        expect(
            q.dtype == k.dtype == v.dtype,
            InvalidBatchError,
            "q/k/v dtypes",
            (q.dtype, k.dtype, v.dtype),
            "one dtype",
        )
        return shaped
