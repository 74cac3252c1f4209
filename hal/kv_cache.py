"""Memory pools: the request-to-token map and the paged token-to-KV pool.

Slot ``s`` of the KV pool lives in page ``s // page_size`` at offset ``s % page_size``,
so one layer's ``[num_slots, head_num, head_dim]`` buffer and the
``[num_pages, page_size, head_num, head_dim]`` view that paged kernels (NPU block
tables, FlashInfer) take are the same memory. Page 0 is reserved: padded tokens of a
graph-replayed batch write there, so it never holds a request's data.
"""

from __future__ import annotations

import torch

from hal.errors import KVCacheError, expect

__all__ = ["ReqToTokenPool", "PagedKVPool", "MHATokenToKVPool"]

INDEX_DTYPES = (torch.int32, torch.int64)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ReqToTokenPool:
    """``req_to_token``: int32 ``[size, max_context_len]``, the KV slot of every token of every request row."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        expect(isinstance(size, int) and size > 0, KVCacheError, "size", size, "a positive int")
        expect(
            isinstance(max_context_len, int) and max_context_len > 0,
            KVCacheError,
            "max_context_len",
            max_context_len,
            "a positive int",
        )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=self.device)

    def write(self, req_index: int, start: int, slots: torch.Tensor) -> None:
        """Set ``req_to_token[req_index, start : start + len(slots)] = slots``."""
        expect(0 <= req_index < self.size, KVCacheError, "req_index", req_index, f"in [0, {self.size})")
        expect(
            isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.dtype in INDEX_DTYPES,
            KVCacheError,
            "slots",
            f"{slots.dtype}{list(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__,
            "a 1-D int32/int64 tensor",
        )
        end = start + slots.numel()
        expect(
            0 <= start and end <= self.max_context_len,
            KVCacheError,
            "token range",
            (start, end),
            f"within [0, max_context_len={self.max_context_len}]",
        )
        self.req_to_token[req_index, start:end] = slots.to(device=self.device, dtype=torch.int32)


class PagedKVPool:
    """Per-layer K and V buffers of ``num_slots = (num_pages + 1) * page_size`` token slots.

    ``k_buffer[layer]``: ``[num_slots, head_num, head_dim]``; ``v_buffer[layer]``:
    ``[num_slots, head_num, v_head_dim]``; both in ``dtype`` (the model dtype).
    Usable slots are ``page_size .. num_slots - 1``; page 0 takes padding writes.
    """

    padding_slot = 0

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for field, value in (
            ("num_pages", num_pages),
            ("layer_num", layer_num),
            ("head_num", head_num),
            ("head_dim", head_dim),
        ):
            expect(isinstance(value, int) and value > 0, KVCacheError, field, value, "a positive int")
        expect(
            isinstance(page_size, int) and page_size > 0 and page_size & (page_size - 1) == 0,
            KVCacheError,
            "page_size",
            page_size,
            "a power of two",
        )
        expect(
            v_head_dim is None or (isinstance(v_head_dim, int) and v_head_dim > 0),
            KVCacheError,
            "v_head_dim",
            v_head_dim,
            "a positive int (or None: head_dim)",
        )
        expect(dtype in KV_DTYPES, KVCacheError, "dtype", dtype, f"one of {KV_DTYPES}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = (num_pages + 1) * page_size
        self.k_buffer = [
            torch.zeros(self.num_slots, head_num, head_dim, dtype=dtype, device=self.device) for _ in range(layer_num)
        ]
        self.v_buffer = [
            torch.zeros(self.num_slots, head_num, self.v_head_dim, dtype=dtype, device=self.device)
            for _ in range(layer_num)
        ]

    @property
    def size(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return self.num_pages * self.page_size

    def _layer(self, layer_id: int) -> int:
        expect(
            isinstance(layer_id, int) and 0 <= layer_id < self.layer_num,
            KVCacheError,
            "layer_id",
            layer_id,
            f"in [0, {self.layer_num})",
        )
        return layer_id

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[self._layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[self._layer(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_paged_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same memory as ``[num_pages + 1, page_size, head_num, dim]`` views."""
        k, v = self.get_kv_buffer(layer_id)
        return (
            k.view(-1, self.page_size, self.head_num, self.head_dim),
            v.view(-1, self.page_size, self.head_num, self.v_head_dim),
        )

    def check_kv(
        self, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, check_range: bool = True
    ) -> None:
        """Raise ``KVCacheError`` unless ``cache_k``/``cache_v`` can be stored at ``loc``.

        Checks shapes, dtypes and devices, and with ``check_range`` the slot range when
        ``loc`` is on the CPU (a host sync; backends skip it because ``ForwardBatch``
        already checked ``out_cache_loc``).
        """
        expect(
            loc.dim() == 1 and loc.dtype in INDEX_DTYPES,
            KVCacheError,
            "loc",
            f"{loc.dtype}{list(loc.shape)}",
            "a 1-D int32/int64 tensor",
        )
        n = loc.numel()
        for name, tensor, dim in (("cache_k", cache_k, self.head_dim), ("cache_v", cache_v, self.v_head_dim)):
            expect(
                tuple(tensor.shape) == (n, self.head_num, dim),
                KVCacheError,
                f"{name}.shape",
                tuple(tensor.shape),
                f"({n}, {self.head_num}, {dim}) for {n} slots",
            )
            expect(tensor.is_floating_point(), KVCacheError, f"{name}.dtype", tensor.dtype, "a float dtype")
            expect(tensor.device == self.device, KVCacheError, f"{name}.device", tensor.device, str(self.device))
        expect(loc.device == self.device, KVCacheError, "loc.device", loc.device, str(self.device))
        if check_range and n and loc.device.type == "cpu":
            lo, hi = int(loc.min()), int(loc.max())
            expect(
                lo >= 0 and hi < self.num_slots,
                KVCacheError,
                "loc range",
                (lo, hi),
                f"slots in [0, {self.num_slots})",
            )

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Store ``cache_k``/``cache_v`` (``[n, head_num, dim]``) at slots ``loc`` (``[n]``) of ``layer``.

        ``layer`` is an ``AttentionLayer`` or a layer id. Values are cast to the pool
        dtype. Nothing is written unless every check passes.
        """
        layer_id = self._layer(getattr(layer, "layer_id", layer))
        self.check_kv(loc, cache_k, cache_v)
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)


MHATokenToKVPool = PagedKVPool
"""SGLang's name for the same pool."""
