"""SGLang's KV pools whose per-layer buffers are not hal's ``[slots, heads, dim]``, served zero-copy.

SGLang 0.5.21 hands out, per layer (python/sglang/srt/hardware_backend/npu/memory_pool_npu.py):

* ``NPUMHATokenToKVPool``: ``[size // page_size + 1, page_size, head_num, head_dim]`` (values ``v_head_dim``),
  one page more than the slots, page 0 taking padding writes, each layer a contiguous slice of one
  ``[layer, page, token, head, dim]`` allocation; with ``ASCEND_USE_FIA=1`` the per-layer views are
  ``[pages * page_size, 1, head_num, head_dim]`` of the same memory. Slot ``s`` is token ``s % page_size`` of
  page ``s // page_size`` in both, so ``buffer.view(-1, head_num, dim)`` is hal's ``[slots, heads, dim]`` buffer
  over the same storage (slot 0 the padding slot, as hal's pools).
* ``MHATokenToKVPool`` (CUDA, CPU): ``[slots, head_num, head_dim]`` already: served as is.
* ``NPUMLATokenToKVPool``: the latent ``[pages + 1, page_size, 1, kv_lora_rank]`` (``get_key_buffer``) and the
  rope part ``[pages + 1, page_size, 1, qk_rope_head_dim]`` (``get_value_buffer``) in two separate buffers, the
  layout FIA v2 reads MLA from (``key`` and ``key_rope``). hal's ``MLAKVPool`` keeps one ``[slots, 1, kv_lora_rank
  + qk_rope_head_dim]`` buffer, which two allocations cannot be viewed as: :class:`SplitMLABufferPool` serves the
  two buffers as they are, to backends that read a split pool (``mla_split = True``: the ascend backend); others
  refuse it by shape in their prologue. SGLang's NZ variant (``SGLANG_USE_FIA_NZ``) is refused.
"""

from __future__ import annotations

import torch

from hal.errors import KVCacheError, UnsupportedError

__all__ = ["PagedBufferPool", "SplitMLABufferPool", "serve_pool"]


def _slots_view(buffer: torch.Tensor, what: str) -> torch.Tensor:
    """A 4-D ``[pages, tokens_per_page, heads, dim]`` buffer as ``[slots, heads, dim]`` (the same memory)."""
    if buffer.dim() == 3:
        return buffer
    if buffer.dim() != 4 or not buffer.is_contiguous():
        raise KVCacheError(
            f"{what}: {tuple(buffer.shape)} (contiguous={buffer.is_contiguous()}): expected a contiguous "
            "[slots, heads, dim] or [pages, page_size, heads, dim] buffer"
        )
    return buffer.view(-1, buffer.shape[2], buffer.shape[3])


class PagedBufferPool:
    """An SGLang pool whose layer buffers are 4-D paged tensors, seen through hal's ``KVPool`` interface.

    ``get_key_buffer(l)`` / ``get_value_buffer(l)`` return ``[slots, heads, dim]`` views of SGLang's buffers
    (no copy: writes through them land in SGLang's cache); ``set_kv_buffer`` is SGLang's own; every other
    attribute (``page_size``, ``dtype``, ``device``, ``head_num``, ``layer_num``...) is read from the pool.
    """

    def __init__(self, pool):
        self.pool = pool

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return _slots_view(self.pool.get_key_buffer(layer_id), f"{type(self.pool).__name__} key buffer {layer_id}")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return _slots_view(self.pool.get_value_buffer(layer_id), f"{type(self.pool).__name__} value buffer {layer_id}")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        return self.pool.set_kv_buffer(layer, loc, cache_k, cache_v, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["pool"], name)


class SplitMLABufferPool(PagedBufferPool):
    """SGLang's NPU MLA pool: the latent and the rope part of each token in two paged buffers, served in place.

    ``mla_split = True`` tells a backend that ``get_key_buffer(l)`` is the latent ``[slots, 1, kv_lora_rank]`` and
    ``get_value_buffer(l)`` the rope part ``[slots, 1, qk_rope_head_dim]`` (SGLang's own meaning for this pool),
    both views of SGLang's buffers; ``set_kv_buffer`` is SGLang's (latent and rope, or the joined key split).
    """

    mla_split = True


def serve_pool(pool):
    """``pool`` as hal reads it: itself when its buffers are ``[slots, heads, dim]``, a :class:`PagedBufferPool`
    when they are 4-D paged buffers (SGLang's NPU pools), a :class:`SplitMLABufferPool` for SGLang's NPU MLA pool
    (latent and rope buffers apart); ``UnsupportedError`` for its NZ variant."""
    layer = getattr(pool, "start_layer", 0) or 0
    key = pool.get_key_buffer(layer)
    if key.dim() == 3:
        return pool
    if getattr(pool, "kv_lora_rank", None) is None:
        return PagedBufferPool(pool)
    if getattr(pool, "use_fia_nz", False):
        raise UnsupportedError(
            f"{type(pool).__name__} with SGLANG_USE_FIA_NZ: its latent and rope buffers are in the NZ format; hal "
            "reads the ND [pages, page_size, 1, dim] layout"
        )
    return SplitMLABufferPool(pool)
