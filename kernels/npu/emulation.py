"""A plain-torch CPU emulation of the torch_npu ops hal's Ascend backend calls.

``torch_npu`` (the namespace object at the bottom) carries the ops under their real
names, with the real argument names, argument order, layouts and host/device rules, so
backend code is written once::

    ops = real_torch_npu_module_or(emulation.torch_npu)
    ops._npu_paged_attention(query=..., key_cache=..., ...)

Every op checks its inputs as strictly as its documentation describes and raises a
``ValueError`` / ``TypeError`` naming the argument, what it got and what it expected;
a combination the real op accepts but this emulation does not compute raises
``NotImplementedError`` instead of computing something else. Numerics: blocks are
gathered through the block table, everything is widened to float32, the result is
written in the query dtype. The emulation also accepts float32 tensors (the real ops
take float16/bfloat16 only) so hal can run it on CPUs; ``hal.kernels.npu.unsupported_reasons``
reports the real restriction.

Sources (fetched 2025-2026; the ``_npu_*`` ops are ATB operations bound by op-plugin):

* ``_npu_reshape_and_cache``, ``_npu_paged_attention``, ``_npu_paged_attention_splitfuse``:
  schemas in https://github.com/Ascend/op-plugin/blob/master/op_plugin/ops/atb/ReshapeAndCachAtb.cpp,
  .../PagedAttentionAtb.cpp, .../PagedAttentionSplitfuse.cpp; CPU tensors become ATB
  ``hostData`` (.../op_plugin/utils/custom_functions/atb/AtbCommon.cpp); ATB operation
  docs: https://www.hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/ascendtbapi/ascendtb_01_0073.html
  (ReshapeAndCache), .../canncommercial/80RC2/apiref/ascendtbapi/ascendtb_01_0070.html and
  .../CANNCommunityEdition/82RC1/API/ascendtbapi/ascendtb_01_0206.html (PagedAttention:
  contextLens ``[batch]`` int32 *cpu*, blockTables int32 npu, block_size % 16 == 0,
  head_size in (0, 256], head_size * block_size <= 128 * 128),
  .../canncommercial/80RC3/apiref/ascendtbapi/ascendtb_01_0085.html (MASK_TYPE_SPEC mask
  ``[num_tokens, max_seq_len]``).
* ``npu_fused_infer_attention_score``:
  https://github.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu_fused_infer_attention_score.md
  (also https://hiascend.com/document/detail/zh/Pytorch/60RC3/apiref/apilist/ptaoplist_000768.html),
  sparse modes: https://gitcode.com/cann/ops-transformer docs/zh/context/sparse_mode参数说明.md.
* ``npu_scatter_pa_kv_cache``: https://github.com/Ascend/op-plugin/blob/master/docs/zh/custom_APIs/torch_npu/
  torch_npu-npu_scatter_pa_kv_cache.md (op-plugin 517f2e7, 2026-08-21), called with ``cache_mode="Norm"`` (ND
  ``[num_blocks, block_size, kv_heads, head_size]`` caches) as vllm-ascend's ``BaseDeviceAdaptor.reshape_and_cache``
  (vllm_ascend/device/device_op.py at 182b75e, 2026-08-22) does on A2/A3.
* Callers whose conventions are mirrored: vllm-ascend ``vllm_ascend/attention/attention_v1.py``
  and ``attention_mask.py``; SGLang ``python/sglang/srt/layers/attention/ascend_backend.py``.
"""

from __future__ import annotations

import itertools
import math
import numbers
import types
from collections.abc import Sequence

import torch

__all__ = [
    "torch_npu",
    "npu_fused_infer_attention_score",
    "_npu_reshape_and_cache",
    "npu_scatter_pa_kv_cache",
    "_npu_paged_attention",
    "_npu_paged_attention_splitfuse",
    "FIA_MASK_SIZE",
    "INT_MAX",
]

INT_MAX = 2147483647
FIA_MASK_SIZE = 2048  # sparse_mode 2/3/4 take an "optimised" 2048 x 2048 lower-triangle mask

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # float32: emulation only
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.float32)
_MASK_FLAG_DTYPES = (torch.bool, torch.int8, torch.uint8)
_TND_MAX_TOKENS = 1 << 20  # "T小于等于1M"
_FIA_MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64
_ATB_MAX_HEAD_SIZE = 256
_ATB_MAX_BLOCK_ELEMS = 128 * 128  # "embedding * blockSize <= 128 * 128"


