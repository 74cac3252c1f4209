"""What vLLM hands an attention backend, as hal reads it: the KV cache, the layers, one step's batch.

The part of :mod:`hal.integrations.vllm` that needs no vLLM (so it is tested in every env):

* :func:`kv_views`: one layer's vLLM KV cache tensor as hal's ``[slots, kv_heads, dim]`` K and V
  views of the same memory (no copy), and :class:`VllmKVPool`, the pool protocol of
  :mod:`hal.kv_cache` over those views.
* :func:`vllm_layer`: an ``AttentionLayer`` from what vLLM gives an attention impl (window, soft cap,
  attention type, KV scales), refusing what hal does not compute.
* :class:`StepTranslator`: vLLM's per-step ``CommonAttentionMetadata`` as hal's batch protocol
  (:class:`VllmStep`), once per step: a ``req_to_token`` table from the block table, ``out_cache_loc``
  from the slot mapping, the mode from the host query lengths.

The KV cache layout (vLLM 0.32, ``vllm/v1/kv_cache_interface.py``, ``vllm/v1/kv_cache_layout.py``):
each layer's cache is a logical ``[num_blocks, kv_heads, block_size, C]`` view whose content axis
``C`` holds ``head_size + head_size_v`` values per token and head. hal's backend declares the
``LBNHC`` layout (block, then token, then head, then content in memory), so token ``n`` of block
``b`` is slot ``b * block_size + n`` at one stride, exactly as hal's pools place slot ``s`` in page
``s // page_size``: the first ``head_size`` values of ``C`` are the key, the rest the value.
vLLM's block 0 is its null block (never a request's data): hal's padding page.
"""

from __future__ import annotations

import torch

import hal
from hal.errors import InvalidBatchError, KVCacheError, UnsupportedError, describe, expect, refuse
from hal.kernels.reference import kv_scales, write_kv
from hal.kv_cache import check_kv_inputs
from hal.modes import ForwardMode
from hal.validation import BATCH_FIELDS

__all__ = [
    "VLLM_KV_CACHE_DTYPES",
    "kv_views",
    "VllmKVPool",
    "vllm_layer",
    "VllmStep",
    "StepTranslator",
    "step_mode",
]

