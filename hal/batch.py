"""``ForwardMode`` and the forward batch: one scheduler step, with SGLang's field names.

Backends read a batch by SGLang's ``ForwardBatch`` field names, so any object that has
them (SGLang's own batch included) serves; :class:`ForwardBatch` is hal's convenient,
validated implementation. Token layout, shared by every backend (SGLang's conventions):

* DECODE: one query token per request; ``seq_lens`` counts it (its KV slot is
  ``out_cache_loc[r]``, already in ``req_to_token[req, seq_lens[r] - 1]``).
* EXTEND / MIXED / DRAFT_EXTEND: request ``r`` brings ``extend_seq_lens[r]`` new tokens
  after ``extend_prefix_lens[r]`` cached ones; ``seq_lens = prefix + extend``. A MIXED
  batch is an extend batch whose decode requests have one new token.
* TARGET_VERIFY: ``seq_lens`` counts the committed tokens only; every request brings
  ``spec_info.draft_token_num`` draft tokens, which see the prefix and each other through
  ``spec_info.custom_mask`` (per request row-major ``[draft, seq_len + draft]``, True =
  visible, concatenated; a longer, padded mask is accepted and its tail ignored).
* IDLE: no tokens.

``out_cache_loc`` holds the KV slot of every query token, in order, and matches what
``req_to_token`` holds for those positions. Graph-padding requests (SGLang pads a
replayed batch with ``req_pool_indices = 0``, ``out_cache_loc = 0``, ``seq_lens`` = the
backend's fill value) write the padding slot 0 and are exempt from that rule.

Padding tokens: ``out_cache_loc[t] = -1`` (vLLM's ``PAD_SLOT_ID``) writes no KV
anywhere (every slot of the pool, page 0 included, keeps its bytes); the token's output row
is unspecified and the caller ignores it. Every query token of such a padding request is -1
(a request that also writes real slots may not hold one: its later tokens would read KV never
written), and the slots it reads are in the pool (row 0, the padding row, reads the padding
slot). Only backends that declare ``supports_padding_slots`` take -1; ``full`` validation
refuses it for the others.

Request tables: the slots a request reads come from ``req_to_token_pool.req_to_token`` (SGLang's per-token table,
int32 ``[rows, max_context]``) or ``req_to_page_pool.req_to_page`` (a block table, vLLM's form: int32
``[rows, max_pages]`` with ``req_to_page_pool.page_size``, token ``i`` at slot ``page * page_size + i % page_size``),
both indexed by ``req_pool_indices``; a batch carries either or both (``req_to_token_pool`` None beside a block
table). A backend declares the forms it reads (``reads_tables``); where the batch lacks them,
:func:`tables_for` derives them once per step, sized to the step.

Validation lives in :mod:`hal.validation`; the modes and per-request lengths in :mod:`hal.modes`
(both re-exported here, so that ``from hal.batch import ...`` reaches them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from hal.kernels.reference import step_page_table, step_token_table
from hal.kv_cache import KVPool, ReqToPageTable, ReqToTokenTable
from hal.modes import REFUSED_MODES, BatchLens, ForwardMode, SharedReadEnds, device_lens, host_lens
from hal.plugin_compat import Api1BatchNames
from hal.validation import VALIDATION_LEVELS, check_request_tables, validate_batch, validation_level

if TYPE_CHECKING:
    from hal.declaration import BackendDeclaration

__all__ = [
    "ForwardMode",
    "ForwardBatch",
    "SpecInfo",
    "BatchLens",
    "host_lens",
    "device_lens",
    "validate_batch",
    "validation_level",
    "static_decode_batch",
    "tables_for",
    "StepTable",
    "RequestTables",
    "VALIDATION_LEVELS",
    "SharedReadEnds",
    "REFUSED_MODES",
]


@dataclass
class SpecInfo:
    """Speculative-decoding input of a TARGET_VERIFY batch.

    ``custom_mask``: flat bool, for each request ``[draft_token_num, seq_len + draft_token_num]``
    row-major (``seq_len`` = committed tokens), concatenated over requests.
    """

    draft_token_num: int
    custom_mask: torch.Tensor


@dataclass
class ForwardBatch(Api1BatchNames):
    """One forward step of a batch of requests, validated on construction. ``B = batch_size``, ``T`` = query tokens.

    Required: ``forward_mode``, ``batch_size``, ``req_pool_indices`` (int ``[B]``),
    ``seq_lens`` (int ``[B]``), ``out_cache_loc`` (int ``[T]``), the pools (any
    objects with the pool protocols of :mod:`hal.kv_cache`): ``token_to_kv_pool`` and a request
    table, ``req_to_token_pool`` and/or ``req_to_page_pool`` (a block table); the ``extend_*`` tensors for
    extend modes, ``spec_info`` for TARGET_VERIFY. Give the host mirrors (``seq_lens_cpu``,
    ``extend_*_cpu``) when you have them: ``cheap`` validation then checks them for free
    and backends never read the device tensors back; missing ones are read once, when a
    backend needs them. ``validate``: ``off`` / ``cheap`` / ``full`` (default
    ``HAL_VALIDATE``, else ``cheap``).
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenTable | None = None
    token_to_kv_pool: KVPool = None
    seq_lens_cpu: torch.Tensor | list[int] | None = None
    seq_lens_sum: int | None = None
    positions: torch.Tensor | None = None
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    spec_info: SpecInfo | None = None
    req_to_page_pool: ReqToPageTable | None = None
    validate: str | None = field(default=None, repr=False)
    # True for a graph runner's static batch: backends then use their fixed-shape graph buffers.
    graph_static: bool = field(default=False, init=False)
    _lens: BatchLens | None = field(default=None, init=False, repr=False)
    keeps_host_lens: ClassVar[bool] = True  # host_lens() caches its answer in _lens

    def __post_init__(self) -> None:
        self.validate = validation_level(self.validate)
        self._lens = validate_batch(self, self.validate)
        if self.forward_mode.is_extend() and not self.forward_mode.is_target_verify():
            if self.extend_start_loc is None and isinstance(self.extend_seq_lens, torch.Tensor):
                self.extend_start_loc = torch.cumsum(self.extend_seq_lens, 0) - self.extend_seq_lens
        if self._lens is not None and self.seq_lens_sum is None:
            lens = self._lens
            self.seq_lens_sum = sum(lens.prefix) if self.forward_mode.is_target_verify() else sum(lens.kv)

    @property
    def num_tokens(self) -> int:
        """Query tokens in this step (``T``)."""
        return self.out_cache_loc.shape[0]

    @property
    def device(self) -> torch.device:
        """The request tables' device (where every batch tensor lives)."""
        if self.req_to_token_pool is None:
            return self.req_to_page_pool.req_to_page.device
        return self.req_to_token_pool.req_to_token.device

    @property
    def lens(self) -> BatchLens:
        """Host lengths (:func:`host_lens`), computed once."""
        return host_lens(self)

    def set_decode_host_lens(self, seq_lens: list[int]) -> None:
        """Refresh the host mirrors of a DECODE (or TARGET_VERIFY) batch whose ``seq_lens`` were refilled in place."""
        self.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        self.seq_lens_sum = sum(seq_lens)
        if self.forward_mode.is_target_verify():
            self._lens = BatchLens(list(seq_lens), [self.spec_info.draft_token_num] * len(seq_lens))
        else:
            self._lens = BatchLens([n - 1 for n in seq_lens], [1] * len(seq_lens))


