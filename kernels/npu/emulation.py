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
  schemas in op-plugin 517f2e7 ``op_plugin/ops/atb/ReshapeAndCachAtb.cpp``,
  .../PagedAttentionAtb.cpp, .../PagedAttentionSplitfuse.cpp; CPU tensors become ATB
  ``hostData`` (.../op_plugin/utils/custom_functions/atb/AtbCommon.cpp); ATB operation
  docs: https://www.hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/ascendtbapi/ascendtb_01_0073.html
  (ReshapeAndCache), .../canncommercial/80RC2/apiref/ascendtbapi/ascendtb_01_0070.html and
  .../CANNCommunityEdition/82RC1/API/ascendtbapi/ascendtb_01_0206.html (PagedAttention:
  contextLens ``[batch]`` int32 *cpu*, blockTables int32 npu, block_size % 16 == 0,
  head_size in (0, 256], head_size * block_size <= 128 * 128),
  .../canncommercial/80RC3/apiref/ascendtbapi/ascendtb_01_0085.html (MASK_TYPE_SPEC mask
  ``[num_tokens, max_seq_len]``).
* ``npu_fused_infer_attention_score`` / ``_v2``: op-plugin ``docs/zh/custom_APIs/torch_npu/
  torch_npu-npu_fused_infer_attention_score.md`` and ``..._v2.md`` at 517f2e7 (the ``docs/context/`` copies the
  emulation was first written from are gone upstream); each rule it enforces is a row of
  :mod:`hal.kernels.npu.contracts` with its section.
* ``npu_scatter_pa_kv_cache``: op-plugin 517f2e7 ``docs/zh/custom_APIs/torch_npu/
  torch_npu-npu_scatter_pa_kv_cache.md`` (2026-08-21), called with ``cache_mode="Norm"`` (ND
  ``[num_blocks, block_size, kv_heads, head_size]`` caches) as vllm-ascend's ``BaseDeviceAdaptor.reshape_and_cache``
  (vllm_ascend/device/device_op.py at 182b75e, 2026-08-22) does on A2/A3.
* Callers whose conventions are mirrored: vllm-ascend ``vllm_ascend/attention/attention_v1.py``
  and ``attention_mask.py``; SGLang ``python/sglang/srt/layers/attention/ascend_backend.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import numbers
import types
from collections.abc import Iterator, Sequence

import torch

from . import contracts
from .contracts import (
    ACL_FORMAT_FRACTAL_NZ,
    ACL_FORMAT_ND,
    ATB_310P_MAX_BATCH,
    FIA_A5_MAX_HEAD_DIM,
    FIA_DECODE_MAX_KV,
    FIA_MAX_SEQ,
    INT32_MAX,
    violation,
)

__all__ = [
    "torch_npu",
    "npu_fused_infer_attention_score",
    "_npu_reshape_and_cache",
    "npu_scatter_pa_kv_cache",
    "_npu_paged_attention",
    "_npu_paged_attention_splitfuse",
    "npu_fused_infer_attention_score_v2",
    "_npu_paged_attention_mla",
    "_npu_reshape_and_cache_siso",
    "npu_scatter_nd_update_",
    "npu_format_cast",
    "get_npu_format",
    "chip",
    "current_chip",
    "FIA_MASK_SIZE",
    "INT_MAX",
    "TND_MAX_BATCH",
]

INT_MAX = INT32_MAX
FIA_MASK_SIZE = 2048  # sparse_mode 2/3/4 take an "optimised" 2048 x 2048 lower-triangle mask

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # float32: emulation only
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.float32)
_MASK_FLAG_DTYPES = (torch.bool, torch.int8, torch.uint8)
_FIA_MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64
_ATB_MAX_HEAD_SIZE = 256
_ATB_MAX_BLOCK_ELEMS = 128 * 128  # "embedding * blockSize <= 128 * 128"
_ATB_MAX_BLOCK_SIZE = 128  # ATB PagedAttention "因硬件限制，block_size <= 128" (contracts: _npu_paged_attention)
TND_MAX_BATCH = 4096  # FIA / FIA v2 TND: "元素个数即batch值（≤ 4096）"


# ----------------------------------------------------------------------------- the emulated chip

_CHIP: contextvars.ContextVar[str] = contextvars.ContextVar("hal_npu_emulated_chip", default="A2")


@contextlib.contextmanager
def chip(generation: str) -> Iterator[None]:
    """Run the emulated ops as ``generation``'s ("A2", "A3", "A5", "310P"): its op availability and layouts."""
    if generation not in contracts.ALL_CHIPS:
        raise ValueError(f"chip({generation!r}): expected one of {contracts.ALL_CHIPS}")
    token = _CHIP.set(generation)
    try:
        yield
    finally:
        _CHIP.reset(token)


def current_chip() -> str:
    """The generation the emulated ops act as now (A2 unless inside :func:`chip`)."""
    return _CHIP.get()


def _on_chip(op: str):
    """Refuse ``op`` on a chip its ``chips`` row does not list (the contract table)."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not contracts.available(op, current_chip()):
                raise violation(op, "chips", f"called on {current_chip()}")
            return fn(*args, **kwargs)

        return call

    return wrap


# ----------------------------------------------------------------------------- formats (ND / FRACTAL_NZ)


def get_npu_format(x: torch.Tensor) -> int:
    """``torch_npu.get_npu_format``: 29 for a tensor made by :func:`npu_format_cast` to FRACTAL_NZ, else 2 (ND)."""
    return int(getattr(x, "_hal_npu_format", ACL_FORMAT_ND))


def npu_format_cast(x: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``torch_npu.npu_format_cast(x, acl_format)``: a new tensor of ``x``'s logical shape in ``acl_format``.

    The emulation keeps the data as it is and records the format, so an op that needs FRACTAL_NZ refuses a
    tensor that was never cast (vllm-ascend casts its 310P caches and masks so: ``_310p/`` at 182b75e)."""
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError(f"npu_format_cast: acl_format = {acl_format}: the emulation models ND (2), NZ (29)")
    out = x.contiguous().clone()
    out._hal_npu_format = int(acl_format)
    return out


