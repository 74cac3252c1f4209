"""Property-based batches: ``hal check --fuzz N [--seed S]``.

:func:`cases` is a hypothesis strategy of :class:`~hal.conformance.cases.Case` for one
backend: any mode it claims, request lengths including an empty prefix, one token and
page boundaries, head layouts, the page sizes and dtypes it declares, windows, logit
caps, non-causal layers, random verify trees, shuffled pages or slots scattered off
their page offsets (where the backend does not require aligned slots), several layers
of pools that start at layer 0 or later, and what the backend declares of MLA, attention
sinks and fp8 KV caches; where it declares ``supports_padding_slots``, DECODE, EXTEND and MIXED
steps now and then hold padding requests (every query token's ``out_cache_loc`` -1, inside the
batch or at its end). Each batch is compared with the float64
reference (the real tokens' rows) and the whole pool with its canaries (only the real
tokens' ``out_cache_loc`` of the forwarded layer may change). A failing batch is shrunk
by hypothesis and reported as Python that rebuilds it.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, check_cache, check_output, describe
from hal.kv_dtypes import COMPUTE_DTYPES, KV_DTYPE_TABLE

__all__ = ["cases", "padding_inserts", "fit_padding", "run_fuzz", "check_case"]

_ANY_PAGE = (1, 2, 4, 16)
_PADDABLE = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED)


def _lengths(page: int):
    """Prefix lengths with the interesting values over-represented: 0, 1, around page boundaries."""
    boundaries = sorted({0, 1, page - 1, page, page + 1, 2 * page, 2 * page + 1} - {-1})
    return st.one_of(st.sampled_from(boundaries), st.integers(0, max(3 * page + 5, 40)))


@st.composite
def cases(draw, backend_cls, capability) -> Case:
    """A random case ``backend_cls`` declares it can serve on ``capability``."""
    declared = backend_cls.declaration()
    pages = sorted(declared.page_sizes) if declared.page_sizes is not None else list(_ANY_PAGE)
    page = draw(st.sampled_from([p for p in pages if p <= 128] or pages[:1]))
    modes = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND]
    if declared.supports_custom_mask:
        modes.append(ForwardMode.TARGET_VERIFY)
    mode = draw(st.sampled_from(modes))
    dtypes = [d for name, d in COMPUTE_DTYPES.items() if name in declared.dtypes and capability.supports_dtype(d)]
    dtype = draw(st.sampled_from(dtypes or [torch.float32]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dims = sorted(declared.head_dims) if declared.head_dims else [16, 32, 64, 80, 128]
    head_dim = draw(st.sampled_from(head_dims))
    v_head_dim = None
    if declared.supports_mla and draw(st.booleans()):
        v_head_dim = draw(st.sampled_from([16, 32, 64]))
    bs = draw(st.integers(1, 4))
    prefixes = [draw(_lengths(page)) for _ in range(bs)]
    if mode.is_decode():
        news = [1] * bs
    elif mode.is_target_verify():
        news = [draw(st.integers(1, 5))] * bs
    elif mode.is_mixed():
        news = [draw(st.one_of(st.just(1), st.integers(1, 2 * page + 3))) for _ in range(bs)]
    else:
        news = [draw(st.one_of(st.sampled_from([1, page, page + 1]), st.integers(1, 2 * page + 3))) for _ in range(bs)]
    if not mode.is_target_verify() and not mode.is_decode():
        prefixes = [p if mode != ForwardMode.DRAFT_EXTEND or p > 0 else 1 for p in prefixes]
    window = -1
    if declared.supports_sliding_window and draw(st.booleans()):
        window = draw(st.one_of(st.sampled_from([0, 1, page - 1, page, page + 1]), st.integers(0, 40)))
        window = max(window, 0)
    cap, q_scale = 0.0, 1.0
    if declared.supports_logit_cap and draw(st.booleans()):
        cap, q_scale = draw(st.sampled_from([1.0, 5.0, 30.0])), draw(st.sampled_from([1.0, 8.0]))
    attn_type = "decoder"
    if declared.supports_non_causal and mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and draw(st.booleans()):
        attn_type = "encoder_only"
    scaling = draw(st.one_of(st.none(), st.sampled_from([0.05, 0.3, 1.0])))
    layer_num = draw(st.integers(1, 3))
    start_layer = draw(st.sampled_from([0, 0, 1, 5]))  # a pipeline stage's pool now and then
    layer_id = start_layer + draw(st.integers(0, layer_num - 1))
    scatter = page > 1 and not declared.requires_page_aligned_slots and draw(st.booleans())
    case = Case(
        "fuzz",
        mode,
        tuple(zip(prefixes, news)),
        tp_q_head_num=kv_heads * group,
        tp_k_head_num=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        page_size=page,
        sliding_window_size=window,
        logit_cap=cap,
        attn_type=attn_type,
        q_scale=q_scale,
        blind_row=mode.is_target_verify() and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        scaling=scaling,
        layer_num=layer_num,
        layer_id=layer_id,
        start_layer=start_layer,
        slots="scattered" if scatter else "aligned",
    )
    return _model_features(draw, backend_cls, case)


def _model_features(draw, backend_cls, case: Case) -> Case:
    """``case`` with, where ``backend_cls`` declares them, attention sinks, an fp8 cache and MLA's latent layout."""
    changes: dict = {}
    declared = backend_cls.declaration()
    if declared.supports_sinks and draw(st.booleans()):
        changes["sinks"] = True
    fp8 = [row.torch_dtype for row in KV_DTYPE_TABLE if row.scaled and row.name in declared.kv_cache_dtypes]
    if fp8 and draw(st.booleans()):
        k_scale, v_scale = (draw(st.sampled_from([0.004, 0.37, 1.0, 1.9])) for _ in range(2))
        changes.update(kv_cache_dtype=draw(st.sampled_from(fp8)), k_scale=k_scale, v_scale=v_scale)
    if declared.supports_mla and draw(st.booleans()):
        rank, rope = draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([0, 8, 16]))
        if not declared.head_dims or rank + rope in declared.head_dims:
            changes.update(kv_lora_rank=rank, qk_rope_head_dim=rope, head_dim=rank + rope, v_head_dim=rank)
            changes.update(tp_k_head_num=1, tp_q_head_num=case.tp_q_head_num // case.tp_k_head_num)
            changes["v_scale"] = changes.get("k_scale")  # the value is the key's latent: one scale
    return dataclasses.replace(case, **changes)


def padding_inserts(backend_cls):
    """Padding requests to insert into a fuzzed case (``{before request i: query tokens}``), drawn apart from the
    case so that shrinking the case leaves them as they were; :func:`fit_padding` fits them to the case. Always
    ``{}`` where the backend does not declare ``supports_padding_slots``."""
    if not backend_cls.declaration().supports_padding_slots:
        return st.just({})
    inserts = st.dictionaries(st.integers(0, 4), st.integers(1, 3), min_size=1, max_size=2)
    return st.one_of(st.just({}), inserts)


def fit_padding(case: Case, inserts: dict[int, int]) -> dict[int, int]:
    """``inserts`` as :func:`hal.conformance.padding.with_padding` takes them for ``case``: none in verify and draft
    steps (they carry no padding requests), one token each in DECODE, positions past the batch at its end."""
    if case.mode not in _PADDABLE:
        return {}
    fitted: dict[int, int] = {}
    for i, n in sorted(inserts.items()):
        at = min(i, len(case.requests))
        fitted[at] = 1 if case.mode.is_decode() else fitted.get(at, 0) + n
    return fitted


def check_case(target, backend, case: Case, padding: dict[int, int] | None = None) -> str | None:
    """Run ``case`` on ``backend`` (with the ``padding`` requests of :func:`fit_padding` inserted); None when the
    real tokens' outputs and the whole pool are right, else what is wrong."""
    from hal.conformance.padding import with_padding  # a pytest module: imported where the fuzz runs, under pytest

    built = build(case, target.capability.torch_device)
    fb, q, k, v, real = with_padding(built, padding) if padding else (built.batch, built.q, built.k, built.v, None)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, built.layer, fb, **built.forward_kwargs)
    return check_cache(built) or check_output(built, out if real is None else out[real])


