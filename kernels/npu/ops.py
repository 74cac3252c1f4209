"""Thin wrappers over the torch_npu attention ops, for hal's Ascend backend.

Each wrapper takes ``ops`` first: the real ``torch_npu`` module (from :func:`load_torch_npu`)
or :data:`hal.kernels.npu.emulation.torch_npu`; both are called identically, with keywords,
the way vllm-ascend and SGLang call them.

Host/device rules the wrappers enforce (they never move a device tensor to the host,
which would be a sync and break graph capture):

* KV caches are ND ``[num_blocks, block_size, kv_heads, head_dim]`` (hal's ``[num_slots, kv_heads, head_dim]`` pool
  buffer viewed with :func:`buffer_pages`) on A2/A3/A5; on 310P the ATB ops take FRACTAL_NZ caches
  ``[num_blocks, kv_heads * head_dim / 16, block_size, 16]`` (a ``fractal_nz`` pool's pages, or :func:`nz_pages`).
* Every int32 the ops take is range-checked on the host (:func:`_int32_limit`): ATB's host lengths, and the pool's
  slot count before a slot tensor is cast to int32 (no device read).
* ``block_table``: int32 ``[batch, max_blocks]`` on the device, passed through unchanged
  (hal's ``req_to_token`` is int32, so :func:`block_tables` keeps int32).
* Per-request lengths: *host* values. The ATB ops (decode, mixed) take CPU int32 tensors;
  ``npu_fused_infer_attention_score`` takes python lists (cumulative query ends, per-request
  KV lengths when paged). The wrappers accept lists, tuples or CPU tensors of any integer
  dtype and convert on the host; a device tensor raises ``TypeError`` (use ``*_cpu``).
* ``slots`` for :func:`write_kv` may be int64 (SGLang's ``out_cache_loc``); it is cast to the
  int32 the op needs on the device, with no host sync.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hal.errors import UnsupportedError
from hal.kernels import opaque_kernel

from . import emulation
from .contracts import ACL_FORMAT_FRACTAL_NZ, FIA_DECODE_MAX_KV, FIA_MAX_SEQ, INT32_MAX
from .limits import (  # noqa: F401 - re-exported: hal.kernels.npu.ops.<name> is importable
    FIA_TND_HEAD_DIMS,
    MLA_LATENT_DIMS,
    MLA_ROPE_DIM,
    MLA_TND_MAX_QUERY,
    MLA_TREE_LATENT_DIM,
    PA_MAX_BLOCK_SIZE,
    PA_MLA_DIMS,
    SINK_MAX_VALUE_DIM,
    mla_unsupported_reasons,
    sink_unsupported_reasons,
    unsupported_reasons,
)
from .loaders import (  # noqa: F401 - re-exported, as above
    ATB_LOADER,
    GENERATIONS,
    MLA_OP_NAMES,
    OP_NAMES,
    generation_of_arch,
    generation_of_soc,
    is_emulation,
    load_atb,
    load_torch_npu,
    resolve_ops,
)

__all__ = [
    "OP_NAMES",
    "ATB_LOADER",
    "FIA_TND_HEAD_DIMS",
    "GENERATIONS",
    "generation_of_soc",
    "generation_of_arch",
    "load_atb",
    "load_torch_npu",
    "resolve_ops",
    "is_emulation",
    "buffer_pages",
    "block_tables",
    "write_kv",
    "paged_decode",
    "paged_prefill",
    "paged_mixed",
    "splitfuse_mask",
    "splitfuse_mask_value",
    "fia_causal_mask",
    "unsupported_reasons",
    "MLA_OP_NAMES",
    "write_latent",
    "mla_decode",
    "mla_attention",
    "mla_unsupported_reasons",
    "paged_attention_sinks",
    "sink_unsupported_reasons",
    "scatter_rows",
    "nz_pages",
    "nz_mask",
]
_VLLM_ASCEND = "https://github.com/vllm-project/vllm-ascend/blob/182b75e/vllm_ascend/attention/attention_v1.py"
_SGLANG = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/layers/attention/ascend_backend.py"
_FIA_DOC = (
    "https://github.com/Ascend/op-plugin/blob/517f2e7/docs/zh/custom_APIs/torch_npu/"
    "torch_npu-npu_fused_infer_attention_score.md"
)
_ATB_PA_DOC = (
    "https://www.hiascend.com/document/detail/zh/canncommercial/80RC2/apiref/ascendtbapi/ascendtb_01_0070.html"
)
_ATB_PA_IO_DOC = (
    "https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/82RC1/API/ascendtbapi/ascendtb_01_0206.html"
)
_ATB_RC_DOC = (
    "https://www.hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/ascendtbapi/ascendtb_01_0073.html"
)
_FIA_V2_DOC = (
    "https://github.com/Ascend/op-plugin/blob/517f2e7/docs/zh/custom_APIs/torch_npu/"
    "torch_npu-npu_fused_infer_attention_score_v2.md"
)
_VLLM_ASCEND_MLA = "https://github.com/vllm-project/vllm-ascend/blob/182b75e/vllm_ascend/attention/mla_v1.py"


# ----------------------------------------------------------------------------- helpers


def buffer_pages(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a ``[num_slots, heads, dim]`` pool buffer as ``[num_pages, page_size, heads, dim]``."""
    if buffer.dim() != 3 or buffer.shape[0] % page_size or not buffer.is_contiguous():
        raise ValueError(
            f"buffer_pages: buffer = {list(buffer.shape)} (contiguous={buffer.is_contiguous()}): expected a "
            f"contiguous [num_slots, heads, dim] buffer with num_slots a multiple of page_size = {page_size}"
        )
    return buffer.view(buffer.shape[0] // page_size, page_size, buffer.shape[1], buffer.shape[2])


def block_tables(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int, max_blocks: int
) -> torch.Tensor:
    """int32 ``[batch, max_blocks]``: page id of every ``page_size`` tokens of each request.

    SGLang's rule (``req_to_token[idx, ::page_size] // page_size``, see ascend_backend.py): it
    assumes a request's tokens fill its pages in order, which hal's paged allocator guarantees.
    ``max_blocks`` is a host int (a static shape, graph-capturable); columns past a request's
    length hold whatever ``req_to_token`` holds there and are never read by the ops.
    """
    rows = req_to_token.index_select(0, req_pool_indices.to(torch.long))
    pages = rows[:, ::page_size][:, :max_blocks]
    if pages.shape[1] < max_blocks:
        raise ValueError(
            f"block_tables: max_blocks = {max_blocks}: expected <= ceil(max_context_len / page_size) = {pages.shape[1]}"
        )
    return torch.div(pages, page_size, rounding_mode="floor").to(torch.int32)


def _host_lengths(name: str, lengths: object) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu":
            raise TypeError(
                f"{name} = Tensor(device={lengths.device}): expected host lengths (a list or a CPU tensor, "
                "e.g. forward_batch.seq_lens_cpu); reading a device tensor here would sync the stream"
            )
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dim() != 1:
            raise TypeError(
                f"{name} = Tensor(dtype={lengths.dtype}, shape={list(lengths.shape)}): expected 1-D integers"
            )
        return [int(v) for v in lengths.tolist()]
    if isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        values = list(lengths)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return values
    raise TypeError(f"{name} = {lengths!r}: expected a list of ints or a 1-D CPU integer tensor")


def _int32_limit(what: str, value: int) -> None:
    """Refuse ``value`` (an int32 argument, or the largest one a tensor cast to int32 can hold) past int32."""
    if not 0 <= value <= INT32_MAX:
        raise UnsupportedError(f"{what} = {value}: the op takes it as int32, in [0, {INT32_MAX}]")


def _host_int32(name: str, lengths: object) -> torch.Tensor:
    values = _host_lengths(name, lengths)
    for v in values:
        _int32_limit(f"{name} (an ATB int32 host length)", v)
    with opaque_kernel():  # a host argument of the op launch, re-issued per replay on NPU graphs
        return torch.tensor(values, dtype=torch.int32)


def _slots_int32(slots: torch.Tensor, cache: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``slots`` as the int32 the KV writes take: refused when ``cache`` (ND or FRACTAL_NZ pages) holds more slots of
    ``row``'s shape than int32 numbers (a valid slot would wrap in the cast); read from the shapes, not the data."""
    _int32_limit("the last slot of the paged cache", cache.numel() // max(math.prod(row.shape[1:]), 1) - 1)
    return slots if slots.dtype == torch.int32 else slots.to(torch.int32)


def splitfuse_mask_value(dtype: torch.dtype) -> float:
    """The additive value vllm-ascend puts on masked entries of the splitfuse mask.

    float16: ``torch.finfo(torch.float32).min`` (``-inf`` once cast); bfloat16: ``-10000``
    (``AttentionMaskBuilder.get_mask_scale_factor``, vllm_ascend/attention/attention_mask.py);
    float32 (emulation only): ``torch.finfo(torch.float32).min``.
    """
    if dtype == torch.bfloat16:
        return -10000.0
    if dtype in (torch.float16, torch.float32):
        return torch.finfo(torch.float32).min
    raise ValueError(f"splitfuse_mask: dtype = {dtype}: expected float16 or bfloat16 (float32 for the emulation)")


def splitfuse_mask(
    query_lens: Sequence[int] | torch.Tensor,
    kv_lens: Sequence[int] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    causal: bool = True,
    sliding_window: int = -1,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``mask`` of ``_npu_paged_attention_splitfuse``: ``[sum(query_lens), max(kv_lens)]`` in ``dtype``.

    Row ``t`` belongs to query token ``i`` of request ``r`` at position ``p = kv_lens[r] -
    query_lens[r] + i``; it is 0 where KV ``j`` is visible and :func:`splitfuse_mask_value`
    where not. Causal: ``j <= p`` (vllm-ascend builds the same rows as
    ``attn_mask_cache[positions, :max_seq_len]``). ``sliding_window >= 0`` also needs
    ``j >= p - sliding_window``; ``custom_mask`` (hal's flat bool, per request row-major
    ``[query_len, kv_len]``, True = visible) replaces the causal rule. Built on the host and
    copied once: build it once per batch (out of graph), not per layer.
    """
    with opaque_kernel():  # host-built argument of the op (out_graph work; an emulated replay rebuilds it)
        return _splitfuse_mask(query_lens, kv_lens, dtype, device, causal, sliding_window, custom_mask)


def _splitfuse_mask(query_lens, kv_lens, dtype, device, causal, sliding_window, custom_mask) -> torch.Tensor:
    q_lens = _host_lengths("query_lens", query_lens)
    k_lens = _host_lengths("kv_lens", kv_lens)
    if len(q_lens) != len(k_lens) or any(not 0 <= s <= n for s, n in zip(q_lens, k_lens, strict=True)):
        raise ValueError(
            f"splitfuse_mask: query_lens = {q_lens}, kv_lens = {k_lens}: expected equal lengths, 0 <= query <= kv"
        )
    fill = splitfuse_mask_value(dtype)
    total, width = sum(q_lens), max(k_lens, default=0)
    cols = torch.arange(width).unsqueeze(0)
    pos = torch.tensor(
        [n - s + i for s, n in zip(q_lens, k_lens, strict=True) for i in range(s)], dtype=torch.long
    ).unsqueeze(1)
    kv_of_row = torch.tensor(
        [n for s, n in zip(q_lens, k_lens, strict=True) for _ in range(s)], dtype=torch.long
    ).unsqueeze(1)
    visible = cols <= pos if causal else cols < kv_of_row
    if custom_mask is not None:
        flat = custom_mask.reshape(-1).to(device="cpu", dtype=torch.bool)
        expected = sum(s * n for s, n in zip(q_lens, k_lens, strict=True))
        if flat.numel() != expected:
            raise ValueError(
                f"splitfuse_mask: custom_mask has {flat.numel()} elements: "
                f"expected sum(query_len * kv_len) = {expected}"
            )
        visible = torch.zeros(total, width, dtype=torch.bool)
        row = start = 0
        for s, n in zip(q_lens, k_lens, strict=True):
            visible[row : row + s, :n] = flat[start : start + s * n].view(s, n)
            row, start = row + s, start + s * n
    if sliding_window >= 0:
        visible &= cols >= pos - sliding_window
    mask = torch.zeros(total, width, dtype=torch.float32).masked_fill_(~visible, fill)
    return mask.to(dtype).to(device)


_FIA_MASKS: dict[str, torch.Tensor] = {}


def fia_causal_mask(device: torch.device | str) -> torch.Tensor:
    """The compressed rightDownCausal ``atten_mask`` of FIA ``sparse_mode=3``.

    int8 ``triu(ones(2048, 2048), 1)`` (1 = masked out), as vllm-ascend's
    ``AttentionMaskBuilder.get_splitfuse_attn_mask``; SGLang passes the bool equivalent.
    Cached per device.
    """
    key = str(torch.device(device))
    mask = _FIA_MASKS.get(key)
    if mask is None:
        size = emulation.FIA_MASK_SIZE
        mask = _FIA_MASKS[key] = torch.ones(size, size, dtype=torch.int8).triu_(1).to(device)
    return mask


# ----------------------------------------------------------------------------- wrappers


def _cite(fn: Any, **urls: str) -> None:
    """Fill the source URLs into ``fn``'s docstring (absent under ``python -OO``)."""
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.format(**urls)


def write_kv(
    ops: Any,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    scatter: bool = False,
) -> None:
    """Store ``key``/``value`` ``[n, kv_heads, dim]`` at ``slots`` ``[n]`` of the paged caches, in place.

    ``scatter=True`` (A2/A3/A5): ``torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache,
    slot_mapping, cache_mode="Norm")`` as vllm-ascend's ``BaseDeviceAdaptor.reshape_and_cache`` (doc: {scatter});
    every slot must lie in ``[0, num_blocks * block_size)``: the caller redirects padding to its padding slot.
    ``scatter=False`` (310P, a FRACTAL_NZ pool's pages, written in place as vllm-ascend's 310P runner writes its NZ
    caches; a token-major 310P pool is written row by row with :func:`scatter_rows`):
    ``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`` (schema: op-plugin
    ``op_plugin/ops/atb/ReshapeAndCachAtb.cpp``; ATB doc: {rc}, whose "取值为负数时不进行任何搬运操作" makes a
    negative slot a documented skip; called as in {vllm}).
    Slot ``s`` goes to block ``s // block_size``, offset ``s % block_size``. Both ops take one dtype for the four
    tensors: key/value are cast to the cache dtype and slots to int32 here (device-side, no sync).
    """
    slots = _slots_int32(slots, key_cache, key)
    key, value = key.to(key_cache.dtype).contiguous(), value.to(value_cache.dtype).contiguous()
    if scatter:
        ops.npu_scatter_pa_kv_cache(
            key=key,
            value=value,
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slots.contiguous(),
            cache_mode="Norm",
        )
        return
    ops._npu_reshape_and_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots)


_SCATTER_DOC = "https://github.com/Ascend/op-plugin/blob/517f2e7/docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_pa_kv_cache.md"
_cite(write_kv, rc=_ATB_RC_DOC, vllm=_VLLM_ASCEND, scatter=_SCATTER_DOC)


def scatter_rows(ops: Any, buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``buffer[slots[i]] = rows[i]`` in place: ``torch_npu.npu_scatter_nd_update_(buffer, slots.view(-1, 1), rows)``.

    ``buffer`` ``[num_slots, ...]`` (a pool buffer, ND), ``rows`` ``[n, *buffer.shape[1:]]`` (cast to its dtype),
    ``slots`` ``[n]`` int32/int64, every one in ``[0, num_slots)``: the op takes no out-of-bounds index
    (doc: op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_nd_update_.md``), so the caller redirects
    padding to its padding slot. SGLang writes its NPU MLA pool so (two calls, latent and rope part); the ascend
    backend writes MLA pools on A3 and token-major pools on 310P so."""
    ops.npu_scatter_nd_update_(buffer, slots.view(-1, 1), rows.to(buffer.dtype).reshape(-1, *buffer.shape[1:]))


def nz_pages(ops: Any, pages: torch.Tensor) -> torch.Tensor:
    """ND pages ``[n, block_size, kv_heads, head_size]`` as the FRACTAL_NZ cache ATB takes on 310P,
    ``[n, kv_heads * head_size / 16, block_size, 16]`` (vllm-ascend ``_310p/attention/attention_v1.py``
    ``get_kv_cache_shape``, allocated with ``acl_format=ACL_FORMAT_FRACTAL_NZ``): a copy, cast with
    ``torch_npu.npu_format_cast``. ``kv_heads * head_size`` must be a multiple of 16."""
    n, block_size, heads, dim = pages.shape
    nz = pages.reshape(n, block_size, heads * dim // 16, 16).permute(0, 2, 1, 3).contiguous()
    return ops.npu_format_cast(nz, ACL_FORMAT_FRACTAL_NZ)


def nz_mask(ops: Any, mask: torch.Tensor) -> torch.Tensor:
    """A splitfuse mask ``[T, W]`` as 310P takes it: zero-padded to multiples of 16 and laid out
    ``[1, ceil16(W) / 16, ceil16(T), 16]`` in FRACTAL_NZ (vllm-ascend ``vllm_ascend/utils.py`` ``nd_to_nz_spec``
    then ``npu_format_cast``, ``_310p/attention/attention_mask.py`` ``get_splitfuse_mask``)."""
    tokens, width = mask.shape
    padded = torch.nn.functional.pad(mask, (0, -width % 16, 0, -tokens % 16))
    nz = padded.reshape(padded.shape[0], padded.shape[1] // 16, 16).permute(1, 0, 2).unsqueeze(0).contiguous()
    return ops.npu_format_cast(nz, ACL_FORMAT_FRACTAL_NZ)


# ----------------------------------------------------------------------------- TND call plans

TND_MAX_BATCH = emulation.TND_MAX_BATCH  # FIA / FIA v2 TND: at most 4096 requests per call


@dataclass(frozen=True)
class _Piece:
    """One TND request of a call: query rows ``first .. first + q - 1`` of request ``request`` over its first ``kv``
    keys; ``pad``: a copy of the first row goes before them (its output is dropped)."""

    request: int
    first: int
    q: int
    kv: int
    pad: bool = False


def _tnd_pieces(q_lens: list[int], kv_lens: list[int], *, window: bool, max_query: int | None) -> list[_Piece]:
    """The requests of a TND call as the op can take them.

    * A one-token request gets a padding row before its token (Q_S = 2; the padding row's output is dropped) where
      Q_S = 1 would not serve it: over more than 262144 keys (the Q_S = 1 limit, contracts ``kv_len``), and under a
      ``window``, whose band the op ignores at Q_S = 1 (op-plugin FIA docs, "Q_S = 1且不带rope输入时，sparse_mode参数
      无效"). In a call of one-token requests only, every request is padded (the same shapes whatever the lengths, as a
      graph needs) and the call passes ``next_tokens >= 1`` (the op's rule ``next_tokens + KV_S - Q_S >= 0`` at
      KV_S = 1; the real token is the last row, so it sees no key past its own either way). In a call with longer
      requests the doc does not say whether a one-token row is banded (contracts ``sparse_rows``): hal takes the safe
      side and pads each windowed one-token request over two keys or more (``next_tokens`` stays 0 there).
    * ``max_query``: requests longer than that are cut into consecutive pieces of at most ``max_query`` tokens, each
      over the keys up to its last token (right-down causal alignment is unchanged), as the absorbed MLA path's
      "TND layout's limit of 16" asks (vllm-ascend ``attention/mla_v1.py``).
    Lengths past FIA's Q_S > 1 limit (20971520 query or KV tokens) are refused with the reason."""
    for q, kv in zip(q_lens, kv_lens, strict=True):
        if max(q, kv) > FIA_MAX_SEQ:
            raise UnsupportedError(
                f"FIA (TND): a request of {q} query tokens over {kv} keys: the op takes at most {FIA_MAX_SEQ} of each "
                "(op-plugin FIA doc, '各轴取值范围速查')"
            )
    decode = max(q_lens, default=0) <= 1
    pieces, row = [], 0
    for r, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        step = max_query or max(q, 1)
        for start in range(0, max(q, 1), step) if q else [0]:
            n = min(step, q - start) if q else 0
            keys = kv - (q - start - n)
            pad = n == 1 and (keys > FIA_DECODE_MAX_KV or (window and (decode or keys >= 2)))
            pieces.append(_Piece(r, row + start, n, keys, pad))
        row += q
    return pieces


def _run_tnd(
    call,
    queries: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    q_lens,
    kv_lens,
    *,
    window: bool,
    max_query: int | None = None,
) -> torch.Tensor:
    """``call(queries, block_table, q_lens, kv_lens, padded)`` -> ``[T, N, Dv]`` over the TND plan of
    :func:`_tnd_pieces`, in calls of at most :data:`TND_MAX_BATCH` requests; the output rows are the original query
    rows, in order. ``padded``: every request of the call carries a padding row (see :func:`_tnd_pieces`)."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    pieces = _tnd_pieces(q_lens, kv_lens, window=window, max_query=max_query)
    padded = bool(pieces) and all(p.pad for p in pieces)  # a decode call, every request padded
    if len(pieces) == len(q_lens) and len(q_lens) <= TND_MAX_BATCH and (padded or not any(p.pad for p in pieces)):
        if not padded:
            return call(queries, block_table, q_lens, kv_lens, False)
        # a padded decode (one token per request): row b twice; device-side indices, so a graph can capture it
        rows = torch.arange(len(q_lens), device=queries[0].device).repeat_interleave(2)
        out = call([q.index_select(0, rows) for q in queries], block_table, [2] * len(q_lens), kv_lens, True)
        return out[1::2]
    outs = []
    for at in range(0, len(pieces), TND_MAX_BATCH):
        chunk = pieces[at : at + TND_MAX_BATCH]
        rows = [i for p in chunk for i in ([p.first] if p.pad else []) + list(range(p.first, p.first + p.q))]
        keep = [
            j for j, (p, k) in enumerate((p, k) for p in chunk for k in range(p.pad + p.q)) if not (p.pad and k == 0)
        ]
        with opaque_kernel():  # host-built gather indices of an eager step (FIA is never captured by hal)
            device = queries[0].device
            row_idx = torch.tensor(rows, dtype=torch.long).to(device)
            req_idx = torch.tensor([p.request for p in chunk], dtype=torch.long).to(device)
            keep_idx = torch.tensor(keep, dtype=torch.long).to(device)
        out = call(
            [q.index_select(0, row_idx) for q in queries],
            block_table.index_select(0, req_idx),
            [p.q + p.pad for p in chunk],
            [p.kv for p in chunk],
            padded,
        )
        outs.append(out.index_select(0, keep_idx))
    return torch.cat(outs)


def _paged_args(query, key_cache, block_table, context_lens, scale: float, kv_heads: int | None) -> dict[str, Any]:
    """The arguments ATB PagedAttention's bindings share (``_npu_paged_attention`` and its MLA variant).
    ``kv_heads`` None: an ND cache's dim 2 (a 310P FRACTAL_NZ cache does not hold the head count in a dim)."""
    return dict(
        query=query,
        key_cache=key_cache,
        num_kv_heads=key_cache.shape[2] if kv_heads is None else kv_heads,
        num_heads=query.shape[1],
        scale_value=float(scale),
        block_table=block_table,
        context_lens=_host_int32("context_lens", context_lens),
    )


def paged_decode(
    ops: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int] | torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
    num_kv_heads: int | None = None,
    max_batch: int | None = None,
) -> torch.Tensor:
    """Decode: ``query`` ``[B, Hq, D]``, one token per request, over the paged caches -> ``out``.

    ``torch_npu._npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads,
    scale_value, block_table, context_lens, out)`` (schema: op-plugin
    ``op_plugin/ops/atb/PagedAttentionAtb.cpp``; ATB doc: {io}; called as in {vllm} and
    {sglang}). ``context_lens`` are the total KV lengths (host); ``out`` is written in place
    (allocated when None). ``max_batch``: at most that many requests per call (310P: ATB's "0<batch<=2048",
    ``contracts.ATB_310P_MAX_BATCH``), a larger batch going in several calls.
    """
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    lens = _host_lengths("context_lens", context_lens)
    for r0, r1, _, _ in _request_chunks([1] * len(lens), max_batch):
        ops._npu_paged_attention(
            **_paged_args(query[r0:r1], key_cache, block_table[r0:r1], lens[r0:r1], scale, num_kv_heads),
            value_cache=value_cache,
            out=out[r0:r1],
        )
    return out


def _nz_or_nd(ops: Any, mask: torch.Tensor, nz: bool) -> torch.Tensor:
    return nz_mask(ops, mask) if nz else mask


def _request_chunks(q_lens: list[int], limit: int | None) -> list[tuple[int, int, int, int]]:
    """``(first request, end request, first token, end token)`` of consecutive calls of at most ``limit`` requests
    (one call when ``limit`` is None)."""
    ends = list(itertools.accumulate(q_lens, initial=0))
    step = limit or max(len(q_lens), 1)
    return [
        (r, min(r + step, len(q_lens)), ends[r], ends[min(r + step, len(q_lens))]) for r in range(0, len(q_lens), step)
    ] or [(0, 0, 0, 0)]


_cite(paged_decode, io=_ATB_PA_IO_DOC, vllm=_VLLM_ASCEND, sglang=_SGLANG)


def paged_prefill(
    ops: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    kv_lens: Sequence[int] | torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int = -1,
) -> torch.Tensor:
    """Extend (prefix + new tokens, the new ones already in the cache), or decode -> ``[T, Hq, D]``.

    ``torch_npu.npu_fused_infer_attention_score(query, key, value, *, atten_mask,
    block_table, input_layout="TND", block_size, actual_seq_lengths, actual_seq_lengths_kv,
    num_key_value_heads, num_heads, scale, sparse_mode, pre_tokens, next_tokens)`` (doc: {fia}; called as in
    {vllm} ``forward_fused_infer_attention``). TND conventions: ``actual_seq_lengths`` =
    cumulative query ends (host list), ``actual_seq_lengths_kv`` = per-request KV lengths
    (host list) because the KV is paged; caches are passed as ``(blocks, block_size,
    kv_heads * dim)`` views. Causal: ``sparse_mode=3`` + :func:`fia_causal_mask`
    (rightDownCausal, query ``i`` sees KV ``j <= kv_len - q_len + i``); a sliding window: ``sparse_mode=4`` with
    ``pre_tokens = sliding_window, next_tokens = 0`` (as vllm-ascend); non-causal: ``sparse_mode=0``, no mask. The op
    ignores the band at one query token per request, so a windowed decode goes with a padding row per request
    (:func:`_tnd_pieces`); batches above 4096 requests go in several calls.
    """
    num_blocks, block_size = key_cache.shape[:2]

    def call(queries, table, q_lens, kv_lens, with_pad):
        out, _ = ops.npu_fused_infer_attention_score(
            queries[0],
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            block_table=table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=list(itertools.accumulate(q_lens)),
            actual_seq_lengths_kv=kv_lens,
            num_key_value_heads=key_cache.shape[2],
            num_heads=query.shape[1],
            scale=float(scale),
            **_fia_visibility(query.device, causal, sliding_window, with_pad),
        )
        return out

    q_lens, k_lens = _host_lengths("query_lens", query_lens), _host_lengths("kv_lens", kv_lens)
    return _run_tnd(call, [query.contiguous()], block_table, q_lens, k_lens, window=sliding_window >= 0)


_cite(paged_prefill, fia=_FIA_DOC, vllm=_VLLM_ASCEND)


def paged_mixed(
    ops: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    kv_lens: Sequence[int] | torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    sliding_window: int = -1,
    custom_mask: torch.Tensor | None = None,
    num_kv_heads: int | None = None,
    max_batch: int | None = None,
    nz: bool = False,
) -> torch.Tensor:
    """Mixed batch (decodes and chunked prefills, query tokens concatenated) -> ``out`` ``[T, Hq, D]``.

    ``torch_npu._npu_paged_attention_splitfuse(query, key_cache, value_cache, block_table,
    context_lens, mask, seq_len, num_kv_heads, num_heads, scale_value, out)`` (schema:
    op-plugin ``op_plugin/ops/atb/PagedAttentionSplitfuse.cpp``; called as in vllm-ascend 182b75e
    ``vllm_ascend/_310p/attention/attention_v1.py`` ``forward_chunked_prefill_310`` and {sglang} ``forward_mixed``).
    ``seq_len`` = query lengths and ``context_lens`` = total KV lengths, both host int32 tensors. ``mask`` defaults to
    :func:`splitfuse_mask` built from the lengths (and ``causal`` / ``sliding_window`` /
    ``custom_mask``); pass one prebuilt per batch to avoid a host-to-device copy per layer. ``nz``: the caches are
    310P's FRACTAL_NZ ones and the (ND ``[T, W]``) mask is cast to NZ per call (:func:`nz_mask`). ``max_batch``: at
    most that many requests per call (310P: ``contracts.ATB_310P_MAX_BATCH``), the batch split between requests.
    """
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if mask is None:
        mask = splitfuse_mask(
            query_lens,
            kv_lens,
            query.dtype,
            query.device,
            causal=causal,
            sliding_window=sliding_window,
            custom_mask=custom_mask,
        )
    q_lens, k_lens = _host_lengths("query_lens", query_lens), _host_lengths("kv_lens", kv_lens)
    heads = key_cache.shape[2] if num_kv_heads is None else num_kv_heads
    for r0, r1, t0, t1 in _request_chunks(q_lens, max_batch):
        ops._npu_paged_attention_splitfuse(
            query=query[t0:t1],
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=block_table[r0:r1],
            context_lens=_host_int32("kv_lens", k_lens[r0:r1]),
            mask=_nz_or_nd(ops, mask if r1 - r0 == len(q_lens) else mask[t0:t1], nz),
            seq_len=_host_int32("query_lens", q_lens[r0:r1]),
            num_kv_heads=heads,
            num_heads=query.shape[1],
            scale_value=float(scale),
            out=out[t0:t1],
        )
    return out


_cite(paged_mixed, vllm=_VLLM_ASCEND, sglang=_SGLANG)


def write_latent(ops: Any, key: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store MLA keys ``key`` ``[n, 1, kv_lora_rank + qk_rope_head_dim]`` (latent ++ rope part) at ``slots`` of the
    one paged cache ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, in place.

    ``torch_npu._npu_reshape_and_cache_siso(key, key_cache, slot_indices)``: ATB ReshapeAndCache with
    ``K_CACHE_V_BYPASS`` (schema: op-plugin ``op_plugin/ops/atb/ReshapeAndCacheSisoAtb.cpp``; ATB doc: {rc}, a
    negative slot is skipped). ``slots`` are cast to int32 on the device, ``key`` to the cache dtype.
    """
    ops._npu_reshape_and_cache_siso(
        key=key.to(cache.dtype).contiguous(), key_cache=cache, slot_indices=_slots_int32(slots, cache, key)
    )


def mla_decode(
    ops: Any,
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int] | torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA decode, one absorbed query token per request ``[B, Hq, kv_lora_rank + rope]`` over the one paged cache
    ``[num_blocks, block_size, 1, kv_lora_rank + rope]`` -> ``out`` ``[B, Hq, kv_lora_rank]`` (written in place,
    allocated when None).

    ``torch_npu._npu_paged_attention_mla(query, key_cache, num_kv_heads, num_heads, scale_value, block_table,
    context_lens, mla_vheadsize, out)`` (schema: op-plugin ``op_plugin/ops/atb/PagedAttentionMlaAtb.cpp``; called
    as in {sglang} ``forward_decode``, which concatenates its two caches into this layout first): the value is the
    first ``mla_vheadsize`` columns of the key cache. ``context_lens`` are host lengths.
    """
    query = query.contiguous()
    if out is None:
        out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
    ops._npu_paged_attention_mla(
        **_paged_args(query, cache, block_table, context_lens, scale, None), mla_vheadsize=kv_lora_rank, out=out
    )
    return out


def mla_attention(
    ops: Any,
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    kv_lens: Sequence[int] | torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA over paged latent and rope caches, any query lengths (TND) -> ``[T, Hq, kv_lora_rank]``.

    ``query`` ``[T, Hq, kv_lora_rank + rope]``; ``latent_cache`` ``[num_blocks, block_size, 1, kv_lora_rank]`` and
    ``rope_cache`` ``[num_blocks, block_size, 1, rope]``, both contiguous.
    ``torch_npu.npu_fused_infer_attention_score_v2(q_nope, latent, latent, query_rope=q_rope, key_rope=rope,
    input_layout="TND", num_key_value_heads=1, ...)``
    (doc: {fia2}; called so by {vllm} ``_forward_decode``, TND + ``sparse_mode=3`` for multi-token queries).
    Visibility: ``sparse_mode`` 3 (causal: query ``i`` sees KV ``j <= kv_len - q_len + i``), 4 with
    ``pre_tokens = sliding_window`` (the band SGLang and vllm-ascend pass for windows), 0 (non-causal), or 9 with
    ``tree_mask`` (flat ``(sum(q_len ** 2),)``, True = hidden, every query seeing the prefix). Query heads are
    padded with zeros to a power of two as both upstreams do (D = 512 takes Q_N in 1, 2, 4 ... 128).
    """
    rank = latent_cache.shape[-1]
    heads = query.shape[1]
    padded = 1 << (heads - 1).bit_length()
    if padded != heads:
        query = torch.nn.functional.pad(query, (0, 0, 0, padded - heads))
    blocks, block_size = latent_cache.shape[:2]
    extra = _fia_visibility(query.device, causal, sliding_window)  # rope inputs: the band holds at Q_S = 1 too
    if tree_mask is not None:
        extra = {"sparse_mode": 9, "atten_mask": tree_mask}

    def call(queries, table, q_lens, kv_lens, with_pad):
        out, _ = ops.npu_fused_infer_attention_score_v2(
            queries[0],
            latent_cache.view(blocks, block_size, -1),
            latent_cache.view(blocks, block_size, -1),
            query_rope=queries[1],
            key_rope=rope_cache.view(blocks, block_size, -1),
            block_table=table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_qlen=list(itertools.accumulate(q_lens)),
            actual_seq_kvlen=kv_lens,
            num_query_heads=padded,
            num_key_value_heads=latent_cache.shape[2],
            softmax_scale=float(scale),
            **extra,
        )
        return out

    q_lens, k_lens = _host_lengths("query_lens", query_lens), _host_lengths("kv_lens", kv_lens)
    if tree_mask is not None and max(q_lens, default=0) > MLA_TND_MAX_QUERY:
        raise UnsupportedError(
            f"mla_attention: a verify step of {max(q_lens)} draft tokens: FIA v2's tree mask (sparse_mode 9) takes at "
            f"most {MLA_TND_MAX_QUERY} query tokens per request in TND (vllm-ascend attention/mla_v1.py)"
        )
    queries = [query[..., :rank].contiguous(), query[..., rank:].contiguous()]
    out = _run_tnd(call, queries, block_table, q_lens, k_lens, window=False, max_query=MLA_TND_MAX_QUERY)
    return out[:, :heads]


def _fia_visibility(device, causal: bool, sliding_window: int, padded: bool = False) -> dict[str, Any]:
    """FIA's TND mask arguments (v1 and v2 alike): ``sparse_mode`` 4 (band, ``pre_tokens = sliding_window``,
    ``next_tokens = 0``, as SGLang and vllm-ascend pass for windows; every later key too when not causal; 1 for a
    ``padded`` decode, see :func:`_tnd_pieces`), 3 (rightDownCausal) or 0 (no mask); 3 and 4 take the compressed
    mask."""
    if sliding_window >= 0:
        later = int(padded) if causal else emulation.INT_MAX
        return dict(sparse_mode=4, atten_mask=fia_causal_mask(device), pre_tokens=sliding_window, next_tokens=later)
    if causal:
        return dict(sparse_mode=3, atten_mask=fia_causal_mask(device))
    return dict(sparse_mode=0)


def paged_attention_sinks(
    ops: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    kv_lens: Sequence[int] | torch.Tensor,
    sinks: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int = -1,
) -> torch.Tensor:
    """Attention with a learned sink logit per query head (gpt-oss), any query lengths (TND) -> ``[T, Hq, D]``.

    ``torch_npu.npu_fused_infer_attention_score_v2(query, key, value, learnable_sink=sinks, input_layout="TND",
    sparse_mode=3 or 4, pre_tokens=sliding_window, next_tokens=0, ...)`` over the paged caches viewed as
    ``(blocks, block_size, kv_heads * dim)`` (doc: {fia2}, "learnable_sink约束": TND, value D <= 128, bfloat16 sinks;
    called so by {vllm} and {sglang} ``forward_extend`` / ``forward_decode``). ``sinks`` ``[Hq]`` are passed as
    bfloat16 (float32 with float32 queries, which only the CPU emulation takes).
    """
    blocks, block_size = key_cache.shape[:2]
    sink_dtype = torch.float32 if query.dtype == torch.float32 else torch.bfloat16
    sinks = sinks.to(sink_dtype).contiguous()

    def call(queries, table, q_lens, kv_lens, with_pad):
        out, _ = ops.npu_fused_infer_attention_score_v2(
            queries[0],
            key_cache.view(blocks, block_size, -1),
            value_cache.view(blocks, block_size, -1),
            block_table=table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_qlen=list(itertools.accumulate(q_lens)),
            actual_seq_kvlen=kv_lens,
            num_query_heads=query.shape[1],
            num_key_value_heads=key_cache.shape[2],
            softmax_scale=float(scale),
            learnable_sink=sinks,
            **_fia_visibility(query.device, causal, sliding_window, with_pad),
        )
        return out

    q_lens, k_lens = _host_lengths("query_lens", query_lens), _host_lengths("kv_lens", kv_lens)
    return _run_tnd(call, [query.contiguous()], block_table, q_lens, k_lens, window=sliding_window >= 0)


_cite(paged_attention_sinks, fia2=_FIA_V2_DOC, vllm=_VLLM_ASCEND, sglang=_SGLANG)
_cite(write_latent, rc=_ATB_RC_DOC)
_cite(mla_decode, sglang=_SGLANG)
_cite(mla_attention, fia2=_FIA_V2_DOC, vllm=_VLLM_ASCEND_MLA)


def __getattr__(name: str):
    # ``paged_view``: the deprecated name of buffer_pages, which clashed with hal.kv_cache.paged_view(pool, layer_id).
    if name == "paged_view":
        import warnings

        warnings.warn(
            "hal.kernels.npu.ops.paged_view is deprecated since hal 0.2.0 and goes in 0.3.0: use buffer_pages "
            "(hal.kv_cache.paged_view(pool, layer_id) is the pool-level view; see CHANGELOG.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        return buffer_pages
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
