"""The catalogue: the conformance cases (:data:`CASES`, :data:`GRAPH_CASES`); :func:`cases_for`, which moves them
within what a backend declares; :func:`shape_cases`, built from what it declares (every mode at every head-dim
combination, request table form and KV layout it takes); :func:`one_per_shape`, the bounded share a further path of a
backend (a CPU ISA path) runs."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from hal.batch import ForwardMode
from hal.conformance.case import LARGE_LOGITS_Q_SCALE, Case
from hal.kv_layouts import KV_LAYOUTS, TOKEN_MAJOR

__all__ = [
    "CASES",
    "GRAPH_CASES",
    "cases_for",
    "graph_capture_sizes",
    "graph_replays",
    "head_dim_combinations",
    "one_per_shape",
    "shape_cases",
]


def _nearest(page_size: int, declared) -> int:
    return min(sorted(declared), key=lambda p: abs(math.log2(p) - math.log2(page_size)))


# head dims a port's tiles may take, tried in this order where a case's own is refused
_HEAD_DIMS = (64, 128, 32, 96, 256, 80, 192, 16, 48)
# dtypes a case moves to where the backend does not declare its own: the same width first
_DTYPE_ORDER = {
    torch.float32: (torch.bfloat16, torch.float16),
    torch.bfloat16: (torch.float16, torch.float32),
    torch.float16: (torch.bfloat16, torch.float32),
}


def _renamed(case: Case, old: str, new: str) -> str:
    return case.name.replace(old, new) if old and old in case.name else f"{case.name}_{new}"


def _fit_dtype(backend_cls, case: Case, capability) -> Case:
    """``case`` in a dtype the backend (and ``capability``) serves: its own, else the nearest such."""
    declared = backend_cls.declaration().dtypes
    served = set(declared) & (set(capability.dtypes) if capability is not None else set(declared))
    if case.dtype_name in served:
        return case
    for dtype in _DTYPE_ORDER.get(case.dtype, ()):
        moved = replace(case, dtype=dtype)
        if moved.dtype_name in served:
            name = _renamed(case, case.dtype_name if case.dtype_name != "fp32" else "", moved.dtype_name)
            return replace(moved, name=name)
    return case


def _fit_head_dims(backend_cls, case: Case, capability) -> Case:
    """``case`` at head dims the backend takes, keeping ``v_head_dim != head_dim`` where the case has it. Declared
    ``head_dims`` first; with a ``capability``, a case still refused is tried at other dims its config takes (a
    port whose own ``unsupported_reasons`` rules dims out). MLA cases keep the model's dims."""
    if case.kv_lora_rank:
        return case
    split = case.v_head_dim not in (None, case.head_dim)
    declared = backend_cls.declaration().head_dims
    dims = [d for d in _HEAD_DIMS if declared is None or d in declared] + sorted(set(declared or ()) - set(_HEAD_DIMS))
    own = case.head_dim in dims and (not split or case.v_head_dim in dims)
    refused = capability is not None and backend_cls.unsupported_reasons(case.config(), capability)
    if own and not refused:
        return case
    if capability is None:  # the declared dims only: the nearest ones
        head = min(dims, key=lambda d: abs(d - case.head_dim))
        rest = [d for d in dims if d != head]
        v = min(rest, key=lambda d: abs(d - case.v_head_dim)) if split and rest else None
        candidates = [(head, v)] if not split or v is not None else []
    else:
        heads = sorted(dims, key=lambda d: abs(d - case.head_dim))  # the nearest dims first
        values = sorted(dims, key=lambda d: abs(d - (case.v_head_dim or 0)))
        candidates = [(h, v) for h in heads for v in ([d for d in values if d != h] if split else [None])]
    base = replace(case, name="")
    for head, v in candidates:
        if refused and (head, v if split else None) == (case.head_dim, case.v_head_dim if split else None):
            continue  # the case's own dims, which it refuses
        moved = replace(base, head_dim=head, v_head_dim=v)
        reasons = capability is not None and backend_cls.unsupported_reasons(moved.config(), capability)
        if not reasons:
            suffix = f"d{head}" + (f"v{v}" if v is not None else "")
            return replace(moved, name=f"{case.name}_{suffix}")
        if reasons == refused:  # the dims are not what it refuses
            break
    return case  # nothing fits: the backend's own reasons say why when the case is skipped


