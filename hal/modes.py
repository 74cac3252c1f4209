"""``ForwardMode`` and the per-request lengths a batch's mode implies (host and device).

``host_lens(fb)`` reads the host mirrors (or the device tensors, once, when none are given);
``device_lens(fb)`` computes the same on the device, graph-recordably. See :mod:`hal.batch`
for the token layout of each mode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["ForwardMode", "BatchLens", "host_lens", "device_lens", "REFUSED_MODES", "SharedReadEnds", "step_kind"]


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
    if getattr(type(fb), "keeps_host_lens", False):  # hal's ForwardBatch: computed once, kept in fb._lens
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


def step_kind(mode, fused_mixed: bool) -> str:
    """The step ``forward`` runs for a batch of ``mode`` (not IDLE): ``"decode"`` for DECODE, ``"mixed"`` for MIXED
    where the device has a fused mixed kernel (``fused_mixed``, the capability's), else ``"extend"``."""
    if mode.is_decode():
        return "decode"
    return "mixed" if mode.is_mixed() and fused_mixed else "extend"
