"""Memory pools: the request tables (request-to-token map, or request-to-page block table) and the paged
token-to-KV pool.

Backends reach both only through two small protocols, with SGLang's names, so an
engine's own pools (SGLang's ``ReqToTokenPool`` and ``MHATokenToKVPool``) serve as they
are; :class:`ReqToTokenPool` and :class:`PagedKVPool` are hal's implementations, which
can also wrap an engine's existing tensors without a copy (``from_tensor`` /
``from_buffers``).

Slot ``s`` of the KV pool lives in page ``s // page_size`` at offset ``s % page_size``,
so one layer's ``[num_slots, head_num, head_dim]`` buffer and the
``[num_pages, page_size, head_num, head_dim]`` view that paged kernels (NPU block
tables, FlashInfer) take are the same memory. That is the token-major layout, every pool's
unless it says another in ``kv_layout`` (:mod:`hal.kv_layouts`: head-major pages, FRACTAL_NZ);
:meth:`PagedKVPool.get_kv_pages` / :func:`kv_pages` give any pool's pages in its own layout.
Page 0 is reserved: padded tokens of a graph-replayed batch write slot 0, so it never holds a
request's data. A slot of -1 (:data:`PADDING_TOKEN_SLOT`, vLLM's ``PAD_SLOT_ID``) marks a padding token whose KV is
written nowhere: every slot, page 0 included, keeps its content.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from hal.capability import resolve_device
from hal.deprecation import accept_renamed_kwargs, warn_renamed
from hal.errors import ConfigError, KVCacheError, describe, expect
from hal.kernels.reference import kv_scales, quantize_kv, store
from hal.kv_dtypes import KV_STORAGE_DTYPES, kv_dtype
from hal.kv_layouts import TOKEN_MAJOR, pool_kv_layout
from hal.kv_layouts import kv_layout as layout_row

__all__ = [
    "ReqToTokenTable",
    "ReqToPageTable",
    "KVPool",
    "ReqToTokenPool",
    "ReqToPagePool",
    "PagedKVPool",
    "MHATokenToKVPool",
    "MLAKVPool",
    "MLATokenToKVPool",
    "kv_cache_dtype_name",
    "pool_geometry",
    "paged_view",
    "kv_pages",
    "kv_rows",
    "kv_storage",
    "PADDING_TOKEN_SLOT",
]

INDEX_DTYPES = (torch.int32, torch.int64)
# out_cache_loc / loc of a padding token: its KV is written nowhere (vLLM's PAD_SLOT_ID); see docs/porting.md, section 5
PADDING_TOKEN_SLOT = -1


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The name of a KV cache dtype (``"bf16"``, ``"fp8_e4m3"`` ...); ``KVCacheError`` for any other dtype."""
    return kv_dtype(dtype, KVCacheError).name


_HOST = torch.empty(0).device  # host memory: the pages madvise speaks of
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def huge_pages_env() -> bool:
    """``HAL_KV_HUGE_PAGES``: ``1`` (or unset) backs hal's host KV pools with transparent huge pages where
    Linux offers them, ``0`` leaves them to the allocator's 4 KiB pages."""
    raw = os.environ.get("HAL_KV_HUGE_PAGES", "").strip()
    expect(raw in ("", "0", "1"), ConfigError, "HAL_KV_HUGE_PAGES", raw, "0 (4 KiB pages) or 1 (default)")
    return raw != "0"


def host_huge_pages() -> bool:
    """Whether hal's host KV pools ask for huge pages here: on Linux, unless ``HAL_KV_HUGE_PAGES=0``."""
    return sys.platform.startswith("linux") and huge_pages_env()


