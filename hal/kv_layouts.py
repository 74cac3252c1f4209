"""The KV layout table: how one layer's K (or V) cache is laid out in memory, and what engines call it.

Slot ``s`` of a paged cache is offset ``o = s % page_size`` of page ``p = s // page_size`` in every layout; a
layout says where token ``(p, o)``, head ``h``, element ``d`` of a layer's K (or V) lives:

* ``token_major``: ``[num_slots, heads, dim]`` (paged view ``[num_pages, page_size, heads, dim]``), element
  ``((p * P + o) * H + h) * D + d``; FlashInfer ``NHD``, vLLM ``LBNHC``, Ascend ``ND``.
* ``head_major``: ``[num_pages, heads, page_size, dim]``, element ``((p * H + h) * P + o) * D + d``; FlashInfer
  ``HND``, vLLM ``LBHNC``.
* ``fractal_nz``: ``[num_pages, heads * dim / 16, page_size, 16]``, element ``p * H * D * P + (f // 16) * P * 16
  + o * 16 + f % 16`` with ``f = h * D + d`` (``dim`` a multiple of 16); Ascend ``FRACTAL_NZ`` (310P's ATB ops).
* ``amx_packed``: head-major's ``[num_pages, heads, page_size, dim]``, each (page, head)'s ``P * D`` values
  permuted into the 1 KB tiles AMX multiplies, K and V each its own way (:mod:`hal.kernels.reference.kv_layouts`
  gives the offsets): K ``(p * H + h) * P * D + (o // 16) * 16 * D + (d // 2) * 32 + (o % 16) * 2 + d % 2``, V
  ``(p * H + h) * P * D + (d // 16) * P * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2`` (``P`` a multiple of 32,
  ``dim`` of 32). What vLLM's CPU attention writes on AMX CPUs (``csrc/cpu/cpu_attn_amx.hpp``) into the cache it
  allocates head-major (``LBHNC``): the same memory, hal's name for what is in it.

(``P`` page size, ``H`` heads, ``D`` dim.) vLLM before 0.30 named layouts by its backends' ``get_kv_cache_shape``:
FlashAttention's ``[2, num_blocks, block_size, heads, dim]`` is token-major, the CPU backend's ``[2, num_blocks,
heads, block_size, dim]`` head-major; vllm-ascend's 310P runner allocates FRACTAL_NZ.

How an engine hands K and V over (:data:`KV_PACKINGS`) is apart from the layout: two tensors per layer (hal's and
SGLang's pools, vllm-ascend's ``(k_cache, v_cache)`` tuples), one tensor with K and V stacked on a leading axis of 2
(vLLM before 0.30), or one tensor whose content axis holds K then V (vLLM 0.30+).

A pool says its layout in ``kv_layout`` (:func:`pool_kv_layout`; a pool without one is
token-major); a backend declares the layouts it reads in place, in its preferred order, in
``kv_layouts`` (``BackendDeclaration.kv_layouts``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hal.errors import ConfigError, HalError, expect
from hal.kernels.reference import kv_layouts as ops
from hal.kernels.reference import store

__all__ = [
    "KVLayout",
    "KV_LAYOUT_TABLE",
    "KV_LAYOUTS",
    "KV_PACKINGS",
    "TOKEN_MAJOR",
    "HEAD_MAJOR",
    "FRACTAL_NZ",
    "AMX_PACKED",
    "kv_layout",
    "pool_kv_layout",
]

TOKEN_MAJOR, HEAD_MAJOR, FRACTAL_NZ, AMX_PACKED = "token_major", "head_major", "fractal_nz", "amx_packed"


@dataclass(frozen=True)
class KVLayout:
    """One row of the table: a layer's K (or V) cache laid out one way.

    ``axes``: the per-layer tensor's axes, outermost first; ``flashinfer`` / ``vllm`` / ``ascend``: the name each
    gives it (FlashInfer's ``kv_layout``, vLLM's ``KVCacheLayout`` member, Ascend's ACL format), None where it has
    none; ``dim_multiple``: ``dim`` must be a multiple of it; ``write(tensor, loc, rows)`` stores token rows
    ``[n, heads, dim]`` (already in the tensor's dtype) at slots ``loc``, a slot of -1 skipped; ``read(tensor,
    slots, heads)`` returns the rows ``[n, heads, dim]`` at ``slots``; ``value_write`` / ``value_read``: the same
    for V where a layout lays V out otherwise than K (None: as K; :meth:`writer` / :meth:`reader` choose);
    ``page_multiple``: the page size must be a multiple of it.
    """

    name: str
    axes: tuple[str, ...]
    flashinfer: str | None
    vllm: str | None
    ascend: str | None
    dim_multiple: int
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    read: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    value_write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    value_read: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None
    page_multiple: int = 1

    def writer(self, value: bool = False) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """``write`` for K (``value`` False), ``value_write`` (else ``write``) for V."""
        return (self.value_write or self.write) if value else self.write

    def reader(self, value: bool = False) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``read`` for K (``value`` False), ``value_read`` (else ``read``) for V."""
        return (self.value_read or self.read) if value else self.read

    def shape(self, num_pages: int, page_size: int, heads: int, dim: int) -> tuple[int, ...]:
        """The per-layer tensor's shape for ``num_pages`` pages (padding page included)."""
        sizes = {
            "slot": num_pages * page_size,
            "page": num_pages,
            "offset": page_size,
            "head": heads,
            "dim": dim,
            "lane_group": heads * dim // ops.NZ_LANE,
            "lane": ops.NZ_LANE,
        }
        return tuple(sizes[axis] for axis in self.axes)

    def element_offset(
        self, page: int, offset: int, head: int, d: int, page_size: int, heads: int, dim: int, value: bool = False
    ) -> int:
        """Where element ``d`` of head ``head`` of slot ``page * page_size + offset`` lives, counted in elements
        from the start of the (contiguous) per-layer tensor (``value``: V's, where the layout lays V otherwise)."""
        if self.name == AMX_PACKED:
            within = ops.amx_packed_offsets(torch.tensor([offset]), page_size, dim, value)[0, d]
            return (page * heads + head) * page_size * dim + int(within)
        if self.name == FRACTAL_NZ:
            flat = head * dim + d
            return (
                page * heads * dim * page_size
                + (flat // ops.NZ_LANE) * page_size * ops.NZ_LANE
                + offset * ops.NZ_LANE
                + flat % ops.NZ_LANE
            )
        if self.name == HEAD_MAJOR:
            return ((page * heads + head) * page_size + offset) * dim + d
        return ((page * page_size + offset) * heads + head) * dim + d

    def unsupported(self, heads: int, dim: int, page_size: int | None = None) -> str | None:
        """Why ``heads`` x ``dim`` (in pages of ``page_size``, where given) cannot be laid out so (None: it can)."""
        if dim % self.dim_multiple:
            return f"{self.name} needs dim a multiple of {self.dim_multiple}, not {dim}"
        if page_size is not None and page_size % self.page_multiple:
            return f"{self.name} needs a page size that is a multiple of {self.page_multiple}, not {page_size}"
        return None


def _read_token_major(buffer: torch.Tensor, slots: torch.Tensor, heads: int) -> torch.Tensor:
    return buffer[slots.long()]


KV_LAYOUT_TABLE: tuple[KVLayout, ...] = (
    KVLayout(TOKEN_MAJOR, ("slot", "head", "dim"), "NHD", "LBNHC", "ND", 1, store, _read_token_major),
    KVLayout(HEAD_MAJOR, ("page", "head", "offset", "dim"), "HND", "LBHNC", None, 1, ops.write_head_major,
             lambda pages, slots, heads: ops.read_head_major(pages, slots)),
    KVLayout(FRACTAL_NZ, ("page", "lane_group", "offset", "lane"), None, None, "FRACTAL_NZ", ops.NZ_LANE,
             ops.write_fractal_nz, ops.read_fractal_nz),
    KVLayout(AMX_PACKED, ("page", "head", "offset", "dim"), None, None, None, ops.AMX_DIM_MULTIPLE,
             ops.write_amx_packed_k, lambda pages, slots, heads: ops.read_amx_packed_k(pages, slots),
             ops.write_amx_packed_v, lambda pages, slots, heads: ops.read_amx_packed_v(pages, slots),
             ops.AMX_PAGE_MULTIPLE),
)  # fmt: skip
KV_LAYOUTS = {row.name: row for row in KV_LAYOUT_TABLE}

KV_PACKINGS = {
    "split": "two tensors per layer, K and V (hal's and SGLang's pools; vllm-ascend's (k_cache, v_cache) tuples)",
    "stacked": "one tensor per layer, K and V on a leading axis of 2 (vLLM before 0.30: [2, num_blocks, ...])",
    "content": "one tensor per layer whose content axis holds K then V (vLLM 0.30+: [blocks, heads, block_size, "
    "head_size + head_size_v])",
}


def kv_layout(name: object, error: type[HalError] = ConfigError, field: str = "kv_layout") -> KVLayout:
    """The row named ``name``; ``error`` (naming ``field``) for any other value."""
    expect(isinstance(name, str) and name in KV_LAYOUTS, error, field, name, f"one of {list(KV_LAYOUTS)}")
    return KV_LAYOUTS[name]


def pool_kv_layout(pool: object) -> str:
    """The layout of any KV pool: its ``kv_layout``, or ``token_major`` for a pool that names none."""
    return getattr(pool, "kv_layout", None) or TOKEN_MAJOR