def cases_for(backend_cls, cases, capability=None) -> list[Case]:
    """``cases`` within what ``backend_cls`` declares: page sizes, dtypes, head dims.

    A case runs at its own page size when the backend takes it, else at the declared
    size nearest to it; sweep cases run at every declared size. A backend that takes
    any power of two (``page_sizes = None``) runs every case at its own size. A case in a
    dtype the backend does not declare runs in the nearest one it does; a case at head
    dims it does not take runs at ones it does (``v_head_dim != head_dim`` kept), so a
    port with tile constraints still gets every feature in every mode. Cases that end up
    identical but for their names run once.
    """
    declared = backend_cls.declaration().page_sizes
    out, seen = [], set()
    names = {case.name for case in cases}
    for case in cases:
        if declared is None:
            sizes = [case.page_size]
        elif case.sweep:
            sizes = sorted(declared)
        else:
            sizes = [case.page_size if case.page_size in declared else _nearest(case.page_size, declared)]
        for ps in sizes:
            moved = case.at_page(ps)
            if moved is not case and moved.name in names:  # another case's name: say where this one came from
                moved = replace(moved, name=f"{moved.name}_from{case.page_size}")
            moved = _fit_head_dims(backend_cls, _fit_dtype(backend_cls, moved, capability), capability)
            key = replace(moved, name="")
            if key not in seen:
                seen.add(key)
                names.add(moved.name)
                out.append(moved)
    return out


D, E, M, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
X = ForwardMode.DRAFT_EXTEND
_DECODE = ((0, 1), (5, 1), (17, 1), (33, 1))
_EXTEND = ((9, 5), (0, 3), (20, 11))
_MIXED = ((12, 1), (0, 9), (7, 6), (30, 1))
_VERIFY = ((10, 4), (3, 4), (25, 4))
_P128_DECODE = ((0, 1), (130, 1), (260, 1), (5, 1))
_P128_EXTEND = ((130, 5), (0, 20), (200, 12))
# KV lengths at exact multiples of 16 (and of 1, 2, 4, 8) next to lengths across a boundary
_EXACT_DECODE = ((15, 1), (31, 1), (47, 1), (0, 1))
_EXACT_EXTEND = ((16, 16), (0, 16), (31, 1), (40, 8))
_EXACT_MIXED = ((15, 1), (16, 16), (0, 32), (31, 1))
_EXACT_VERIFY = ((12, 4), (28, 4))