def _nz_cache_as_nd(op: str, arg: str, cache: torch.Tensor, kv_heads: int, head_size: int) -> torch.Tensor:
    """A FRACTAL_NZ cache ``[num_blocks, kv_heads * head_size / 16, block_size, 16]`` as the ND
    ``[num_blocks, block_size, kv_heads, head_size]`` it holds (a copy)."""
    if get_npu_format(cache) != ACL_FORMAT_FRACTAL_NZ or cache.dim() != 4 or cache.shape[3] != 16:
        raise violation(op, "layout", f"{arg} = {_describe(cache)} in format {get_npu_format(cache)} on 310P")
    if head_size % 16 or cache.shape[1] * 16 != kv_heads * head_size:
        raise violation(op, "layout", f"{arg} = {_describe(cache)} for {kv_heads} kv heads of head_size {head_size}")
    blocks, _, block_size, _ = cache.shape
    return cache.permute(0, 2, 1, 3).reshape(blocks, block_size, kv_heads, head_size)


def _nd_only(op: str, arg: str, x: torch.Tensor) -> None:
    if get_npu_format(x) != ACL_FORMAT_ND:
        raise violation(op, "layout", f"{arg} in FRACTAL_NZ on {current_chip()} (its caches are ND there)")


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention of one request, float32.

    ``q`` ``[S, Hq, D]``, ``k`` ``[L, Hkv, D]``, ``v`` ``[L, Hkv, Dv]``; query head ``h`` reads KV
    head ``h // (Hq // Hkv)``. ``bias`` ``[S, L]`` is added to the scaled scores; ``sink`` ``[Hq]`` is one more
    logit per head in the softmax denominator (it carries no value). Returns the output ``[S, Hq, Dv]`` and
    the natural-log LSE of the scaled, biased scores (and the sink) ``[S, Hq]``.
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
    if sink is not None:
        lse = torch.logaddexp(lse, sink.float().reshape(hkv, hq // hkv, 1, 1))
    out = torch.matmul(torch.exp(scores - lse), vg)  # [Hkv, G, S, Dv]
    return out.permute(2, 0, 1, 3).reshape(s, hq, -1), lse.squeeze(-1).permute(2, 0, 1).reshape(s, hq)


# ----------------------------------------------------------------------------- ATB ops


def _reshape_and_cache(op: str, pairs: Sequence[tuple[str, torch.Tensor, str, torch.Tensor]], slot_indices) -> None:
    """ATB ReshapeAndCache's contract for each ``(name, new, cache name, cache)`` pair (see the callers).

    Caches are ND ``[num_blocks, block_size, kv_heads, head_size]``, or, when every cache is FRACTAL_NZ (op-plugin's
    binding then picks ``K_CACHE_V_CACHE_NZ``), ``[num_blocks, kv_heads * head_size / 16, block_size, 16]``; 310P
    takes NZ only (contracts: ``_npu_reshape_and_cache`` ``layout``)."""
    names = [n for name, _, cache_name, _ in pairs for n in (name, cache_name)]
    tensors = [t for _, new, _, cache in pairs for t in (new, cache)]
    for name, x in zip(names, tensors):
        _tensor(op, name, x)
    first_new, first_cache = tensors[0], tensors[1]
    _dtype(op, names[1], first_cache, _CACHE_DTYPES)
    nz = all(get_npu_format(cache) == ACL_FORMAT_FRACTAL_NZ for _, _, _, cache in pairs)
    if current_chip() == "310P" and not nz:
        raise violation(
            "_npu_reshape_and_cache", "layout", f"ND caches on 310P ({names[1]} = {_describe(first_cache)})"
        )
    if nz and len(pairs) == 1:
        raise violation(op, "chips", "an NZ key cache with K_CACHE_V_BYPASS")
    views = []
    for name, new, cache_name, cache in pairs:
        _dims(op, name, new, 3, "[num_tokens, kv_heads, head_size]")
        for n, x in ((name, new), (cache_name, cache)):
            if x.dtype != first_cache.dtype:
                raise _bad(op, n, x, f"dtype {first_cache.dtype} (all tensors share one dtype; the op does not cast)")
        if not cache.is_contiguous():
            raise _bad(op, cache_name, cache, "a contiguous tensor (it is written in place)")
        if nz:
            nd = _nz_cache_as_nd("_npu_reshape_and_cache", cache_name, cache, new.shape[1], new.shape[2])
            view = cache.permute(0, 2, 1, 3)  # [blocks, block_size, heads * dim / 16, 16], writes reach the cache
        else:
            _dims(op, cache_name, cache, 4, "[num_blocks, block_size, kv_heads, head_size]")
            nd = view = cache
        if nd.shape[:2] != (views[0][1].shape[:2] if views else nd.shape[:2]):
            raise _bad(op, cache_name, cache, f"the same [num_blocks, block_size] as {names[1]}")
        if new.shape[1:] != nd.shape[2:]:
            raise _bad(op, name, new, f"[num_tokens, {nd.shape[2]}, {nd.shape[3]}] to match {cache_name}")
        if new.shape[0] != first_new.shape[0]:
            raise _bad(op, name, new, f"{first_new.shape[0]} tokens like {names[0]}")
        views.append((view, nd))
    slot_indices = _tensor(op, "slot_indices", slot_indices)
    _dtype(op, "slot_indices", slot_indices, (torch.int32,))
    if slot_indices.dim() != 1 or slot_indices.shape[0] != first_new.shape[0]:
        raise _bad(op, "slot_indices", slot_indices, f"shape [num_tokens] = [{first_new.shape[0]}]")
    blocks, block_size = views[0][1].shape[:2]
    num_slots = blocks * block_size
    slots = slot_indices.long()
    keep = slots >= 0
    used = slots[keep]
    if used.numel():
        if int(used.max()) >= num_slots:
            raise _bad(op, "slot_indices", slot_indices.tolist(), f"slots < num_blocks * block_size = {num_slots}")
        if torch.unique(used).numel() != used.numel():
            raise _bad(op, "slot_indices", slot_indices.tolist(), "no repeated slot")
    for (_, new, _, _), (view, _) in zip(pairs, views):
        rows = new[keep]
        if nz:
            view[used // block_size, used % block_size] = rows.reshape(rows.shape[0], -1, 16)
        else:
            view.view(num_slots, *view.shape[2:])[used] = rows


@_on_chip("_npu_reshape_and_cache")
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
    pairs = (("key", key, "key_cache", key_cache), ("value", value, "value_cache", value_cache))
    _reshape_and_cache("_npu_reshape_and_cache", pairs, slot_indices)


@_on_chip("_npu_reshape_and_cache_siso")
def _npu_reshape_and_cache_siso(key: torch.Tensor, key_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """ATB ReshapeAndCache with ``kvCacheCfg = K_CACHE_V_BYPASS``: the key alone (MLA's latent ++ rope part).

    Schema ``_npu_reshape_and_cache_siso(Tensor key, Tensor(a!) key_cache, Tensor slot_indices)``, op-plugin
    ``op_plugin/ops/atb/ReshapeAndCacheSisoAtb.cpp`` (517f2e7, 2026-08-21). ``key`` ``[num_tokens, kv_heads,
    head_size]`` into ``key_cache`` ``[num_blocks, block_size, kv_heads, head_size]``, one dtype; ``slot_indices``
    as :func:`_npu_reshape_and_cache` (int32, a negative slot skipped, no repeated slot). In place; returns None.
    """
    _reshape_and_cache("_npu_reshape_and_cache_siso", (("key", key, "key_cache", key_cache),), slot_indices)


@_on_chip("npu_scatter_pa_kv_cache")
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
    _nd_only(op, "key_cache", key_cache)
    _nd_only(op, "value_cache", value_cache)
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


@_on_chip("npu_scatter_nd_update_")
def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """``input[indices[i]] = updates[i]`` in place (aclnnScatterNdUpdate); returns ``input``.

    Contract (contracts: ``npu_scatter_nd_update_``): ``indices`` int32/int64, at least 2-D, its last dim ``a`` <=
    ``input.dim()``; ``updates`` shaped ``indices.shape[:-1] + input.shape[a:]``, ``input``'s dtype (310P: float32,
    float16, bool); no index out of bounds (a negative one is refused). Repeated indices: the doc promises nothing;
    the emulation writes one of them."""
    op = "npu_scatter_nd_update_"
    input, indices, updates = (
        _tensor(op, n, x) for n, x in (("input", input), ("indices", indices), ("updates", updates))
    )
    _nd_only(op, "input", input)
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() < 2 or indices.shape[-1] > input.dim():
        raise violation(op, "indices", f"indices = {_describe(indices)} for input {_describe(input)}")
    depth = indices.shape[-1]
    if tuple(updates.shape) != tuple(indices.shape[:-1]) + tuple(input.shape[depth:]):
        raise violation(op, "indices", f"updates = {_describe(updates)} for indices {list(indices.shape)}")
    if updates.dtype != input.dtype:
        raise violation(op, "indices", f"updates dtype {updates.dtype} into input dtype {input.dtype}")
    if current_chip() == "310P" and input.dtype not in (torch.float32, torch.float16, torch.bool):
        raise violation(op, "chips", f"dtype {input.dtype} on 310P")
    flat = indices.reshape(-1, depth).long()
    bounds = torch.tensor(input.shape[:depth])
    if flat.numel() and (bool((flat < 0).any()) or bool((flat >= bounds).any())):
        raise violation(op, "indices", f"indices {flat.tolist()} for input dims {list(input.shape[:depth])}")
    input[tuple(flat.t())] = updates.reshape(flat.shape[0], *input.shape[depth:])
    return input


def _check_out(op: str, out: torch.Tensor, query: torch.Tensor, v_dim: int) -> None:
    """ATB attention's output (contracts: the ``out`` rows): ``[num_tokens, num_heads, v_dim]`` in query's dtype,
    contiguous: the binding hands ``out`` to ATB as it is, and ATB refuses a non-contiguous tensor."""
    if out.shape != query.shape[:2] + (v_dim,) or out.dtype != query.dtype or not out.is_contiguous():
        raise violation(op, "out", f"out = {_describe(out)} with strides {out.stride()} for query {_describe(query)}")


def _paged_checks(
    op: str,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    num_heads: object,
    scale_value: object,
    out: object,
    batch: int,
) -> tuple[int, int, float, torch.Tensor, torch.Tensor]:
    """ATB PagedAttention's shared contract (contracts: ``_npu_paged_attention`` / ``_npu_paged_attention_splitfuse``
    rows): returns ``(heads, kv_heads, scale, key ND, value ND)``, the caches as ``[blocks, block_size, kv_heads,
    head_size]`` (on 310P decoded from the FRACTAL_NZ layout the op takes there). ``batch``: the requests of the call
    (``context_lens``' length), which 310P's "0<batch<=2048" counts, not the query tokens."""
    query = _tensor(op, "query", query)
    key_cache = _tensor(op, "key_cache", key_cache)
    value_cache = _tensor(op, "value_cache", value_cache)
    out = _tensor(op, "out", out)
    _dims(op, "query", query, 3, "[num_tokens, num_heads, head_size]")
    on_310p = current_chip() == "310P"
    _dtype(
        op, "query", query, (torch.float16, torch.float32) if on_310p else _FLOATS, " (float32 in this emulation only)"
    )
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if x.dtype != query.dtype:
            raise _bad(op, name, x, f"dtype {query.dtype} like query")
    heads, kv_heads = _head_counts(op, num_heads, num_kv_heads, query.shape[1])
    head_size = query.shape[2]
    if on_310p:
        if not 0 < batch <= ATB_310P_MAX_BATCH:
            raise violation("_npu_paged_attention", "dtype_310p", f"a batch of {batch} requests")
        key_cache = _nz_cache_as_nd(_PA, "key_cache", key_cache, kv_heads, head_size)
        value_cache = _nz_cache_as_nd(_PA, "value_cache", value_cache, kv_heads, head_size)
    else:
        _nd_only(_PA, "key_cache", key_cache)
        _nd_only(_PA, "value_cache", value_cache)
        _dims(op, "key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (ND)")
        _dims(op, "value_cache", value_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (ND)")
    _, block_size, cache_heads, cache_head_size = key_cache.shape
    if cache_heads != kv_heads:
        raise _bad(
            op,
            "key_cache",
            key_cache,
            f"{kv_heads} kv heads in dim 2 (num_kv_heads): layout [blocks, block_size, heads, dim]",
        )
    if cache_head_size != head_size:
        raise _bad(op, "key_cache", key_cache, f"head_size {head_size} like query")
    if value_cache.shape != key_cache.shape:
        raise _bad(
            op,
            "value_cache",
            value_cache,
            f"the shape of key_cache {list(key_cache.shape)} (one head_size for K and V)",
        )
    if block_size % 16:
        raise _bad(op, "block_size (key_cache dim 1)", block_size, "a multiple of 16")
    if block_size > _ATB_MAX_BLOCK_SIZE:
        raise violation(_PA, "block_size", f"block_size {block_size}")
    if not 0 < head_size <= _ATB_MAX_HEAD_SIZE:
        raise _bad(op, "head_size", head_size, f"in (0, {_ATB_MAX_HEAD_SIZE}]")
    if head_size * block_size > _ATB_MAX_BLOCK_ELEMS and (op == _SF or on_310p):
        raise _bad(op, "head_size * block_size", head_size * block_size, "<= 128 * 128 (hardware limit)")
    _check_out(op, out, query, head_size)
    return heads, kv_heads, _float(op, "scale_value", scale_value), key_cache, value_cache


_PA, _SF = "_npu_paged_attention", "_npu_paged_attention_splitfuse"


@_on_chip(_PA)
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
    batch = _tensor(op, "query", query).shape[0]
    _, _, scale, key_cache, value_cache = _paged_checks(
        op, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, out, batch
    )
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


def _nz_mask_as_nd(op: str, mask: torch.Tensor, tokens: int, max_kv: int) -> torch.Tensor:
    """310P's splitfuse mask, FRACTAL_NZ ``[1, ceil16(W) / 16, ceil16(T), 16]`` (vllm-ascend's ``nd_to_nz_spec``),
    as the ND ``[T, ceil16(W)]`` rows it holds."""
    pad = -(-tokens // 16) * 16
    if (
        get_npu_format(mask) != ACL_FORMAT_FRACTAL_NZ
        or mask.dim() != 4
        or mask.shape[0] != 1
        or mask.shape[2] != pad
        or mask.shape[3] != 16
        or mask.shape[1] * 16 < max_kv
    ):
        raise violation(
            op, "mask_310p", f"mask = {_describe(mask)} in format {get_npu_format(mask)} for {tokens} tokens"
        )
    return mask[0].permute(1, 0, 2).reshape(pad, -1)[:tokens]


@_on_chip(_SF)
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
    q_lens = _host_int32(op, "seq_len", seq_len)
    batch = len(q_lens)
    _, _, scale, key_cache, value_cache = _paged_checks(
        op, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, out, batch
    )
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
    if current_chip() == "310P":
        mask = _nz_mask_as_nd(op, mask, query.shape[0], max_kv)
    else:
        _nd_only(op, "mask", mask)
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


def _paged_layout(op: str, arg: str, cache: torch.Tensor, block_size: int, kv_heads: int, d: int) -> bool:
    """Check a paged FIA cache, ``(blocknum, block_size, KV_N * D)`` or ``(blocknum, KV_N, block_size, D)``;
    True for the heads-major 4-D layout."""
    if cache.dim() == 3:
        if cache.shape[1] != block_size or cache.shape[2] != kv_heads * d:
            raise _bad(op, arg, cache, f"(blocknum, block_size={block_size}, KV_N * D = {kv_heads} * {d})")
        if kv_heads * d > 65535:
            raise _bad(op, arg, cache, "KV_N * D <= 65535 in the (blocknum, blocksize, H) layout")
        return False
    if cache.dim() == 4:
        if tuple(cache.shape[1:]) != (kv_heads, block_size, d):
            raise _bad(
                op,
                arg,
                cache,
                f"(blocknum, KV_N={kv_heads}, block_size={block_size}, D) with D = {d}; a [blocks, block_size, "
                "heads, dim] cache must be passed as .view(blocks, block_size, heads * dim)",
            )
        return True
    raise _bad(op, arg, cache, "a paged cache (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)")


def _check_right_down(op: str, q_lens: Sequence[int], kv_lens: Sequence[int], sparse_mode: int) -> None:
    for r, (s, length) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if s > length:
            raise _bad(op, f"request {r}", (s, length), f"query length <= KV length for sparse_mode={sparse_mode}")


def _band(pre_tokens: int, next_tokens: int):
    """rightDown-aligned band: query ``i`` of ``s`` over ``L`` keys sits at ``p = L - s + i`` and sees
    ``p - pre_tokens <= j <= p + next_tokens`` (``sparse_mode`` 3: ``(INT_MAX, 0)``; 4: the band)."""

    def visible(_: int, s: int, length: int) -> torch.Tensor:
        pos = torch.arange(s).unsqueeze(1) + (length - s)
        cols = torch.arange(length).unsqueeze(0)
        return (cols <= pos + next_tokens) & (cols >= pos - pre_tokens)

    return visible


_TND_HEAD_DIMS = (128, 192)  # FIA TND without rope (contracts: npu_fused_infer_attention_score "tnd_head_dim")


def _visibility(op, sparse_mode: int, pre_tokens: int, next_tokens: int, q_lens, kv_lens, rope: bool):
    """Which keys each query row sees under ``sparse_mode`` 0 / 3 / 4 (None: all). With one query token per request
    and no rope inputs the op ignores sparse_mode, pre_tokens and next_tokens (contracts: ``sparse_q1``): every key."""
    if sparse_mode == 0:
        return None
    if sparse_mode == 3:
        _check_right_down(op, q_lens, kv_lens, sparse_mode)
    if sparse_mode == 4 and (pre_tokens < 0 or any(next_tokens + n - s < 0 for s, n in zip(q_lens, kv_lens))):
        raise _bad(
            op, "pre_tokens/next_tokens", (pre_tokens, next_tokens), "pre_tokens >= 0, next_tokens + KV_S - Q_S >= 0"
        )
    band = _band(INT_MAX, 0) if sparse_mode == 3 else _band(pre_tokens, next_tokens)
    if rope:
        return band
    if max(q_lens, default=0) <= 1:
        return None

    # A call mixing one-token and longer requests (contracts: ``sparse_rows``): the doc says only that Q_S = 1 ignores
    # the band, not what a one-token row of a Q_S > 1 call sees. The emulation takes the reading hal must not rely
    # on, per row: a one-token row sees every key (hal pads such rows, so both readings give it the band).
    def per_row(r: int, s: int, length: int) -> torch.Tensor:
        return band(r, s, length) if s > 1 else torch.ones(s, length, dtype=torch.bool)

    return per_row


def _check_lengths(op: str, q_lens: Sequence[int], kv_lens: Sequence[int]) -> None:
    """FIA's sequence limits per request (contracts: ``kv_len``): a one-token request over at most 262144 keys (the
    Q_S = 1 limit, held per row: the doc does not say which limit a one-token row of a longer call meets), else
    query and KV lengths <= 20971520."""
    for r, (s, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if (s <= 1 and n > FIA_DECODE_MAX_KV) or max(s, n) > FIA_MAX_SEQ:
            raise violation(op, "kv_len", f"request {r}: {s} query tokens over {n} keys")


def _fia_run(
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    value: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    kv_heads: int,
    scale: float,
    table: torch.Tensor | None,
    heads_major: bool,
    dv: int,
    visible=None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA's computation over TND queries: float32 ``(out [T, N, Dv], natural-log lse [T, N])``.

    ``queries`` / ``keys``: the query and its rope part, and the matching caches (scores sum their dot
    products); ``value`` the value cache. Paged when ``table`` is given (per-request ``kv_lens``), else
    contiguous ``[T_kv, KV_N, D]`` KV. ``visible(r, s, L)``: which keys each query row sees (None: all).
    ``sink`` ``[N]``: a learnable logit in every row's softmax denominator (no value).
    """
    query = queries[0]
    t, n = query.shape[:2]
    out = torch.zeros(t, n, dv, dtype=torch.float32, device=query.device)
    lse = torch.full((t, n), float("-inf"), dtype=torch.float32, device=query.device)
    q_start = kv_start = 0
    for r, (s, length) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if s and length:
            if table is not None:
                ks = [_gather(k, table[r], length, heads_major).reshape(length, kv_heads, -1) for k in keys]
                v = _gather(value, table[r], length, heads_major).reshape(length, kv_heads, -1)
            else:
                ks, v = [k[kv_start : kv_start + length] for k in keys], value[kv_start : kv_start + length]
            q = torch.cat([x[q_start : q_start + s].float() for x in queries], dim=-1)
            bias = None
            if visible is not None:
                bias = torch.zeros(s, length).masked_fill_(~visible(r, s, length), float("-inf")).to(query.device)
            o, row_lse = _attend(q, torch.cat([k.float() for k in ks], dim=-1), v, scale, bias, sink)
            out[q_start : q_start + s] = o
            lse[q_start : q_start + s] = row_lse
        elif s and sink is not None:
            lse[q_start : q_start + s] = sink.float()
        q_start += s
        kv_start += length
    return out, lse


def _cumulative(op: str, arg: str, values: list[int], total: int, total_name: str) -> list[int]:
    if not values:
        raise _bad(op, arg, values, "at least one request")
    if values[0] < 0 or any(b < a for a, b in itertools.pairwise(values)):
        raise _bad(op, arg, values, "cumulative end offsets (non-negative, non-decreasing) in TND layout")
    if values[-1] != total:
        raise _bad(op, arg, values, f"a last element equal to {total_name} = {total}")
    return [b - a for a, b in zip([0] + values[:-1], values, strict=True)]


@_on_chip("npu_fused_infer_attention_score")
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
    KV ``j <= L - S + i`` (``S <= L``). ``sparse_mode=4`` with the same mask: the band
    ``L - S + i - pre_tokens <= j <= L - S + i + next_tokens`` (vllm-ascend's window: ``pre_tokens`` = window,
    ``next_tokens`` = 0). ``sparse_mode=0`` with no mask: every KV token is seen. Any other mode is a
    violation of the ``sparse_tnd`` contract (:mod:`hal.kernels.npu.contracts`). With one query token per request
    the op ignores the mode and the band (``sparse_q1``): every key is seen.

    The TND head-dim rule is enforced (``tnd_head_dim``: D = 128, or 192, without rope and one head size for K
    and V, the doc at op-plugin 517f2e7; on A5 ``tnd_head_dim_a5``, what vllm-ascend sends there); hal's routing
    (``hal.kernels.npu.limits.unsupported_reasons``) sends other head dims to splitfuse. Returns ``(attention_out
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
    pre_tokens, next_tokens = _int(op, "pre_tokens", pre_tokens), _int(op, "next_tokens", next_tokens)
    if _int(op, "inner_precise", inner_precise) not in (0, 1, 2, 3):
        raise _bad(op, "inner_precise", inner_precise, "0, 1, 2 or 3")
    if not isinstance(softmax_lse_flag, bool):
        raise _bad(op, "softmax_lse_flag", softmax_lse_flag, "a bool", TypeError)

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

    if batch > TND_MAX_BATCH:
        raise violation(op, "tnd_batch", f"{batch} requests")
    sparse_mode = _int(op, "sparse_mode", sparse_mode)
    if sparse_mode in (3, 4):
        _check_compressed_causal_mask(op, atten_mask, sparse_mode)
    elif sparse_mode == 0:
        if atten_mask is not None:
            raise NotImplementedError(
                f"{op}: sparse_mode=0 with a full atten_mask is not emulated (TND takes it without a mask)"
            )
    else:
        raise violation(op, "sparse_tnd", f"sparse_mode = {sparse_mode}")
    if current_chip() == "A5":
        if d % 16 or not 0 < d <= FIA_A5_MAX_HEAD_DIM or value.shape[-1] != key.shape[-1]:
            raise violation(op, "tnd_head_dim_a5", f"query D = {d}")
    elif d not in _TND_HEAD_DIMS or value.shape[-1] != key.shape[-1]:
        raise violation(op, "tnd_head_dim", f"query D = {d}")

    paged = block_table is not None
    if paged:
        block_size = _int(op, "block_size", block_size, 1)
        _nd_only(op, "key", key)
        _nd_only(op, "value", value)
        heads_major = _paged_layout(op, "key", key, block_size, kv_heads, d)
        if max(q_lens) > 1:
            if block_size % 128 or not 128 <= block_size <= 512:
                raise _bad(
                    op, "block_size", block_size, "a multiple of 128 in [128, 512] (page attention with Q_S > 1)"
                )
        elif block_size % 16 or block_size > 512:
            raise violation(op, "block_size", f"block_size {block_size} at Q_S = 1")
        kv_lens = kv_values
        if any(v < 0 for v in kv_lens):
            raise _bad(op, "actual_seq_lengths_kv", kv_lens, "non-negative per-request KV lengths (paged)")
        _check_lengths(op, q_lens, kv_lens)
        table = _block_table(op, block_table, batch, kv_lens, block_size, key.shape[0])
    else:
        heads_major, table = False, None
        _dims(op, "key", key, 3, "[T_kv, KV_N, D] (contiguous TND KV)")
        if key.shape[1] != kv_heads or key.shape[2] != d:
            raise _bad(op, "key", key, f"[T_kv, {kv_heads}, {d}]")
        kv_lens = _cumulative(op, "actual_seq_lengths_kv", kv_values, key.shape[0], "key.shape[0]")
        _check_lengths(op, q_lens, kv_lens)
    if max(q_lens) > 1 and (d % 16 or d > 512):
        raise _bad(op, "query", query, "D a multiple of 16 and <= 512 (float16/bfloat16, Q_S > 1)")
    visible = _visibility(op, sparse_mode, pre_tokens, next_tokens, q_lens, kv_lens, rope=False)
    out, lse = _fia_run((query,), (key,), value, q_lens, kv_lens, kv_heads, scale, table, heads_major, d, visible)
    softmax_lse = lse.unsqueeze(-1) if softmax_lse_flag else torch.zeros(1, dtype=torch.float32, device=query.device)
    return out.to(query.dtype), softmax_lse


_MLA_LATENT_DIMS = (512, 128)  # query D with query_rope / key_rope (FIA v2 doc, "MLA场景约束")
_MLA_ROPE_DIM = 64
_MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # query N for D = 512
_SINK_MAX_VALUE_DIM = 128  # "仅支持value的D小于等于128"
# FIA v2 TND without rope, paged, K_D = V_D: 64 or 128; no V_D = 192 in page attention (contracts: v2 "tnd_head_dim")
_V2_HEAD_DIMS = (64, 128)
_MLA_TND_MAX_QUERY = 16  # absorbed MLA in TND (contracts: v2 "mla_q16")


def _tree_visibility(op: str, atten_mask: object, q_lens: Sequence[int], kv_lens: Sequence[int]):
    """``sparse_mode=9`` (treeMask, MLA only): a flat ``(sum(Q_S_i ** 2),)`` mask, request ``i``'s
    ``[Q_S_i, Q_S_i]`` block after the previous ones, 1/True = masked out among the request's query tokens
    (the last ``Q_S_i`` keys); every query sees the ``KV_S_i - Q_S_i`` keys before them."""
    atten_mask = _tensor(op, "atten_mask", atten_mask)
    _dtype(op, "atten_mask", atten_mask, _MASK_FLAG_DTYPES, " (1/True = masked out)")
    total = sum(s * s for s in q_lens)
    if atten_mask.dim() != 1 or atten_mask.shape[0] != total:
        raise _bad(op, "atten_mask", atten_mask, f"shape (sum(Q_S_i ** 2),) = ({total},) for sparse_mode=9 and TND")
    _check_right_down(op, q_lens, kv_lens, 9)
    hidden = atten_mask.ne(0).cpu()
    starts = list(itertools.accumulate((s * s for s in q_lens), initial=0))

    def visible(r: int, s: int, length: int) -> torch.Tensor:
        tree = ~hidden[starts[r] : starts[r] + s * s].view(s, s)
        return torch.cat([torch.ones(s, length - s, dtype=torch.bool), tree], dim=1)

    return visible


@_on_chip("npu_fused_infer_attention_score_v2")
def npu_fused_infer_attention_score_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    dequant_scale_query: torch.Tensor | None = None,
    dequant_scale_key: torch.Tensor | None = None,
    dequant_offset_key: torch.Tensor | None = None,
    dequant_scale_value: torch.Tensor | None = None,
    dequant_offset_value: torch.Tensor | None = None,
    dequant_scale_key_rope: torch.Tensor | None = None,
    quant_scale_out: torch.Tensor | None = None,
    quant_offset_out: torch.Tensor | None = None,
    quant_scale_p: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    value_quant_mode: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    **dtypes: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FusedInferAttentionScore v2, the subset hal uses: ``input_layout="TND"``, paged KV, no quantisation.

    Doc: op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score_v2.md`` (517f2e7,
    2026-08-21). Called this way by vllm-ascend (``vllm_ascend/attention/mla_v1.py`` ``_forward_decode``: MLA,
    ``q_nope, k_nope, k_nope`` with ``query_rope`` / ``key_rope``, ``TND_NTD`` + ``sparse_mode=3`` for multi-token
    queries; ``attention_v1.py``: TND, ``sparse_mode`` 3 or 4 with ``pre_tokens=sliding_window, next_tokens=0``,
    ``learnable_sink``; both at 182b75e) and SGLang (``hardware_backend/npu/attention/ascend_backend.py``,
    0.5.21: the same TND call with ``learnable_sink=sinks``).

    ``query`` ``[T, Q_N, D]`` (TND: tokens of all requests concatenated); ``actual_seq_qlen`` cumulative query ends
    (host list, its length is the batch); paged ``key`` / ``value`` ``(blocknum, block_size, KV_N * D)`` or
    ``(blocknum, KV_N, block_size, D)`` with ``block_table`` int32 and ``actual_seq_kvlen`` **per-request** KV lengths.

    * MLA (``query_rope`` ``[T, Q_N, 64]`` and ``key_rope``, the rope cache laid out like ``key``, both or neither):
      scores are ``query . key + query_rope . key_rope``; query D 512 (KV_N = 1, Q_N a power of two <= 128) or 128;
      page block_size a multiple of 16, <= 1024. The value is ``value`` (MLA passes the latent cache again).
    * ``sparse_mode``: 0 without ``atten_mask`` (all keys); 3 rightDownCausal and 4 band (``pre_tokens`` /
      ``next_tokens`` around query ``i``'s position ``KV_S - Q_S + i``), both with the compressed 2048 x 2048 mask;
      9 treeMask (MLA with D = 512 only): a flat ``(sum(Q_S_i ** 2),)`` mask over each request's query tokens,
      1 = masked out, every query seeing the keys before them.
    * ``learnable_sink`` ``[Q_N]`` bfloat16 (float32 with float32 queries: this emulation only): one more logit per
      head in the softmax denominator; TND, value D <= 128, no quantisation.

    Returns ``(attention_out [T, Q_N, D_v] in query dtype, softmax_lse)``: natural-log LSE ``[T, Q_N, 1]`` float32
    with ``return_softmax_lse``, else a float32 ``[1]`` zero. Quantisation, pse, NZ caches and layouts other than
    TND raise ``NotImplementedError``.
    """
    op = "npu_fused_infer_attention_score_v2"
    unsupported = {
        "pse_shift": pse_shift,
        "dequant_scale_query": dequant_scale_query,
        "dequant_scale_key": dequant_scale_key,
        "dequant_offset_key": dequant_offset_key,
        "dequant_scale_value": dequant_scale_value,
        "dequant_offset_value": dequant_offset_value,
        "dequant_scale_key_rope": dequant_scale_key_rope,
        "quant_scale_out": quant_scale_out,
        "quant_offset_out": quant_offset_out,
        "quant_scale_p": quant_scale_p,
    }
    given = [name for name, v in unsupported.items() if v is not None]
    given += [name for name, v in dtypes.items() if v is not None]
    if given:
        raise NotImplementedError(f"{op}: the emulation does not implement {', '.join(given)} (quantisation, pse)")
    for name, v in (("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode)):
        if _int(op, name, v) != 0:
            raise NotImplementedError(f"{op}: {name} = {v}: the emulation implements unquantised inputs only (0)")
    if _int(op, "value_quant_mode", value_quant_mode) != 0:
        raise NotImplementedError(f"{op}: value_quant_mode = {value_quant_mode}: unquantised inputs only (0)")
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: input_layout = {input_layout!r}: the emulation implements 'TND' only")
    if block_table is None:
        raise NotImplementedError(f"{op}: contiguous KV (no block_table): the emulation implements paged KV only")

    query, key, value = (_tensor(op, name, x) for name, x in (("query", query), ("key", key), ("value", value)))
    _dims(op, "query", query, 3, "[T, N, D] for input_layout 'TND'")
    _dtype(op, "query", query, _FLOATS, " (float32 in this emulation only)")
    mla = query_rope is not None or key_rope is not None
    tensors = [("query", query), ("key", key), ("value", value)]
    if mla:
        if query_rope is None or key_rope is None:
            raise _bad(op, "query_rope/key_rope", (query_rope, key_rope), "both set or both None (MLA)")
        tensors += [
            ("query_rope", _tensor(op, "query_rope", query_rope)),
            ("key_rope", _tensor(op, "key_rope", key_rope)),
        ]
    for name, x in tensors:
        if not x.is_contiguous():
            raise _bad(op, name, x, "a contiguous tensor (the op takes no non-contiguous tensor)")
        if x.dtype != query.dtype:
            raise _bad(op, name, x, f"dtype {query.dtype} like query (unquantised)")
    if key.shape != value.shape:
        raise _bad(op, "value", value, f"the shape of key {list(key.shape)}")
    t, n, d = query.shape
    heads = _int(op, "num_query_heads", num_query_heads, 1)
    kv_heads = _int(op, "num_key_value_heads", num_key_value_heads, 0) or heads
    if heads != n:
        raise _bad(op, "num_query_heads", heads, f"the query's N = {n}")
    if heads % kv_heads or heads // kv_heads > _FIA_MAX_GROUP:
        raise _bad(op, "num_key_value_heads", kv_heads, f"a divisor of num_query_heads = {heads}, ratio <= 64")
    scale = _float(op, "softmax_scale", softmax_scale)
    pre_tokens, next_tokens = _int(op, "pre_tokens", pre_tokens), _int(op, "next_tokens", next_tokens)
    if _int(op, "inner_precise", inner_precise) not in (0, 1, 2, 3):
        raise _bad(op, "inner_precise", inner_precise, "0, 1, 2 or 3")
    if not isinstance(return_softmax_lse, bool):
        raise _bad(op, "return_softmax_lse", return_softmax_lse, "a bool", TypeError)
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise _bad(op, "actual_seq_qlen/actual_seq_kvlen", None, "host lists (both required for TND)")
    q_lens = _cumulative(op, "actual_seq_qlen", _int_list(op, "actual_seq_qlen", actual_seq_qlen), t, "T")
    kv_lens = _int_list(op, "actual_seq_kvlen", actual_seq_kvlen)
    if len(kv_lens) != len(q_lens) or any(v < 0 for v in kv_lens):
        raise _bad(op, "actual_seq_kvlen", kv_lens, f"{len(q_lens)} non-negative per-request KV lengths (paged)")

    block_size = _int(op, "block_size", block_size, 1)
    heads_major = _paged_layout(op, "key", key, block_size, kv_heads, d)
    rope = ()
    if mla:
        dr = query_rope.shape[-1]
        if query_rope.shape != (t, n, _MLA_ROPE_DIM):
            raise _bad(op, "query_rope", query_rope, f"[T, N, {_MLA_ROPE_DIM}] = [{t}, {n}, {_MLA_ROPE_DIM}]")
        if _paged_layout(op, "key_rope", key_rope, block_size, kv_heads, dr) != heads_major:
            raise _bad(op, "key_rope", key_rope, "the paged layout of key")
        if d not in _MLA_LATENT_DIMS:
            raise _bad(op, "query", query, f"D in {_MLA_LATENT_DIMS} with query_rope / key_rope (MLA)")
        if d == 512 and (kv_heads != 1 or n not in _MLA_HEADS):
            raise _bad(
                op, "num_query_heads/num_key_value_heads", (n, kv_heads), f"Q_N in {_MLA_HEADS}, KV_N = 1 (D = 512)"
            )
        if block_size % 16 or block_size > 1024:
            raise _bad(op, "block_size", block_size, "a multiple of 16, <= 1024 (MLA page attention)")
        rope = (query_rope,), (key_rope,)
        if max(q_lens) > _MLA_TND_MAX_QUERY:
            raise violation(op, "mla_q16", f"a request of {max(q_lens)} query tokens")
    else:
        if block_size % 16 or block_size > 1024:
            raise violation(op, "block_size", f"block_size {block_size}")
        if d not in _V2_HEAD_DIMS:
            raise violation(op, "tnd_head_dim", f"query D = value D = {d}, paged")
    if len(q_lens) > TND_MAX_BATCH:
        raise violation(op, "tnd_batch", f"{len(q_lens)} requests")
    for name, x in (("key", key), ("value", value), ("key_rope", key_rope)):
        if x is not None:
            _nd_only(op, name, x)
    _check_lengths(op, q_lens, kv_lens)
    table = _block_table(op, block_table, len(q_lens), kv_lens, block_size, key.shape[0])

    sparse_mode = _int(op, "sparse_mode", sparse_mode)
    if sparse_mode == 0:
        if atten_mask is not None:
            raise NotImplementedError(f"{op}: sparse_mode=0 with a full atten_mask is not emulated")
        visible = None
    elif sparse_mode in (3, 4):
        _check_compressed_causal_mask(op, atten_mask, sparse_mode)
        visible = _visibility(op, sparse_mode, pre_tokens, next_tokens, q_lens, kv_lens, rope=mla)
    elif sparse_mode == 9:
        if not mla or d != 512:
            raise _bad(op, "sparse_mode", 9, "treeMask only with query_rope / key_rope and D = 512 (MLA)")
        visible = _tree_visibility(op, atten_mask, q_lens, kv_lens)
    else:
        raise _bad(op, "sparse_mode", sparse_mode, "0, 3, 4 or 9 (the modes hal's emulation implements for TND)")

    sink = None
    if learnable_sink is not None:
        sink = _tensor(op, "learnable_sink", learnable_sink)
        _dtype(
            op, "learnable_sink", sink, (torch.bfloat16,) + ((torch.float32,) if query.dtype == torch.float32 else ())
        )
        if sink.shape != (n,):
            raise _bad(op, "learnable_sink", sink, f"shape (Q_N,) = ({n},)")
        if d > _SINK_MAX_VALUE_DIM:
            raise _bad(op, "value", value, f"value D <= {_SINK_MAX_VALUE_DIM} with learnable_sink")

    queries, keys = ((query, *rope[0]), (key, *rope[1])) if mla else ((query,), (key,))
    out, lse = _fia_run(queries, keys, value, q_lens, kv_lens, kv_heads, scale, table, heads_major, d, visible, sink)
    softmax_lse = lse.unsqueeze(-1) if return_softmax_lse else torch.zeros(1, dtype=torch.float32, device=query.device)
    return out.to(query.dtype), softmax_lse


@_on_chip("_npu_paged_attention_mla")
def _npu_paged_attention_mla(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    mla_vheadsize: int,
    out: torch.Tensor,
) -> None:
    """ATB PagedAttention for MLA decode: one query token per request over ONE cache holding latent ++ rope part.

    Schema (op-plugin ``op_plugin/ops/atb/PagedAttentionMlaAtb.cpp``, 517f2e7): ``mlaVHeadSize = mla_vheadsize``,
    no mask, BSND. ``query`` ``[batch, num_heads, head_size]``; ``key_cache`` ``[num_blocks, block_size, num_kv_heads,
    head_size]`` whose first ``mla_vheadsize`` columns are the value (no value cache); ``block_table`` int32 (device);
    ``context_lens`` int32 ``[batch]`` host tensor; ``out`` ``[batch, num_heads, mla_vheadsize]`` written in place.
    Shapes used upstream: head_size 576, mla_vheadsize 512, one KV head, fp16/bf16 (op-plugin's
    ``test/test_custom_ops/test_atb_paged_attention_mla.py``; SGLang ``ascend_backend.py`` ``forward_decode``).
    Block size a multiple of 16 (ATB PagedAttention).
    """
    op = "_npu_paged_attention_mla"
    query, key_cache, out = (_tensor(op, n, x) for n, x in (("query", query), ("key_cache", key_cache), ("out", out)))
    _dims(op, "query", query, 3, "[num_tokens, num_heads, head_size]")
    _dtype(op, "query", query, _FLOATS, " (float32 in this emulation only)")
    _dims(op, "key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_size] (ND)")
    if key_cache.dtype != query.dtype:
        raise _bad(op, "key_cache", key_cache, f"dtype {query.dtype} like query")
    heads, kv_heads = _head_counts(op, num_heads, num_kv_heads, query.shape[1])
    _, block_size, cache_heads, head_size = key_cache.shape
    if cache_heads != kv_heads or head_size != query.shape[2]:
        raise _bad(
            op, "key_cache", key_cache, f"[blocks, block_size, {kv_heads}, {query.shape[2]}] (kv heads, head_size)"
        )
    _nd_only(op, "key_cache", key_cache)
    if block_size % 16:
        raise _bad(op, "block_size (key_cache dim 1)", block_size, "a multiple of 16")
    if block_size > _ATB_MAX_BLOCK_SIZE:  # "因硬件限制，block_size <= 128", head_size > 256 named apart
        raise violation(op, "block_size", f"block_size {block_size} with head_size {head_size}")
    v_dim = _int(op, "mla_vheadsize", mla_vheadsize, 1)
    if v_dim >= head_size:
        raise _bad(op, "mla_vheadsize", v_dim, f"< head_size = {head_size} (the latent part of the key)")
    _check_out(op, out, query, v_dim)
    scale = _float(op, "scale_value", scale_value)
    lens = _host_int32(op, "context_lens", context_lens, query.shape[0])
    table = _block_table(op, block_table, query.shape[0], lens, block_size, key_cache.shape[0])
    result = torch.zeros(out.shape, dtype=torch.float32, device=query.device)
    for b, length in enumerate(lens):
        if length:
            k = _gather(key_cache, table[b], length)
            result[b : b + 1] = _attend(query[b : b + 1], k, k[..., :v_dim], scale, None)[0]
    out.copy_(result)


torch_npu = types.SimpleNamespace(
    __name__="hal.kernels.npu.emulation.torch_npu",
    __doc__="CPU emulation of the torch_npu ops hal uses (see hal.kernels.npu.emulation).",
    is_emulation=True,
    _npu_reshape_and_cache=_npu_reshape_and_cache,
    npu_scatter_pa_kv_cache=npu_scatter_pa_kv_cache,
    _npu_paged_attention=_npu_paged_attention,
    _npu_paged_attention_splitfuse=_npu_paged_attention_splitfuse,
    npu_fused_infer_attention_score=npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2=npu_fused_infer_attention_score_v2,
    _npu_paged_attention_mla=_npu_paged_attention_mla,
    _npu_reshape_and_cache_siso=_npu_reshape_and_cache_siso,
    npu_scatter_nd_update_=npu_scatter_nd_update_,
    npu_format_cast=npu_format_cast,
    get_npu_format=get_npu_format,
)