# vLLM's --kv-cache-dtype names -> hal's (None: the model dtype). vLLM stores fp8 caches as uint8 bytes
# (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE); "fp8" is e4m3 on the CPU and CUDA.
VLLM_KV_CACHE_DTYPES = {
    "auto": None,
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


def hal_kv_cache_dtype(name: str) -> str | None:
    """hal's name of vLLM's ``kv_cache_dtype`` string (None: the model dtype); ``UnsupportedError`` for the rest
    (vLLM's per-token-head int8 / int4, TurboQuant, NVFP4... have no hal cache format)."""
    expect(
        name in VLLM_KV_CACHE_DTYPES,
        UnsupportedError,
        "kv_cache_dtype",
        name,
        f"one of {list(VLLM_KV_CACHE_DTYPES)}: hal's KV caches are the model dtype or fp8 (e4m3 / e5m2) with "
        "per-tensor scales",
    )
    return VLLM_KV_CACHE_DTYPES[name]


def kv_views(
    kv_cache: torch.Tensor, head_size: int, head_size_v: int | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's vLLM cache (logical ``[num_blocks, kv_heads, block_size, head_size + head_size_v]``, stored
    block, token, head, content: vLLM's ``LBNHC``) as K ``[num_blocks * block_size, kv_heads, head_size]`` and V
    ``[..., head_size_v]`` views of the same memory. ``dtype``: the cache's element type when vLLM stores it as
    bytes (fp8 caches are ``uint8``). ``KVCacheError`` when the memory is not laid out so (another layout,
    padded pages): hal would have to copy, and does not."""
    head_size_v = head_size_v or head_size
    expect(
        isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and kv_cache.shape[3] == head_size + head_size_v,
        KVCacheError,
        "kv_cache",
        describe(kv_cache),
        f"vLLM's per-layer [num_blocks, kv_heads, block_size, {head_size + head_size_v}] cache",
    )
    if dtype is not None and kv_cache.dtype != dtype:
        kv_cache = kv_cache.view(dtype)  # same element size (fp8 over uint8): a reinterpretation
    blocks, heads, block_size, content = kv_cache.shape
    token_major = kv_cache.permute(0, 2, 1, 3)  # [blocks, block_size, heads, content]
    try:
        slots = token_major.view(blocks * block_size, heads, content)
    except RuntimeError:
        slots = None
    expect(
        slots is not None and slots.stride(2) == 1,
        KVCacheError,
        "kv_cache strides",
        tuple(kv_cache.stride()),
        "block, token, head, content order with dense pages (vLLM's LBNHC layout; hal declares it) so that "
        "slot b * block_size + n is one stride apart",
    )
    return slots[..., :head_size], slots[..., head_size:]


class VllmKVPool:
    """hal's KV pool protocol (:mod:`hal.kv_cache`) over vLLM's per-layer cache tensors, read in place.

    ``get_key_buffer(layer_id)`` / ``get_value_buffer(layer_id)`` are :func:`kv_views` of the tensor last
    :meth:`bind`-ed for that layer (vLLM binds its caches after the backend's builders exist, and hands each
    layer's tensor to every forward). Slot ``s`` is token ``s % page_size`` of vLLM block ``s // page_size``.
    """

    padding_slot = 0

    def __init__(self, page_size: int, dtype: torch.dtype, device, head_size: int, head_size_v: int | None = None):
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_size, self.head_size_v = head_size, head_size_v or head_size
        self._tensors: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self, layer_id: int, kv_cache: torch.Tensor) -> None:
        """Serve ``layer_id`` from ``kv_cache`` (vLLM's per-layer tensor); a no-op when it is already bound."""
        if self._tensors.get(layer_id) is kv_cache:
            return
        k, v = kv_views(kv_cache, self.head_size, self.head_size_v, self.dtype)
        expect(
            kv_cache.shape[2] == self.page_size,
            KVCacheError,
            "kv_cache block size",
            kv_cache.shape[2],
            f"{self.page_size} (the kernel block size the metadata builder was made for)",
        )
        self._tensors[layer_id], self._views[layer_id] = kv_cache, (k, v)

    @property
    def start_layer(self) -> int:
        """The lowest bound layer id (hal's full validation reads the slot count there)."""
        return min(self._views, default=0)

    def _layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._views.get(layer_id)
        if views is None:
            refuse(KVCacheError, "layer_id", layer_id, f"a layer whose cache is bound: {sorted(self._views)}")
        return views

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._layer(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._layer(layer_id)[1]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layer(layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, *args) -> None:
        """Store ``cache_k`` / ``cache_v`` (``[n, kv_heads, dim]``) at slots ``loc`` of ``layer`` (a hal layer: its
        fp8 scales apply)."""
        k, v = self._layer(getattr(layer, "layer_id", layer))
        check_kv_inputs(loc, cache_k, cache_v, (k.shape[1], k.shape[2], v.shape[2]), self.device)
        write_kv(k, v, loc, cache_k, cache_v, *(kv_scales(layer) if not isinstance(layer, int) else (1.0, 1.0)))


def vllm_layer(
    layer_id: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    *,
    head_size_v: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    attn_type: str = "decoder",
    alibi_slopes=None,
    causal: bool = True,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> hal.AttentionLayer:
    """hal's descriptor of one vLLM attention layer, from the arguments vLLM gives its attention impl.

    vLLM's ``sliding_window = W`` lets a query see the last ``W`` keys, itself included (FlashAttention's
    ``window_left = W - 1``): hal's ``sliding_window_size = W - 1``. ``causal=False``: a step vLLM marks
    non-causal (``CommonAttentionMetadata.causal``). Refused (``UnsupportedError``): ALiBi, and every
    attention type but ``decoder`` (vLLM's encoder-only layers keep no paged KV cache; cross attention
    reads the encoder's).
    """
    attn_type = getattr(attn_type, "value", attn_type)
    if attn_type != "decoder":
        raise UnsupportedError(
            f"layer {layer_id}: attn_type {attn_type!r}: hal serves vLLM's decoder attention over its paged KV cache "
            "(encoder-only layers keep no paged cache in vLLM; cross attention reads the encoder's)"
        )
    if alibi_slopes is not None:
        raise UnsupportedError(f"layer {layer_id}: ALiBi slopes: hal's attention has no positional biases")
    window = -1 if sliding_window is None or sliding_window <= 0 else int(sliding_window) - 1
    return hal.AttentionLayer(
        layer_id=layer_id,
        tp_q_head_num=num_heads,
        tp_k_head_num=num_kv_heads,
        head_dim=head_size,
        v_head_dim=head_size_v or head_size,
        scaling=float(scale),
        logit_cap=float(logits_soft_cap or 0.0),
        sliding_window_size=window,
        attn_type="decoder" if causal else "encoder_only",
        k_scale=k_scale,
        v_scale=v_scale,
    )


def step_mode(query_lens: list[int]) -> ForwardMode:
    """hal's mode of a vLLM step from its host query lengths: DECODE when every request brings one token,
    MIXED when one-token requests (decodes, which vLLM puts first) share the step with longer ones (prefill
    chunks), EXTEND otherwise."""
    if not query_lens:
        return ForwardMode.IDLE
    low, high = min(query_lens), max(query_lens)
    if high == 1:
        return ForwardMode.DECODE
    return ForwardMode.MIXED if low == 1 else ForwardMode.EXTEND


class VllmStep:
    """One vLLM step as hal reads a batch (SGLang's field names, :mod:`hal.batch`); made by :class:`StepTranslator`.

    ``num_tokens``: the step's real query tokens (vLLM may pad the token count: those rows are not served).
    """

    # hal's batch fields (the one list of them: ``hal.validation.BATCH_FIELDS``), then the step's own
    __slots__ = tuple(field.name for field in BATCH_FIELDS) + (
        "extend_num_tokens",
        "num_tokens",
        "causal",
        "_hal_metadata_step",
    )

    def __repr__(self) -> str:
        return f"VllmStep({self.forward_mode.name} x {self.batch_size}, {self.num_tokens} tokens)"


class _Table:
    """A request table (``req_to_token``) for hal's protocol."""

    __slots__ = ("req_to_token",)

    def __init__(self, req_to_token: torch.Tensor):
        self.req_to_token = req_to_token


class StepTranslator:
    """vLLM's ``CommonAttentionMetadata`` of one step -> :class:`VllmStep`, for one KV cache group.

    ``req_to_token`` is a persistent int32 ``[max_reqs + 1, max_blocks * block_size]`` buffer (row 0: hal's
    padding row); each step fills rows ``1 .. B`` from the block table (``block * block_size + offset``) up to
    the step's longest sequence, so a layer reads slots through it as from any hal request table. Host values
    come from what vLLM keeps on the host (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``, which is exact
    without asynchronous speculative decoding, which hal's integration does not take); only where vLLM gives
    no host copy of ``seq_lens`` is it read from the device.
    """

    def __init__(
        self, pool, block_size: int, max_reqs: int, max_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.device = torch.device(device)
        width = max_blocks * block_size
        self.table = _Table(torch.zeros(max_reqs + 1, width, dtype=torch.int32, device=self.device))
        self.rows = torch.arange(1, max_reqs + 1, dtype=torch.int64, device=self.device)
        self.offsets = torch.arange(block_size, dtype=torch.int32, device=self.device)

    def translate(self, cm) -> VllmStep:
        """The step ``cm`` (vLLM's ``CommonAttentionMetadata`` or any object with its fields) for hal."""
        qsl_cpu = cm.query_start_loc_cpu
        num_reqs = int(cm.num_reqs)
        starts = qsl_cpu[: num_reqs + 1].tolist()
        tokens = starts[-1]
        while num_reqs and starts[num_reqs - 1] == tokens:  # trailing padding requests (no query tokens)
            num_reqs -= 1
        starts = starts[: num_reqs + 1]
        query = [b - a for a, b in zip(starts, starts[1:])]
        seq_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
        if seq_cpu is None:
            seq_cpu = cm.seq_lens if cm.seq_lens.device.type == "cpu" else cm.seq_lens.cpu()
        seq = seq_cpu[:num_reqs].tolist()
        max_rows = self.rows.numel()
        expect(num_reqs <= max_rows, InvalidBatchError, "num_reqs", num_reqs, f"<= max_num_seqs ({max_rows})")
        step = VllmStep()
        step.forward_mode = step_mode(query)
        step.batch_size = num_reqs
        step.num_tokens = tokens
        step.causal = cm.causal
        step.spec_info = None
        step.req_to_token_pool = self.table
        step.token_to_kv_pool = self.pool
        step.req_pool_indices = self.rows[:num_reqs]
        step.seq_lens = cm.seq_lens[:num_reqs]
        step.seq_lens_cpu = seq
        step.seq_lens_sum = sum(seq)
        step.out_cache_loc = cm.slot_mapping[:tokens]
        positions = getattr(cm, "positions", None)
        step.positions = None if positions is None else positions[:tokens]
        step.extend_num_tokens = tokens
        step.extend_seq_lens_cpu = query
        step.extend_prefix_lens_cpu = [s - q for s, q in zip(seq, query)]
        if step.forward_mode.is_decode() or not num_reqs:
            step.extend_seq_lens = step.extend_prefix_lens = step.extend_start_loc = None
        else:
            qsl = cm.query_start_loc[: num_reqs + 1]
            step.extend_start_loc = qsl[:-1]
            step.extend_seq_lens = qsl[1:] - qsl[:-1]
            step.extend_prefix_lens = step.seq_lens - step.extend_seq_lens
        self._fill_table(cm.block_table_tensor, num_reqs, max(seq, default=0))
        return step

    def _fill_table(self, block_table: torch.Tensor, num_reqs: int, longest: int) -> None:
        """Rows ``1 .. num_reqs`` of ``req_to_token``: every slot of the blocks the step's sequences use."""
        blocks = min(-(-longest // self.block_size), block_table.shape[1])
        table = self.table.req_to_token
        expect(
            blocks * self.block_size <= table.shape[1],
            InvalidBatchError,
            "sequence length",
            longest,
            f"<= max_model_len rounded to blocks ({table.shape[1]})",
        )
        if not num_reqs or not blocks:
            return
        rows = table[1 : num_reqs + 1, : blocks * self.block_size].view(num_reqs, blocks, self.block_size)
        torch.add(block_table[:num_reqs, :blocks, None] * self.block_size, self.offsets, out=rows)
