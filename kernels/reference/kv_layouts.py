"""Writing and reading KV pages in the layouts other than token-major (plain torch, the definition of correct).

Every op takes one layer's K (or V) tensor in its native layout (``hal.kv_layouts`` names the rows) and token
rows ``[n, heads, dim]``; slot ``s`` is offset ``s % page_size`` of page ``s // page_size``:

* head-major pages (FlashInfer's ``HND``, vLLM's ``LBHNC``): ``[num_pages, heads, page_size, dim]``;
* FRACTAL_NZ pages (Ascend 310P): ``[num_pages, heads * dim / 16, page_size, 16]``, token row ``r`` flattened to
  ``heads * dim`` values and cut into lanes of 16 (``pages[p, c, o, j] = row[c * 16 + j]``);
* AMX-packed pages (the tiles of vLLM's AMX CPU kernel, ``csrc/cpu/cpu_attn_amx.hpp``): head-major's
  ``[num_pages, heads, page_size, dim]``, each (page, head)'s ``page_size * dim`` values permuted for AMX's B
  operand, 16 rows of 16 pairs of 2-byte values (its "VNNI" form ``B[k / 2][n][k % 2]``). K and V differ. K, as
  B = K^T in panels of 16 tokens: value ``(o, d)`` at ``(o // 16) * 16 * dim + (d // 2) * 32 + (o % 16) * 2 + d %
  2``, so keys ``[16 g, 16 g + 16)`` x dims ``[32 c, 32 c + 32)`` are the 1 KB tile at ``(g * dim / 32 + c) *
  512``. V, as B = V in panels of 16 dims: value ``(o, d)`` at ``(d // 16) * page_size * 16 + (o // 2) * 32 +
  (d % 16) * 2 + o % 2``, so keys ``[32 q, 32 q + 32)`` x dims ``[16 e, 16 e + 16)`` are the tile at ``e *
  page_size * 16 + q * 512``. Page size a multiple of 32 and dims of 32 (whole tiles); the offsets themselves are
  only element positions, so any dtype is stored and read alike (the tiles want bfloat16).

A write skips a negative slot (-1, a padding token) as :func:`hal.kernels.reference.store` does: its row goes to
page 0, offset 0 carrying that place's own bytes, so no shape depends on the data. Values are already in the
pages' dtype (a scaled fp8 cache: quantised by the caller); one-byte floats are moved as bytes.
"""

from __future__ import annotations

import torch

__all__ = [
    "write_head_major",
    "read_head_major",
    "write_fractal_nz",
    "read_fractal_nz",
    "AMX_PAGE_MULTIPLE",
    "AMX_DIM_MULTIPLE",
    "amx_packed_offsets",
    "write_amx_packed_k",
    "read_amx_packed_k",
    "write_amx_packed_v",
    "read_amx_packed_v",
]

NZ_LANE = 16  # FRACTAL_NZ cuts a token's heads * dim values into lanes of 16
AMX_PAGE_MULTIPLE = 32  # AMX-packed pages: V's tiles hold 32 keys of one page
AMX_DIM_MULTIPLE = 32  # and K's 32 dims


def _by_slot(pages: torch.Tensor) -> torch.Tensor:
    """``[num_pages, X, page_size, Y]`` pages as the ``[num_pages, page_size, X, Y]`` view of the same memory."""
    return pages.permute(0, 2, 1, 3)