CASES: tuple[Case, ...] = (
    Case("decode", D, _DECODE),
    Case("decode_bf16", D, _DECODE, dtype=torch.bfloat16),
    Case("decode_page16", D, _DECODE, page_size=16),
    Case("decode_page16_bf16", D, _DECODE, page_size=16, dtype=torch.bfloat16),
    Case("decode_mqa", D, _DECODE, tp_q_head_num=4, tp_k_head_num=1),
    Case("decode_mha", D, _DECODE, tp_q_head_num=2, tp_k_head_num=2),
    Case("decode_gqa8", D, _DECODE, tp_q_head_num=8, tp_k_head_num=2),
    Case("decode_gqa3", D, _DECODE, tp_q_head_num=6, tp_k_head_num=2),
    Case("decode_head_dim_80", D, _DECODE, head_dim=80),
    Case("decode_sliding_window", D, _DECODE, sliding_window_size=8),
    Case("decode_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0),
    Case("decode_v_head_dim", D, _DECODE, v_head_dim=32),
    Case("decode_scaling", D, _DECODE, scaling=0.3),
    Case("decode_batch1", D, ((20, 1),)),
    Case("decode_page16_exact", D, _EXACT_DECODE, page_size=16),
    Case("decode_multi_layer", D, _DECODE, layer_num=3, layer_id=1),
    Case("extend_no_prefix", E, ((0, 7), (0, 12), (0, 1))),
    Case("extend_prefix", E, _EXTEND),
    Case("extend_prefix_bf16", E, _EXTEND, dtype=torch.bfloat16),
    Case("extend_prefix_page16", E, _EXTEND, page_size=16),
    Case("extend_page4", E, _EXTEND, page_size=4),
    Case("extend_mqa", E, _EXTEND, tp_k_head_num=1),
    Case("extend_gqa3", E, _EXTEND, tp_q_head_num=6, tp_k_head_num=2),
    Case("extend_sliding_window", E, _EXTEND, sliding_window_size=6),
    Case("extend_logit_cap", E, _EXTEND, logit_cap=5.0, q_scale=8.0),
    Case("extend_non_causal", E, ((0, 7), (0, 12)), attn_type="encoder_only"),
    Case("extend_v_head_dim", E, _EXTEND, v_head_dim=32),
    Case("extend_scaling", E, _EXTEND, scaling=0.3),
    Case("extend_batch1", E, ((9, 5),)),
    Case("extend_page16_exact", E, _EXACT_EXTEND, page_size=16),
    Case("extend_multi_layer", E, _EXTEND, layer_num=3, layer_id=2),
    Case("mixed", M, _MIXED),
    Case("mixed_page16", M, _MIXED, page_size=16),
    Case("mixed_bf16", M, _MIXED, dtype=torch.bfloat16),
    Case("mixed_sliding_window", M, _MIXED, sliding_window_size=5),
    Case("mixed_logit_cap", M, _MIXED, logit_cap=5.0, q_scale=8.0),
    Case("mixed_non_causal", M, _MIXED, attn_type="encoder_only"),
    Case("mixed_mqa", M, _MIXED, tp_q_head_num=8, tp_k_head_num=1),
    Case("mixed_mha", M, _MIXED, tp_q_head_num=2, tp_k_head_num=2),
    Case("mixed_gqa3", M, _MIXED, tp_q_head_num=6, tp_k_head_num=2),
    Case("mixed_scaling", M, _MIXED, scaling=0.3),
    Case("mixed_batch1", M, ((7, 6),)),
    Case("mixed_page16_exact", M, _EXACT_MIXED, page_size=16),
    Case("mixed_multi_layer", M, _MIXED, layer_num=2, layer_id=1),
    Case("draft_extend", X, ((6, 3), (11, 3))),
    Case("draft_extend_batch1", X, ((13, 3),)),
    Case("draft_extend_sliding_window", X, ((6, 3), (11, 3)), sliding_window_size=4),
    Case("draft_extend_logit_cap", X, ((6, 3), (11, 3)), logit_cap=5.0, q_scale=8.0),
    Case("draft_extend_gqa3", X, ((6, 3), (11, 3)), tp_q_head_num=6, tp_k_head_num=2),
    Case("draft_extend_scaling", X, ((6, 3), (11, 3)), scaling=0.3),
    Case("draft_extend_page16_exact", X, ((13, 3), (29, 3)), page_size=16),
    Case("draft_extend_multi_layer", X, ((6, 3), (11, 3)), layer_num=2, layer_id=1),
    Case("verify", V, _VERIFY),
    Case("verify_page16_bf16", V, _VERIFY, page_size=16, dtype=torch.bfloat16),
    Case("verify_sliding_window", V, _VERIFY, sliding_window_size=7),
    Case("verify_logit_cap", V, _VERIFY, logit_cap=5.0, q_scale=8.0),
    Case("verify_mqa", V, _VERIFY, tp_q_head_num=4, tp_k_head_num=1),
    Case("verify_scaling", V, _VERIFY, scaling=0.3),
    Case("verify_batch1", V, ((10, 4),)),
    Case("verify_page16_exact", V, _EXACT_VERIFY, page_size=16),
    Case("verify_multi_layer", V, _VERIFY, layer_num=2, layer_id=1),
    # fp16: accelerators (and emulations that compute it); at page 16 too, where paged-only kernels run it
    Case("decode_fp16", D, _DECODE, dtype=torch.float16),
    Case("decode_fp16_page16", D, _EXACT_DECODE, dtype=torch.float16, page_size=16),
    Case("extend_prefix_fp16", E, _EXTEND, dtype=torch.float16, page_size=16),
    Case("mixed_fp16", M, _MIXED, dtype=torch.float16),
    Case("mixed_fp16_page16", M, _EXACT_MIXED, dtype=torch.float16, page_size=16),
    Case("verify_fp16", V, _VERIFY, dtype=torch.float16),
    Case("verify_fp16_page16", V, _EXACT_VERIFY, dtype=torch.float16, page_size=16),
    Case("draft_extend_fp16_page16", X, ((6, 3), (29, 3)), dtype=torch.float16, page_size=16),
    # 128-token pages (Ascend's default block size): requests cross page boundaries
    Case("decode_page128", D, _P128_DECODE, page_size=128),
    Case("decode_page128_bf16", D, _P128_DECODE, page_size=128, dtype=torch.bfloat16),
    # long contexts in bf16: a sum kept in bf16 (softmax denominator, output) stalls there
    Case("decode_long_bf16", D, ((1000, 1), (700, 1), (300, 1)), page_size=16, dtype=torch.bfloat16, q_scale=2.0),
    Case("extend_prefix_page128", E, _P128_EXTEND, page_size=128),
    Case("extend_prefix_page128_bf16", E, _P128_EXTEND, page_size=128, dtype=torch.bfloat16),
    Case("mixed_page128", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128),
    Case("mixed_page128_bf16", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128, dtype=torch.bfloat16),
    Case("mixed_page128_head_dim_128", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128, head_dim=128),
    Case("verify_page128", V, ((130, 4), (3, 4)), page_size=128),
    # the same features at the page sizes paged-only kernels (Ascend: multiples of 16) take
    Case("decode_mqa_page16", D, _DECODE, tp_k_head_num=1, page_size=16),
    Case("decode_gqa8_page128", D, ((0, 1), (130, 1), (260, 1)), tp_q_head_num=8, page_size=128),
    Case("decode_sliding_window_page16", D, _DECODE, sliding_window_size=8, page_size=16),
    Case("extend_no_prefix_page128", E, ((0, 7), (0, 140), (0, 1)), page_size=128),
    Case("extend_sliding_window_page128", E, _P128_EXTEND, sliding_window_size=6, page_size=128),
    Case("extend_non_causal_page16", E, ((0, 7), (0, 12)), attn_type="encoder_only", page_size=16),
    Case("extend_non_causal_page128", E, ((0, 7), (0, 130)), attn_type="encoder_only", page_size=128),
    Case("draft_extend_page128", X, ((130, 3), (11, 3)), page_size=128),
    Case("mixed_page16_bf16", M, _MIXED, page_size=16, dtype=torch.bfloat16),
    Case("mixed_sliding_window_page16", M, _EXACT_MIXED, sliding_window_size=9, page_size=16),
    Case("verify_sliding_window_page16", V, _VERIFY, sliding_window_size=7, page_size=16),
    Case("verify_blind_row_page16", V, _VERIFY, page_size=16, blind_row=True),
    # a second blind-row case (a route one case reaches is one refactor away from none): bf16, exact pages
    Case("verify_blind_row_page16_bf16", V, _EXACT_VERIFY, page_size=16, dtype=torch.bfloat16, blind_row=True),
    # run at every page size the backend declares: KV lengths at and across 16/32/64/128 boundaries
    Case("decode_pages", D, ((15, 1), (63, 1), (128, 1), (0, 1), (31, 1)), sweep=True),
    Case("extend_pages", E, ((16, 16), (0, 64), (100, 29)), sweep=True),
    Case("mixed_pages", M, ((31, 1), (0, 16), (64, 64), (127, 1)), sweep=True),
    Case("verify_pages", V, ((12, 4), (60, 4)), sweep=True),
    Case("draft_extend_pages", X, ((13, 3), (125, 3)), sweep=True),
)

_SMALL_DECODE = ((0, 1), (9, 1), (40, 1))
_SMALL_EXTEND = ((7, 5), (0, 9))
_SMALL_VERIFY = ((6, 3), (21, 3))
_SMALL_DRAFT = ((6, 3), (21, 3))
# what the issue-16 review found passing: every case below has a mutant (tests/mutant_backends.py) it kills
CASES += (
    # large scaled logits without a cap: exp() overflows unless the row maximum is subtracted first
    Case("decode_large_logits", D, _DECODE, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("extend_large_logits", E, _EXTEND, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("mixed_large_logits", M, _MIXED, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("verify_large_logits", V, _VERIFY, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("draft_extend_large_logits", X, _SMALL_DRAFT, q_scale=LARGE_LOGITS_Q_SCALE),
    Case(
        "decode_large_logits_page16_bf16", D, _DECODE, q_scale=LARGE_LOGITS_Q_SCALE, page_size=16, dtype=torch.bfloat16
    ),
    Case(
        "extend_large_logits_page16_bf16", E, _EXTEND, q_scale=LARGE_LOGITS_Q_SCALE, page_size=16, dtype=torch.bfloat16
    ),
    # bf16 with a logit cap, in every mode: a capped path that computes in the cache dtype shows
    Case("decode_logit_cap_bf16", D, _DECODE, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("extend_logit_cap_bf16", E, _EXTEND, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("mixed_logit_cap_bf16", M, _MIXED, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("verify_logit_cap_bf16", V, _VERIFY, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("draft_extend_logit_cap_bf16", X, _SMALL_DRAFT, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case(
        "decode_logit_cap_page16_bf16",
        D,
        _EXACT_DECODE,
        logit_cap=30.0,
        q_scale=16.0,
        page_size=16,
        dtype=torch.bfloat16,
    ),
    # slots not at offset i % page_size (a page-size-1 allocator on a paged pool), in every mode
    Case("decode_scattered_page16", D, _DECODE, page_size=16, slots="scattered"),
    Case("decode_scattered_page16_bf16", D, _DECODE, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("extend_scattered_page16_bf16", E, _EXTEND, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("extend_scattered_page4", E, _EXTEND, page_size=4, slots="scattered"),
    Case("mixed_scattered_page16_bf16", M, _MIXED, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("verify_scattered_page16_bf16", V, _VERIFY, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("draft_extend_scattered_page16_bf16", X, _SMALL_DRAFT, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case(
        "decode_window_scattered_page16_bf16",
        D,
        _DECODE,
        page_size=16,
        slots="scattered",
        sliding_window_size=8,
        dtype=torch.bfloat16,
    ),
    Case(
        "extend_scattered_head_dim_128_page128_bf16",
        E,
        ((130, 5), (0, 20)),
        head_dim=128,
        page_size=128,
        slots="scattered",
        dtype=torch.bfloat16,
    ),
    # the same at decode: pages of 128 are the smallest FIA takes at Q_S > 1, so on A5 (no ATB op) these two are
    # the scattered cases it serves, and each route wants two cases
    Case(
        "decode_scattered_head_dim_128_page128_bf16",
        D,
        ((130, 1), (0, 1), (260, 1)),
        head_dim=128,
        page_size=128,
        slots="scattered",
        dtype=torch.bfloat16,
    ),
    # head dims of every tile table (64 and 80 above), at page 1 and at the paged-only kernels' sizes
    Case("decode_head_dim_96", D, _SMALL_DECODE, head_dim=96),
    Case("decode_head_dim_128", D, _SMALL_DECODE, head_dim=128),
    Case("decode_head_dim_192", D, _SMALL_DECODE, head_dim=192),
    Case("decode_head_dim_256", D, _SMALL_DECODE, head_dim=256),
    Case("extend_head_dim_96", E, _SMALL_EXTEND, head_dim=96),
    Case("extend_head_dim_128", E, _SMALL_EXTEND, head_dim=128),
    Case("extend_head_dim_192", E, _SMALL_EXTEND, head_dim=192),
    Case("extend_head_dim_256", E, _SMALL_EXTEND, head_dim=256),
    Case("verify_head_dim_128_bf16", V, _SMALL_VERIFY, head_dim=128, dtype=torch.bfloat16),
    Case("mixed_head_dim_256_bf16", M, ((12, 1), (0, 9)), head_dim=256, dtype=torch.bfloat16),
    Case("decode_head_dim_128_page16_bf16", D, _SMALL_DECODE, head_dim=128, page_size=16, dtype=torch.bfloat16),
    Case("decode_head_dim_192_page16_bf16", D, _SMALL_DECODE, head_dim=192, page_size=16, dtype=torch.bfloat16),
    Case("decode_head_dim_256_page16_bf16", D, _SMALL_DECODE, head_dim=256, page_size=16, dtype=torch.bfloat16),
    Case("extend_head_dim_96_page16_bf16", E, _SMALL_EXTEND, head_dim=96, page_size=16, dtype=torch.bfloat16),
    # Ascend's FIA route: EXTEND / DRAFT_EXTEND, head dim 128 or 192, pages of 128..512, bf16 / fp16
    Case(
        "extend_head_dim_128_page128_bf16",
        E,
        ((130, 5), (0, 20), (3, 7)),
        head_dim=128,
        page_size=128,
        dtype=torch.bfloat16,
    ),
    Case("extend_head_dim_192_page128_fp16", E, ((130, 5), (0, 20)), head_dim=192, page_size=128, dtype=torch.float16),
    Case(
        "draft_extend_head_dim_128_page128_bf16",
        X,
        ((130, 3), (11, 3)),
        head_dim=128,
        page_size=128,
        dtype=torch.bfloat16,
    ),
    Case("extend_head_dim_128_page256_bf16", E, ((260, 4), (0, 9)), head_dim=128, page_size=256, dtype=torch.bfloat16),
    Case("decode_page256_bf16", D, ((0, 1), (300, 1)), page_size=256, dtype=torch.bfloat16),
    # FIA's decode route where it is the only decode op (A5: no ATB ops) and the page must also serve extend
    Case("decode_head_dim_128_page128_bf16", D, ((0, 1), (130, 1)), head_dim=128, page_size=128, dtype=torch.bfloat16),
    # the compiled CPU kernel's task shapes at one thread, whatever the machine: (request, every KV head)
    # row tasks from 4 requests on, one task per (request, KV head) below, query tiles from 128 rows
    # (query tokens x GQA group), with partial last tiles and key blocks
    Case("decode_all_heads_per_task", D, _DECODE, tp_q_head_num=8, tp_k_head_num=4, threads=1),
    Case(
        "decode_all_heads_per_task_bf16",
        D,
        ((0, 1), (31, 1), (33, 1), (64, 1), (100, 1)),
        threads=1,
        dtype=torch.bfloat16,
    ),
    Case("decode_one_head_per_task", D, ((5, 1), (70, 1), (33, 1)), tp_q_head_num=8, tp_k_head_num=4, threads=1),
    Case(
        "verify_all_heads_per_task", V, ((10, 3), (3, 3), (25, 3), (40, 3)), tp_q_head_num=6, tp_k_head_num=2, threads=1
    ),
    Case("mixed_all_heads_per_task", M, ((12, 1), (0, 3), (7, 6), (30, 1), (2, 2)), threads=1),
    Case("decode_all_heads_window", D, _DECODE, sliding_window_size=7, threads=1),
    Case("decode_all_heads_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0, threads=1),
    Case("extend_tiles", E, ((0, 70), (20, 100)), threads=1),
    Case("extend_tiles_gqa3", E, ((5, 50), (0, 43)), tp_q_head_num=6, tp_k_head_num=2, threads=1),
    Case("extend_tiles_gqa4_bf16", E, ((33, 33), (0, 65)), tp_q_head_num=8, dtype=torch.bfloat16, threads=1),
    Case("mixed_tiles", M, ((12, 1), (0, 70), (40, 66)), threads=1),
    Case("extend_tiles_window", E, ((10, 80),), sliding_window_size=20, threads=1),
    Case("draft_extend_tiles_gqa8", X, ((20, 17), (3, 16)), tp_q_head_num=16, tp_k_head_num=2, threads=1),
    # pools of a pipeline stage: the model's layers start_layer.. (layer_id - start_layer indexes the pool)
    Case("decode_start_layer", D, _DECODE, layer_num=2, start_layer=3, layer_id=4),
    Case("extend_start_layer", E, _EXTEND, layer_num=2, start_layer=2, layer_id=2),
    Case("mixed_start_layer_page16", M, _MIXED, layer_num=3, start_layer=5, layer_id=6, page_size=16),
    Case("verify_start_layer", V, _VERIFY, layer_num=2, start_layer=1, layer_id=2),
    Case(
        "draft_extend_start_layer_page16_bf16",
        X,
        _SMALL_DRAFT,
        layer_num=2,
        start_layer=4,
        layer_id=5,
        page_size=16,
        dtype=torch.bfloat16,
    ),
    # v_head_dim != head_dim in every mode
    Case("mixed_v_head_dim", M, _MIXED, v_head_dim=32),
    Case("verify_v_head_dim", V, _VERIFY, v_head_dim=32),
    Case("draft_extend_v_head_dim", X, _SMALL_DRAFT, v_head_dim=48),
    Case("verify_v_head_dim_page16_bf16", V, _VERIFY, v_head_dim=128, page_size=16, dtype=torch.bfloat16),
    # a window on a non-causal layer: keys j >= p - W, none ruled out after the query (SGLang's triton and
    # FlashInfer backends: the window bounds the past only, also without causality)
    Case("extend_non_causal_window", E, ((0, 12), (0, 20)), attn_type="encoder_only", sliding_window_size=5),
    Case("mixed_non_causal_window", M, _MIXED, attn_type="encoder_only", sliding_window_size=4),
    Case(
        "extend_non_causal_window_page16_bf16",
        E,
        ((0, 30), (0, 9)),
        attn_type="encoder_only",
        sliding_window_size=7,
        page_size=16,
        dtype=torch.bfloat16,
    ),
)

# Graph cases: DECODE or TARGET_VERIFY batches; the graph test replays several
# different sub-batches of them in a row (see GRAPH_REPLAYS), so state kept from a previous replay shows.
GRAPH_CASES: tuple[Case, ...] = (
    Case("graph_decode", D, ((3, 1), (20, 1), (9, 1))),
    Case("graph_decode_page128", D, ((3, 1), (200, 1), (127, 1)), page_size=128),
    Case("graph_decode_fp16", D, ((3, 1), (20, 1), (9, 1)), dtype=torch.float16),
    Case("graph_decode_fp16_page16", D, ((3, 1), (20, 1), (15, 1), (40, 1)), dtype=torch.float16, page_size=16),
    Case("graph_decode_page16_window", D, ((3, 1), (20, 1), (9, 1), (31, 1)), page_size=16, sliding_window_size=6),
    Case(
        "graph_decode_page16_bf16",
        D,
        ((3, 1), (20, 1), (9, 1), (40, 1), (1, 1)),
        page_size=16,
        dtype=torch.bfloat16,
    ),
    Case("graph_decode_multi_layer", D, ((3, 1), (20, 1), (15, 1), (33, 1)), page_size=16, layer_num=2),
    Case("graph_decode_pages", D, ((15, 1), (63, 1), (2, 1), (40, 1)), sweep=True),
    # TARGET_VERIFY at a fixed draft count (SGLang captures verify under speculative decoding)
    Case("graph_verify", V, ((3, 4), (20, 4), (9, 4))),
    Case("graph_verify_page16_bf16", V, ((3, 3), (40, 3), (17, 3)), page_size=16, dtype=torch.bfloat16),
    Case("graph_verify_page128_window", V, ((130, 4), (3, 4)), page_size=128, sliding_window_size=5),
    # graphs run the checked prologue path (never a fused one-call forward): a cap and a pipeline stage there
    Case("graph_decode_logit_cap", D, ((3, 1), (20, 1), (9, 1)), logit_cap=5.0, q_scale=8.0),
    Case(
        "graph_verify_logit_cap_page16_bf16",
        V,
        ((3, 3), (40, 3), (17, 3)),
        logit_cap=5.0,
        q_scale=8.0,
        page_size=16,
        dtype=torch.bfloat16,
    ),
    Case(
        "graph_decode_start_layer_page16",
        D,
        ((3, 1), (20, 1), (9, 1), (33, 1)),
        layer_num=2,
        start_layer=3,
        layer_id=3,
        page_size=16,
    ),
    Case("graph_verify_start_layer", V, ((3, 4), (20, 4), (9, 4)), layer_num=2, start_layer=2, layer_id=2),
)


# The declared-shape cases' requests per mode: contexts of up to four 16-token pages (a block-table walk past its
# second page, a page's last offset), new tokens across page boundaries; fp32 and bf16 alternate over the modes.
_SHAPE_REQUESTS = {
    D: (((37, 1), (5, 1), (50, 1)), torch.float32),
    E: (((33, 7), (0, 20)), torch.bfloat16),
    M: (((40, 1), (0, 9), (20, 18)), torch.float32),
    V: (((35, 3), (10, 3)), torch.bfloat16),
    X: (((34, 3), (12, 3)), torch.float32),
}
# head dims standing for "any" (head_dims = None): a multiple of 32 and one with a 16-wide tail (MLA's 64 + 16)
_ANY_HEAD_DIMS = (64, 80)


def head_dim_combinations(backend_cls) -> list[tuple[int, int | None]]:
    """``(head_dim, v_head_dim)`` pairs ``backend_cls`` declares (``v_head_dim`` None: equal): each declared head dim
    (64 and 80 for one that takes any), and with ``supports_mla`` every ordered pair of two of them."""
    declared = backend_cls.declaration()
    dims = sorted(declared.head_dims) if declared.head_dims is not None else list(_ANY_HEAD_DIMS)
    pairs: list[tuple[int, int | None]] = [(d, None) for d in dims]
    if declared.supports_mla:
        pairs += [(d, v) for d in dims for v in dims if v != d]
    return pairs


def _layout_page(page: int, multiple: int, declared) -> int:
    """``page``, or where a layout needs pages of a multiple of ``multiple`` (AMX-packed: 32) the smallest
    such page the backend declares (``declared`` None: any power of two)."""
    if not page % multiple:
        return page
    fitting = [p for p in (declared or (multiple,)) if not p % multiple]
    return min(fitting, default=page)


def shape_cases(backend_cls, capability=None) -> list[Case]:
    """Cases built from what ``backend_cls`` declares: every forward mode at every :func:`head_dim_combinations`
    pair, request table form (``reads_tables``: a token table, a block table) and KV layout (``kv_layouts``) it
    takes, at the declared page size nearest to 16 (or the smallest a layout takes: AMX-packed pages hold 32;
    contexts of three and four pages), in a dtype it declares.
    Families ``kv_layout`` / ``page_table`` where the layout or table is not the default, else by their dims."""
    declared = backend_cls.declaration()
    page = 16 if declared.page_sizes is None else _nearest(16, declared.page_sizes)
    tables = sorted(declared.reads_tables, key=lambda t: t != "token")  # the token table first
    out = []
    for mode, (requests, dtype) in _SHAPE_REQUESTS.items():
        for head, v in head_dim_combinations(backend_cls):
            for table in tables:
                for layout in declared.kv_layouts:
                    name = f"shape_{mode.name.lower()}_d{head}" + (f"v{v}" if v is not None else "")
                    name += ("" if table == "token" else "_block_table") + (
                        "" if layout == TOKEN_MAJOR else f"_{layout}"
                    )
                    shape = {"head_dim": head, "v_head_dim": v, "table": table, "kv_layout": layout}
                    row = KV_LAYOUTS[layout]
                    at = _layout_page(page, row.page_multiple, declared.page_sizes)
                    scaled = tuple((prefix * at // page, n) for prefix, n in requests)  # as many pages
                    case = Case(name, mode, scaled, dtype=dtype, page_size=at, **shape)
                    if not any(row.unsupported(case.tp_k_head_num, d, at) for d in (head, v or head)):
                        out.append(_served_dtype(backend_cls, _fit_dtype(backend_cls, case, capability), capability))
    return out


def _served_dtype(backend_cls, case: Case, capability) -> Case:
    """``case``, or where ``capability`` is given and the backend refuses it in its dtype but serves it in another
    it declares (AMX-packed pages hold bf16 only), the case in that dtype."""
    if capability is None or not backend_cls.unsupported_reasons(case.config(), capability):
        return case
    for dtype in (torch.bfloat16, torch.float32):
        moved = replace(case, dtype=dtype)
        if moved.dtype_name != case.dtype_name and not backend_cls.unsupported_reasons(moved.config(), capability):
            return replace(
                moved, name=_renamed(case, case.dtype_name if case.dtype_name != "fp32" else "", moved.dtype_name)
            )
    return case


def one_per_shape(cases) -> list[Case]:
    """The share of ``cases`` a further path of a backend runs (a CPU ISA path besides the default): in order, each
    case that brings a shape none before it had, so the share meets every shape the whole list does, once: every
    (mode, head-dim combination, request table, KV layout), every family, every page size, KV cache dtype and task
    shape (host threads) in every mode, every dtype in every mode and at every head-dim combination."""
    seen: set = set()
    out = []
    for case in cases:
        dims = (case.head_dim, case.v_head_dim, case.kv_lora_rank, case.qk_rope_head_dim)
        facets = {
            ("shape", case.mode, *dims, case.table, case.kv_layout),
            ("family", case.family),
            ("page", case.page_size, case.mode),
            ("dtype", case.dtype_name, *dims),
            ("dtype", case.dtype_name, case.mode),
            ("kv_dtype", case.kv_dtype_name, case.mode),
            ("threads", case.threads, case.mode),
        }
        if not facets <= seen:
            seen |= facets
            out.append(case)
    return out


def graph_capture_sizes(num_requests: int) -> tuple[int, ...]:
    """The batch sizes a graph test captures: powers of two up to the first >= ``num_requests`` (3 requests:
    1, 2, 4, the replay of all three padded to 4), so every replay of :func:`graph_replays` has a captured size;
    a larger one would never be replayed, and capturing it under an interpreter costs the most."""
    sizes = [1]
    while sizes[-1] < num_requests:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def graph_replays(num_requests: int) -> list[list[int]]:
    """The sub-batches a graph test replays in order: same padded size with other lengths back to back."""
    every = list(range(num_requests))
    return [every, every[::-1], [num_requests - 1], every[:2]]
