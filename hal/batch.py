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

Validation is a level (:func:`validation_level`): ``off`` trusts the caller; ``cheap``
(the default) checks what shapes, dtypes, devices and the host mirrors (``*_cpu``) tell,
with no device-to-host read and nothing proportional to context length; ``full`` also
reads the device tensors and checks every slot (conformance, ``hal check``, ``--check``).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import torch

from hal.errors import ConfigError, InvalidBatchError, UnsupportedError, expect
from hal.kv_cache import INDEX_DTYPES, KVPool, ReqToTokenTable, pool_geometry

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
    "VALIDATION_LEVELS",
    "SharedReadEnds",
    "REFUSED_MODES",
]

VALIDATION_LEVELS = ("off", "cheap", "full")


def validation_level(level: str | None = None) -> str:
    """``level``, else ``HAL_VALIDATE``, else ``cheap``; ``ConfigError`` for anything but off/cheap/full."""
    source = "validate"
    if level is None:
        level, source = os.environ.get("HAL_VALIDATE", "").strip() or "cheap", "HAL_VALIDATE"
    expect(level in VALIDATION_LEVELS, ConfigError, source, level, f"one of {VALIDATION_LEVELS}")
    return level


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    # SGLang 0.5.21's other modes. DRAFT_EXTEND_V2 is SGLang's name for DRAFT_EXTEND (an alias);
    # SPLIT_PREFILL (PD multiplexing: one prefill run in layer slices) is served as an extend;
    # PREBUILT and DLLM_EXTEND are refused (REFUSED_MODES says why).
    DRAFT_EXTEND_V2 = DRAFT_EXTEND
    PREBUILT = enum.auto()
    SPLIT_PREFILL = enum.auto()
    DLLM_EXTEND = enum.auto()

    def refusal(self) -> str | None:
        """Why hal's backends do not serve this mode, None when they do."""
        return REFUSED_MODES.get(self.name)

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
            ForwardMode.SPLIT_PREFILL,
        )

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_cuda_graph(self) -> bool:
        """Modes a graph runner captures."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


REFUSED_MODES = {
    "PREBUILT": "PREBUILT (SGLang's disaggregated decode: the KV cache arrived prebuilt) never runs a model "
    "forward, so no attention backend is asked for it",
    "DLLM_EXTEND": "DLLM_EXTEND (diffusion LLMs) attends bidirectionally within each block of new tokens; "
    "hal's extend is causal (or non-causal for a whole encoder_only model)",
}


class SharedReadEnds(enum.Enum):
    """Where a backend's reads of scheduler-shared buffers (request table, ``seq_lens``) end in a step
    (SGLang's ``SharedReadEnds``: the scheduler may overwrite them after that point)."""

    PRE_REPLAY = 1  # after init_forward_metadata_out_graph
    IN_REPLAY = 2  # after init_forward_metadata_in_graph
    POST_REPLAY = 3  # only after forward
    UNKNOWN = 4  # not audited: the engine fences the whole forward


@dataclass(frozen=True)
class BatchLens:
    """Host-side lengths of one step, per request: cached ``prefix`` tokens before the ``query`` tokens."""

    prefix: list[int]
    query: list[int]

    @property
    def kv(self) -> list[int]:
        """Keys each request attends over, its query tokens included."""
        return [p + q for p, q in zip(self.prefix, self.query)]

    @property
    def num_tokens(self) -> int:
        return sum(self.query)


def _host(values) -> list[int] | None:
    """A host mirror (list or CPU tensor) as a list, None when absent."""
    if values is None:
        return None
    return values.tolist() if isinstance(values, torch.Tensor) else [int(x) for x in values]


def host_lens(fb) -> BatchLens:
    """The host lengths of any batch with SGLang's fields, from its ``*_cpu`` mirrors.

    A missing mirror is read from the device tensor (a host sync): backends call this in
    ``init_forward_metadata_out_graph`` only. hal's :class:`ForwardBatch` keeps the result.
    """
    if isinstance(fb, ForwardBatch):
        if fb._lens is None:
            fb._lens = _compute_lens(fb)
        return fb._lens
    return _compute_lens(fb)


def _compute_lens(fb) -> BatchLens:
    mode, bs = fb.forward_mode, fb.batch_size
    if mode.is_idle():
        return BatchLens([0] * bs, [0] * bs)
    if mode.is_decode() or mode.is_target_verify():
        seq = _host(getattr(fb, "seq_lens_cpu", None))
        seq = fb.seq_lens.tolist() if seq is None else seq
        if mode.is_decode():
            return BatchLens([n - 1 for n in seq], [1] * bs)
        return BatchLens(seq, [fb.spec_info.draft_token_num] * bs)
    prefix = _host(getattr(fb, "extend_prefix_lens_cpu", None))
    extend = _host(getattr(fb, "extend_seq_lens_cpu", None))
    prefix = fb.extend_prefix_lens.tolist() if prefix is None else prefix
    extend = fb.extend_seq_lens.tolist() if extend is None else extend
    return BatchLens(prefix, extend)


def device_lens(fb) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_lens, kv_lens)``, int64 ``[B]`` on the device, from the device tensors only (graph-recordable).

    ``kv_lens`` counts every key a request attends over, its query tokens included; the
    cached prefix is ``kv_lens - query_lens``.
    """
    mode, seq_lens = fb.forward_mode, fb.seq_lens.long()
    if mode.is_decode() or mode.is_idle():
        return torch.ones_like(seq_lens) if mode.is_decode() else torch.zeros_like(seq_lens), seq_lens
    if mode.is_target_verify():
        draft = fb.spec_info.draft_token_num
        return torch.full_like(seq_lens, draft), seq_lens + draft
    return fb.extend_seq_lens.long(), seq_lens


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"
    return type(t).__name__


def _index_tensor(fb, name: str, length: int | None, device: torch.device) -> torch.Tensor:
    tensor = getattr(fb, name, None)
    expect(
        isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and tensor.dtype in INDEX_DTYPES,
        InvalidBatchError,
        name,
        _describe(tensor),
        "a 1-D int32/int64 tensor",
    )
    expect(tensor.device == device, InvalidBatchError, f"{name}.device", tensor.device, f"{device} (req_to_token's)")
    if length is not None:
        expect(tensor.numel() == length, InvalidBatchError, f"len({name})", tensor.numel(), str(length))
    return tensor


def validate_batch(fb, level: str | None = None, *, page_aligned: bool = False) -> BatchLens | None:
    """Check any batch with SGLang's field names at ``level`` (see the module docstring).

    ``page_aligned``: also require token ``i`` of a request at offset ``i % page_size`` of
    its page (``full`` only: only some backends need it). Returns the host lengths when
    the mirrors gave them (or ``full`` read them), else None. Raises ``InvalidBatchError``
    naming the field, what it held and what was expected.
    """
    level = validation_level(level)
    if level == "off":
        return None
    full = level == "full"
    mode = fb.forward_mode
    expect(
        getattr(mode, "name", None) in ForwardMode.__members__ and hasattr(mode, "is_decode"),
        InvalidBatchError,
        "forward_mode",
        mode,
        f"one of {list(ForwardMode.__members__)} (hal's or SGLang's ForwardMode)",
    )
    if mode.name in REFUSED_MODES:
        raise UnsupportedError(f"forward_mode {mode.name}: {REFUSED_MODES[mode.name]}")
    rt_pool, kv_pool = fb.req_to_token_pool, fb.token_to_kv_pool
    expect(
        isinstance(rt_pool, ReqToTokenTable) and isinstance(rt_pool.req_to_token, torch.Tensor),
        InvalidBatchError,
        "req_to_token_pool",
        type(rt_pool).__name__,
        "a request table with a req_to_token tensor (hal.ReqToTokenPool, SGLang's ReqToTokenPool)",
    )
    expect(
        isinstance(kv_pool, KVPool),
        InvalidBatchError,
        "token_to_kv_pool",
        type(kv_pool).__name__,
        "a KV pool with get_key_buffer / get_value_buffer / set_kv_buffer, page_size and dtype",
    )
    table = rt_pool.req_to_token
    device, (rows, max_context) = table.device, table.shape
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
        _check_slots(fb, lens, req_idx, loc, kv_pool, page_aligned)
    return lens


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
        _describe(mask),
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


def _check_slots(fb, lens, req_idx, loc, kv_pool, page_aligned) -> None:
    """``full`` mode: every slot a request reads is in the pool past the padding page; the query
    tokens' slots are ``out_cache_loc``, no two alike; with ``page_aligned``, token ``i`` of a
    request sits at offset ``i % page_size`` of its page. Graph-padding requests (every query
    token writing the padding slot 0) are skipped."""
    page_size = kv_pool.page_size
    num_slots = pool_geometry(kv_pool, getattr(kv_pool, "start_layer", 0))[0]
    padding = getattr(kv_pool, "padding_slot", 0)
    loc_list = loc.tolist()
    starts = [sum(lens.query[:i]) for i in range(len(lens.query))]
    real = [
        r for r, (s, n) in enumerate(zip(starts, lens.query)) if n and any(x != padding for x in loc_list[s : s + n])
    ]
    if not real:
        return
    kv_lens = [lens.kv[r] for r in real]
    width = max(kv_lens)
    table = fb.req_to_token_pool.req_to_token
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
            expect(
                False,
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
    written = [x for x in loc_list if x != padding]
    if len(set(written)) != len(written):
        seen: set[int] = set()
        dup = sorted({x for x in written if x in seen or seen.add(x)})
        expect(False, InvalidBatchError, "out_cache_loc", f"slots {dup} written twice", "distinct slots")


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
    """One forward step of a batch of requests, validated on construction. ``B = batch_size``, ``T`` = query tokens.

    Required: ``forward_mode``, ``batch_size``, ``req_pool_indices`` (int ``[B]``),
    ``seq_lens`` (int ``[B]``), ``out_cache_loc`` (int ``[T]``), the two pools (any
    objects with the pool protocol of :mod:`hal.kv_cache`); the ``extend_*`` tensors for
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
    req_to_token_pool: ReqToTokenTable
    token_to_kv_pool: KVPool
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
    validate: str | None = field(default=None, repr=False)
    # True for a graph runner's static batch: backends then use their fixed-shape graph buffers.
    graph_static: bool = field(default=False, init=False)
    _lens: BatchLens | None = field(default=None, init=False, repr=False)

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
) -> ForwardBatch:
    """A DECODE (or, with ``draft_token_num``, TARGET_VERIFY) batch of padding requests whose tensors a
    graph runner captures and refills.

    Its padding requests are SGLang's: row 0, ``seq_len_fill_value`` tokens, writes to the
    padding slot 0. A verify batch's ``spec_info.custom_mask`` is a fixed buffer of
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
            (tokens,), getattr(token_to_kv_pool, "padding_slot", 0), dtype=torch.int64, device=device
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
