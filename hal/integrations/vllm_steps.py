"""What vLLM hands an attention backend, as hal reads it: the KV cache, the layers, one step's batch.

The part of :mod:`hal.integrations.vllm` that needs no vLLM (so it is tested in every env):

* :func:`kv_views`: one layer's vLLM KV cache tensor as hal's ``[slots, kv_heads, dim]`` K and V
  views of the same memory (no copy), and :class:`VllmKVPool`, the pool protocol of
  :mod:`hal.kv_cache` over those views.
* :func:`vllm_layer`: an ``AttentionLayer`` from what vLLM gives an attention impl (window, soft cap,
  attention type, KV scales), refusing what hal does not compute.
* :class:`StepTranslator`: vLLM's per-step ``CommonAttentionMetadata`` as hal's batch protocol
  (:class:`VllmStep`), once per step: vLLM's block table as it is (hal's ``req_to_page_pool``), ``out_cache_loc``
  from the slot mapping, the mode from the host query lengths.
* :class:`GraphDecodeSteps`: the decode steps of vLLM's full graphs, one static :class:`VllmStep` per padded batch
  size whose tensors every build refills in place (hal's graph contract, as ``hal.graph.GraphRunner`` keeps it).

The KV cache layout (vLLM 0.32, ``vllm/v1/kv_cache_interface.py``, ``vllm/v1/kv_cache_layout.py``):
each layer's cache is a logical ``[num_blocks, kv_heads, block_size, C]`` view whose content axis
``C`` holds ``head_size + head_size_v`` values per token and head. hal's backend declares the
``LBNHC`` layout (block, then token, then head, then content in memory), so token ``n`` of block
``b`` is slot ``b * block_size + n`` at one stride, exactly as hal's pools place slot ``s`` in page
``s // page_size``: the first ``head_size`` values of ``C`` are the key, the rest the value.
vLLM's block 0 is its null block (never a request's data): hal's padding page.

Where hal's backend reads head-major pages (the CPU's), vLLM allocates its native CPU layout instead, ``LBHNC``
(``CPU_ATTN``'s: ``vllm/v1/attention/backends/cpu_attn.py``): the same logical ``[num_blocks, kv_heads,
block_size, C]`` dense in that order, each (block, head)'s ``block_size * C`` values holding the block's keys
``[block_size, head_size]`` then its values ``[block_size, head_size_v]`` (CPU_ATTN's ``view(num_blocks, kv_heads,
2 * block_size, head_size).chunk(2, dim=2)``); :func:`head_major_views` reads them in place and
:class:`VllmKVPool` serves them as a ``head_major`` pool (:mod:`hal.kv_layouts`) with vLLM's block table as it is.
"""

from __future__ import annotations

import os

import torch

import hal
from hal.errors import (
    ConfigError,
    HalError,
    InvalidBatchError,
    KVCacheError,
    UnsupportedError,
    describe,
    expect,
    refuse,
)
from hal.kernels.reference import kv_scales, quantize_kv, write_kv
from hal.kv_cache import ReqToPagePool, check_kv_inputs, paged_view
from hal.kv_layouts import AMX_PACKED, FRACTAL_NZ, HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR
from hal.kv_layouts import kv_layout as layout_row
from hal.modes import ForwardMode
from hal.registry import device_backends, get_registry
from hal.validation import BATCH_FIELDS