def static_decode_batch(
    batch_size: int,
    req_to_token_pool: ReqToTokenTable,
    token_to_kv_pool: KVPool,
    seq_len_fill_value: int,
    draft_token_num: int | None = None,
    padding_slot: int | None = None,
) -> ForwardBatch:
    """A DECODE (or, with ``draft_token_num``, TARGET_VERIFY) batch of padding requests whose tensors a
    graph runner captures and refills.

    Its padding requests are SGLang's: row 0, ``seq_len_fill_value`` tokens, writes to the
    padding slot 0; with ``padding_slot=-1`` (a backend that ``supports_padding_slots``) they
    write nothing, as vLLM pads ``slot_mapping``. A verify batch's ``spec_info.custom_mask`` is a fixed buffer of
    ``batch_size * draft_token_num * max_context_len`` entries (the most any batch of this size
    needs): a replay copies the step's flat mask into its start, the backends read the first
    ``sum(draft * (seq_len + draft))``.
    """
    device = req_to_token_pool.req_to_token.device
    verify = draft_token_num is not None
    tokens = batch_size * (draft_token_num if verify else 1)
    spec_info = None
    if verify:
        width = req_to_token_pool.req_to_token.shape[1]
        mask = torch.ones(tokens * width, dtype=torch.bool, device=device)
        spec_info = SpecInfo(draft_token_num=draft_token_num, custom_mask=mask)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE,
        batch_size=batch_size,
        req_pool_indices=torch.zeros(batch_size, dtype=torch.int64, device=device),
        seq_lens=torch.full((batch_size,), seq_len_fill_value, dtype=torch.int32, device=device),
        out_cache_loc=torch.full(
            (tokens,),
            getattr(token_to_kv_pool, "padding_slot", 0) if padding_slot is None else padding_slot,
            dtype=torch.int64,
            device=device,
        ),
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        positions=torch.zeros(tokens, dtype=torch.int64, device=device),
        spec_info=spec_info,
        validate="off",
    )
    fb.graph_static = True
    fb.set_decode_host_lens([seq_len_fill_value] * batch_size)
    return fb