def run_fuzz(target, examples: int, seed: int = 0) -> int:
    """``examples`` random batches on ``target``; raises AssertionError with a shrunk, reproducible case."""
    backend = target.create()  # one backend for every batch, as an engine keeps it
    counted = {"ran": 0}

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(padding=padding_inserts(target.backend), case=cases(target.backend, target.capability))
    def property_(padding, case):
        reasons = target.backend.unsupported_reasons(case.config(), target.capability)
        if reasons:
            from hypothesis import reject

            reject()
        counted["ran"] += 1
        padding = fit_padding(case, padding)
        try:
            problem = check_case(target, backend, case, padding)
        except Exception as exc:  # an exception is a failure like any other, with the case that raised it
            problem = f"{type(exc).__name__}: {exc}"
        padded = f" with padding requests (out_cache_loc -1) {padding}" if padding else ""
        step = (
            "  from hal.conformance.padding import with_padding\n"
            f"  fb, q, k, v, real = with_padding(built, {padding})\n"
            if padding
            else "  fb, q, k, v, real = built.batch, built.q, built.k, built.v, slice(None)\n"
        )
        assert problem is None, (
            f"{describe(case)}{padded}\n{problem}\nreproduce:\n  from hal.batch import ForwardMode\n"
            f"  from hal.conformance.cases import Case, build\n  import torch\n  case = {case.source()}\n"
            f"  built = build(case)  # then, with your backend:\n{step}"
            "  backend.init_forward_metadata(fb)\n"
            "  out = backend.forward(q, k, v, built.layer, fb, **built.forward_kwargs)\n"
            "  # compare: hal.conformance.cases.check_cache(built), check_output(built, out[real])"
        )

    property_()
    return counted["ran"]