__all__ = [
    "VLLM_KV_CACHE_DTYPES",
    "kv_views",
    "head_major_views",
    "fractal_nz_views",
    "served_kv_layouts",
    "hal_kv_layout",
    "vllm_block_size",
    "VllmKVPool",
    "vllm_layer",
    "VllmStep",
    "StepTranslator",
    "GraphDecodeSteps",
    "StepPlanner",
    "forward_layer",
    "common_block_size",
    "engine_options",
    "unserved_packing_reason",
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


def hal_kv_cache_dtype(name: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> str | None:
    """hal's name of vLLM's ``kv_cache_dtype`` string (None: the model dtype); ``UnsupportedError`` for the rest
    (vLLM's per-token-head int8 / int4, TurboQuant, NVFP4... have no hal cache format). ``fp8_dtype``: the
    platform's fp8 (vLLM's ``current_platform.fp8_dtype()``), which its ``fp8`` / ``fp8_e4m3`` caches hold: ROCm's
    MI300 stores ``float8_e4m3fnuz``, whose bytes are not hal's ``fp8_e4m3``, so it is refused."""
    expect(
        name in VLLM_KV_CACHE_DTYPES,
        UnsupportedError,
        "kv_cache_dtype",
        name,
        f"one of {list(VLLM_KV_CACHE_DTYPES)}: hal's KV caches are the model dtype or fp8 (e4m3 / e5m2) with "
        "per-tensor scales",
    )
    hal_name = VLLM_KV_CACHE_DTYPES[name]
    expect(
        hal_name != "fp8_e4m3" or fp8_dtype == torch.float8_e4m3fn,
        UnsupportedError,
        f"kv_cache_dtype {name!r} on this platform",
        fp8_dtype,
        "torch.float8_e4m3fn bytes (hal's fp8_e4m3; it has no e4m3fnuz cache format): use --kv-cache-dtype auto",
    )
    return hal_name


def kv_views(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    head_size: int,
    head_size_v: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's vLLM KV cache as K ``[num_blocks * block_size, kv_heads, head_size]`` and V ``[..., head_size_v]``
    views of the same memory (hal's token-major layout, :mod:`hal.kv_layouts`). ``kv_cache`` is any of vLLM's
    packings (``hal.kv_layouts.KV_PACKINGS``), each laid out token-major (block, token, head, content in memory):

    * ``content``, vLLM 0.30+: logical ``[num_blocks, kv_heads, block_size, head_size + head_size_v]`` stored
      ``LBNHC``, K then V on the content axis;
    * ``stacked``, the ``get_kv_cache_shape`` of vLLM before 0.30 that hal's backend declares:
      ``[2, num_blocks, block_size, kv_heads, head_size]``;
    * ``split``, vllm-ascend: a ``(k_cache, v_cache)`` pair of ``[num_blocks, block_size, kv_heads, dim]``.

    ``dtype``: the cache's element type when vLLM stores it as bytes (fp8 caches are ``uint8``). ``KVCacheError``
    when the memory is not laid out so (another layout, padded pages): hal would have to copy, and does not."""
    k_pages, v_pages = _token_major_pages(kv_cache, head_size, head_size_v or head_size)
    views = []
    for name, pages in (("K", k_pages), ("V", v_pages)):
        if dtype is not None and pages.dtype != dtype:
            pages = pages.view(dtype)  # same element size (fp8 over uint8): a reinterpretation
        blocks, block_size, heads, dim = pages.shape
        try:
            slots = pages.view(blocks * block_size, heads, dim)
        except RuntimeError:
            slots = None
        expect(
            slots is not None and slots.stride(2) == 1,
            KVCacheError,
            f"kv_cache {name} strides",
            tuple(pages.stride()),
            "block, token, head, content order with dense pages (hal's token_major layout, vLLM's LBNHC, which "
            "hal declares) so that slot b * block_size + n is one stride apart",
        )
        views.append(slots)
    return views[0], views[1]


def served_kv_layouts(device: str = "cpu") -> tuple[str, ...]:
    """The KV layouts vLLM may allocate for hal on ``device``, preferred first: ``head_major`` (vLLM's CPU layout,
    ``LBHNC``, CPU_ATTN's own) where hal's backend there reads it in place, then ``token_major`` (``LBNHC``: chosen
    with ``VLLM_KV_CACHE_LAYOUT=LBNHC``) where it reads that. Head-major first: in vLLM's engine on the CPU, hal's
    decode steps over it are faster than over token-major in both dtypes (bench/README.md, "vLLM's engine where
    attention dominates"), and it is the cache vLLM's other CPU paths (KV connectors' CPU_ATTN post-processing) know.
    The device: ``HAL_DEVICE`` where set (an unknown one: token-major, and the builder names it); the backend:
    those ``HAL_ATTENTION_BACKEND`` / ``HAL_PREFILL_BACKEND`` / ``HAL_DECODE_BACKEND`` name, else the device's first
    (hal's default there); the builder's selection then checks the model against the layout vLLM chose
    (``AttentionConfig.kv_layout``), with its reasons."""
    device = (os.environ.get("HAL_DEVICE", "").strip() or device).split(":")[0]
    try:
        classes, _ = device_backends(get_registry().get(device))
    except HalError:
        return (TOKEN_MAJOR,)
    names = ("HAL_ATTENTION_BACKEND", "HAL_PREFILL_BACKEND", "HAL_DECODE_BACKEND")
    forced = {os.environ.get(name, "").strip() for name in names} - {""}
    chosen = [cls for cls in classes if cls.declaration().name in forced] if forced else classes[:1]
    reads = [set(cls.declaration().kv_layouts) for cls in chosen]
    served = tuple(name for name in (HEAD_MAJOR, TOKEN_MAJOR) if reads and all(name in r for r in reads))
    return served or (TOKEN_MAJOR,)


def hal_kv_layout(vllm_name: str | None, default: str = TOKEN_MAJOR) -> str:
    """hal's name (:mod:`hal.kv_layouts`) of the KV cache layout vLLM resolved (``cache_config.kv_cache_layout``:
    ``LBNHC``, ``LBHNC``; None, as before vLLM 0.30: ``default``); ``UnsupportedError`` for a layout hal's vLLM
    pools do not bind in place."""
    if vllm_name is None:
        return default
    for name in (TOKEN_MAJOR, HEAD_MAJOR):
        if KV_LAYOUTS[name].vllm == vllm_name:
            return name
    return refuse(
        UnsupportedError,
        "vLLM KV cache layout",
        vllm_name,
        f"{KV_LAYOUTS[TOKEN_MAJOR].vllm} or {KV_LAYOUTS[HEAD_MAJOR].vllm} (the layouts hal binds in place)",
    )


def head_major_views(
    kv_cache: torch.Tensor, head_size: int, head_size_v: int | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's vLLM cache in its CPU layout as head-major K ``[num_blocks, kv_heads, block_size, head_size]``
    and V ``[..., head_size_v]`` pages of the same memory (no copy). ``kv_cache``: vLLM 0.30+'s logical
    ``[num_blocks, kv_heads, block_size, head_size + head_size_v]`` stored ``LBHNC`` (each (block, head): the keys'
    ``block_size`` rows, then the values'), or vLLM before 0.30's CPU shape ``[2, num_blocks, kv_heads, block_size,
    head_size]``. ``dtype`` as :func:`kv_views`'. ``KVCacheError`` for any other form or memory order."""
    head_size_v = head_size_v or head_size
    content = head_size + head_size_v
    expected = (
        f"vLLM's CPU layout (LBHNC): [num_blocks, kv_heads, block_size, {content}] with each (block, head)'s "
        f"block_size x {content} values dense, or [2, num_blocks, kv_heads, block_size, {head_size}]"
    )
    stacked = isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
    if stacked and head_size == head_size_v and kv_cache.shape[4] == head_size and kv_cache.stride(4) == 1:
        k, v = kv_cache[0], kv_cache[1]
    else:
        expect(
            isinstance(kv_cache, torch.Tensor)
            and kv_cache.dim() == 4
            and kv_cache.shape[3] == content
            and kv_cache.stride(3) == 1
            and kv_cache.stride(2) == content,
            KVCacheError,
            "kv_cache",
            f"{describe(kv_cache)} strides {tuple(kv_cache.stride())}"
            if isinstance(kv_cache, torch.Tensor)
            else describe(kv_cache),
            expected,
        )
        blocks, heads, block_size, _ = kv_cache.shape
        outer = (kv_cache.stride(0), kv_cache.stride(1))
        offset = kv_cache.storage_offset()
        k = kv_cache.as_strided((blocks, heads, block_size, head_size), (*outer, head_size, 1), offset)
        v = kv_cache.as_strided(
            (blocks, heads, block_size, head_size_v), (*outer, head_size_v, 1), offset + block_size * head_size
        )
    if dtype is not None and k.dtype != dtype:
        k, v = k.view(dtype), v.view(dtype)  # same element size (fp8 over uint8): a reinterpretation
    return k, v


def fractal_nz_views(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    head_size: int | None,
    head_size_v: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's vllm-ascend 310P cache, a ``(k_cache, v_cache)`` pair of FRACTAL_NZ pages ``[num_blocks, kv_heads *
    head_size / 16, block_size, 16]`` (its runner allocates them from ``AscendAttentionBackend310.get_kv_cache_shape``),
    as they are (no copy; ``dtype`` as :func:`kv_views`'). ``head_size`` None: any. ``KVCacheError`` for any other
    form, or pages that are not dense in that order."""
    lanes = KV_LAYOUTS[FRACTAL_NZ].dim_multiple
    ok = (
        isinstance(kv_cache, (tuple, list))
        and len(kv_cache) == 2
        and all(
            isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[3] == lanes and t.is_contiguous() for t in kv_cache
        )
        and kv_cache[0].shape[:3] == kv_cache[1].shape[:3]
    )
    expect(
        ok
        and (head_size is None or (kv_cache[0].shape[1] * lanes) % head_size == 0)
        and head_size_v in (None, head_size),
        KVCacheError,
        "kv_cache",
        describe(kv_cache),
        f"a (k_cache, v_cache) pair of dense FRACTAL_NZ pages [num_blocks, kv_heads * head_size / {lanes}, block_size, "
        f"{lanes}] (vllm-ascend's 310P form), K and V of one head size",
    )
    k, v = kv_cache
    if dtype is not None and k.dtype != dtype:
        k, v = k.view(dtype), v.view(dtype)  # same element size (fp8 over uint8): a reinterpretation
    return k, v


def vllm_block_size(kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_layout: str = TOKEN_MAJOR) -> int:
    """The block size of a layer's vLLM cache in any of the forms :func:`kv_views` (``kv_layout`` token_major),
    :func:`head_major_views` (head_major) or :func:`fractal_nz_views` (fractal_nz) reads."""
    if kv_layout in (HEAD_MAJOR, AMX_PACKED):
        return kv_cache.shape[-2]
    if kv_layout == FRACTAL_NZ:
        return fractal_nz_views(kv_cache, None)[0].shape[2]
    return _token_major_pages(kv_cache, None, None)[0].shape[1]


def _token_major_pages(kv_cache, head_size: int | None, head_size_v: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's cache as ``[num_blocks, block_size, kv_heads, dim]`` views (``head_size`` None: any)."""
    expected = (
        "vLLM's per-layer cache: [num_blocks, kv_heads, block_size, head_size + head_size_v] (0.30+), "
        "[2, num_blocks, block_size, kv_heads, head_size], or a (k_cache, v_cache) pair of "
        "[num_blocks, block_size, kv_heads, dim]"
    )
    if isinstance(kv_cache, (tuple, list)):
        expect(
            len(kv_cache) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in kv_cache),
            KVCacheError,
            "kv_cache",
            describe(kv_cache),
            expected,
        )
        k_pages, v_pages = kv_cache
    elif isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        k_pages, v_pages = kv_cache[0], kv_cache[1]
    else:
        content = head_size + head_size_v if head_size is not None else None
        expect(
            isinstance(kv_cache, torch.Tensor)
            and kv_cache.dim() == 4
            and (content is None or kv_cache.shape[3] == content),
            KVCacheError,
            "kv_cache",
            describe(kv_cache),
            expected if content is None else f"{expected} (content axis {content})",
        )
        token_major = kv_cache.permute(0, 2, 1, 3)  # [blocks, block_size, heads, content]
        return token_major[..., : head_size or 0], token_major[..., head_size or 0 :]
    for name, pages, dim in (("k_cache", k_pages, head_size), ("v_cache", v_pages, head_size_v)):
        expect(
            dim is None or pages.shape[3] == dim,
            KVCacheError,
            f"kv_cache {name}",
            describe(pages),
            f"[num_blocks, block_size, kv_heads, {dim}]",
        )
    expect(
        k_pages.shape[:3] == v_pages.shape[:3],
        KVCacheError,
        "kv_cache v_cache",
        describe(v_pages),
        f"the K cache's [num_blocks, block_size, kv_heads] = {list(k_pages.shape[:3])}",
    )
    return k_pages, v_pages


class VllmKVPool:
    """hal's KV pool protocol (:mod:`hal.kv_cache`) over vLLM's per-layer cache tensors, read in place.

    ``kv_layout`` (:mod:`hal.kv_layouts`): the layout vLLM allocated. ``token_major``: ``get_key_buffer(layer_id)``
    / ``get_value_buffer(layer_id)`` are :func:`kv_views` of the tensor last :meth:`bind`-ed for that layer;
    ``head_major`` (vLLM's CPU layout): ``get_kv_pages(layer_id)`` are its :func:`head_major_views`, and there is no
    token-major buffer to get; ``fractal_nz`` (vllm-ascend's 310P caches): the same with :func:`fractal_nz_views`.
    vLLM binds its caches after the backend's builders exist, and hands each layer's tensor to every forward. Slot
    ``s`` is token ``s % page_size`` of vLLM block ``s // page_size``.
    """

    padding_slot = 0

    def __init__(
        self,
        page_size: int,
        dtype: torch.dtype,
        device,
        head_size: int,
        head_size_v: int | None = None,
        kv_layout: str = TOKEN_MAJOR,
    ):
        expect(
            kv_layout in _POOL_VIEWS,
            KVCacheError,
            "kv_layout",
            kv_layout,
            f"{TOKEN_MAJOR} (vLLM's LBNHC), {HEAD_MAJOR} (LBHNC, vLLM's CPU layout), {AMX_PACKED} (LBHNC holding "
            f"what vLLM's AMX kernel writes there) or {FRACTAL_NZ} (vllm-ascend's "
            "310P caches)",
        )
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_size, self.head_size_v = head_size, head_size_v or head_size
        self.kv_layout = kv_layout
        self._tensors: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self, layer_id: int, kv_cache: torch.Tensor) -> None:
        """Serve ``layer_id`` from ``kv_cache`` (vLLM's per-layer tensor); a no-op when it is already bound."""
        if self._tensors.get(layer_id) is kv_cache:
            return
        k, v = _POOL_VIEWS[self.kv_layout](kv_cache, self.head_size, self.head_size_v, self.dtype)
        block_size = vllm_block_size(kv_cache, self.kv_layout)
        # vllm-ascend's hybrid blocks: its runner allocates blocks of the backend's first kernel block size
        # (model_runner_v1.py L4322-4330 at 182b75e) while its block table counts select_common_block_size's
        # (L4466-4489), which may be a multiple of it. Token-major slots are block-size free (slot b * B + n is one
        # stride apart for any B), so such a cache is read as blocks of the table's size, in place.
        regrouped = self.kv_layout == TOKEN_MAJOR and k.shape[0] % max(self.page_size, block_size) == 0
        regrouped = regrouped and (self.page_size % block_size == 0 or block_size % self.page_size == 0)
        expect(
            block_size == self.page_size or regrouped,
            KVCacheError,
            "kv_cache block size",
            block_size,
            f"{self.page_size} (the block size of the step's block table, the one the metadata builder was made for), "
            "or for a token-major cache a divisor or multiple of it",
        )
        self._tensors[layer_id], self._views[layer_id] = kv_cache, (k, v)

    # the geometry a pool not laid out token-major states (hal.kv_cache.KVPool), read off the bound caches
    @property
    def head_num(self) -> int:
        k = self._layer(self.start_layer)[0]
        return k.shape[1] * k.shape[3] // self.head_size if self.kv_layout == FRACTAL_NZ else k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def v_head_dim(self) -> int:
        return self.head_size_v

    @property
    def num_slots(self) -> int:
        k = self._layer(self.start_layer)[0]
        return k.shape[0] if self.kv_layout == TOKEN_MAJOR else k.shape[0] * self.page_size

    def get_kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V pages in the pool's layout, views of vLLM's tensor: head-major
        ``[num_blocks, kv_heads, block_size, dim]``, token-major ``[num_blocks, block_size, kv_heads, dim]``, FRACTAL_NZ
        ``[num_blocks, kv_heads * dim / 16, block_size, 16]``."""
        return paged_view(self, layer_id) if self.kv_layout == TOKEN_MAJOR else self._layer(layer_id)

    @property
    def start_layer(self) -> int:
        """The lowest bound layer id (hal's full validation reads the slot count there)."""
        return min(self._views, default=0)

    def _layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._views.get(layer_id)
        if views is None:
            refuse(KVCacheError, "layer_id", layer_id, f"a layer whose cache is bound: {sorted(self._views)}")
        return views

    def _slot_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        expect(
            self.kv_layout == TOKEN_MAJOR,
            KVCacheError,
            f"token-major buffers of a {self.kv_layout} pool",
            layer_id,
            f"a token_major pool; a backend that reads {self.kv_layout} pages declares it in kv_layouts and reads "
            "get_kv_pages(layer_id)",
        )
        return self._layer(layer_id)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._slot_buffers(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._slot_buffers(layer_id)[1]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slot_buffers(layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, *args) -> None:
        """Store ``cache_k`` / ``cache_v`` (``[n, kv_heads, dim]``) at slots ``loc`` of ``layer`` (a hal layer: its
        fp8 scales apply), in the pool's layout."""
        k, v = self._layer(getattr(layer, "layer_id", layer))
        scales = kv_scales(layer) if not isinstance(layer, int) else (1.0, 1.0)
        if self.kv_layout != TOKEN_MAJOR:
            check_kv_inputs(loc, cache_k, cache_v, (self.head_num, self.head_size, self.head_size_v), self.device)
            layout = layout_row(self.kv_layout)
            layout.writer()(k, loc, quantize_kv(cache_k, k.dtype, scales[0]))
            layout.writer(value=True)(v, loc, quantize_kv(cache_v, v.dtype, scales[1]))
            return
        check_kv_inputs(loc, cache_k, cache_v, (k.shape[1], k.shape[2], v.shape[2]), self.device)
        write_kv(k, v, loc, cache_k, cache_v, *scales)


_POOL_VIEWS = {
    TOKEN_MAJOR: kv_views,
    HEAD_MAJOR: head_major_views,
    AMX_PACKED: head_major_views,  # the same memory as head-major pages, packed within each (block, head)
    FRACTAL_NZ: fractal_nz_views,
}


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
        raise UnsupportedError(
            f"layer {layer_id}: ALiBi slopes: hal's attention has no positional biases; vLLM's own backend serves "
            "this model (unset HAL_VLLM, or leave out --attention-backend CUSTOM)"
        )
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


def engine_options(selection: hal.Selection, vllm_config) -> dict:
    """The options the selected backend(s) take from vLLM's config rather than from their defaults:
    ``max_num_tokens`` (the scheduler's ``max_num_batched_tokens``, which FlashInfer's workspace is sized by, as
    vLLM 0.32 sizes its own: ``vllm/v1/attention/backends/flashinfer.py``) where a chosen backend declares it."""
    tokens = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    classes = {selection.prefill_backend, selection.decode_backend}
    takes = any("max_num_tokens" in cls.declaration().option_defaults for cls in classes)
    return {"max_num_tokens": int(tokens)} if takes and tokens else {}


def unserved_packing_reason(capability, packing: str) -> str | None:
    """Why hal's backend on ``capability`` cannot serve a vLLM KV cache of ``packing``
    (:data:`hal.kv_layouts.KV_PACKINGS`: ``"content"``, vLLM's own caches; ``"split"``, vllm-ascend's ``(k_cache,
    v_cache)`` pairs), asked before serving starts; None: it can. An Ascend NPU writes its caches with
    ``npu_scatter_pa_kv_cache``, which takes contiguous caches only (docs/hardware-contracts.md), and vLLM reaches an
    NPU only through vllm-ascend's platform, whose pairs are contiguous: vLLM's content-packed cache (K and V on one
    content axis) would fail at the first KV write."""
    if packing != "content" or capability.type != "npu":
        return None
    return (
        "hal's vLLM route on an Ascend NPU: vLLM's own KV cache packs K and V on one content axis, which the Ascend "
        "KV write (npu_scatter_pa_kv_cache) cannot take (contiguous caches only); vLLM serves an Ascend NPU through "
        "vllm-ascend's platform, whose (k_cache, v_cache) pairs hal reads (HAL_VLLM=1 there: "
        "hal.integrations.vllm_ascend)"
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
        "graph_static",
        "_hal_metadata_step",
    )

    def __repr__(self) -> str:
        return f"VllmStep({self.forward_mode.name} x {self.batch_size}, {self.num_tokens} tokens)"


class StepTranslator:
    """vLLM's ``CommonAttentionMetadata`` of one step -> :class:`VllmStep`, for one KV cache group.

    vLLM's block table (``block_table_tensor``, int32 ``[num_reqs, max_blocks]``, row ``b`` = request ``b``) is the
    step's ``req_to_page_pool`` as it is, with ``req_pool_indices = 0 .. B - 1`` and no ``req_to_token_pool``: a
    backend that reads pages reads it in place, and one that reads tokens gets a token table derived for the step
    (``hal.batch.tables_for``: ``B`` rows, the step's longest context), so nothing here is sized by
    ``max_num_seqs x max_model_len`` and no memory is held beyond what vLLM's profiler sees. ``B`` may exceed
    ``max_num_seqs`` (chunked local attention makes a virtual request per attention chunk): ``max_reqs`` is only the
    first size of the row index.

    Host values come from what vLLM keeps on the host (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``), except:

    * ``exact_seq_lens``: ``seq_lens`` is read from the device each step. Under speculative decoding with
      asynchronous scheduling vLLM's host bound assumes every draft was accepted, so it overstates decode rows;
    * ``wait_for_host_copies``: the device is synchronised before the host values are read, where vLLM fills
      ``query_start_loc_cpu`` with a non-blocking device-to-host copy (shared-KV fast prefill);
    * no host copy of ``seq_lens`` at all: it is read from the device.
    """

    def __init__(
        self,
        pool,
        block_size: int,
        max_reqs: int,
        max_blocks: int,
        device: torch.device | str = "cpu",
        *,
        exact_seq_lens: bool = False,
        wait_for_host_copies: bool = False,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.exact_seq_lens = exact_seq_lens
        self.wait_for_host_copies = wait_for_host_copies and self.device.type != "cpu"
        self.rows = torch.arange(max_reqs, dtype=torch.int64, device=self.device)  # request b reads row b

    def _row_indices(self, num_reqs: int) -> torch.Tensor:
        if num_reqs > self.rows.numel():
            self.rows = torch.arange(max(num_reqs, 2 * self.rows.numel()), dtype=torch.int64, device=self.device)
        return self.rows[:num_reqs]

    def translate(self, cm) -> VllmStep:
        """The step ``cm`` (vLLM's ``CommonAttentionMetadata`` or any object with its fields) for hal."""
        if self.wait_for_host_copies:
            torch.accelerator.synchronize(self.device)
        qsl_cpu = cm.query_start_loc_cpu
        num_reqs = int(cm.num_reqs)
        starts = qsl_cpu[: num_reqs + 1].tolist()
        tokens = starts[-1]
        while num_reqs and starts[num_reqs - 1] == tokens:  # trailing padding requests (no query tokens)
            num_reqs -= 1
        starts = starts[: num_reqs + 1]
        query = [b - a for a, b in zip(starts, starts[1:])]
        seq_cpu = None if self.exact_seq_lens else getattr(cm, "seq_lens_cpu_upper_bound", None)
        if seq_cpu is None:
            seq_cpu = cm.seq_lens if cm.seq_lens.device.type == "cpu" else cm.seq_lens.cpu()
        seq = seq_cpu[:num_reqs].tolist()
        step = VllmStep()
        step.forward_mode = step_mode(query)
        step.batch_size = num_reqs
        step.num_tokens = tokens
        step.causal = cm.causal
        step.spec_info = None
        step.req_to_token_pool = None
        step.req_to_page_pool = ReqToPagePool.from_tensor(cm.block_table_tensor, self.block_size)
        step.token_to_kv_pool = self.pool
        step.req_pool_indices = self._row_indices(num_reqs)
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
        longest = max(seq, default=0)
        expect(
            -(-longest // self.block_size) <= min(self.max_blocks, cm.block_table_tensor.shape[1]),
            InvalidBatchError,
            "sequence length",
            longest,
            f"<= max_model_len rounded to blocks ({self.max_blocks * self.block_size})",
        )
        return step


class GraphDecodeSteps:
    """The decode steps of vLLM's full graphs (``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``) for one KV cache
    group: per padded batch size ``N`` (vLLM's ``num_reqs``, one query token each), one static :class:`VllmStep`
    marked ``graph_static`` whose tensors are refilled in place by every build of that size, so a graph captured over
    one build reads the next build's batch at the captured addresses.

    The tensors are allocated once, for ``max_bs`` requests, when the group's builder is made: every size's step holds
    views of their first ``N`` rows (vLLM runs one step at a time, and each build refills its rows before the replay
    reads them, as vLLM's own block table and hal's graph runner are shared by every captured size). A static step of
    ``N`` requests holds: ``req_to_page_pool`` int32 ``[max_bs, max_blocks]`` (one table for every size: the step's
    block table rows first, zero rows, vLLM's null block, for padding and past ``N``), ``req_pool_indices`` int64
    ``0 .. N - 1``, ``seq_lens`` int32 ``[N]`` and
    ``out_cache_loc`` / ``positions`` int64 ``[N]``. Padding requests (vLLM's trailing requests with no query token,
    and the requests past them up to ``N``) have ``seq_len_fill_value`` tokens and write to the pool's padding slot
    (slot 0: vLLM's null block, never a request's data), as hal's graph runner pads.
    """

    def __init__(
        self, pool, block_size: int, max_bs: int, max_blocks: int, seq_len_fill_value: int, device="cpu"
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_bs = max_bs
        self.max_blocks = max_blocks
        self.fill_value = seq_len_fill_value
        self.padding_slot = getattr(pool, "padding_slot", 0)
        self.device = torch.device(device)
        self.steps: dict[int, VllmStep] = {}
        self.table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=self.device)
        self.req_pool_indices = torch.arange(max_bs, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.full((max_bs,), seq_len_fill_value, dtype=torch.int32, device=self.device)
        self.out_cache_loc = torch.full((max_bs,), self.padding_slot, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=self.device)

    def serves(self, cm, step: VllmStep) -> bool:
        """Whether the translated ``step`` of ``cm`` is a full graph's: one query token per padded request, at most
        ``max_bs`` of them, causal, its real requests all decodes."""
        size = int(cm.num_reqs)
        return (
            0 < size <= self.max_bs
            and int(cm.num_actual_tokens) == size
            and (step.forward_mode.is_decode() or step.forward_mode.is_idle())
            and step.causal is True
        )

    def static_step(self, size: int) -> VllmStep:
        """The static step of ``size`` padded requests (made at its first build, vLLM's capture; its tensors are views
        of the shared ones)."""
        step = self.steps.get(size)
        if step is not None:
            return step
        expect(0 < size <= self.max_bs, InvalidBatchError, "full graph batch size", size, f"1 .. {self.max_bs}")
        step = VllmStep()
        step.forward_mode = ForwardMode.DECODE
        step.batch_size = step.num_tokens = step.extend_num_tokens = size
        step.causal = True
        step.graph_static = True
        step.spec_info = None
        step.req_to_token_pool = None
        # every size reads the one table (its first N rows): what a backend derives from it (hal.batch.RequestTables,
        # a token table for a backend that reads tokens) is one persistent buffer for every captured size too
        step.req_to_page_pool = ReqToPagePool.from_tensor(self.table, self.block_size)
        step.token_to_kv_pool = self.pool
        step.req_pool_indices = self.req_pool_indices[:size]
        step.seq_lens = self.seq_lens[:size]
        step.out_cache_loc = self.out_cache_loc[:size]
        step.positions = self.positions[:size]
        step.extend_seq_lens = step.extend_prefix_lens = step.extend_start_loc = None
        self.steps[size] = step
        return step

    def fill(self, cm, step: VllmStep) -> VllmStep:
        """The static step of ``cm``'s padded size holding ``step`` (``cm`` translated, :meth:`serves` true) in place:
        its ``n`` real requests first, padding after."""
        size, n = int(cm.num_reqs), step.batch_size
        static = self.static_step(size)
        width = min(cm.block_table_tensor.shape[1], self.max_blocks)
        table = static.req_to_page_pool.req_to_page
        table.zero_()[:n, :width].copy_(cm.block_table_tensor[:n, :width])
        static.seq_lens.fill_(self.fill_value)[:n].copy_(step.seq_lens)
        static.out_cache_loc.fill_(self.padding_slot)[:n].copy_(step.out_cache_loc[:n])
        static.positions.zero_()
        if step.positions is not None:
            static.positions[:n].copy_(step.positions[:n])
        seq = list(step.seq_lens_cpu) + [self.fill_value] * (size - n)
        static.seq_lens_cpu = seq
        static.seq_lens_sum = sum(seq)
        static.extend_seq_lens_cpu = [1] * size
        static.extend_prefix_lens_cpu = [s - 1 for s in seq]
        return static


class StepPlanner:
    """The per-step plan of one KV cache group, as hal's vLLM metadata builder runs it (importable without vLLM):
    ``plan(cm, step)`` prepares ``backend``'s metadata for the translated ``step`` of ``cm``. A full graph's decode
    step (``graph_steps`` serves it) becomes its padded size's static step, refilled in place, with ``out_graph`` run
    here and ``in_graph`` left to the group's first layer's forward (:func:`forward_layer`, so that a capture records
    it); any other step gets its metadata whole (``init_forward_metadata``)."""

    def __init__(self, backend, graph_steps: GraphDecodeSteps | None = None) -> None:
        self.backend = backend
        self.graph_steps = graph_steps

    def plan(self, cm, step: VllmStep, in_capture: bool = False) -> tuple[VllmStep, bool]:
        """``(the step the layers run, whether its in_graph part is left to the first layer's forward)``."""
        if self.graph_steps is not None and self.graph_steps.serves(cm, step):
            step = self.graph_steps.fill(cm, step)
            self.backend.init_forward_metadata_out_graph(step, in_capture=in_capture)
            return step, True
        self.backend.init_forward_metadata(step)
        return step, False


def forward_layer(
    backend,
    step: VllmStep,
    layer,
    kv_cache,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    num_tokens: int,
    *,
    in_graph: bool = False,
    **kwargs,
) -> torch.Tensor:
    """One layer's share of a planned step, as hal's vLLM impl runs it: ``kv_cache`` (vLLM's tensor for ``layer``, a
    hal ``AttentionLayer``) bound to the step's pool, ``in_graph`` metadata where :meth:`StepPlanner.plan` left it
    to this layer, then hal's forward of the first ``num_tokens`` rows into ``output`` (``[T, heads, head_size_v]``;
    rows past them untouched). ``key`` / ``value`` None: nothing written (a layer sharing another's cache)."""
    step.token_to_kv_pool.bind(layer.layer_id, kv_cache)
    if in_graph:
        backend.init_forward_metadata_in_graph(step)
    write = key is not None and value is not None
    n = num_tokens
    backend.forward(
        query[:n],
        key[:n] if write else None,
        value[:n] if write else None,
        layer,
        step,
        save_kv_cache=write,
        out=output,
        **kwargs,
    )
    return output


def common_block_size(manager_block_size: int, supported: list) -> int:
    """The kernel block size vLLM's ``select_common_block_size`` (``vllm/v1/worker/utils.py``) picks for one backend
    declaring ``supported`` (ints, or objects with a ``base``: vLLM's ``MultipleOf``) under a KV manager of
    ``manager_block_size``: that size where supported, else the largest int size dividing it. vllm-ascend's runner
    counts its block table in it (``model_runner_v1.py`` L4466-4489 at 182b75e). ``ConfigError`` where none fits."""

    def takes(size: int) -> bool:
        return any(size == s if isinstance(s, int) else size % s.base == 0 for s in supported)

    if takes(manager_block_size):
        return manager_block_size
    for size in sorted((s for s in supported if isinstance(s, int)), reverse=True):
        if manager_block_size % size == 0:
            return size
    raise ConfigError(
        f"block size {manager_block_size}: no kernel block size of {list(supported)} divides it; set --block-size to "
        "one of them"
    )