@dataclass
class StepTable:
    """A request table hal derived (:func:`tables_for`, :class:`RequestTables`): ``req_to_token`` (int32
    ``[rows, tokens]``) or ``req_to_page`` (int32 ``[rows, pages]``) with ``page_size``, so it serves either protocol.
    ``graph``: a captured graph's table (a persistent buffer refilled in place each step, indexed by the batch's own
    ``req_pool_indices``); else one step's rows in batch order."""

    req_to_token: torch.Tensor | None = None
    req_to_page: torch.Tensor | None = None
    page_size: int = 1
    graph: bool = False


class RequestTables:
    """The request tables one backend reads (``reads``: its declaration's ``reads_tables``), given to every step it
    plans: :meth:`hal.backend.AttentionBackend.init_forward_metadata_out_graph`, the edge every entry path goes
    through (eager, hal's and the engines' graph runners), calls :meth:`prepare` before the backend's own plan.

    An eager step gets :func:`tables_for` (tables sized to the step, the batch rebased on it). A captured graph's
    step gets the missing form in a persistent buffer, one per form and given table shape, made the first time
    (its capture) and refilled in place, outside the graph, before each replay: the graph reads it at the captured
    address. It covers every row of the given table (the batch's ``req_pool_indices`` index it, as they index the
    given one), so its cost is the given table's size (``[rows, max_context]`` tokens for a block table of
    ``rows`` requests, what a token-reading backend's graph buffers hold anyway).
    """

    def __init__(self, reads: frozenset[str]):
        self.reads = reads
        self._graph: dict[tuple, StepTable] = {}  # (form, rows, width) -> its persistent table

    def withdraw(self, forward_batch) -> None:
        """Take back from ``forward_batch`` a form :meth:`prepare` derived for a captured graph at an earlier step (a
        static batch keeps it, but its buffer holds that step's rows until :meth:`prepare` refills it), so that the
        step is checked on the tables its engine gave."""
        for name in ("req_to_token_pool", "req_to_page_pool"):
            table = getattr(forward_batch, name, None)
            if isinstance(table, StepTable) and table.graph:
                setattr(forward_batch, name, None)

    def prepare(self, forward_batch, graph: bool) -> None:
        """Give ``forward_batch`` the form this backend reads where it carries only the other (``graph``: the batch
        is a captured graph's static one). Nothing happens where the batch has a form the backend reads."""
        if not graph:
            tables_for(self.reads, forward_batch)
            return
        tokens, pages = _given(forward_batch, "req_to_token_pool"), _given(forward_batch, "req_to_page_pool")
        if (tokens is not None and "token" in self.reads) or (pages is not None and "page" in self.reads):
            return
        if tokens is None and pages is None:
            return
        check_request_tables(forward_batch)
        page_size = forward_batch.token_to_kv_pool.page_size
        if pages is not None:  # tokens from a block table
            given, form = pages.req_to_page, "req_to_token"
            width = given.shape[1] * page_size
        else:
            given, form = tokens.req_to_token, "req_to_page"
            width = -(-given.shape[1] // page_size)
        key = (form, given.shape[0], width)
        table = self._graph.get(key)
        if table is None:
            buffer = torch.zeros(given.shape[0], width, dtype=torch.int32, device=given.device)
            table = StepTable(**{form: buffer}, page_size=page_size, graph=True)
            self._graph[key] = table
        rows = torch.arange(given.shape[0], device=given.device)
        source = {"req_to_page": given} if pages is not None else {"req_to_token": given}
        if form == "req_to_token":
            getattr(table, form).copy_(step_token_table(rows, width, page_size=page_size, **source))
            forward_batch.req_to_token_pool = table
        else:
            getattr(table, form).copy_(step_page_table(rows, width, page_size, **source))
            forward_batch.req_to_page_pool = table


def _given(forward_batch, field: str):
    """The batch's ``field`` table unless hal derived it for a graph (then it is refilled from the other form)."""
    table = getattr(forward_batch, field, None)
    return None if isinstance(table, StepTable) and table.graph else table


def tables_for(reads: BackendDeclaration | frozenset[str], forward_batch) -> None:
    """Give ``forward_batch`` the request table form ``reads`` (a declaration's ``reads_tables``, or the
    declaration) names where it carries only the other: an eager step's part of :meth:`RequestTables.prepare`, which
    every backend's plan step runs.

    Nothing happens where the batch has a form the backend reads (an SGLang batch for a backend reading tokens, a
    vLLM block table for one reading pages). Otherwise the missing form is derived on the batch's device for the
    step's requests only (:func:`hal.kernels.reference.step_token_table` / ``step_page_table``): ``B`` rows, as
    many columns as the step's longest context needs (whole pages; a captured graph's static batch: the given
    table's width), never the table's rows or its full width. The batch is then rebased on its step: both tables
    become :class:`StepTable` views of the step's rows (the engine's own tensors are not written) and
    ``req_pool_indices`` becomes ``0 .. B - 1``. A malformed table is an ``InvalidBatchError``
    (:func:`hal.validation.check_request_tables`) before anything is derived.
    """
    reads = getattr(reads, "reads_tables", reads)
    tokens = getattr(forward_batch, "req_to_token_pool", None)
    pages = getattr(forward_batch, "req_to_page_pool", None)
    if (tokens is not None and "token" in reads) or (pages is not None and "page" in reads) or tokens is pages:
        return
    check_request_tables(forward_batch)
    page_size = forward_batch.token_to_kv_pool.page_size
    given = tokens.req_to_token if pages is None else pages.req_to_page
    rows = forward_batch.req_pool_indices
    if getattr(forward_batch, "graph_static", False):
        num_pages = -(-given.shape[1] // page_size) if pages is None else given.shape[1]
    else:
        num_pages = -(-max(host_lens(forward_batch).kv, default=0) // page_size)
    tables = {"req_to_page": given} if pages is not None else {"req_to_token": given}
    step_tokens = step_token_table(rows, num_pages * page_size, page_size=page_size, **tables)
    step_pages = step_page_table(rows, num_pages, page_size, **tables)
    forward_batch.req_to_token_pool = StepTable(req_to_token=step_tokens)
    forward_batch.req_to_page_pool = StepTable(req_to_page=step_pages, page_size=page_size)
    forward_batch.req_pool_indices = torch.arange(rows.shape[0], dtype=rows.dtype, device=rows.device)