def _store(paged: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
    """``paged[s // page_size, s % page_size] = values[i]`` for ``s = loc[i] >= 0`` (``paged``: a slot-ordered view)."""
    if paged.dtype.is_floating_point and paged.dtype.itemsize == 1:
        paged, values = paged.view(torch.uint8), values.view(torch.uint8)
    loc = loc.long()
    skip = (loc < 0).view(-1, *[1] * (values.dim() - 1))
    slots = loc.clamp(min=0)
    page, offset = slots // paged.shape[1], slots % paged.shape[1]
    paged[page, offset] = torch.where(skip, paged[:1, 0], values)


def _gather(paged: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    slots = slots.long()
    return paged[slots // paged.shape[1], slots % paged.shape[1]]


def write_head_major(pages: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` ``[n, heads, dim]`` at slots ``loc`` ``[n]`` of head-major ``pages``
    ``[num_pages, heads, page_size, dim]`` (in place)."""
    _store(_by_slot(pages), loc, rows)


def read_head_major(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows ``[n, heads, dim]`` at ``slots`` ``[n]`` of head-major ``pages`` (a copy). A request's keys:
    ``read_head_major(k_pages, req_to_token[row, :seq_len])``."""
    return _gather(_by_slot(pages), slots)


def write_fractal_nz(pages: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` ``[n, heads, dim]`` at slots ``loc`` of FRACTAL_NZ ``pages``
    ``[num_pages, heads * dim / 16, page_size, 16]`` (in place), as ATB's ``ReshapeAndCache`` with NZ caches."""
    _store(_by_slot(pages), loc, rows.reshape(rows.shape[0], -1, NZ_LANE))


def read_fractal_nz(pages: torch.Tensor, slots: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows ``[n, heads, dim]`` at ``slots`` of FRACTAL_NZ ``pages`` (a copy)."""
    rows = _gather(_by_slot(pages), slots)
    return rows.reshape(rows.shape[0], heads, -1)


def amx_packed_offsets(offsets: torch.Tensor, page_size: int, dim: int, value: bool) -> torch.Tensor:
    """int64 ``[n, dim]``: where value ``(offsets[i], d)`` of one (page, head) lives among its ``page_size * dim``
    values in AMX-packed pages, K's order (``value`` False) or V's (module docstring)."""
    o = offsets.long()[:, None]
    d = torch.arange(dim, device=offsets.device)[None, :]
    if value:
        return (d // 16) * (page_size * 16) + (o // 2) * 32 + (d % 16) * 2 + o % 2
    return (o // 16) * (16 * dim) + (d // 2) * 32 + (o % 16) * 2 + d % 2


def _amx_places(pages: torch.Tensor, slots: torch.Tensor, value: bool):
    """Index tensors ``[n, heads, dim]`` (page, head, row, column) of the values of ``slots`` in AMX-packed
    ``pages`` ``[num_pages, heads, page_size, dim]`` (any strides: a slab's flat position is its row and column)."""
    _, heads, page_size, dim = pages.shape
    slots = slots.long()
    flat = amx_packed_offsets(slots % page_size, page_size, dim, value)[:, None, :]
    page = (slots // page_size)[:, None, None]
    head = torch.arange(heads, device=pages.device)[None, :, None]
    return page, head, flat // dim, flat % dim


def _write_amx(pages: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, value: bool) -> None:
    if pages.dtype.is_floating_point and pages.dtype.itemsize == 1:
        pages, rows = pages.view(torch.uint8), rows.view(torch.uint8)
    loc = loc.long()
    skip = (loc < 0)[:, None, None]
    places = _amx_places(pages, loc.clamp(min=0), value)
    pages[places] = torch.where(skip, pages[places], rows)


def _read_amx(pages: torch.Tensor, slots: torch.Tensor, value: bool) -> torch.Tensor:
    return pages[_amx_places(pages, slots, value)]


def write_amx_packed_k(pages: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """Store key rows ``[n, heads, dim]`` at slots ``loc`` ``[n]`` of AMX-packed K ``pages`` (in place)."""
    _write_amx(pages, loc, rows, value=False)


def read_amx_packed_k(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The key rows ``[n, heads, dim]`` at ``slots`` ``[n]`` of AMX-packed K ``pages`` (a copy)."""
    return _read_amx(pages, slots, value=False)


def write_amx_packed_v(pages: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """Store value rows ``[n, heads, dim]`` at slots ``loc`` ``[n]`` of AMX-packed V ``pages`` (in place)."""
    _write_amx(pages, loc, rows, value=True)


def read_amx_packed_v(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The value rows ``[n, heads, dim]`` at ``slots`` ``[n]`` of AMX-packed V ``pages`` (a copy)."""
    return _read_amx(pages, slots, value=True)