# ----------------------------------------------------------------------------- checks


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(dtype={x.dtype}, shape={list(x.shape)}, device={x.device})"
    text = repr(x)
    return text if len(text) <= 100 else text[:97] + "..."


def _bad(op: str, arg: str, got: object, expected: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"{op}: {arg} = {_describe(got)}: expected {expected}")


def _tensor(op: str, arg: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _bad(op, arg, x, "a torch.Tensor", TypeError)
    return x


def _dims(op: str, arg: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise _bad(op, arg, x, f"a {ndim}-D tensor {layout}")


def _dtype(op: str, arg: str, x: torch.Tensor, allowed: Sequence[torch.dtype], why: str = "") -> None:
    if x.dtype not in allowed:
        names = "/".join(str(d).replace("torch.", "") for d in allowed)
        raise _bad(op, arg, x, f"dtype {names}{why}")


def _int(op: str, arg: str, x: object, minimum: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise _bad(op, arg, x, "a python int", TypeError)
    if minimum is not None and int(x) < minimum:
        raise _bad(op, arg, x, f"an int >= {minimum}")
    return int(x)


def _float(op: str, arg: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise _bad(op, arg, x, "a finite python float", TypeError)
    return float(x)


def _host_int32(op: str, arg: str, x: object, length: int | None = None) -> list[int]:
    """An ATB length tensor that the op reads as hostData: int32, 1-D, on the CPU."""
    if not isinstance(x, torch.Tensor):
        raise _bad(op, arg, x, "a torch.Tensor (int32, on the CPU: ATB reads it as host data), not a list", TypeError)
    if x.device.type != "cpu":
        raise _bad(op, arg, x, "a host (CPU) tensor: ATB reads it as hostData; pass the *_cpu lengths")
    if x.dtype != torch.int32:
        raise _bad(op, arg, x, "dtype int32")
    if x.dim() != 1 or (length is not None and x.shape[0] != length):
        raise _bad(op, arg, x, "shape [batch]" + (f" = [{length}]" if length is not None else ""))
    values = x.tolist()
    if any(v < 0 for v in values):
        raise _bad(op, arg, values, "non-negative lengths")
    return values


def _int_list(op: str, arg: str, x: object) -> list[int]:
    """A ``SymInt[]`` argument: a host list/tuple of python ints."""
    if isinstance(x, torch.Tensor):
        raise _bad(op, arg, x, "a host list of ints (SymInt[]), e.g. lengths_cpu.tolist(), not a tensor", TypeError)
    if not isinstance(x, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in x):
        raise _bad(op, arg, x, "a list of python ints (SymInt[])", TypeError)
    return [int(v) for v in x]


def _block_table(
    op: str,
    block_table: object,
    batch: int,
    kv_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
) -> torch.Tensor:
    block_table = _tensor(op, "block_table", block_table)
    _dtype(op, "block_table", block_table, (torch.int32,))
    _dims(op, "block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    need = max((-(-n // block_size) for n in kv_lens), default=0)
    if block_table.shape[0] != batch:
        raise _bad(op, "block_table", block_table, f"{batch} rows (one per request)")
    if block_table.shape[1] < need:
        raise _bad(op, "block_table", block_table, f">= {need} columns (max kv length / block_size, rounded up)")
    for r, n in enumerate(kv_lens):
        used = block_table[r, : -(-n // block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise _bad(op, f"block_table[{r}]", used.tolist(), f"block ids in [0, {num_blocks})")
    return block_table


def _head_counts(op: str, num_heads: object, num_kv_heads: object, heads_in_query: int) -> tuple[int, int]:
    num_heads = _int(op, "num_heads", num_heads, 1)
    num_kv_heads = _int(op, "num_kv_heads", num_kv_heads, 0) or num_heads  # 0: same as num_heads
    if num_heads != heads_in_query:
        raise _bad(op, "num_heads", num_heads, f"the query's head count {heads_in_query}")
    if num_heads % num_kv_heads:
        raise _bad(op, "num_kv_heads", num_kv_heads, f"a divisor of num_heads = {num_heads}")
    return num_heads, num_kv_heads


# ----------------------------------------------------------------------------- compute


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int, heads_major: bool = False) -> torch.Tensor:
    """Tokens ``0 .. length-1`` of one request from a paged cache.

    ``cache`` is ``[blocks, block_size, ...]`` or, with ``heads_major``, ``[blocks, heads, block_size, dim]``.
    Returns ``[length, ...]`` (``[length, heads, dim]`` for the heads-major layout).
    """
    block_size = cache.shape[2] if heads_major else cache.shape[1]
    n = -(-length // block_size)
    pages = cache.index_select(0, block_ids[:n].long())
    if heads_major:
        pages = pages.permute(0, 2, 1, 3)
    return pages.reshape(n * block_size, *pages.shape[2:])[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention of one request, float32.

    ``q`` ``[S, Hq, D]``, ``k`` ``[L, Hkv, D]``, ``v`` ``[L, Hkv, Dv]``; query head ``h`` reads KV
    head ``h // (Hq // Hkv)``. ``bias`` ``[S, L]`` is added to the scaled scores. Returns the
    output ``[S, Hq, Dv]`` and the natural-log LSE of the scaled, biased scores ``[S, Hq]``.
    """
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(s, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, S, D]
    kt = k.float().permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, L]
    vg = v.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, Dv]
    scores = torch.matmul(qg, kt) * scale  # [Hkv, G, S, L]
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), vg)  # [Hkv, G, S, Dv]
    return out.permute(2, 0, 1, 3).reshape(s, hq, -1), lse.squeeze(-1).permute(2, 0, 1).reshape(s, hq)


# ----------------------------------------------------------------------------- ATB ops


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """ATB ReshapeAndCache: ``key_cache[s // block_size, s % block_size] = key[i]``, ``s = slot_indices[i]``.

    ``key`` ``[num_tokens, kv_heads, head_size]``, ``value`` ``[num_tokens, kv_heads, v_head_size]``,
    ``key_cache`` ``[num_blocks, block_size, kv_heads, head_size]`` (value_cache alike), all of one
    dtype (no cast: "key、value、keyCache、valueCache ... 的数据类型都必须完全一致"); ``slot_indices``
    int32 ``[num_tokens]`` on the device, each in ``[0, num_blocks * block_size)`` and no two equal;
    a negative slot is skipped (vLLM's pad slot; "取值为负数时不进行任何搬运操作"). In place; returns None.
    """
    op = "_npu_reshape_and_cache"
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(op, name, x)
    _dims(op, "key", key, 3, "[num_tokens, kv_heads, head_size]")
    _dims(op, "value", value, 3, "[num_tokens, kv_heads, head_size]")
    _dims(op, "key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_size]")
    _dims(op, "value_cache", value_cache, 4, "[num_blocks, block_size, kv_heads, head_size]")
    _dtype(op, "key_cache", key_cache, _CACHE_DTYPES)
    for name, x in (("key", key), ("value", value), ("value_cache", value_cache)):
        if x.dtype != key_cache.dtype:
            raise _bad(
                op,
                name,
                x,
                f"dtype {key_cache.dtype} (all four tensors share one dtype; the op does not cast)",
            )
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise _bad(
            op,
            "value_cache",
            value_cache,
            f"the same [num_blocks, block_size] as key_cache {list(key_cache.shape[:2])}",
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise _bad(op, "key", key, f"[num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}] to match key_cache")
    if value.shape[1:] != value_cache.shape[2:]:
        raise _bad(
            op,
            "value",
            value,
            f"[num_tokens, {value_cache.shape[2]}, {value_cache.shape[3]}] to match value_cache",
        )
    if value.shape[0] != key.shape[0]:
        raise _bad(op, "value", value, f"{key.shape[0]} tokens like key")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not x.is_contiguous():
            raise _bad(op, name, x, "a contiguous tensor (it is written in place)")
    slot_indices = _tensor(op, "slot_indices", slot_indices)
    _dtype(op, "slot_indices", slot_indices, (torch.int32,))
    if slot_indices.dim() != 1 or slot_indices.shape[0] != key.shape[0]:
        raise _bad(op, "slot_indices", slot_indices, f"shape [num_tokens] = [{key.shape[0]}]")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    keep = slots >= 0
    used = slots[keep]
    if used.numel():
        if int(used.max()) >= num_slots:
            raise _bad(op, "slot_indices", slot_indices.tolist(), f"slots < num_blocks * block_size = {num_slots}")
        if torch.unique(used).numel() != used.numel():
            raise _bad(op, "slot_indices", slot_indices.tolist(), "no repeated slot")
    key_cache.view(num_slots, *key_cache.shape[2:])[used] = key[keep]
    value_cache.view(num_slots, *value_cache.shape[2:])[used] = value[keep]


def npu_scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_mode: str | None = "PA_NZ",
) -> None:
    """``key_cache[s // block_size, s % block_size] = key[i]`` for ``s = slot_mapping[i]`` (scenario 1, ND).

    Contract (op-plugin doc, see the module docstring): ``key`` ``[num_tokens, kv_heads, head_size]`` and
    ``value`` ``[num_tokens, kv_heads, v_head_size]`` (3-D: scenario 1; the 4-D compressing scenario 2 is not
    emulated), caches 4-D, every tensor contiguous ("输入参数不支持非连续"), the four of one dtype; ``slot_mapping``
    int32 or int64 ``[num_tokens]`` with values in ``[0, num_blocks * block_size - 1]`` (a negative slot is outside
    the documented range: it raises here, there is no documented skip); repeated slots are allowed but "重复时不保证
    正确性": the emulation writes one of them (unspecified which). ``cache_mode`` ``"Norm"`` (or None) is the ND
    layout ``[num_blocks, block_size, kv_heads, head_size]``; the default ``"PA_NZ"`` (FRACTAL_NZ caches) is not
    emulated. In place; returns None.
    """
    op = "npu_scatter_pa_kv_cache"
    if cache_mode not in (None, "Norm"):
        raise NotImplementedError(f"{op}: cache_mode = {cache_mode!r}: the emulation implements the ND 'Norm' layout")
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError(f"{op}: compress_lens / compress_seq_offsets / seq_lens: not emulated (scenario 2)")
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(op, name, x)
        if not x.is_contiguous():
            raise _bad(op, name, x, "a contiguous tensor (the op takes no non-contiguous input)")
    _dims(op, "key", key, 3, "[num_tokens, kv_heads, head_size] (scenario 1)")
    _dims(op, "value", value, 3, "[num_tokens, kv_heads, v_head_size] (scenario 1)")
    _dims(op, "key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (cache_mode 'Norm')")
    _dims(op, "value_cache", value_cache, 4, "[num_blocks, block_size, kv_heads, v_head_size] (cache_mode 'Norm')")
    for name, x in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if x.dtype != key.dtype:
            raise _bad(op, name, x, f"dtype {key.dtype} like key (the four tensors share one dtype)")
    if key.shape[:2] != value.shape[:2]:
        raise _bad(op, "value", value, f"the first two dims of key {list(key.shape[:2])}")
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise _bad(op, "value_cache", value_cache, f"[num_blocks, block_size] = {list(key_cache.shape[:2])}")
    if key.shape[1:] != key_cache.shape[2:] or value.shape[1:] != value_cache.shape[2:]:
        raise _bad(op, "key/value", key, f"[num_tokens, *cache.shape[2:]] = [n, {list(key_cache.shape[2:])}]")
    slot_mapping = _tensor(op, "slot_mapping", slot_mapping)
    _dtype(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise _bad(op, "slot_mapping", slot_mapping, f"shape [num_tokens] = [{key.shape[0]}]")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise _bad(op, "slot_mapping", slots.tolist(), f"values in [0, num_blocks * block_size - 1 = {num_slots - 1}]")
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value


def _paged_checks(
    op: str,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    num_heads: object,
    scale_value: object,
    out: object,
) -> tuple[int, int, float]:
    query = _tensor(op, "query", query)
    key_cache = _tensor(op, "key_cache", key_cache)
    value_cache = _tensor(op, "value_cache", value_cache)
    out = _tensor(op, "out", out)
    _dims(op, "query", query, 3, "[num_tokens, num_heads, head_size]")
    _dtype(op, "query", query, _FLOATS, " (float32 in this emulation only)")
    _dims(op, "key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (ND)")
    _dims(op, "value_cache", value_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (ND)")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if x.dtype != query.dtype:
            raise _bad(op, name, x, f"dtype {query.dtype} like query")
    heads, kv_heads = _head_counts(op, num_heads, num_kv_heads, query.shape[1])
    _, block_size, cache_heads, head_size = key_cache.shape
    if cache_heads != kv_heads:
        raise _bad(
            op,
            "key_cache",
            key_cache,
            f"{kv_heads} kv heads in dim 2 (num_kv_heads): layout [blocks, block_size, heads, dim]",
        )
    if head_size != query.shape[2]:
        raise _bad(op, "key_cache", key_cache, f"head_size {query.shape[2]} like query")
    if value_cache.shape != key_cache.shape:
        raise _bad(
            op,
            "value_cache",
            value_cache,
            f"the shape of key_cache {list(key_cache.shape)} (one head_size for K and V)",
        )
    if block_size % 16:
        raise _bad(op, "block_size (key_cache dim 1)", block_size, "a multiple of 16")
    if not 0 < head_size <= _ATB_MAX_HEAD_SIZE:
        raise _bad(op, "head_size", head_size, f"in (0, {_ATB_MAX_HEAD_SIZE}]")
    if head_size * block_size > _ATB_MAX_BLOCK_ELEMS:
        raise _bad(op, "head_size * block_size", head_size * block_size, "<= 128 * 128 (hardware limit)")
    if out.shape != query.shape[:2] + (head_size,) or out.dtype != query.dtype or not out.is_contiguous():
        raise _bad(
            op,
            "out",
            out,
            f"a contiguous {query.dtype} tensor of shape {list(query.shape[:2]) + [head_size]}",
        )
    return heads, kv_heads, _float(op, "scale_value", scale_value)


def _npu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
) -> None:
    """ATB PagedAttention (decode): one query token per request over its paged KV.

    ``query`` ``[batch, num_heads, head_size]``; caches ``[num_blocks, block_size, num_kv_heads,
    head_size]``; ``block_table`` int32 ``[batch, max_blocks]`` (device); ``context_lens`` int32
    ``[batch]`` **host (CPU) tensor**; ``out`` preallocated like query, written in place. No mask:
    token ``b`` sees all ``context_lens[b]`` keys (a 0 length gives zeros). ``workspace`` (newer
    torch_npu, for graph capture) is accepted and ignored.
    """
    op = "_npu_paged_attention"
    _, _, scale = _paged_checks(op, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, out)
    batch = query.shape[0]
    lens = _host_int32(op, "context_lens", context_lens, batch)
    table = _block_table(op, block_table, batch, lens, key_cache.shape[1], key_cache.shape[0])
    result = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b, length in enumerate(lens):
        if length == 0:
            continue
        k = _gather(key_cache, table[b], length)
        v = _gather(value_cache, table[b], length)
        result[b : b + 1] = _attend(query[b : b + 1], k, v, scale, None)[0]
    out.copy_(result)


def _npu_paged_attention_splitfuse(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    mask: torch.Tensor,
    seq_len: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    out: torch.Tensor,
) -> None:
    """ATB PagedAttention, ``maskType=MASK_TYPE_SPEC``, ``calcType=CALC_TYPE_SPEC``: chunked prefill + decode.

    ``query`` ``[num_tokens, num_heads, head_size]``, the query tokens of all requests
    concatenated; ``seq_len`` int32 ``[batch]`` query tokens per request and ``context_lens``
    int32 ``[batch]`` total KV tokens per request (prefix + new, already in the cache), both
    **host (CPU) tensors**; ``mask`` float ``[num_tokens, max_seq_len]`` (``max_seq_len >=
    max(context_lens)``) is *added* to the scaled scores of token ``t`` over KV ``0 ..
    context_lens[r]-1``: 0 where visible, a large negative value (vllm-ascend: float32 min for
    float16, -10000 for bfloat16) where not. There is no implicit causal rule: the mask is the
    whole visibility. Positional order follows the op-plugin schema (block_table,
    context_lens, mask, seq_len); callers pass keywords.
    """
    op = "_npu_paged_attention_splitfuse"
    _, _, scale = _paged_checks(op, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, out)
    q_lens = _host_int32(op, "seq_len", seq_len)
    batch = len(q_lens)
    kv_lens = _host_int32(op, "context_lens", context_lens, batch)
    if sum(q_lens) != query.shape[0]:
        raise _bad(op, "seq_len", q_lens, f"query lengths summing to num_tokens = {query.shape[0]}")
    for r, (s, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if not 1 <= s <= n:
            raise _bad(op, f"seq_len[{r}]", s, f"1 <= seq_len <= context_lens[{r}] = {n}")
    mask = _tensor(op, "mask", mask)
    _dtype(
        op,
        "mask",
        mask,
        _HALF + ((torch.float32,) if query.dtype == torch.float32 else ()),
        " (an additive float mask)",
    )
    max_kv = max(kv_lens, default=0)
    if mask.dim() != 2 or mask.shape[0] != query.shape[0] or mask.shape[1] < max_kv:
        raise _bad(
            op,
            "mask",
            mask,
            f"shape [num_tokens, max_seq_len] with num_tokens = {query.shape[0]}, max_seq_len >= {max_kv}",
        )
    table = _block_table(op, block_table, batch, kv_lens, key_cache.shape[1], key_cache.shape[0])
    result = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    for r, (s, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k = _gather(key_cache, table[r], n)
        v = _gather(value_cache, table[r], n)
        bias = mask[start : start + s, :n].float()
        result[start : start + s] = _attend(query[start : start + s], k, v, scale, bias)[0]
        start += s
    out.copy_(result)


# ----------------------------------------------------------------------------- FIA


_TRIU_CACHE: dict[str, torch.Tensor] = {}


def _check_compressed_causal_mask(op: str, atten_mask: object, sparse_mode: int) -> None:
    if atten_mask is None:
        raise _bad(
            op,
            "atten_mask",
            None,
            f"the compressed 2048 x 2048 causal mask (required by sparse_mode={sparse_mode})",
        )
    atten_mask = _tensor(op, "atten_mask", atten_mask)
    size = FIA_MASK_SIZE
    if tuple(atten_mask.shape) not in ((size, size), (1, size, size), (1, 1, size, size)):
        raise _bad(
            op,
            "atten_mask",
            atten_mask,
            f"shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) for sparse_mode={sparse_mode}",
        )
    _dtype(op, "atten_mask", atten_mask, _MASK_FLAG_DTYPES, " (1/True = masked out)")
    expected = _TRIU_CACHE.get("cpu")
    if expected is None:
        expected = _TRIU_CACHE["cpu"] = torch.ones(size, size, dtype=torch.bool).triu_(1)
    if not torch.equal(atten_mask.reshape(size, size).ne(0).cpu(), expected):
        raise _bad(
            op,
            "atten_mask",
            atten_mask,
            "the compressed causal mask torch.triu(torch.ones(2048, 2048), diagonal=1) (1 above diagonal)",
        )


def _cumulative(op: str, arg: str, values: list[int], total: int, total_name: str) -> list[int]:
    if not values:
        raise _bad(op, arg, values, "at least one request")
    if values[0] < 0 or any(b < a for a, b in itertools.pairwise(values)):
        raise _bad(op, arg, values, "cumulative end offsets (non-negative, non-decreasing) in TND layout")
    if values[-1] != total:
        raise _bad(op, arg, values, f"a last element equal to {total_name} = {total}")
    return [b - a for a, b in zip([0] + values[:-1], values, strict=True)]


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FusedInferAttentionScore, the subset hal uses: ``input_layout="TND"``, no quantisation.

    ``query`` ``[T, num_heads, D]``, the query tokens of all requests concatenated;
    ``actual_seq_lengths`` (required for TND) is a host list of **cumulative** query end offsets
    (its length is the batch; the last equals T).

    * Paged KV (``block_table`` given): ``key``/``value`` are the caches viewed as ``(blocknum,
      blocksize, H = KV_N * D)`` or in the ``(blocknum, KV_N, blocksize, D)`` layout;
      ``block_table`` int32 ``[batch, >= max blocks]``; ``block_size`` the cache's block size;
      ``actual_seq_lengths_kv`` a host list of **per-request** KV lengths (not cumulative).
    * Contiguous KV (no ``block_table``): ``key``/``value`` ``[T_kv, KV_N, D]`` and
      ``actual_seq_lengths_kv`` **cumulative** like the query's.

    ``sparse_mode=3`` with the compressed 2048 x 2048 ``atten_mask`` (``triu(ones, 1)``, bool/int8/
    uint8): rightDownCausal, query ``i`` of a request with ``S`` query and ``L`` KV tokens sees
    KV ``j <= L - S + i`` (``S <= L``). ``sparse_mode=0`` with no mask: every KV token is seen.
    TND allows no other mode ("sparse模式仅支持sparse=0且不传mask，或sparse=3且传入mask"), so
    band (sparse_mode 4, pre_tokens/next_tokens) is rejected.

    Not enforced, on purpose: the TND head-dim rule (D = 128, or 192, without rope: the doc at
    op-plugin master 56bbfdf; earlier versions said 192 only, without page attention, while
    vllm-ascend ran TND paged at D = 128). The emulation computes any D; hal's routing
    (``hal.kernels.npu.ops.unsupported_reasons``, ``FIA_TND_HEAD_DIMS``) sends other head dims
    to splitfuse, so the real op never sees them from hal. Returns ``(attention_out
    [T, num_heads, D_v] in query dtype, softmax_lse)``; the LSE is natural-log over the scaled
    scores, ``[T, num_heads, 1]`` float32 with ``softmax_lse_flag``, else a float32 ``[1]`` zero.
    """
    op = "npu_fused_infer_attention_score"
    unsupported = {
        "pse_shift": pse_shift,
        "dequant_scale1": dequant_scale1,
        "quant_scale1": quant_scale1,
        "dequant_scale2": dequant_scale2,
        "quant_scale2": quant_scale2,
        "quant_offset2": quant_offset2,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "query_padding_size": query_padding_size,
        "kv_padding_size": kv_padding_size,
        "key_antiquant_scale": key_antiquant_scale,
        "key_antiquant_offset": key_antiquant_offset,
        "value_antiquant_scale": value_antiquant_scale,
        "value_antiquant_offset": value_antiquant_offset,
        "key_shared_prefix": key_shared_prefix,
        "value_shared_prefix": value_shared_prefix,
        "actual_shared_prefix_len": actual_shared_prefix_len,
        "query_rope": query_rope,
        "key_rope": key_rope,
        "key_rope_antiquant_scale": key_rope_antiquant_scale,
    }
    given = [name for name, v in unsupported.items() if v is not None]
    if given:
        raise NotImplementedError(
            f"{op}: the emulation does not implement {', '.join(given)} (quantisation, pse, padding, prefix, rope)"
        )
    for name, v in (
        ("antiquant_mode", antiquant_mode),
        ("key_antiquant_mode", key_antiquant_mode),
        ("value_antiquant_mode", value_antiquant_mode),
    ):
        if _int(op, name, v) != 0:
            raise NotImplementedError(f"{op}: {name} = {v}: the emulation implements unquantised KV only (0)")
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: input_layout = {input_layout!r}: the emulation implements 'TND' only")

    query = _tensor(op, "query", query)
    key = _tensor(op, "key", key)
    value = _tensor(op, "value", value)
    _dims(op, "query", query, 3, "[T, N, D] for input_layout 'TND'")
    _dtype(op, "query", query, _FLOATS, " (float32 in this emulation only)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not x.is_contiguous():
            raise _bad(op, name, x, "a contiguous tensor (the op does not take non-contiguous tensors)")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise _bad(op, name, x, f"dtype {query.dtype} like query (unquantised KV)")
    if key.shape != value.shape:
        raise _bad(op, "value", value, f"the shape of key {list(key.shape)}")
    t, n, d = query.shape
    heads = _int(op, "num_heads", num_heads, 1)
    kv_heads = _int(op, "num_key_value_heads", num_key_value_heads, 0) or heads
    if heads != n:
        raise _bad(op, "num_heads", heads, f"the query's N = {n}")
    if heads % kv_heads or heads // kv_heads > _FIA_MAX_GROUP:
        raise _bad(
            op,
            "num_key_value_heads",
            kv_heads,
            f"a divisor of num_heads = {heads} with ratio <= {_FIA_MAX_GROUP}",
        )
    scale = _float(op, "scale", scale)
    _int(op, "pre_tokens", pre_tokens)
    _int(op, "next_tokens", next_tokens)
    if _int(op, "inner_precise", inner_precise) not in (0, 1, 2, 3):
        raise _bad(op, "inner_precise", inner_precise, "0, 1, 2 or 3")
    if not isinstance(softmax_lse_flag, bool):
        raise _bad(op, "softmax_lse_flag", softmax_lse_flag, "a bool", TypeError)
    if t > _TND_MAX_TOKENS:
        raise _bad(op, "query", query, f"T <= {_TND_MAX_TOKENS} in TND layout")

    if actual_seq_lengths is None:
        raise _bad(op, "actual_seq_lengths", None, "a host list of cumulative query lengths (required for TND)")
    q_lens = _cumulative(op, "actual_seq_lengths", _int_list(op, "actual_seq_lengths", actual_seq_lengths), t, "T")
    batch = len(q_lens)
    if actual_seq_lengths_kv is None:
        raise _bad(op, "actual_seq_lengths_kv", None, "a host list of KV lengths (required for TND)")
    kv_values = _int_list(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    if len(kv_values) != batch:
        raise _bad(
            op,
            "actual_seq_lengths_kv",
            kv_values,
            f"{batch} elements (one per request, like actual_seq_lengths)",
        )

    sparse_mode = _int(op, "sparse_mode", sparse_mode)
    if sparse_mode == 3:
        _check_compressed_causal_mask(op, atten_mask, sparse_mode)
    elif sparse_mode == 0:
        if atten_mask is not None:
            raise NotImplementedError(
                f"{op}: sparse_mode=0 with a full atten_mask is not emulated (TND takes it without a mask)"
            )
    else:
        raise _bad(op, "sparse_mode", sparse_mode, "0 (no atten_mask) or 3 (with atten_mask) for input_layout 'TND'")

    paged = block_table is not None
    if paged:
        block_size = _int(op, "block_size", block_size, 1)
        if key.dim() == 3:
            heads_major = False
            if key.shape[1] != block_size or key.shape[2] % kv_heads:
                raise _bad(op, "key", key, f"(blocknum, block_size={block_size}, KV_N * D) with KV_N = {kv_heads}")
            if kv_heads * d > 65535:
                raise _bad(op, "key", key, "KV_N * D <= 65535 in the (blocknum, blocksize, H) layout")
            dk = key.shape[2] // kv_heads
        elif key.dim() == 4:
            heads_major = True
            if key.shape[1] != kv_heads or key.shape[2] != block_size:
                raise _bad(
                    op,
                    "key",
                    key,
                    f"(blocknum, KV_N={kv_heads}, block_size={block_size}, D); a [blocks, block_size, "
                    "heads, dim] cache must be passed as .view(blocks, block_size, heads * dim)",
                )
            dk = key.shape[3]
        else:
            raise _bad(op, "key", key, "a paged cache (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)")
        if dk != d:
            raise _bad(op, "key", key, f"head dim D = {d} like query")
        if max(q_lens) > 1:
            if block_size % 128 or not 128 <= block_size <= 512:
                raise _bad(
                    op,
                    "block_size",
                    block_size,
                    "a multiple of 128 in [128, 512] (page attention with Q_S > 1)",
                )
        elif block_size % 16:
            raise _bad(
                op,
                "block_size",
                block_size,
                "a multiple of 16 (page attention with Q_S = 1, float16/bfloat16)",
            )
        kv_lens = kv_values
        if any(v < 0 for v in kv_lens):
            raise _bad(op, "actual_seq_lengths_kv", kv_lens, "non-negative per-request KV lengths (paged)")
        table = _block_table(op, block_table, batch, kv_lens, block_size, key.shape[0])
    else:
        _dims(op, "key", key, 3, "[T_kv, KV_N, D] (contiguous TND KV)")
        if key.shape[1] != kv_heads or key.shape[2] != d:
            raise _bad(op, "key", key, f"[T_kv, {kv_heads}, {d}]")
        kv_lens = _cumulative(op, "actual_seq_lengths_kv", kv_values, key.shape[0], "key.shape[0]")
    if max(q_lens) > 1 and (d % 16 or d > 512):
        raise _bad(op, "query", query, "D a multiple of 16 and <= 512 (float16/bfloat16, Q_S > 1)")
    if sparse_mode == 3:
        for r, (s, length) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if s > length:
                raise _bad(
                    op,
                    f"request {r}",
                    (s, length),
                    "query length <= KV length for sparse_mode=3 (rightDownCausal)",
                )

    dev = query.device
    out = torch.zeros(t, n, d, dtype=torch.float32, device=dev)
    lse = torch.full((t, n), float("-inf"), dtype=torch.float32, device=dev)
    q_start = kv_start = 0
    for r, (s, length) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if s and length:
            if paged:
                k = _gather(key, table[r], length, heads_major)
                v = _gather(value, table[r], length, heads_major)
                k = k.reshape(length, kv_heads, -1)
                v = v.reshape(length, kv_heads, -1)
            else:
                k = key[kv_start : kv_start + length]
                v = value[kv_start : kv_start + length]
            bias = None
            if sparse_mode == 3:
                rows = torch.arange(s, device=dev).unsqueeze(1) + (length - s)
                bias = torch.zeros(s, length, device=dev).masked_fill_(
                    torch.arange(length, device=dev).unsqueeze(0) > rows, float("-inf")
                )
            o, row_lse = _attend(query[q_start : q_start + s], k, v, scale, bias)
            out[q_start : q_start + s] = o
            lse[q_start : q_start + s] = row_lse
        q_start += s
        kv_start += length
    softmax_lse = lse.unsqueeze(-1) if softmax_lse_flag else torch.zeros(1, dtype=torch.float32, device=dev)
    return out.to(query.dtype), softmax_lse


torch_npu = types.SimpleNamespace(
    __name__="hal.kernels.npu.emulation.torch_npu",
    __doc__="CPU emulation of the torch_npu ops hal uses (see hal.kernels.npu.emulation).",
    is_emulation=True,
    _npu_reshape_and_cache=_npu_reshape_and_cache,
    npu_scatter_pa_kv_cache=npu_scatter_pa_kv_cache,
    _npu_paged_attention=_npu_paged_attention,
    _npu_paged_attention_splitfuse=_npu_paged_attention_splitfuse,
    npu_fused_infer_attention_score=npu_fused_infer_attention_score,
)
