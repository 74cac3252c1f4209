"""The demo's one contact with hal's core API: selection, pools, batches, graphs.

Everything the serving loop needs from the core goes through these few functions, so a
change of the core's signatures is adapted here and nowhere else.
"""

from __future__ import annotations

from hal.batch import ForwardBatch
from hal.config import AttentionConfig
from hal.kv_cache import MLAKVPool, PagedKVPool, ReqToTokenPool
from hal.registry import get_registry
from hal.selection import Selection, select

__all__ = ["select_backend", "make_pools", "request_rows", "make_batch", "make_graph"]


def select_backend(
    config: AttentionConfig, device: str | None = None, backend: str | None = None, index: int | None = None
) -> Selection:
    """``hal.select`` for ``config`` on ``device`` (``"cuda:1"``, ``"npu"``, None: the best), ``backend`` forced
    when given. ``index`` (a tensor-parallel rank's local rank) picks the device's index: ``cuda:<index>``."""
    if index is not None:
        capability = select(config, device=device, backend=backend).capability
        if not capability.on_host:  # a device with indices: this rank's
            device = f"{capability.torch_type}:{index}"
    return select(config, device=device, backend=backend)


def make_pools(
    selection: Selection, config: AttentionConfig, *, num_pages: int, max_requests: int
) -> tuple[ReqToTokenPool, PagedKVPool]:
    """The request table (rows ``1 .. max_requests``; row 0 is the padding row) and the paged KV pool of
    ``config`` (its layers, heads, page size, context and KV cache dtype): a ``hal.MLAKVPool`` of the latent
    and rope part for MLA, else K and V buffers."""
    device, dtype = selection.capability.torch_device, config.kv_cache_torch_dtype
    if config.is_mla:
        kv_pool = MLAKVPool(
            num_pages,
            config.page_size,
            config.layer_num,
            config.kv_lora_rank,
            config.qk_rope_head_dim,
            dtype=dtype,
            device=device,
        )
    else:
        kv_pool = PagedKVPool(
            num_pages,
            config.page_size,
            config.layer_num,
            config.tp_k_head_num,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
    return ReqToTokenPool(max_requests, config.max_context_len, device), kv_pool


def request_rows(req_pool: ReqToTokenPool) -> list[int]:
    """The rows of ``req_pool`` a request may take."""
    return list(range(1, req_pool.size + 1))


def make_batch(validate: str | None, **fields) -> ForwardBatch:
    """A ``ForwardBatch`` validated at ``validate`` (``"full"`` for --check runs; None: ``HAL_VALIDATE`` or cheap)."""
    return ForwardBatch(validate=validate, **fields)


def make_graph(selection: Selection):
    """A fresh graph of the selected device (``torch.cuda.CUDAGraph``, ``NPUGraph``, the CPU's checked eager graph)."""
    return get_registry().get(selection.device_name).make_graph(selection.capability)
