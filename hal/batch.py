"""``ForwardMode`` and ``ForwardBatch``: one scheduler step, with SGLang's field names.

Token layout, shared by every backend (SGLang's conventions):

* DECODE: one query token per request; ``seq_lens`` counts it (its KV slot is
  ``out_cache_loc[r]``, already in ``req_to_token[req, seq_lens[r] - 1]``).
* EXTEND / MIXED / DRAFT_EXTEND: request ``r`` brings ``extend_seq_lens[r]`` new tokens
  after ``extend_prefix_lens[r]`` cached ones; ``seq_lens = prefix + extend``. A MIXED
  batch is an extend batch whose decode requests have one new token.
* TARGET_VERIFY: ``seq_lens`` counts the committed tokens only; every request brings
  ``spec_info.draft_token_num`` draft tokens, which see the prefix and each other through
  ``spec_info.custom_mask`` (per request row-major ``[draft, seq_len + draft]``, True =
  visible, concatenated).

``out_cache_loc`` holds the KV slot of every query token, in order, and must match what
``req_to_token`` says for those positions. Validation runs on construction and reads the
host mirrors (``*_cpu``), computing them once when they are not given.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from hal.errors import InvalidBatchError, expect
from hal.kv_cache import INDEX_DTYPES, PagedKVPool, ReqToTokenPool

__all__ = ["ForwardMode", "ForwardBatch", "SpecInfo", "static_decode_batch"]


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend(self) -> bool:
        """Every mode that runs more than one token per request through ``forward_extend``."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.DRAFT_EXTEND,
            ForwardMode.TARGET_VERIFY,
        )

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_cuda_graph(self) -> bool:
        """Modes a graph runner captures."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


@dataclass
class SpecInfo:
    """Speculative-decoding input of a TARGET_VERIFY batch.

    ``custom_mask``: flat bool, for each request ``[draft_token_num, seq_len + draft_token_num]``
    row-major (``seq_len`` = committed tokens), concatenated over requests.
    """

    draft_token_num: int
    custom_mask: torch.Tensor


@dataclass
class ForwardBatch:
    """One forward step of a batch of requests. Shapes: ``B = batch_size``, ``T`` = query tokens.

    Required: ``forward_mode``, ``batch_size``, ``req_pool_indices`` (int ``[B]``),
    ``seq_lens`` (int ``[B]``), ``out_cache_loc`` (int ``[T]``), the two pools; the
    ``extend_*`` tensors for extend modes, ``spec_info`` for TARGET_VERIFY. Missing host
    mirrors and ``extend_start_loc`` are derived; given ones are checked.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: PagedKVPool
    seq_lens_cpu: torch.Tensor | None = None
    seq_lens_sum: int | None = None
    positions: torch.Tensor | None = None
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    spec_info: SpecInfo | None = None
    # Derived on validation: per request, cached tokens before the query tokens and query tokens.
    prefix_lens_cpu: list[int] = field(default_factory=list, init=False)
    query_lens_cpu: list[int] = field(default_factory=list, init=False)
    # True for a graph runner's static batch: backends then use their fixed-shape graph buffers.
    graph_static: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_tokens(self) -> int:
        """Query tokens in this step (``T``)."""
        return sum(self.query_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.token_to_kv_pool.device

    @property
    def kv_lens_cpu(self) -> list[int]:
        """Keys each request attends over, the query tokens included."""
        return [p + q for p, q in zip(self.prefix_lens_cpu, self.query_lens_cpu)]

    def device_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query_lens, kv_lens)``, int64 ``[B]`` on the device, from the device tensors only (graph-recordable).

        ``kv_lens`` counts every key a request attends over, its query tokens included;
        the cached prefix is ``kv_lens - query_lens``.
        """
        mode, seq_lens = self.forward_mode, self.seq_lens.long()
        if mode.is_decode() or mode.is_idle():
            return torch.ones_like(seq_lens) if mode.is_decode() else torch.zeros_like(seq_lens), seq_lens
        if mode.is_target_verify():
            draft = self.spec_info.draft_token_num
            return torch.full_like(seq_lens, draft), seq_lens + draft
        return self.extend_seq_lens.long(), seq_lens

    def set_decode_host_lens(self, seq_lens: list[int]) -> None:
        """Refresh the host mirrors of a DECODE batch whose ``seq_lens`` tensor was refilled in place."""
        self.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        self.seq_lens_sum = sum(seq_lens)
        self.prefix_lens_cpu, self.query_lens_cpu = [n - 1 for n in seq_lens], [1] * len(seq_lens)

    # -- validation --------------------------------------------------------------------
    def _index_tensor(self, name: str, length: int | None) -> torch.Tensor:
        tensor = getattr(self, name)
        expect(isinstance(tensor, torch.Tensor), InvalidBatchError, name, type(tensor).__name__, "a tensor")
        expect(
            tensor.dim() == 1 and tensor.dtype in INDEX_DTYPES,
            InvalidBatchError,
            name,
            f"{tensor.dtype}{list(tensor.shape)}",
            "a 1-D int32/int64 tensor",
        )
        expect(tensor.device == self.device, InvalidBatchError, f"{name}.device", tensor.device, str(self.device))
        if length is not None:
            expect(tensor.numel() == length, InvalidBatchError, f"len({name})", tensor.numel(), str(length))
        return tensor

    def _host_list(self, name: str, tensor: torch.Tensor, given) -> list[int]:
        values = tensor.tolist()
        if given is not None:
            given_list = given.tolist() if isinstance(given, torch.Tensor) else list(given)
            expect(given_list == values, InvalidBatchError, name, given_list, f"{values} (the device tensor)")
        return values

    def _validate(self) -> None:
        mode = self.forward_mode
        expect(isinstance(mode, ForwardMode), InvalidBatchError, "forward_mode", mode, "a ForwardMode")
        expect(
            isinstance(self.req_to_token_pool, ReqToTokenPool),
            InvalidBatchError,
            "req_to_token_pool",
            type(self.req_to_token_pool).__name__,
            "a ReqToTokenPool",
        )
        expect(
            isinstance(self.token_to_kv_pool, PagedKVPool),
            InvalidBatchError,
            "token_to_kv_pool",
            type(self.token_to_kv_pool).__name__,
            "a PagedKVPool",
        )
        bs = self.batch_size
        expect(isinstance(bs, int) and bs >= 0, InvalidBatchError, "batch_size", bs, "an int >= 0")
        expect(bs > 0 or mode.is_idle(), InvalidBatchError, "batch_size", bs, f"> 0 in {mode.name} mode")
        req_idx = self._index_tensor("req_pool_indices", bs).tolist()
        seq_lens = self._host_list("seq_lens_cpu", self._index_tensor("seq_lens", bs), self.seq_lens_cpu)
        self.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        if self.seq_lens_sum is not None:
            expect(
                self.seq_lens_sum == sum(seq_lens),
                InvalidBatchError,
                "seq_lens_sum",
                self.seq_lens_sum,
                f"sum(seq_lens) = {sum(seq_lens)}",
            )
        self.seq_lens_sum = sum(seq_lens)
        pool = self.req_to_token_pool
        bad = [i for i in req_idx if not 0 <= i < pool.size]
        expect(not bad, InvalidBatchError, "req_pool_indices", bad, f"rows in [0, {pool.size})")
        min_len = 0 if mode.is_target_verify() else 1
        bad = [n for n in seq_lens if n < min_len]
        expect(not bad, InvalidBatchError, "seq_lens", bad, f"every length >= {min_len} in {mode.name} mode")

        if mode.is_idle():
            self.prefix_lens_cpu, self.query_lens_cpu = [0] * bs, [0] * bs
        elif mode.is_decode():
            self.prefix_lens_cpu, self.query_lens_cpu = [n - 1 for n in seq_lens], [1] * bs
        elif mode.is_target_verify():
            spec = self.spec_info
            expect(
                isinstance(spec, SpecInfo),
                InvalidBatchError,
                "spec_info",
                spec,
                "a SpecInfo in TARGET_VERIFY",
            )
            draft = spec.draft_token_num
            expect(
                isinstance(draft, int) and draft >= 1,
                InvalidBatchError,
                "spec_info.draft_token_num",
                draft,
                "an int >= 1",
            )
            self.prefix_lens_cpu, self.query_lens_cpu = list(seq_lens), [draft] * bs
            mask = spec.custom_mask
            mask_numel = sum(draft * (n + draft) for n in seq_lens)
            expect(
                isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.numel() == mask_numel,
                InvalidBatchError,
                "spec_info.custom_mask",
                f"{getattr(mask, 'dtype', type(mask).__name__)}[{getattr(mask, 'numel', lambda: '?')()}]",
                f"a bool tensor of sum(draft * (seq_len + draft)) = {mask_numel} elements",
            )
            expect(
                mask.device == self.device,
                InvalidBatchError,
                "spec_info.custom_mask.device",
                mask.device,
                str(self.device),
            )
        else:  # EXTEND, MIXED, DRAFT_EXTEND
            extend = self._host_list(
                "extend_seq_lens_cpu", self._index_tensor("extend_seq_lens", bs), self.extend_seq_lens_cpu
            )
            prefix = self._host_list(
                "extend_prefix_lens_cpu",
                self._index_tensor("extend_prefix_lens", bs),
                self.extend_prefix_lens_cpu,
            )
            bad = [i for i, (p, e, n) in enumerate(zip(prefix, extend, seq_lens)) if p < 0 or e < 1 or p + e != n]
            expect(
                not bad,
                InvalidBatchError,
                "extend_prefix_lens + extend_seq_lens",
                [(prefix[i], extend[i]) for i in bad],
                f"prefix >= 0, extend >= 1, prefix + extend == seq_lens {[seq_lens[i] for i in bad]}",
            )
            self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu = extend, prefix
            self.prefix_lens_cpu, self.query_lens_cpu = prefix, extend
            starts = [sum(extend[:i]) for i in range(bs)]
            if self.extend_start_loc is not None:
                self._host_list("extend_start_loc", self._index_tensor("extend_start_loc", bs), starts)
            else:
                self.extend_start_loc = torch.tensor(starts, dtype=torch.int32, device=self.device)
            if self.extend_num_tokens is not None:
                expect(
                    self.extend_num_tokens == sum(extend),
                    InvalidBatchError,
                    "extend_num_tokens",
                    self.extend_num_tokens,
                    f"sum(extend_seq_lens) = {sum(extend)}",
                )
            self.extend_num_tokens = sum(extend)

        kv_lens = self.kv_lens_cpu
        too_long = [n for n in kv_lens if n > pool.max_context_len]
        expect(
            not too_long,
            InvalidBatchError,
            "sequence length",
            too_long,
            f"<= max_context_len ({pool.max_context_len})",
        )
        num_tokens = self.num_tokens
        loc = self._index_tensor("out_cache_loc", num_tokens)
        if self.positions is not None:
            self._index_tensor("positions", num_tokens)
        self._check_slots(req_idx, kv_lens, loc)

    def _check_slots(self, req_idx: list[int], kv_lens: list[int], loc: torch.Tensor) -> None:
        """Every slot a request reads is in the pool past the padding page, pages are whole (token ``i``
        at offset ``i % page_size`` of its page, as paged kernels read them), and the query tokens'
        slots are ``out_cache_loc``."""
        if not req_idx:
            return
        num_slots, page_size = self.token_to_kv_pool.num_slots, self.token_to_kv_pool.page_size
        width = max(kv_lens)
        rows = self.req_to_token_pool.req_to_token[torch.tensor(req_idx, device=self.device), :width].long()
        pos = torch.arange(width, device=self.device)
        kv_lens_t = torch.tensor(kv_lens, device=self.device)
        used = pos[None, :] < kv_lens_t[:, None]
        slots = rows[used]
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            expect(
                lo >= page_size and hi < num_slots,
                InvalidBatchError,
                "req_to_token slots of the batch",
                (lo, hi),
                f"in [{page_size}, {num_slots}): page 0 takes graph padding writes and holds no request's tokens",
            )
        if page_size > 1:
            page_start = rows[:, (pos - pos % page_size)]  # the slot of each token's page-mate at offset 0
            misplaced = used & (rows != page_start + pos % page_size)
            if bool(misplaced.any()):
                r, i = (int(x) for x in misplaced.nonzero()[0])
                expect(
                    False,
                    InvalidBatchError,
                    f"req_to_token[{req_idx[r]}, {i}]",
                    int(rows[r, i]),
                    f"slot {int(page_start[r, i]) + i % page_size}: token i of a request sits at offset "
                    f"i % page_size ({page_size}) of its page",
                )
        is_query = used & (pos[None, :] >= torch.tensor(self.prefix_lens_cpu, device=self.device)[:, None])
        expected = rows[is_query]
        expect(
            torch.equal(expected, loc.long()),
            InvalidBatchError,
            "out_cache_loc",
            loc.tolist(),
            f"the slots req_to_token holds for the query tokens: {expected.tolist()}",
        )


def static_decode_batch(
    batch_size: int,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: PagedKVPool,
    seq_len_fill_value: int,
) -> ForwardBatch:
    """A DECODE batch of padding requests whose tensors a graph runner captures and refills.

    It is built without validation: its padding requests (row 0, ``seq_len_fill_value``
    tokens, writes to the padding slot) break the ``out_cache_loc`` invariant on purpose.
    """
    device = token_to_kv_pool.device
    fb = object.__new__(ForwardBatch)
    for f in dataclasses.fields(ForwardBatch):
        if f.default is not dataclasses.MISSING:
            setattr(fb, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(fb, f.name, f.default_factory())
    fb.forward_mode = ForwardMode.DECODE
    fb.batch_size = batch_size
    fb.req_pool_indices = torch.zeros(batch_size, dtype=torch.int64, device=device)
    fb.seq_lens = torch.full((batch_size,), seq_len_fill_value, dtype=torch.int32, device=device)
    fb.out_cache_loc = torch.full((batch_size,), token_to_kv_pool.padding_slot, dtype=torch.int64, device=device)
    fb.positions = torch.zeros(batch_size, dtype=torch.int64, device=device)
    fb.req_to_token_pool, fb.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
    fb.graph_static = True
    fb.set_decode_host_lens([seq_len_fill_value] * batch_size)
    return fb
