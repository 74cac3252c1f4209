"""Validation of a forward batch (any object with SGLang's field names) at a level.

Validation is a level (:func:`validation_level`): ``off`` trusts the caller; ``cheap``
(the default) checks what shapes, dtypes, devices and the host mirrors (``*_cpu``) tell,
with no device-to-host read and nothing proportional to context length; ``full`` also
reads the device tensors and checks every slot (conformance, ``hal check``, ``--check``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from hal.errors import ConfigError, InvalidBatchError, UnsupportedError, describe, expect, refuse
from hal.kernels.reference import step_page_table, step_token_table
from hal.kv_cache import INDEX_DTYPES, PADDING_TOKEN_SLOT, KVPool, ReqToTokenTable, conforms, pool_geometry
from hal.kv_dtypes import COMPUTE_DTYPE_NAMES, COMPUTE_DTYPES, find_kv_dtype
from hal.modes import REFUSED_MODES, BatchLens, ForwardMode, _host

__all__ = [
    "refuse_mixed_dtypes",
    "VALIDATION_LEVELS",
    "validation_level",
    "validate_batch",
    "BatchField",
    "BATCH_FIELDS",
    "check_batch_fields",
    "check_forward_fields",
    "check_request_tables",
    "check_input_dtypes",
]

if TYPE_CHECKING:
    from hal.config import AttentionConfig
    from hal.declaration import BackendDeclaration
    from hal.layer import AttentionLayer

VALIDATION_LEVELS = ("off", "cheap", "full")
_MISSING = object()


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _is_lengths(value) -> bool:
    """A host mirror: a tensor or any iterable of ints (list, tuple, numpy array), not a str."""
    return isinstance(value, torch.Tensor) or hasattr(value, "__iter__") and not isinstance(value, (str, bytes))


@dataclass(frozen=True)
class BatchField:
    """A batch field a backend reads: hal's name (read as ``getattr(fb, name)``), the SGLang field it corresponds
    to, what it must be, the test of its type (presence and type only: no device read), and when it is read:
    ``always``, ``extend`` (EXTEND / MIXED / DRAFT_EXTEND), ``verify`` (TARGET_VERIFY) or ``optional`` (None or
    absent means not given). ``req_to_token_pool`` is read always, unless the batch carries a block table
    (``req_to_page_pool``) instead."""

    name: str
    sglang: str
    expected: str
    accepts: Callable[[object], bool]
    when: str = "always"


# Every field the forward prologue and init_forward_metadata read, in the order they are checked.
BATCH_FIELDS = (
    BatchField(
        "forward_mode",
        "ForwardBatch.forward_mode",
        "a ForwardMode (hal's or SGLang's)",
        lambda m: getattr(m, "name", None) in ForwardMode.__members__ and hasattr(m, "is_decode"),
    ),
    BatchField("batch_size", "ForwardBatch.batch_size", "an int", lambda n: isinstance(n, int)),
    BatchField("req_pool_indices", "ForwardBatch.req_pool_indices", "an int tensor [batch_size]", _is_tensor),
    BatchField("seq_lens", "ForwardBatch.seq_lens", "an int tensor [batch_size]", _is_tensor),
    BatchField("out_cache_loc", "ForwardBatch.out_cache_loc", "an int tensor [tokens]", _is_tensor),
    BatchField(
        "req_to_token_pool",
        "ForwardBatch.req_to_token_pool (SGLang's ReqToTokenPool)",
        "a request table with a req_to_token tensor (hal.ReqToTokenPool, SGLang's ReqToTokenPool), or None "
        "beside a req_to_page_pool",
        lambda pool: isinstance(getattr(pool, "req_to_token", None), torch.Tensor),
    ),
    BatchField(
        "req_to_page_pool",
        "vLLM's CommonAttentionMetadata.block_table_tensor (SGLang has none)",
        "a block table with a req_to_page tensor and a page_size (hal.ReqToPagePool)",
        lambda pool: isinstance(getattr(pool, "req_to_page", None), torch.Tensor) and hasattr(pool, "page_size"),
        "optional",
    ),
    BatchField(
        "token_to_kv_pool",
        "ForwardBatch.token_to_kv_pool (SGLang's KVCache)",
        "a KV pool with get_key_buffer / get_value_buffer / set_kv_buffer, page_size and dtype",
        lambda pool: all(hasattr(pool, a) for a in ("get_key_buffer", "get_value_buffer", "dtype")),
    ),
    BatchField("extend_seq_lens", "ForwardBatch.extend_seq_lens", "an int tensor [batch_size]", _is_tensor, "extend"),
    BatchField(
        "extend_prefix_lens", "ForwardBatch.extend_prefix_lens", "an int tensor [batch_size]", _is_tensor, "extend"
    ),
    BatchField(
        "spec_info",
        "ForwardBatch.spec_info (SGLang's EagleVerifyInput)",
        "the verify input: draft_token_num (int) and custom_mask (flat bool tensor)",
        lambda s: isinstance(getattr(s, "draft_token_num", None), int) and _is_tensor(getattr(s, "custom_mask", None)),
        "verify",
    ),
    BatchField("seq_lens_cpu", "ForwardBatch.seq_lens_cpu", "a host tensor or list of ints", _is_lengths, "optional"),
    BatchField("seq_lens_sum", "ForwardBatch.seq_lens_sum", "an int", lambda n: isinstance(n, int), "optional"),
    BatchField("positions", "ForwardBatch.positions", "an int tensor [tokens]", _is_tensor, "optional"),
    BatchField(
        "extend_start_loc", "ForwardBatch.extend_start_loc", "an int tensor [batch_size]", _is_tensor, "optional"
    ),
    BatchField("extend_seq_lens_cpu", "ForwardBatch.extend_seq_lens_cpu", "a list of ints", _is_lengths, "optional"),
    BatchField(
        "extend_prefix_lens_cpu", "ForwardBatch.extend_prefix_lens_cpu", "a list of ints", _is_lengths, "optional"
    ),
)
# The fields the forward prologue reads on every layer call (checked there each call, cheaply).
_FORWARD_FIELDS = tuple(f for f in BATCH_FIELDS if f.name in ("forward_mode", "batch_size", "out_cache_loc"))
_TOKEN_TO_KV_POOL = next(f for f in BATCH_FIELDS if f.name == "token_to_kv_pool")


def _check_field(fb, field: BatchField) -> None:
    value = getattr(fb, field.name, _MISSING)
    if field.when == "optional" and (value is _MISSING or value is None):
        return
    if value is not _MISSING and field.accepts(value):
        return  # (every step: the message is made only for a field that fails)
    refuse(
        InvalidBatchError,
        f"forward_batch.{field.name}",
        "missing" if value is _MISSING else value if isinstance(value, (int, str, Enum)) else describe(value),
        f"{field.expected} (SGLang: {field.sglang})",
    )


def check_batch_fields(fb) -> None:
    """``InvalidBatchError`` naming the first field of :data:`BATCH_FIELDS` that ``fb``'s mode reads and that is
    missing or of the wrong type (and the SGLang field it corresponds to). Attribute presence and types only:
    no device read, so it runs at every validation level, ``off`` included."""
    _check_field(fb, BATCH_FIELDS[0])
    mode = fb.forward_mode
    when = {"always", "optional"}
    if mode.is_target_verify():
        when.add("verify")
    elif mode.is_extend() and not mode.is_idle():
        when.add("extend")
    block_table_only = getattr(fb, "req_to_page_pool", None) is not None and (
        getattr(fb, "req_to_token_pool", None) is None
    )
    for field in BATCH_FIELDS[1:]:
        if field.when in when and not (block_table_only and field.name == "req_to_token_pool"):
            _check_field(fb, field)


def check_forward_fields(fb) -> None:
    """The per-call part of :func:`check_batch_fields`: the fields the forward prologue reads
    (``forward_mode``, ``batch_size``, ``out_cache_loc``, ``token_to_kv_pool``), a few attribute reads."""
    mode, loc, pool = (getattr(fb, name, None) for name in ("forward_mode", "out_cache_loc", "token_to_kv_pool"))
    if not (
        hasattr(mode, "is_decode")
        and isinstance(loc, torch.Tensor)
        and isinstance(getattr(fb, "batch_size", None), int)
        and hasattr(pool, "get_key_buffer")
    ):
        for field in (*_FORWARD_FIELDS, _TOKEN_TO_KV_POOL):
            _check_field(fb, field)


def validation_level(level: str | None = None) -> str:
    """``level``, else ``HAL_VALIDATE``, else ``cheap``; ``ConfigError`` for anything but off/cheap/full."""
    source = "validate"
    if level is None:
        level, source = os.environ.get("HAL_VALIDATE", "").strip() or "cheap", "HAL_VALIDATE"
    expect(level in VALIDATION_LEVELS, ConfigError, source, level, f"one of {VALIDATION_LEVELS}")
    return level


def _index_tensor(fb, name: str, length: int | None, device: torch.device) -> torch.Tensor:
    tensor = getattr(fb, name, None)
    if not (isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and tensor.dtype in INDEX_DTYPES):
        refuse(InvalidBatchError, name, describe(tensor), "a 1-D int32/int64 tensor")
    expect(
        tensor.device == device, InvalidBatchError, f"{name}.device", tensor.device, f"{device} (the request table's)"
    )
    if length is not None:
        expect(tensor.numel() == length, InvalidBatchError, f"len({name})", tensor.numel(), str(length))
    return tensor


def validate_batch(
    fb, level: str | None = None, *, page_aligned: bool = False, padding_slots: str | None = None
) -> BatchLens | None:
    """Check any batch with SGLang's field names at ``level`` (see the module docstring).

    ``page_aligned``: also require token ``i`` of a request at offset ``i % page_size`` of
    its page (``full`` only: only some backends need it). ``padding_slots``: None where -1
    padding slots in ``out_cache_loc`` are accepted, else the name of a backend that does not
    declare ``supports_padding_slots``, refused (``UnsupportedError``) when ``full``
    finds one. Returns the host lengths when
    the mirrors gave them (or ``full`` read them), else None. Raises ``InvalidBatchError``
    naming the field, what it held and what was expected.
    """
    level = validation_level(level)
    check_batch_fields(fb)
    if level == "off":
        return None
    full = level == "full"
    mode = fb.forward_mode
    if mode.name in REFUSED_MODES:
        raise UnsupportedError(f"forward_mode {mode.name}: {REFUSED_MODES[mode.name]}")
    kv_pool = fb.token_to_kv_pool
    expect(
        conforms(kv_pool, KVPool),
        InvalidBatchError,
        "token_to_kv_pool",
        type(kv_pool).__name__,
        "a KV pool with get_key_buffer / get_value_buffer / set_kv_buffer, page_size and dtype",
    )
    device, rows, max_context = check_request_tables(fb)
    bs = fb.batch_size
    expect(isinstance(bs, int) and bs >= 0, InvalidBatchError, "batch_size", bs, "an int >= 0")
    expect(bs > 0 or mode.is_idle(), InvalidBatchError, "batch_size", bs, f"> 0 in {mode.name} mode")
    req_idx = _index_tensor(fb, "req_pool_indices", bs, device)
    seq_lens = _index_tensor(fb, "seq_lens", bs, device)
    loc = _index_tensor(fb, "out_cache_loc", None, device)
    seq = _host(getattr(fb, "seq_lens_cpu", None))
    if full:
        seq = _mirror(seq, seq_lens, "seq_lens_cpu")
    if seq is not None:
        expect(len(seq) == bs, InvalidBatchError, "len(seq_lens_cpu)", len(seq), str(bs))
        seq_sum = getattr(fb, "seq_lens_sum", None)
        if seq_sum is not None:
            expect(seq_sum == sum(seq), InvalidBatchError, "seq_lens_sum", seq_sum, f"sum(seq_lens) = {sum(seq)}")
        min_len = 0 if mode.is_target_verify() else 1
        bad = [n for n in seq if n < min_len]
        expect(not bad, InvalidBatchError, "seq_lens", bad, f"every length >= {min_len} in {mode.name} mode")

    lens: BatchLens | None = None
    if mode.is_idle():
        expect(loc.numel() == 0, InvalidBatchError, "len(out_cache_loc)", loc.numel(), "0: an IDLE batch has no tokens")
        lens = BatchLens([0] * bs, [0] * bs)
    elif mode.is_decode():
        expect(loc.numel() == bs, InvalidBatchError, "len(out_cache_loc)", loc.numel(), f"{bs}: one token a request")
        lens = None if seq is None else BatchLens([n - 1 for n in seq], [1] * bs)
    elif mode.is_target_verify():
        lens = _validate_verify(fb, bs, seq, loc, device, full)
    else:
        lens = _validate_extend(fb, bs, seq, loc, device, full)
    positions = getattr(fb, "positions", None)
    if positions is not None:
        _index_tensor(fb, "positions", loc.numel(), device)
    if lens is not None:
        too_long = [n for n in lens.kv if n > max_context]
        expect(not too_long, InvalidBatchError, "sequence length", too_long, f"<= max_context_len ({max_context})")
        expect(
            loc.numel() == lens.num_tokens,
            InvalidBatchError,
            "len(out_cache_loc)",
            loc.numel(),
            f"{lens.num_tokens}: one slot per query token",
        )
    if full and bs:
        bad = [i for i in req_idx.tolist() if not 0 <= i < rows]
        expect(not bad, InvalidBatchError, "req_pool_indices", bad, f"rows in [0, {rows})")
        num_slots = pool_geometry(kv_pool, getattr(kv_pool, "start_layer", 0))[0]
        _check_out_cache_loc(loc.tolist(), num_slots, padding_slots)
        table, table_rows = _token_rows(fb, req_idx, lens, num_slots)
        _check_slots(table, lens, table_rows, loc, kv_pool, page_aligned)
        _check_writes_spare_padding_and_context(table, lens, table_rows, loc.tolist(), kv_pool.page_size)
    return lens


def check_request_tables(fb) -> tuple[torch.device, int, int]:
    """The cheap checks of ``fb``'s request tables (shapes, dtypes, devices, page size; no device read): a
    ``req_to_token_pool`` (None allowed beside a ``req_to_page_pool``) and/or a ``req_to_page_pool`` whose
    ``req_to_page`` is int32 ``[rows, max_pages]`` with the KV pool's ``page_size``, both on one device. Returns
    ``(device, rows, max_context_len)`` the tables give (the smaller bound where both are given)."""
    tokens, pages = getattr(fb, "req_to_token_pool", None), getattr(fb, "req_to_page_pool", None)
    bounds = []
    if tokens is not None or pages is None:
        expect(
            conforms(tokens, ReqToTokenTable) and isinstance(tokens.req_to_token, torch.Tensor),
            InvalidBatchError,
            "req_to_token_pool",
            type(tokens).__name__,
            "a request table with a req_to_token tensor (hal.ReqToTokenPool, SGLang's ReqToTokenPool)",
        )
        table = tokens.req_to_token
        bounds.append((table.device, table.shape[0], table.shape[1]))
    if pages is not None:
        table = getattr(pages, "req_to_page", None)
        expect(
            isinstance(table, torch.Tensor) and table.dim() == 2 and table.dtype == torch.int32,
            InvalidBatchError,
            "req_to_page_pool.req_to_page",
            describe(table),
            "an int32 tensor [rows, max_pages] (a block table: the KV pool page of every page_size tokens)",
        )
        page_size, pool_page_size = getattr(pages, "page_size", None), getattr(fb.token_to_kv_pool, "page_size", None)
        expect(
            isinstance(page_size, int) and page_size == pool_page_size,
            InvalidBatchError,
            "req_to_page_pool.page_size",
            page_size,
            f"the KV pool's page_size ({pool_page_size})",
        )
        if bounds:
            expect(
                table.device == bounds[0][0],
                InvalidBatchError,
                "req_to_page_pool.req_to_page.device",
                table.device,
                f"{bounds[0][0]} (req_to_token's)",
            )
        bounds.append((table.device, table.shape[0], table.shape[1] * page_size))
    return bounds[0][0], min(b[1] for b in bounds), min(b[2] for b in bounds)


def _token_rows(fb, req_idx: torch.Tensor, lens: BatchLens, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``full`` mode: the token table the slot checks read and the batch's rows in it: ``req_to_token`` and
    ``req_pool_indices`` where the batch has no block table; else the block table's token rows in batch order,
    once its pages in use are checked to be pages of the KV pool and, where ``req_to_token`` is given too, to
    name the slots it holds."""
    tokens, pages = getattr(fb, "req_to_token_pool", None), getattr(fb, "req_to_page_pool", None)
    if pages is None:
        return tokens.req_to_token, req_idx
    page_size, block_table = pages.page_size, pages.req_to_page
    kv = torch.tensor(lens.kv, device=block_table.device)
    num_pages = -(-max(lens.kv, default=0) // page_size)
    page_rows = step_page_table(req_idx, num_pages, page_size, req_to_page=block_table)
    in_use = torch.arange(num_pages, device=kv.device)[None, :] < (kv[:, None] + page_size - 1) // page_size
    pool_pages = num_slots // page_size
    bad = page_rows[in_use & ((page_rows < 0) | (page_rows >= pool_pages))]
    expect(
        bad.numel() == 0,
        InvalidBatchError,
        "req_to_page",
        sorted(set(bad.tolist()))[:8],
        f"page ids in [0, {pool_pages}) (the KV pool's pages) for every page the batch's requests read",
    )
    derived = step_token_table(req_idx, num_pages * page_size, req_to_page=block_table, page_size=page_size)
    if tokens is not None:
        given = step_token_table(req_idx, num_pages * page_size, req_to_token=tokens.req_to_token)
        used = torch.arange(derived.shape[1], device=kv.device)[None, :] < kv[:, None]
        differ = used & (given != derived)
        if bool(differ.any()):
            r, i = (int(x) for x in differ.nonzero()[0])
            row = int(req_idx[r])
            refuse(
                InvalidBatchError,
                f"req_to_page[{row}, {i // page_size}]",
                int(page_rows[r, i // page_size]),
                f"the page of req_to_token[{row}, {i}] = {int(given[r, i])} at offset {i % page_size}: a batch "
                "carrying both request tables must name the same slot for every token",
            )
    return derived, torch.arange(len(lens.kv), device=derived.device)


def _mirror(given: list[int] | None, tensor: torch.Tensor, name: str) -> list[int]:
    """``full`` mode: the device tensor's values, which a given host mirror must equal."""
    values = tensor.tolist()
    if given is not None:
        expect(given == values, InvalidBatchError, name, given, f"{values} (the device tensor)")
    return values


def _validate_verify(fb, bs, seq, loc, device, full) -> BatchLens | None:
    spec = getattr(fb, "spec_info", None)
    draft = getattr(spec, "draft_token_num", None)
    expect(isinstance(draft, int) and draft >= 1, InvalidBatchError, "spec_info.draft_token_num", draft, "an int >= 1")
    expect(
        loc.numel() == bs * draft,
        InvalidBatchError,
        "len(out_cache_loc)",
        loc.numel(),
        f"batch_size * draft_token_num = {bs * draft}",
    )
    mask = getattr(spec, "custom_mask", None)
    expect(
        isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 1,
        InvalidBatchError,
        "spec_info.custom_mask",
        describe(mask),
        "a flat bool tensor",
    )
    expect(mask.device == device, InvalidBatchError, "spec_info.custom_mask.device", mask.device, str(device))
    if seq is None:
        return None
    needed = sum(draft * (n + draft) for n in seq)
    expect(
        mask.numel() >= needed,
        InvalidBatchError,
        "spec_info.custom_mask",
        f"{mask.numel()} elements",
        f"at least sum(draft * (seq_len + draft)) = {needed}",
    )
    return BatchLens(list(seq), [draft] * bs)


def _validate_extend(fb, bs, seq, loc, device, full) -> BatchLens | None:
    extend_t = _index_tensor(fb, "extend_seq_lens", bs, device)
    prefix_t = _index_tensor(fb, "extend_prefix_lens", bs, device)
    start = getattr(fb, "extend_start_loc", None)
    if start is not None:
        _index_tensor(fb, "extend_start_loc", bs, device)
    extend = _host(getattr(fb, "extend_seq_lens_cpu", None))
    prefix = _host(getattr(fb, "extend_prefix_lens_cpu", None))
    if full:
        extend = _mirror(extend, extend_t, "extend_seq_lens_cpu")
        prefix = _mirror(prefix, prefix_t, "extend_prefix_lens_cpu")
    num = getattr(fb, "extend_num_tokens", None)
    if num is not None:
        expect(num == loc.numel(), InvalidBatchError, "extend_num_tokens", num, f"len(out_cache_loc) = {loc.numel()}")
    if extend is None or prefix is None:
        return None
    expect(
        len(extend) == len(prefix) == bs,
        InvalidBatchError,
        "len(extend_seq_lens_cpu), len(extend_prefix_lens_cpu)",
        (len(extend), len(prefix)),
        f"{bs} each",
    )
    seq = seq if seq is not None else [p + e for p, e in zip(prefix, extend)]
    bad = [i for i, (p, e, n) in enumerate(zip(prefix, extend, seq)) if p < 0 or e < 1 or p + e != n]
    expect(
        not bad,
        InvalidBatchError,
        "extend_prefix_lens + extend_seq_lens",
        [(prefix[i], extend[i]) for i in bad],
        f"prefix >= 0, extend >= 1, prefix + extend == seq_lens {[seq[i] for i in bad]}",
    )
    if full and start is not None:
        starts = [sum(extend[:i]) for i in range(bs)]
        _mirror(starts, start, "extend_start_loc")
    return BatchLens(prefix, extend)


def _check_out_cache_loc(loc_list: list[int], num_slots: int, refusing: str | None) -> None:
    """``full`` mode: every slot of ``out_cache_loc`` is in the pool or -1 (a padding token); ``refusing``: the name
    of a backend that does not declare ``supports_padding_slots`` (then a -1 is an ``UnsupportedError``)."""
    bad = sorted({x for x in loc_list if not PADDING_TOKEN_SLOT <= x < num_slots})
    expect(
        not bad,
        InvalidBatchError,
        "out_cache_loc",
        bad[:8],
        f"slots in [0, {num_slots}) (the KV pool's), or -1 for a padding token (its KV is not written)",
    )
    if refusing is not None and PADDING_TOKEN_SLOT in loc_list:
        raise UnsupportedError(
            f"out_cache_loc holds -1 (a padding token, {loc_list.count(PADDING_TOKEN_SLOT)} of them): {refusing} "
            "does not declare supports_padding_slots = True; -1 padding slots were added in hal 0.3 (a port "
            "declares the attribute once its KV write skips them: docs/porting.md), so pad with the padding slot "
            "0 for it"
        )


def _padding_request(slots: list[int], padding: int) -> bool:
    """Whether a request's query tokens are all padding (-1, or SGLang's padding slot): it writes no real KV."""
    return all(x == PADDING_TOKEN_SLOT or x == padding for x in slots)


def _check_slots(table, lens, req_idx, loc, kv_pool, page_aligned) -> None:
    """``full`` mode: every slot a request reads is in the pool past the padding page; the query
    tokens' slots are ``out_cache_loc``, no two alike; with ``page_aligned``, token ``i`` of a
    request sits at offset ``i % page_size`` of its page. Padding requests (every query token
    -1 or the padding slot 0: vLLM's and SGLang's graph padding) read only slots of the pool and
    are exempt from the rest; -1 is refused in a request that also writes real slots (its own
    later tokens would read KV that was never written)."""
    page_size = kv_pool.page_size
    num_slots = pool_geometry(kv_pool, getattr(kv_pool, "start_layer", 0))[0]
    padding = getattr(kv_pool, "padding_slot", 0)
    loc_list = loc.tolist()
    starts = [sum(lens.query[:i]) for i in range(len(lens.query))]
    real = [
        r
        for r, (s, n) in enumerate(zip(starts, lens.query))
        if n and not _padding_request(loc_list[s : s + n], padding)
    ]
    for r, (s, n) in enumerate(zip(starts, lens.query)):
        own = loc_list[s : s + n]
        if r in real and PADDING_TOKEN_SLOT in own:
            refuse(
                InvalidBatchError,
                f"out_cache_loc of request {r}",
                own,
                "-1 (a padding token) only in a padding request, all of whose query tokens are -1: a request "
                "with real slots writes every one of its tokens (its later tokens read them)",
            )
        if r not in real and n and PADDING_TOKEN_SLOT in own:  # a kernel still reads a padding request's slots
            reads = table[int(req_idx[r]), : lens.kv[r]]
            expect(
                reads.numel() == 0 or 0 <= int(reads.min()) and int(reads.max()) < num_slots,
                InvalidBatchError,
                f"req_to_token slots of padding request {r}",
                (int(reads.min()), int(reads.max())),
                f"slots of the pool, in [0, {num_slots}) (row 0, the padding row, reads the padding slot)",
            )
    if not real:
        return
    kv_lens = [lens.kv[r] for r in real]
    width = max(kv_lens)
    rows = table[req_idx.long()[real], :width].long()
    pos = torch.arange(width, device=table.device)
    used = pos[None, :] < torch.tensor(kv_lens, device=table.device)[:, None]
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
    if page_aligned and page_size > 1:
        page_start = rows[:, (pos - pos % page_size)]  # the slot of each token's page-mate at offset 0
        misplaced = used & (rows != page_start + pos % page_size)
        if bool(misplaced.any()):
            r, i = (int(x) for x in misplaced.nonzero()[0])
            refuse(
                InvalidBatchError,
                f"req_to_token[{int(req_idx[real[r]])}, {i}]",
                int(rows[r, i]),
                f"slot {int(page_start[r, i]) + i % page_size}: this backend reads whole pages, so token i of a "
                f"request must sit at offset i % page_size ({page_size}) of its page",
            )
    for j, r in enumerate(real):
        s, n, p = starts[r], lens.query[r], lens.prefix[r]
        want = rows[j, p : p + n].tolist()
        expect(
            want == loc_list[s : s + n],
            InvalidBatchError,
            f"out_cache_loc of request {r}",
            loc_list[s : s + n],
            f"the slots req_to_token holds for its query tokens: {want}",
        )
    written = [x for x in loc_list if x not in (padding, PADDING_TOKEN_SLOT)]
    if len(set(written)) != len(written):
        seen: set[int] = set()
        dup = sorted({x for x in written if x in seen or seen.add(x)})
        refuse(InvalidBatchError, "out_cache_loc", f"slots {dup} written twice", "distinct slots")


def _check_writes_spare_padding_and_context(table, lens, req_idx, loc_list, page_size) -> None:
    """``full`` mode: a request that reads real slots (not graph padding) writes nothing into the padding
    page, and no query token writes a slot that a request of the batch reads as cached context (that KV
    would be overwritten before it is read)."""
    rows = req_idx.tolist()
    context: dict[int, tuple[int, int]] = {}  # slot -> (request, position) of the cached prefixes
    start = 0
    for r, (prefix, n, kv) in enumerate(zip(lens.prefix, lens.query, lens.kv)):
        writes = loc_list[start : start + n]
        start += n
        reads = table[rows[r], :kv].tolist() if 0 <= rows[r] < table.shape[0] else []
        in_padding = [w for w in writes if 0 <= w < page_size]
        if in_padding and any(x >= page_size for x in reads):
            refuse(
                InvalidBatchError,
                f"out_cache_loc of request {r}",
                in_padding,
                f"slots >= {page_size}: page 0 is the padding page graph padding requests write; a request "
                "with real context may not keep its tokens there",
            )
        context.update({slot: (r, i) for i, slot in enumerate(reads[:prefix]) if slot >= page_size})
    clobbered = [(t, x) for t, x in enumerate(loc_list) if x in context]
    if clobbered:
        t, x = clobbered[0]
        r, i = context[x]
        refuse(
            InvalidBatchError,
            f"out_cache_loc[{t}]",
            x,
            f"a slot no request of the batch reads as cached context: slot {x} holds position {i} of request "
            f"{r}'s prefix ({len(clobbered)} such write(s))",
        )


def check_input_dtypes(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    layer: AttentionLayer,
    config: AttentionConfig | None,
    declaration: BackendDeclaration,
    kv_dtype: torch.dtype | None,
) -> None:
    """Refuse a forward's q/k/v dtypes that the backend cannot take; returns None.

    ``q`` / ``k`` / ``v``: the forward's tensors (``k`` / ``v`` None where they are read back from the cache, ``v``
    None for MLA's latent value); ``layer``: their layer (named in the message); ``config``: the
    ``AttentionConfig`` the backend was created for (None: none); ``declaration``: the backend's
    ``BackendDeclaration``; ``kv_dtype``: the KV pool's torch dtype (None: not checked).

    ``InvalidBatchError`` for a q, k or v that is not a compute dtype (``hal.kv_dtypes.COMPUTE_DTYPES``: fp8
    storage or int tensors are not), a k or v of another dtype than q, or a q of another dtype than
    ``config.dtype``; ``UnsupportedError`` for a q dtype the backend does not declare (``dtypes``) or a KV pool
    dtype it does not declare (``kv_cache_dtypes``; the model dtype's own pool needs no declaring, as in
    selection). The passing path is a few compares; the message is built only on failure.
    """
    try:
        dtype = q.dtype
        if (
            _COMPUTE_NAMES.get(dtype) in declaration.dtypes
            and (k is None or k.dtype is dtype)
            and (v is None or v.dtype is dtype)
            and (config is None or config.dtype is dtype)
            and (kv_dtype is None or kv_dtype is dtype or _kv_dtype_name(kv_dtype) in declaration.kv_cache_dtypes)
        ):
            return
    except AttributeError:  # not a tensor: named below
        pass
    _refuse_input_dtypes(q, k, v, layer, config, declaration, kv_dtype)


_COMPUTE_NAMES = dict(COMPUTE_DTYPE_NAMES)  # the view as a plain dict: a lookup on every layer call


def _kv_dtype_name(dtype: torch.dtype) -> str | None:
    row = find_kv_dtype(dtype)
    return None if row is None else row.name


def refuse_mixed_dtypes(q, k, v, layer: AttentionLayer | None) -> None:
    """``InvalidBatchError`` naming a q, k or v that is not a compute dtype (``hal.kv_dtypes.COMPUTE_DTYPES``) or a
    k or v of another dtype than q; returns where they are fine. The one place these input dtype rules are
    worded (the forward's dtype check and the checked path's input check both raise through it)."""
    at = f"layer {layer.layer_id}: " if layer is not None else ""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None and name != "q":
            continue
        expect(isinstance(t, torch.Tensor), InvalidBatchError, f"{at}{name}", describe(t), "a torch.Tensor")
        storage = f" ({_kv_dtype_name(t.dtype)} is a KV cache's storage dtype)" if find_kv_dtype(t.dtype) else ""
        expect(
            t.dtype in COMPUTE_DTYPE_NAMES,
            InvalidBatchError,
            f"{at}{name}.dtype",
            t.dtype,
            f"a compute dtype, one of {list(COMPUTE_DTYPES.values())}{storage}",
        )
    for name, t in (("k", k), ("v", v)):
        expect(
            t is None or t.dtype is q.dtype,
            InvalidBatchError,
            f"{at}{name}.dtype",
            getattr(t, "dtype", None),
            f"q's {q.dtype}: q, k and v come in one dtype",
        )


def _refuse_input_dtypes(q, k, v, layer, config, declaration: BackendDeclaration, kv_dtype) -> None:
    """Raise the error that names what :func:`check_input_dtypes` found wrong."""
    at = f"layer {layer.layer_id}: " if layer is not None else ""
    refuse_mixed_dtypes(q, k, v, layer)
    expect(
        config is None or config.dtype is q.dtype,
        InvalidBatchError,
        f"{at}q.dtype",
        q.dtype,
        f"{getattr(config, 'dtype', None)}, the dtype of the model this backend was created for (config.dtype "
        f"{getattr(config, 'dtype_name', '?')}); cast before forward",
    )
    expect(
        COMPUTE_DTYPE_NAMES[q.dtype] in declaration.dtypes,
        UnsupportedError,
        f"{at}q.dtype",
        q.dtype,
        f"a dtype {declaration.name} declares: {sorted(declaration.dtypes)}",
    )
    kv_name = _kv_dtype_name(kv_dtype)
    expect(
        kv_dtype is None or kv_dtype is q.dtype or kv_name in declaration.kv_cache_dtypes,
        UnsupportedError,
        f"{at}KV cache dtype",
        kv_name or kv_dtype,
        f"q's {COMPUTE_DTYPE_NAMES[q.dtype]} or a KV cache dtype {declaration.name} declares: "
        f"{sorted(declaration.kv_cache_dtypes)}",
    )