def pool_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV buffer. On a Linux host, a buffer of 4 MiB or more asks for transparent huge pages
    (``madvise(MADV_HUGEPAGE)`` before its pages are first touched) unless ``HAL_KV_HUGE_PAGES=0``: a decode
    step reads every slot of every request, slots scattered over the pool, and with 4 KiB pages nearly each
    slot's rows cost a page walk (hal bench decode bf16 at page 1, 2-core Xeon: 1.07-1.18x with huge pages).
    Where the kernel says no (THP ``never``, no memory to spare) the pages stay 4 KiB; the contents are the
    same either way."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    nbytes = buf.numel() * buf.element_size()
    if host_huge_pages() and buf.device == _HOST and nbytes >= 2 * _HUGE_PAGE:  # (HAL_KV_HUGE_PAGES checked always)
        start = -(-buf.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the whole huge pages inside the buffer
        length = (buf.data_ptr() + nbytes - start) // _HUGE_PAGE * _HUGE_PAGE
        if length > 0:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return buf.zero_()


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@runtime_checkable
class ReqToTokenTable(Protocol):
    """The request table a backend reads: ``req_to_token``, int32 ``[rows, max_context_len]``."""

    req_to_token: torch.Tensor


@runtime_checkable
class ReqToPageTable(Protocol):
    """The block table a backend may read instead: ``req_to_page``, int32 ``[rows, max_pages]`` (the page id of
    every ``page_size`` tokens of each request row; token ``i`` is slot ``page * page_size + i % page_size``)."""

    req_to_page: torch.Tensor
    page_size: int


@runtime_checkable
class KVPool(Protocol):
    """The KV pool a backend reads and writes (SGLang's ``MHATokenToKVPool`` interface).

    ``layer_id`` is the model's global layer id (a pipeline stage's pool holds layers
    ``start_layer ..``). Buffers are ``[num_slots, head_num, head_dim]`` (values
    ``[num_slots, head_num, v_head_dim]``), slot ``s`` at offset ``s % page_size`` of page
    ``s // page_size``; slot 0 takes padding writes.

    A pool in another layout (:mod:`hal.kv_layouts`) says so in ``kv_layout`` and has no such buffers: it gives
    ``get_kv_pages(layer_id)`` (K and V in its layout) and ``num_slots``, ``head_num``, ``head_dim``,
    ``v_head_dim``; only backends that declare the layout in ``kv_layouts`` read it.
    """

    page_size: int
    dtype: torch.dtype

    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None: ...


def conforms(obj, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a runtime-checkable protocol, at the cost of its ``hasattr`` calls.

    The same test Python 3.11 makes (every member present, no method member set to None), without its walk of the
    protocol's MRO on every call (about 30 us a check; validate_batch makes two per step)."""
    members = _PROTOCOL_MEMBERS.get(protocol)
    if members is None:
        names = {**protocol.__annotations__, **vars(protocol)}
        members = _PROTOCOL_MEMBERS[protocol] = tuple(
            (name, callable(getattr(protocol, name, None))) for name in names if not name.startswith("_")
        )
    for name, is_method in members:
        value = getattr(obj, name, _ABSENT)
        if value is _ABSENT or (is_method and value is None):
            return False
    return True


_PROTOCOL_MEMBERS: dict[type, tuple[tuple[str, bool], ...]] = {}
_ABSENT = object()


def pool_geometry(pool: KVPool, layer_id: int) -> tuple[int, int, int, int]:
    """``(num_slots, head_num, head_dim, v_head_dim)`` of ``layer_id``'s buffers in any KV pool (shapes only)."""
    if pool_kv_layout(pool) != TOKEN_MAJOR:
        return pool.num_slots, pool.head_num, pool.head_dim, pool.v_head_dim
    k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    return k.shape[0], k.shape[1], k.shape[2], v.shape[2]


class ReqToTokenPool:
    """``req_to_token``: int32 ``[size + 1, max_context_len]``, the KV slot of every token of every request row.

    As SGLang's ``ReqToTokenPool(size, ...)``: ``size`` requests fit, in rows ``1 .. size``;
    row 0 is the padding row (graph-padding requests use ``req_pool_indices = 0``) and
    stays all zeros, i.e. the padding slot.
    """

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
        self.device = resolve_device(device)
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=self.device)

    @classmethod
    def from_tensor(cls, req_to_token: torch.Tensor) -> ReqToTokenPool:
        """Wrap an engine's int32 ``[size + 1, max_context_len]`` table (row 0: padding) without a copy."""
        expect(
            isinstance(req_to_token, torch.Tensor)
            and req_to_token.dim() == 2
            and req_to_token.dtype == torch.int32
            and req_to_token.shape[0] >= 2,
            KVCacheError,
            "req_to_token",
            describe(req_to_token),
            "an int32 tensor [size + 1, max_context_len] (row 0 is the padding row)",
        )
        pool = cls.__new__(cls)
        rows, pool.max_context_len = req_to_token.shape
        pool.size = rows - 1
        pool.device = resolve_device(req_to_token.device)
        pool.req_to_token = req_to_token
        return pool

    def write(self, req_index: int, start: int, slots: torch.Tensor) -> None:
        """Set ``req_to_token[req_index, start : start + len(slots)] = slots`` (``req_index`` in ``1 .. size``)."""
        _write_row(self.req_to_token, self.size, req_index, start, slots, ("slots", "token range", "max_context_len"))


def _write_row(table: torch.Tensor, size: int, req_index: int, start: int, values: torch.Tensor, names) -> None:
    """``table[req_index, start : start + len(values)] = values`` for a request table (row 0: the padding row),
    each argument checked; ``names``: (the values, the range, the table's width) as the messages call them."""
    what, span, width = names
    expect(
        isinstance(req_index, int) and 1 <= req_index <= size,
        KVCacheError,
        "req_index",
        req_index,
        f"a request row in [1, {size}] (row 0 is the padding row)",
    )
    expect(
        isinstance(values, torch.Tensor) and values.dim() == 1 and values.dtype in INDEX_DTYPES,
        KVCacheError,
        what,
        describe(values),
        "a 1-D int32/int64 tensor",
    )
    end = start + values.numel()
    expect(
        0 <= start and end <= table.shape[1], KVCacheError, span, (start, end), f"within [0, {width}={table.shape[1]}]"
    )
    table[req_index, start:end] = values.to(device=table.device, dtype=torch.int32)


class ReqToPagePool:
    """``req_to_page``: int32 ``[size + 1, max_pages]``, the KV pool page of every ``page_size`` tokens of every
    request row (a block table, vLLM's form); rows as :class:`ReqToTokenPool`'s (row 0: the padding row, all
    zeros: the padding page). Indexed by ``req_pool_indices`` like ``req_to_token``.
    """

    def __init__(self, size: int, max_pages: int, page_size: int, device: torch.device | str = "cpu"):
        for name, value in (("size", size), ("max_pages", max_pages), ("page_size", page_size)):
            expect(isinstance(value, int) and value > 0, KVCacheError, name, value, "a positive int")
        self.size, self.max_pages, self.page_size = size, max_pages, page_size
        self.device = resolve_device(device)
        self.req_to_page = torch.zeros(size + 1, max_pages, dtype=torch.int32, device=self.device)

    @classmethod
    def from_tensor(cls, req_to_page: torch.Tensor, page_size: int) -> ReqToPagePool:
        """Wrap an engine's int32 ``[rows, max_pages]`` block table without a copy (vLLM's ``block_table_tensor``:
        one row per request of the step, no padding row)."""
        expect(
            isinstance(req_to_page, torch.Tensor) and req_to_page.dim() == 2 and req_to_page.dtype == torch.int32,
            KVCacheError,
            "req_to_page",
            describe(req_to_page),
            "an int32 tensor [rows, max_pages]",
        )
        expect(isinstance(page_size, int) and page_size > 0, KVCacheError, "page_size", page_size, "a positive int")
        pool = cls.__new__(cls)
        rows, pool.max_pages = req_to_page.shape
        pool.size, pool.page_size = rows - 1, page_size
        pool.device = resolve_device(req_to_page.device)
        pool.req_to_page = req_to_page
        return pool

    @property
    def max_context_len(self) -> int:
        """Tokens a row holds: ``max_pages * page_size``."""
        return self.max_pages * self.page_size

    def write(self, req_index: int, start_page: int, pages: torch.Tensor) -> None:
        """Set ``req_to_page[req_index, start_page : start_page + len(pages)] = pages`` (``req_index`` in
        ``1 .. size``)."""
        _write_row(self.req_to_page, self.size, req_index, start_page, pages, ("pages", "page range", "max_pages"))


class PagedKVPool:
    """Per-layer K and V buffers of ``num_slots = (num_pages + 1) * page_size`` token slots.

    ``k_buffer[i]``: ``[num_slots, head_num, head_dim]``; ``v_buffer[i]``:
    ``[num_slots, head_num, v_head_dim]``; both in ``dtype`` (the model dtype, or
    ``float8_e4m3fn`` / ``float8_e5m2``: writes quantise with the layer's scales), for the
    model's layers ``start_layer .. start_layer + layer_num - 1`` (a pipeline stage holds
    a slice of the model). Usable slots are ``page_size .. num_slots - 1``; page 0 takes
    padding writes.

    ``kv_layout`` (:mod:`hal.kv_layouts`; ``Selection.create_kv_pool`` passes the chosen backend's) lays each
    layer out otherwise: ``k_buffer[i]`` / ``v_buffer[i]`` are then that layout's pages (head-major
    ``[num_pages + 1, head_num, page_size, dim]``, FRACTAL_NZ ``[num_pages + 1, head_num * dim / 16, page_size,
    16]``), read with :meth:`get_kv_pages` and written with :meth:`set_kv_buffer`; there is no token-major buffer
    to get (``get_key_buffer`` refuses). ``format_pages(tensor) -> tensor``, when given, turns each freshly
    allocated buffer into the device's storage format once (an NPU's FRACTAL_NZ format cast).
    """

    padding_slot = 0
    kv_layout = TOKEN_MAJOR

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
        start_layer: int = 0,
        kv_layout: str = TOKEN_MAJOR,
        format_pages=None,
    ):
        for name, value in (("num_pages", num_pages), ("layer_num", layer_num), ("head_num", head_num)):
            expect(isinstance(value, int) and value > 0, KVCacheError, name, value, "a positive int")
        for name, value in (("head_dim", head_dim), ("v_head_dim", v_head_dim or head_dim)):
            expect(isinstance(value, int) and value > 0, KVCacheError, name, value, "a positive int")
        _check_page_size(page_size)
        _check_storage_dtype(dtype)
        layout = layout_row(kv_layout, KVCacheError)
        v_dim = v_head_dim or head_dim
        for dim in (head_dim, v_dim):
            why = layout.unsupported(head_num, dim, page_size)
            expect(why is None, KVCacheError, "kv_layout", layout.name, f"a layout for head dim {dim} ({why})")
        device = resolve_device(device)
        make = format_pages or (lambda t: t)
        k = [make(pool_buffer(layout.shape(num_pages + 1, page_size, head_num, head_dim), dtype, device))]
        k += [make(pool_buffer(k[0].shape, dtype, device)) for _ in range(layer_num - 1)]
        v = [make(pool_buffer(layout.shape(num_pages + 1, page_size, head_num, v_dim), dtype, device))]
        v += [make(pool_buffer(v[0].shape, dtype, device)) for _ in range(layer_num - 1)]
        if layout.name == TOKEN_MAJOR:
            self._attach(k, v, page_size, start_layer)
            return
        self.k_buffer, self.v_buffer = k, v
        self.page_size, self.start_layer, self.layer_num = page_size, start_layer, layer_num
        self.num_slots, self.head_num, self.head_dim, self.v_head_dim = (
            (num_pages + 1) * page_size,
            head_num,
            head_dim,
            v_dim,
        )
        self.num_pages, self.dtype, self.device, self.kv_layout = num_pages, dtype, device, layout.name

    @classmethod
    def from_buffers(
        cls,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        page_size: int,
        start_layer: int = 0,
    ) -> PagedKVPool:
        """Wrap an engine's per-layer ``[num_slots, head_num, dim]`` K and V tensors without a copy.

        ``num_slots`` must be a multiple of ``page_size``; every layer's buffers must share
        one shape, dtype and device. Reads and writes go to those very tensors.
        """
        _check_page_size(page_size)
        pool = cls.__new__(cls)
        pool._attach(list(k_buffers), list(v_buffers), page_size, start_layer)
        return pool

    def _attach(self, k_buffers: list, v_buffers: list, page_size: int, start_layer: int) -> None:
        expect(
            isinstance(start_layer, int) and start_layer >= 0, KVCacheError, "start_layer", start_layer, "an int >= 0"
        )
        expect(
            len(k_buffers) == len(v_buffers) > 0,
            KVCacheError,
            "len(k_buffers), len(v_buffers)",
            (len(k_buffers), len(v_buffers)),
            "one K and one V buffer per layer, at least one layer",
        )
        k0, v0 = k_buffers[0], v_buffers[0]
        for name, buffers, like in (("k_buffers", k_buffers, k0), ("v_buffers", v_buffers, v0)):
            for i, buf in enumerate(buffers):
                expect(
                    isinstance(buf, torch.Tensor)
                    and buf.dim() == 3
                    and buf.shape == like.shape
                    and buf.dtype == like.dtype
                    and buf.device == like.device,
                    KVCacheError,
                    f"{name}[{i}]",
                    describe(buf),
                    f"a 3-D tensor like layer 0's {describe(like)}",
                )
        expect(
            v0.shape[:2] == k0.shape[:2] and v0.dtype == k0.dtype and v0.device == k0.device,
            KVCacheError,
            "v_buffers[0]",
            describe(v0),
            f"[{k0.shape[0]}, {k0.shape[1]}, v_head_dim] {k0.dtype} on {k0.device}, like the K buffers",
        )
        _check_storage_dtype(k0.dtype)
        num_slots = k0.shape[0]
        expect(
            num_slots % page_size == 0 and num_slots >= 2 * page_size,
            KVCacheError,
            "num_slots",
            num_slots,
            f"a multiple of page_size ({page_size}), at least two pages (page 0 is the padding page)",
        )
        self.k_buffer, self.v_buffer = k_buffers, v_buffers
        self.page_size, self.start_layer, self.layer_num = page_size, start_layer, len(k_buffers)
        self.num_slots, self.head_num, self.head_dim = k0.shape
        self.v_head_dim = v0.shape[2]
        self.num_pages = num_slots // page_size - 1
        self.dtype = k0.dtype
        self.device = resolve_device(k0.device)

    @property
    def size(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return self.num_pages * self.page_size

    def _layer(self, layer_id: int) -> int:
        index = layer_id - self.start_layer if isinstance(layer_id, int) else -1
        if 0 <= index < self.layer_num:  # the per-layer hot path builds no message
            return index
        expect(
            False,
            KVCacheError,
            "layer_id",
            layer_id,
            f"a layer of this pool, in [{self.start_layer}, {self.start_layer + self.layer_num})",
        )
        return index

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        if self.kv_layout != TOKEN_MAJOR:
            self._refuse_slot_buffers("get_key_buffer")
        return self.k_buffer[self._layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        if self.kv_layout != TOKEN_MAJOR:
            self._refuse_slot_buffers("get_value_buffer")
        return self.v_buffer[self._layer(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_layout != TOKEN_MAJOR:
            self._refuse_slot_buffers("get_kv_buffer")
        index = self._layer(layer_id)
        return self.k_buffer[index], self.v_buffer[index]

    def _refuse_slot_buffers(self, method: str) -> None:
        expect(
            False,
            KVCacheError,
            f"{method} on a {self.kv_layout} pool",
            tuple(self.k_buffer[0].shape),
            "a token_major pool ([num_slots, head_num, head_dim] buffers); a backend that reads "
            f"{self.kv_layout} pages declares it in kv_layouts and reads get_kv_pages(layer_id)",
        )

    def get_kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V pages in the pool's layout (the tensors themselves, no copy): token-major
        ``[num_pages + 1, page_size, head_num, dim]`` views, head-major ``[num_pages + 1, head_num, page_size,
        dim]``, FRACTAL_NZ ``[num_pages + 1, head_num * dim / 16, page_size, 16]``."""
        if self.kv_layout == TOKEN_MAJOR:
            return paged_view(self, layer_id)
        index = self._layer(layer_id)
        return self.k_buffer[index], self.v_buffer[index]

    def get_paged_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same memory as ``[num_pages + 1, page_size, head_num, dim]`` views."""
        return paged_view(self, layer_id)

    def check_kv(
        self, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, check_range: bool = True
    ) -> None:
        """Raise ``KVCacheError`` unless ``cache_k``/``cache_v`` can be stored at ``loc``.

        Checks shapes, dtypes and devices, and with ``check_range`` the slot range (a read
        of ``loc``; backends skip it: batch validation covers ``out_cache_loc``): slots in
        ``[0, num_slots)`` or :data:`PADDING_TOKEN_SLOT` (-1: nothing written for that row).
        """
        check_kv_inputs(loc, cache_k, cache_v, (self.head_num, self.head_dim, self.v_head_dim), self.device)
        n = loc.numel()
        if check_range and n:
            lo, hi = int(loc.min()), int(loc.max())
            expect(
                lo >= PADDING_TOKEN_SLOT and hi < self.num_slots,
                KVCacheError,
                "loc range",
                (lo, hi),
                f"slots in [0, {self.num_slots}), or -1 for a padding token (nothing written)",
            )

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale=None,
        v_scale=None,
        layer_id_override: int | None = None,
    ) -> None:
        """Store ``cache_k``/``cache_v`` (``[n, head_num, dim]``) at slots ``loc`` (``[n]``) of ``layer``.

        ``layer`` is an ``AttentionLayer`` (or SGLang's ``RadixAttention``) or a layer id;
        ``layer_id_override`` replaces its id (SGLang's argument). Values are cast to the pool
        dtype; an fp8 pool quantises them with ``k_scale`` / ``v_scale`` (floats or 1-element
        tensors; None: the layer's scales, 1.0 for a bare id), as ``hal.kernels.reference.quantize_kv``.
        A slot of -1 (a padding token) writes nothing. Nothing is written unless every check passes.
        """
        index, ks, vs = self._write_target(layer, k_scale, v_scale, layer_id_override)
        self.check_kv(loc, cache_k, cache_v)
        layout = layout_row(self.kv_layout)
        layout.writer()(self.k_buffer[index], loc, quantize_kv(cache_k, self.dtype, ks))
        layout.writer(value=True)(self.v_buffer[index], loc, quantize_kv(cache_v, self.dtype, vs))

    def _write_target(self, layer, k_scale, v_scale, layer_id_override) -> tuple[int, float, float]:
        """The buffer index and the ``(k_scale, v_scale)`` floats of a write."""
        layer_id = layer_id_override if layer_id_override is not None else getattr(layer, "layer_id", layer)
        own_k, own_v = kv_scales(layer) if not isinstance(layer, int) else (1.0, 1.0)
        scales = []
        for name, given, own in (("k_scale", k_scale, own_k), ("v_scale", v_scale, own_v)):
            value = own if given is None else float(given)
            expect(value > 0 and value != float("inf"), KVCacheError, name, value, "a finite float > 0")
            scales.append(value)
        return self._layer(layer_id), scales[0], scales[1]


class MLAKVPool(PagedKVPool):
    """SGLang's ``MLATokenToKVPool``: one buffer per layer, the compressed latent and the rope part of each token.

    ``kv_buffer[i]`` (also ``k_buffer[i]``): ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``;
    ``v_buffer[i]`` is its view ``[..., :kv_lora_rank]`` (the latent is the value: no copy,
    no second write). ``dtype`` is the model dtype or fp8 (scaled with the layer's
    ``k_scale``, which for MLA is also its ``v_scale``). Slots and pages as :class:`PagedKVPool`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_num: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        start_layer: int = 0,
    ):
        for name, value in (("num_pages", num_pages), ("layer_num", layer_num), ("kv_lora_rank", kv_lora_rank)):
            expect(isinstance(value, int) and value > 0, KVCacheError, name, value, "a positive int")
        expect(
            isinstance(qk_rope_head_dim, int) and qk_rope_head_dim >= 0,
            KVCacheError,
            "qk_rope_head_dim",
            qk_rope_head_dim,
            "an int >= 0",
        )
        _check_page_size(page_size)
        _check_storage_dtype(dtype)
        slots, dim, device = (num_pages + 1) * page_size, kv_lora_rank + qk_rope_head_dim, resolve_device(device)
        buffers = [pool_buffer((slots, 1, dim), dtype, device) for _ in range(layer_num)]
        self._attach_latent(buffers, kv_lora_rank, page_size, start_layer)

    @classmethod
    def from_buffers(
        cls, kv_buffers: Sequence[torch.Tensor], kv_lora_rank: int, page_size: int, start_layer: int = 0
    ) -> MLAKVPool:
        """Wrap an engine's per-layer ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffers without a copy."""
        _check_page_size(page_size)
        pool = cls.__new__(cls)
        pool._attach_latent(list(kv_buffers), kv_lora_rank, page_size, start_layer)
        return pool

    def _attach_latent(self, kv_buffers: list, kv_lora_rank: int, page_size: int, start_layer: int) -> None:
        first = kv_buffers[0] if kv_buffers else None
        expect(
            isinstance(first, torch.Tensor) and first.dim() == 3 and first.shape[1] == 1,
            KVCacheError,
            "kv_buffers[0]",
            describe(first),
            "a [num_slots, 1, kv_lora_rank + qk_rope_head_dim] tensor (one latent head)",
        )
        expect(
            isinstance(kv_lora_rank, int) and 0 < kv_lora_rank <= first.shape[2],
            KVCacheError,
            "kv_lora_rank",
            kv_lora_rank,
            f"a positive int <= the buffers' last dim ({first.shape[2]})",
        )
        self._attach(kv_buffers, [buf[..., :kv_lora_rank] for buf in kv_buffers], page_size, start_layer)
        self.kv_buffer = self.k_buffer
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, self.head_dim - kv_lora_rank

    def check_kv(self, loc: torch.Tensor, cache_k: torch.Tensor, cache_v=None, check_range: bool = True) -> None:
        """As :meth:`PagedKVPool.check_kv`; ``cache_v`` (the latent again) may be None."""
        super().check_kv(loc, cache_k, cache_k[..., : self.kv_lora_rank] if cache_v is None else cache_v, check_range)

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
        k_scale=None,
        v_scale=None,
        layer_id_override: int | None = None,
    ) -> None:
        """Store the full key ``cache_k`` ``[n, 1, kv_lora_rank + qk_rope_head_dim]`` (latent and rope part)
        at ``loc``; ``cache_v`` (its latent, for the MHA signature) is checked, not written."""
        index, ks, _ = self._write_target(layer, k_scale, v_scale, layer_id_override)
        self.check_kv(loc, cache_k, cache_v)
        store(self.k_buffer[index], loc, quantize_kv(cache_k, self.dtype, ks))

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor):
        """SGLang's split write: the latent ``[n, 1, kv_lora_rank]`` and the rope part ``[n, 1, qk_rope_head_dim]``."""
        n = loc.numel() if isinstance(loc, torch.Tensor) else -1
        for name, t, dim in (
            ("cache_k_nope", cache_k_nope, self.kv_lora_rank),
            ("cache_k_rope", cache_k_rope, self.qk_rope_head_dim),
        ):
            expect(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (n, 1, dim),
                KVCacheError,
                f"{name}.shape",
                describe(t),
                f"({n}, 1, {dim}) for {n} slots",
            )
        self.set_kv_buffer(layer, loc, torch.cat([cache_k_nope, cache_k_rope.to(cache_k_nope.dtype)], dim=-1))


# Deprecated keywords -> SGLang's names: the old keywords still work, with a warning.
accept_renamed_kwargs(PagedKVPool, {"num_layers": "layer_num", "kv_heads": "head_num"}, KVCacheError)


def paged_view(pool: KVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_id`` of any token-major KV pool as ``[num_pages + 1, page_size, head_num, dim]`` views of the
    same memory."""
    k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    ps = pool.page_size
    return k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:])


def kv_pages(pool: KVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_id`` of any KV pool as pages in its layout: its ``get_kv_pages``, or (a pool without it, which
    is token-major) :func:`paged_view`."""
    pages = getattr(pool, "get_kv_pages", None)
    return pages(layer_id) if pages is not None else paged_view(pool, layer_id)


def kv_storage(pool: KVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Layer ``layer_id``'s K and V as ``pool`` stores them, with their ``(head_num, head_dim, v_head_dim)``: a
    token-major pool's ``[num_slots, head_num, dim]`` buffers, any other pool's pages in its layout
    (``get_kv_pages``; heads and dims read from the pages' ``head`` / ``dim`` axes where the layout has them, else
    the pool's). Shapes only, no copy; the pool checks ``layer_id``."""
    layout = layout_row(pool_kv_layout(pool), KVCacheError)
    if layout.name == TOKEN_MAJOR:
        k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        return k, v, (k.shape[1], k.shape[2], v.shape[2])
    k, v = pool.get_kv_pages(layer_id)
    if "head" in layout.axes and "dim" in layout.axes:
        head, dim = layout.axes.index("head"), layout.axes.index("dim")
        return k, v, (k.shape[head], k.shape[dim], v.shape[dim])
    return k, v, (pool.head_num, pool.head_dim, pool.v_head_dim)


def kv_rows(pool: KVPool, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows ``[n, head_num, dim]`` at ``slots`` ``[n]`` (every one in the pool) of layer ``layer_id`` of
    any KV pool, in any layout (a copy, in the pool's dtype)."""
    layout = layout_row(pool_kv_layout(pool), KVCacheError)
    if layout.name == TOKEN_MAJOR:
        return pool.get_key_buffer(layer_id)[slots.long()], pool.get_value_buffer(layer_id)[slots.long()]
    k, v = pool.get_kv_pages(layer_id)
    return layout.reader()(k, slots, pool.head_num), layout.reader(value=True)(v, slots, pool.head_num)


def check_kv_inputs(loc, cache_k, cache_v, dims: tuple[int, int, int], device: torch.device) -> None:
    """Shapes, dtypes and devices of a KV write at ``loc`` (``[n]``); ``dims``: ``(head_num, head_dim, v_head_dim)``."""
    expect(
        isinstance(loc, torch.Tensor) and loc.dim() == 1 and loc.dtype in INDEX_DTYPES,
        KVCacheError,
        "loc",
        describe(loc),
        "a 1-D int32/int64 tensor",
    )
    n, (heads, head_dim, v_dim) = loc.numel(), dims
    for name, tensor, dim in (("cache_k", cache_k, head_dim), ("cache_v", cache_v, v_dim)):
        expect(
            isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (n, heads, dim),
            KVCacheError,
            f"{name}.shape",
            describe(tensor),
            f"({n}, {heads}, {dim}) for {n} slots",
        )
        expect(tensor.is_floating_point(), KVCacheError, f"{name}.dtype", tensor.dtype, "a float dtype")
        expect(tensor.device == device, KVCacheError, f"{name}.device", tensor.device, str(device))
    expect(loc.device == device, KVCacheError, "loc.device", loc.device, str(device))


def _check_storage_dtype(dtype) -> None:
    expect(
        dtype in KV_STORAGE_DTYPES.values(),
        KVCacheError,
        "dtype",
        dtype,
        f"the storage dtype of a KV-cache dtype: one of {dict(KV_STORAGE_DTYPES)}",
    )


def _check_page_size(page_size) -> None:
    expect(
        isinstance(page_size, int) and page_size > 0 and page_size & (page_size - 1) == 0,
        KVCacheError,
        "page_size",
        page_size,
        "a power of two",
    )


MHATokenToKVPool = PagedKVPool
"""SGLang's name for the same pool."""

MLATokenToKVPool = MLAKVPool
"""SGLang's name for the latent pool."""


# Deprecated views of the dtype table (hal.kv_dtypes): old name -> (its replacement, its value).
_RENAMED_IN_0_4 = {
    "KV_CACHE_DTYPES": ("hal.kv_dtypes.KV_STORAGE_DTYPES", lambda: KV_STORAGE_DTYPES),
    "KV_DTYPES": ("tuple(hal.kv_dtypes.KV_STORAGE_DTYPES.values())", lambda: tuple(KV_STORAGE_DTYPES.values())),
}


def __getattr__(name: str):
    if name not in _RENAMED_IN_0_4:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new, value = _RENAMED_IN_0_4[name]
    warn_renamed(f"{__name__}.{name}", new, since="0.4.0")
    return value()
