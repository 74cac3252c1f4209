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

Padding tokens (since 0.3): ``out_cache_loc[t] = -1`` (vLLM's ``PAD_SLOT_ID``) writes no KV
anywhere (every slot of the pool, page 0 included, keeps its bytes); the token's output row
is unspecified and the caller ignores it. Every query token of such a padding request is -1
(a request that also writes real slots may not hold one: its later tokens would read KV never
written), and the slots it reads are in the pool (row 0, the padding row, reads the padding
slot). Only backends that declare ``supports_padding_slots`` take -1; ``full`` validation
refuses it for the others.

Validation lives in :mod:`hal.validation`; the modes and per-request lengths in :mod:`hal.modes`
(both re-exported here, where they were before 0.2.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hal.kv_cache import KVPool, ReqToTokenTable
from hal.modes import REFUSED_MODES, BatchLens, ForwardMode, SharedReadEnds, device_lens, host_lens
from hal.plugin_compat import Api1BatchNames
from hal.validation import VALIDATION_LEVELS, validate_batch, validation_level

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
