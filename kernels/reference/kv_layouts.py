"""Writing and reading KV pages in the layouts other than token-major (plain torch, the definition of correct).

Every op takes one layer's K (or V) tensor in its native layout (``hal.kv_layouts`` names the rows) and token
rows ``[n, heads, dim]``; slot ``s`` is offset ``s % page_size`` of page ``s // page_size``:

* head-major pages (FlashInfer's ``HND``, vLLM's ``LBHNC``): ``[num_pages, heads, page_size, dim]``;
* FRACTAL_NZ pages (Ascend 310P): ``[num_pages, heads * dim / 16, page_size, 16]``, token row ``r`` flattened to
  ``heads * dim`` values and cut into lanes of 16 (``pages[p, c, o, j] = row[c * 16 + j]``).

A write skips a negative slot (-1, a padding token) as :func:`hal.kernels.reference.store` does: its row goes to
page 0, offset 0 carrying that place's own bytes, so no shape depends on the data. Values are already in the
pages' dtype (a scaled fp8 cache: quantised by the caller); one-byte floats are moved as bytes.
"""

from __future__ import annotations

import torch

__all__ = ["write_head_major", "read_head_major", "write_fractal_nz", "read_fractal_nz"]

NZ_LANE = 16  # FRACTAL_NZ cuts a token's heads * dim values into lanes of 16


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
