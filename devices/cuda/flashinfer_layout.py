"""FlashInfer's host-side plan inputs (indptrs, page tables) and its merge rule, in plain torch.

``merge_states_base2`` documents what FlashInfer's ``merge_state`` computes and serves where the
CUDA kernel cannot (too many heads for one block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hal.kernels.reference import kv_csr

__all__ = ["PagedKV", "build_paged_kv", "indptr_from_lens", "merge_states_base2", "paged_kv_layout"]


# ----------------------------------------------------------------------------- host-side plan inputs


def indptr_from_lens(lens: Sequence[int]) -> torch.Tensor:
    """int32 host ``[len(lens) + 1]``: ``0`` then the running sums of ``lens``."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if len(lens):
        out[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int64), 0)
    return out


def paged_kv_layout(
    kv_lens: Sequence[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side page table shape for ``kv_lens`` keys per request.

    Returns ``(indptr, last_page_len, page_req, page_pos)``: ``indptr`` int32 ``[B + 1]``
    (pages per request, summed), ``last_page_len`` int32 ``[B]`` (keys in each request's
    last page, ``1..page_size``; 0 for a request without keys), and for each page of the
    flat page list, its request ``page_req`` and the position of its first token
    ``page_pos`` (int64 ``[num_pages]``).
    """
    kv = torch.tensor(list(kv_lens), dtype=torch.int64)
    pages = (kv + page_size - 1) // page_size
    indptr = indptr_from_lens(pages.tolist())
    last = torch.where(kv > 0, (kv - 1) % page_size + 1, torch.zeros_like(kv)).to(torch.int32)
    page_req = torch.repeat_interleave(torch.arange(len(kv), dtype=torch.int64), pages)
    page_pos = (torch.arange(page_req.numel(), dtype=torch.int64) - indptr.long()[page_req]) * page_size
    return indptr, last, page_req, page_pos


@dataclass
class PagedKV:
    """FlashInfer's page table of a batch: ``indptr`` / ``last_page_len`` on the host, ``indices`` on the request
    table's device (int32 page ids)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])


def build_paged_kv(
    req_to_token: torch.Tensor | None,
    req_pool_indices: torch.Tensor,
    kv_lens: Sequence[int],
    page_size: int,
    req_to_page: torch.Tensor | None = None,
) -> PagedKV:
    """The page table of keys ``0 .. kv_lens[b] - 1`` of each request ``b``, from either request table.

    Page ``j`` of request ``b`` is ``req_to_page[req_pool_indices[b], j]`` (a block table), else
    ``req_to_token[req_pool_indices[b], j * page_size] // page_size``
    (:func:`hal.kernels.reference.kv_csr`, ``per_page=True``). Positions come from the host lens; the row lookup
    and the gather run on the table's device, so ``req_pool_indices`` is never read back to the host.
    """
    indptr, indices, last = kv_csr(
        list(kv_lens),
        req_pool_indices,
        req_to_token=req_to_token,
        req_to_page=req_to_page,
        page_size=page_size,
        per_page=True,
    )
    return PagedKV(indptr, indices, last)


# ----------------------------------------------------------------------------- merge (documentation + fallback)


def merge_states_base2(
    v_a: torch.Tensor, lse_a: torch.Tensor, v_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over KV ``A ∪ B`` from the attention over each part: FlashInfer's ``merge_state``.

    ``v_*``: ``[T, H, D]`` outputs, each normalised over its own keys; ``lse_*``: float
    ``[T, H]`` log-sum-exp of the (scaled, soft-capped) scores in **base 2**, i.e.
    ``log2(sum_j exp(s_j))``, as FlashInfer's kernels return it. With ``m = max(lse_a, lse_b)``,
    ``w_x = 2 ** (lse_x - m)``: ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``,
    ``lse = m + log2(w_a + w_b)``. An empty part has ``lse = -inf`` and weighs nothing;
    two empty parts give ``v = 0`` and ``lse = -inf`` (FlashInfer guards that case too).
    Returns ``(v, lse)`` with ``v`` in ``v_a``'s dtype and ``lse`` float32.
    """
    a, b = lse_a.float(), lse_b.float()
    m = torch.maximum(a, b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp2(a - m), torch.exp2(b - m)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    s_a = torch.where(total > 0, w_a / denom, torch.zeros_like(total))
    s_b = torch.where(total > 0, w_b / denom, torch.zeros_like(total))
    v = s_a[..., None] * v_a.float() + s_b[..., None] * v_b.float()
    return v.to(v_a.dtype), torch.log2(total) + m
