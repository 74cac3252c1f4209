"""``PageAllocator``: the pages of a paged KV pool, handed out to requests and taken back.

An engine owns the scheduling; hal offers the bookkeeping every engine repeats around
a paged pool. Pages are numbered ``1 .. num_pages`` (page 0 is the pool's padding page:
graph-replayed padding tokens write there, so it is never handed out). A request holds
a list of pages; its token ``i`` lives in slot ``pages[i // page_size] * page_size +
i % page_size``, the layout paged kernels (and ``ForwardBatch`` validation) expect.
"""

from __future__ import annotations

import heapq

import torch

from hal.errors import KVCacheError, expect

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free-list of the pages ``1 .. num_pages`` of a pool of ``page_size``-token pages.

    ``alloc(n)`` hands out the ``n`` lowest free pages or raises ``KVCacheError`` (and
    hands out nothing); ``free(pages)`` takes pages back and refuses pages that are not
    in use. ``reserve`` / ``unreserve`` let a scheduler promise pages to an admitted
    request without taking them yet (``can_alloc`` counts the promises).
    """

    def __init__(self, num_pages: int, page_size: int):
        expect(isinstance(num_pages, int) and num_pages > 0, KVCacheError, "num_pages", num_pages, "a positive int")
        expect(
            isinstance(page_size, int) and page_size > 0,
            KVCacheError,
            "page_size",
            page_size,
            "a positive int",
        )
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(1, num_pages + 1))  # a heap: the lowest page first
        self._used: set[int] = set()
        self.reserved = 0

    @classmethod
    def for_pool(cls, pool) -> PageAllocator:
        """An allocator over every page of ``pool`` (a ``hal.PagedKVPool`` or anything with
        ``num_slots`` and ``page_size``) but its padding page."""
        return cls(pool.num_slots // pool.page_size - 1, pool.page_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        expect(isinstance(tokens, int) and tokens >= 0, KVCacheError, "tokens", tokens, "an int >= 0")
        return -(-tokens // self.page_size)

    def can_alloc(self, pages: int) -> bool:
        """Whether ``pages`` more pages can be promised on top of the reserved ones."""
        return pages <= self.num_free - self.reserved

    def reserve(self, pages: int) -> None:
        """Promise ``pages`` pages (``alloc(..., reserved=True)`` draws on the promise)."""
        expect(
            isinstance(pages, int) and 0 <= pages and self.can_alloc(pages),
            KVCacheError,
            "reserve",
            pages,
            f"at most the {self.num_free - self.reserved} free pages not already reserved",
        )
        self.reserved += pages

    def unreserve(self, pages: int) -> None:
        expect(0 <= pages <= self.reserved, KVCacheError, "unreserve", pages, f"in [0, {self.reserved}]")
        self.reserved -= pages

    def alloc(self, pages: int, reserved: bool = False) -> list[int]:
        """Hand out ``pages`` pages (lowest first); ``reserved``: they were promised by ``reserve``."""
        expect(isinstance(pages, int) and pages >= 0, KVCacheError, "pages", pages, "an int >= 0")
        if reserved:
            expect(pages <= self.reserved, KVCacheError, "pages", pages, f"<= the {self.reserved} reserved")
        else:
            expect(
                self.can_alloc(pages),
                KVCacheError,
                "pages",
                pages,
                f"<= {self.num_free - self.reserved} (free pages not reserved; the pool has {self.num_pages})",
            )
        out = [heapq.heappop(self._free) for _ in range(pages)]
        self._used.update(out)
        if reserved:
            self.reserved -= pages
        return out

    def free(self, pages) -> None:
        """Take ``pages`` back. Nothing is freed unless every page is one in use."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        expect(not bad, KVCacheError, "free", bad, "pages this allocator handed out and that are not freed yet")
        expect(len(set(pages)) == len(pages), KVCacheError, "free", pages, "each page once")
        for page in pages:
            self._used.remove(page)
            heapq.heappush(self._free, page)

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """int64 slots of tokens ``start .. end - 1`` of a request holding ``pages``."""
        size = self.page_size
        expect(
            0 <= start <= end <= len(pages) * size,
            KVCacheError,
            "token range",
            (start, end),
            f"within the {len(pages)} pages held ({len(pages) * size} tokens)",
        )
        pos = torch.arange(start, end)
        return torch.tensor(pages, dtype=torch.int64)[pos // size] * size + pos % size if end > start else pos
