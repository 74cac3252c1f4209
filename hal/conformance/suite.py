"""The conformance tests. Each takes ``hal_target`` (a device and backend) from the plugin.

A case the backend declares it cannot serve (``unsupported_reasons`` gives reasons) is skipped
with those reasons; everything else must match the float64 reference, and the whole
KV pool (every layer, K and V) must equal what a correct forward leaves: the new
tokens at ``out_cache_loc`` and nothing else. The cache is compared first, so a
failure says whether the KV write or the attention output is wrong.

Cases run at the page sizes the backend declares (``hal.conformance.cases.cases_for``).
Every assertion says what it expected; ``hal check`` reports per mode and feature family
what passed, failed and was skipped, and why.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.conformance.cases import (
    Built,
    Case,
    build,
    cases_for,
    check_cache,
    check_output,
    describe,
    graph_capture_sizes,
    graph_replays,
    sub_batch,
)
from hal.conformance.output import (  # noqa: F401 (collected as this suite's tests)
    test_an_output_buffer_the_kernel_cannot_write_is_refused,
    test_out_buffer_receives_the_rows_in_place,
)
from hal.conformance.padding import (  # noqa: F401 (collected as this suite's tests)
    test_bad_padding_slot_is_rejected,
    test_padding_slots_in_a_graph_replay,
    test_padding_slots_write_nothing,
    test_padding_slots_write_nothing_mla,
)
from hal.conformance.targets import _backend_for, _first_servable, _record
from hal.errors import InvalidBatchError, KVCacheError
from hal.graph import GraphRunner
from hal.kernels import reference


def assert_result(built: Built, out: torch.Tensor | None, expected=None, rows=None, skip_padding_page=False) -> None:
    """The cache first (a wrong or missing KV write), then the output; one message naming the case."""
    problem = check_cache(built, skip_padding_page=skip_padding_page)
    if problem is None and out is not None:
        problem = check_output(built, out, expected=expected, rows=rows)
    assert problem is None, f"{describe(built.case)}\n{problem}"


@contextmanager
def host_threads(threads: int | None):
    """Run with ``threads`` host threads (None: as configured), restored after."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _record_routes(request, target, backend, case: Case, built: Built) -> None:
    """Tell ``hal check`` the routes the backend declares for this case's config and the ones this forward took."""
    declared = list(target.backend.routes(case.config(), target.capability))
    taken = list(backend.route_of(built.batch, built.layer)) if declared else []
    request.node.user_properties.append(("hal_routes", {"declared": declared, "taken": taken}))


def _assert_misaligned_refused(target, case: Case) -> None:
    """A backend that requires page-aligned slots refuses a scattered layout, naming why, and writes nothing."""
    _backend_for(target, case)  # skips with the reasons when the config itself is declared off
    backend = target.create(case.config(), validate="full")
    built = build(case, target.capability.torch_device)
    with pytest.raises(InvalidBatchError, match="page_size") as info:
        backend.init_forward_metadata(built.batch)
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert "offset" in str(info.value), f"the refusal does not say what is wrong with the layout: {info.value}"
    assert_result(replace(built, expected_pool_k=built.initial_pool_k, expected_pool_v=built.initial_pool_v), None)


@pytest.mark.hal_cases("forward")
def test_forward_matches_reference(hal_target, hal_case, request):
    """Output equals the reference, the new K/V land at out_cache_loc, and no other slot of any layer changes.

    Scattered slots on a backend that declares ``requires_page_aligned_slots``: refused (full validation)."""
    aligned_only = hal_target.backend.declaration().requires_page_aligned_slots
    if hal_case.slots != "aligned" and aligned_only and hal_case.page_size > 1:
        _assert_misaligned_refused(hal_target, hal_case)
        return
    backend = _backend_for(hal_target, hal_case)
    built = build(hal_case, hal_target.capability.torch_device)
    with host_threads(hal_case.threads):
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, **built.forward_kwargs)
        _record_routes(request, hal_target, backend, hal_case, built)
    assert_result(built, out)


_MODES = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY]
_MODES.append(ForwardMode.DRAFT_EXTEND)


# save_kv_cache=False runs the checked prologue path on every backend with a fused one: with a logit cap and
# in a pipeline stage's pool (start_layer > 0) too
_VARIANTS = {
    "plain": {},
    "logit_cap": {"logit_cap": 5.0, "q_scale": 8.0},
    "start_layer": {"layer_num": 2, "start_layer": 3, "layer_id": 4},
}


def _cache_holds_the_truth(target, mode, request, variant: str = "plain") -> tuple[object, Built]:
    case = _first_servable(target, mode)
    if variant != "plain":
        case = replace(case, name=f"{case.name}_{variant}", **_VARIANTS[variant])
    _record(request, case, "save_kv_cache")
    backend = _backend_for(target, case)
    built = build(case, target.capability.torch_device)
    pool = built.batch.token_to_kv_pool
    for bufs, want in ((pool.k_buffer, built.expected_pool_k), (pool.v_buffer, built.expected_pool_v)):
        for buf, w in zip(bufs, want):
            buf.copy_(w)  # the engine already wrote the new tokens (e.g. a fused rotary + cache kernel)
    built.initial_pool_k = [b.clone() for b in pool.k_buffer]
    built.initial_pool_v = [b.clone() for b in pool.v_buffer]
    return backend, built


@pytest.mark.hal_family("save_kv_cache")
@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("mode", _MODES, ids=lambda m: m.name)
def test_save_kv_cache_false_reads_the_cache_not_k_v(hal_target, mode, variant, request):
    """save_kv_cache=False: write nothing (K nor V, any layer) and attend over the cache, not the k/v passed;
    plain, with a logit cap, and on the pool of a pipeline stage (start_layer > 0)."""
    backend, built = _cache_holds_the_truth(hal_target, mode, request, variant)
    gen = torch.Generator().manual_seed(1)
    other_k = (torch.randn(built.k.shape, generator=gen) * 3).to(built.k.dtype).to(built.k.device)
    other_v = (torch.randn(built.v.shape, generator=gen) * 3).to(built.v.dtype).to(built.v.device)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, other_k, other_v, built.layer, built.batch, save_kv_cache=False)
    assert_result(built, out)


@pytest.mark.hal_family("save_kv_cache")
@pytest.mark.parametrize("mode", _MODES, ids=lambda m: m.name)
def test_save_kv_cache_false_with_k_v_none(hal_target, mode, request):
    """SGLang's contract: with save_kv_cache=False, k and v may be None; the cache is read."""
    backend, built = _cache_holds_the_truth(hal_target, mode, request)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, None, None, built.layer, built.batch, save_kv_cache=False)
    assert_result(built, out)


@pytest.mark.hal_cases("graph")
def test_graph_replay_matches_reference(hal_target, hal_case):
    """Captured at batch sizes 1, 2, 4... up to the first that holds every request (largest first, one shared
    pool), replayed padded for several different batches in a row, every layer.

    DECODE cases capture decode steps; TARGET_VERIFY cases capture verify steps of their (fixed) draft count.
    """
    case = hal_case
    backend = _backend_for(hal_target, case, graph=True)
    built = build(case, hal_target.capability.torch_device)
    fb = built.batch
    pool = fb.token_to_kv_pool
    layers = [case.layer(i) for i in range(case.start_layer, case.start_layer + case.layer_num)]
    runner = GraphRunner(
        backend,
        layers,
        fb.req_to_token_pool,
        pool,
        make_graph=lambda: hal_target.device.make_graph(hal_target.capability),
        capture_bs=graph_capture_sizes(len(case.requests)),
        dtype=case.dtype,
        draft_token_num=case.requests[0][1] if case.mode.is_target_verify() else None,
        sinks=None if built.sinks is None else [built.sinks] * len(layers),
    )
    runner.capture()
    # the runner writes the new tokens to every layer: that is the expectation
    tokens = built.q.shape[0]
    exp_k = [b.clone() for b in built.initial_pool_k]
    exp_v = [b.clone() for b in built.initial_pool_v]
    expected = []
    for layer in layers:
        kb, vb = exp_k[layer.layer_id - case.start_layer], exp_v[layer.layer_id - case.start_layer]
        new_k, new_v = (t.view(tokens, case.tp_k_head_num, -1) for t in (built.k, built.v))
        reference.write_kv(kb, vb, fb.out_cache_loc, new_k, new_v, *reference.kv_scales(layer))
        expected.append(
            reference.batch_attention(built.q, kb, vb, layer, fb, sinks=built.sinks, acc_dtype=torch.float64)
        )
    built = replace(built, expected_pool_k=exp_k, expected_pool_v=exp_v)
    for step, rows in enumerate(graph_replays(len(case.requests))):
        sub, q, k, v, tokens = sub_batch(built, rows)
        out = runner.run(sub, q, k, v)
        for li, layer in enumerate(layers):
            problem = check_output(replace(built, layer=layer), out[li], expected=expected[li][tokens], rows=tokens)
            assert problem is None, (
                f"{describe(case)}\nreplay {step} (requests {rows}, after {graph_replays(len(case.requests))[:step]})"
                f", layer {layer.layer_id}:\n{problem}"
            )
    assert_result(built, None, skip_padding_page=True)  # page 0 takes the padding requests' writes


@pytest.mark.hal_family("bad_input")
@pytest.mark.parametrize("corrupt", ["q_tokens", "k_heads", "v_dtype", "layer_id"])
def test_bad_input_is_rejected_and_cache_untouched(hal_target, corrupt, request):
    """Ill-shaped inputs raise a hal error naming the field, before anything is written."""
    case = _first_servable(hal_target, ForwardMode.DECODE, prefix=False)
    _record(request, case)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    q, k, v, layer = built.q, built.k, built.v, built.layer
    if corrupt == "q_tokens":
        q = q[:-1]
    elif corrupt == "k_heads":
        k = k[:, : k.shape[1] // 2]
    elif corrupt == "v_dtype":
        v = v.to(torch.float64)
    else:
        layer = case.layer(layer_id=5)
    backend.init_forward_metadata(built.batch)
    with pytest.raises((InvalidBatchError, KVCacheError)) as info:
        backend.forward(q, k, v, layer, built.batch)
    field = corrupt.split("_")[0]
    assert field in str(info.value), f"the error does not name {field!r}: {info.value}"
    assert_result(replace(built, expected_pool_k=built.initial_pool_k, expected_pool_v=built.initial_pool_v), None)


@pytest.mark.hal_family("metadata")
def test_forward_needs_this_batchs_metadata(hal_target, request):
    """forward without init_forward_metadata, or with metadata of an earlier step or of a batch of
    another size, is a hal error and writes nothing."""
    case = _first_servable(hal_target, ForwardMode.DECODE, prefix=False)
    _record(request, case)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    other = build(case, hal_target.capability.torch_device)
    smaller = build(replace(case, requests=case.requests[:-1]), hal_target.capability.torch_device)
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    backend.init_forward_metadata(built.batch)
    backend.init_forward_metadata(other.batch)  # a later step: built.batch's metadata is gone
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    backend.init_forward_metadata(smaller.batch)
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert_result(replace(built, expected_pool_k=built.initial_pool_k, expected_pool_v=built.initial_pool_v), None)


def _idle_step(target, request):
    """A backend, a built decode case, and an IDLE batch over its pools whose metadata the backend prepared."""
    case = _first_servable(target, ForwardMode.DECODE, prefix=False)
    _record(request, case)
    backend = _backend_for(target, case)
    built = build(case, target.capability.torch_device)
    fb = built.batch
    device = fb.req_pool_indices.device
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        req_pool_indices=torch.zeros(0, dtype=torch.int64, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        out_cache_loc=torch.zeros(0, dtype=torch.int64, device=device),
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        validate="full",
    )
    backend.init_forward_metadata(idle)
    return backend, built, idle


@pytest.mark.hal_family("idle")
def test_idle_batch(hal_target, request):
    """An IDLE step (no requests, as under data-parallel attention) prepares and returns an empty output."""
    backend, built, idle = _idle_step(hal_target, request)
    out = backend.forward(built.q[:0], built.k[:0], built.v[:0], built.layer, idle)
    want = (0, built.layer.tp_q_head_num * built.layer.v_head_dim)
    assert tuple(out.shape) == want, f"IDLE output shape {tuple(out.shape)}, expected {want}"


@pytest.mark.hal_family("validation")
def test_idle_batch_with_tokens_is_rejected(hal_target, request):
    """An IDLE batch has no tokens: q/k/v with tokens are a caller's bug, not an uninitialised output."""
    backend, built, idle = _idle_step(hal_target, request)
    with pytest.raises(InvalidBatchError):
        backend.forward(built.q, built.k, built.v, built.layer, idle)


def _batch_kwargs(fb) -> dict:
    """The fields a ForwardBatch of ``fb``'s step is built from (to rebuild it with one field changed)."""
    names = ("forward_mode", "batch_size", "req_pool_indices", "seq_lens", "out_cache_loc", "spec_info")
    names += ("extend_prefix_lens", "extend_seq_lens", "extend_prefix_lens_cpu", "extend_seq_lens_cpu")
    kw = {name: getattr(fb, name) for name in names if getattr(fb, name, None) is not None}
    return kw | {"req_to_token_pool": fb.req_to_token_pool, "token_to_kv_pool": fb.token_to_kv_pool}


def _assert_refused(hal_target, request, case: Case, corrupt, field: str) -> None:
    """``case`` built, then ``corrupt(built, kwargs)`` changes the batch's fields (and req_to_token) into a batch
    that must be refused, naming ``field``: by hal's batch validation (``validate="full"``), and by the backend
    created with ``validate="full"`` for the same batch built unchecked (an engine's batch), which writes
    nothing."""
    backend = _backend_for(hal_target, case)
    _record(request, case)
    built = build(case, hal_target.capability.torch_device)
    kw = _batch_kwargs(built.batch)
    corrupt(built, kw)
    with pytest.raises(InvalidBatchError, match=field):
        ForwardBatch(**kw, validate="full")
    backend = hal_target.create(case.config(), validate="full")
    batch = ForwardBatch(**kw, validate="off")
    # a backend that reads whole pages may refuse the moved slot for its page offset first
    aligned = hal_target.backend.declaration().requires_page_aligned_slots and case.page_size > 1
    with pytest.raises(InvalidBatchError, match=f"{field}|req_to_token\\[" if aligned else field):
        backend.init_forward_metadata(batch)
        backend.forward(built.q, built.k, built.v, built.layer, batch, **built.forward_kwargs)
    assert_result(replace(built, expected_pool_k=built.initial_pool_k, expected_pool_v=built.initial_pool_v), None)


def _refused_decode_write(hal_target, request, name: str, page_size: int, onto) -> None:
    """A two-request DECODE batch whose second new token is moved onto ``onto(req_to_token, rows)`` (in
    req_to_token and out_cache_loc alike): full validation must refuse the batch, naming out_cache_loc."""
    _first_servable(hal_target, ForwardMode.DECODE, prefix=False)  # a target that serves nothing runs nothing
    case = _servable(hal_target, Case(name, ForwardMode.DECODE, ((4, 1), (6, 1)), page_size=page_size))

    def corrupt(built, kw):
        rt = built.batch.req_to_token_pool.req_to_token
        rows = built.batch.req_pool_indices.tolist()
        rt[rows[1], 6] = onto(rt, rows)
        kw["out_cache_loc"] = torch.stack([rt[rows[0], 4], rt[rows[1], 6]]).long().to(kw["out_cache_loc"].device)

    _assert_refused(hal_target, request, case, corrupt, "out_cache_loc")


@pytest.mark.hal_family("validation")
def test_duplicate_out_cache_loc_is_rejected(hal_target, request):
    """Two query tokens writing one slot (two requests sharing a page) is rejected by full validation."""
    _refused_decode_write(hal_target, request, "duplicate_slots", 1, lambda rt, rows: rt[rows[0], 4])


@pytest.mark.hal_family("validation")
@pytest.mark.parametrize("onto", ["padding_page", "cached_context"])
def test_write_over_padding_or_context_is_rejected(hal_target, onto, request):
    """Full validation refuses a new token of a real request in the padding page, or on a slot a request of
    the batch reads as cached context, even when req_to_token agrees (that KV would be overwritten)."""
    target = (lambda rt, rows: 0) if onto == "padding_page" else (lambda rt, rows: rt[rows[0], 2])
    _refused_decode_write(hal_target, request, f"write_onto_{onto}", 4, target)


def _servable(target, case: Case) -> Case:
    """``case`` at the page size nearest to its own that the target declares."""
    return cases_for(target.backend, [case], target.capability)[0]


@pytest.mark.hal_family("validation")
def test_later_token_out_cache_loc_mismatch_is_rejected(hal_target, request):
    """out_cache_loc that agrees with req_to_token on a request's first new token but not on a later one (the
    third new token of the second request writes a free slot) is refused: every token is compared."""
    _first_servable(hal_target, ForwardMode.EXTEND)
    case = _servable(hal_target, Case("later_token_mismatch", ForwardMode.EXTEND, ((5, 4), (7, 4))))

    def corrupt(built, kw):
        used = set(built.batch.req_to_token_pool.req_to_token.flatten().tolist())
        pool = built.batch.token_to_kv_pool
        free = next(s for s in range(pool.page_size, pool.k_buffer[0].shape[0]) if s not in used)
        kw["out_cache_loc"] = kw["out_cache_loc"].clone()
        kw["out_cache_loc"][4 + 2] = free

    _assert_refused(hal_target, request, case, corrupt, "out_cache_loc")


@pytest.mark.hal_family("validation")
def test_earlier_request_writing_a_later_prefix_is_rejected(hal_target, request):
    """The first request's new token placed (in req_to_token and out_cache_loc alike) on a slot the second
    request reads as cached context: refused, as the reverse is (that KV would be overwritten before read)."""
    _first_servable(hal_target, ForwardMode.DECODE, prefix=False)
    case = _servable(hal_target, Case("write_onto_later_prefix", ForwardMode.DECODE, ((4, 1), (6, 1))))

    def corrupt(built, kw):
        rt = built.batch.req_to_token_pool.req_to_token
        rows = built.batch.req_pool_indices.tolist()
        rt[rows[0], 4] = rt[rows[1], 3]
        kw["out_cache_loc"] = torch.stack([rt[rows[0], 4], rt[rows[1], 6]]).long().to(kw["out_cache_loc"].device)

    _assert_refused(hal_target, request, case, corrupt, "out_cache_loc")


@pytest.mark.hal_family("validation")
def test_verify_mask_sized_without_the_drafts_is_rejected(hal_target, request):
    """A TARGET_VERIFY custom mask sized draft x prefix per request (the drafts' own columns left out) instead
    of draft x (prefix + draft) is refused, naming spec_info.custom_mask."""
    if not hal_target.backend.declaration().supports_custom_mask:
        pytest.skip(f"{hal_target.id} declares no custom mask (supports_custom_mask = False)")
    _first_servable(hal_target, ForwardMode.TARGET_VERIFY)
    case = _servable(hal_target, Case("verify_mask_draft_by_prefix", ForwardMode.TARGET_VERIFY, ((10, 4), (25, 4))))

    def corrupt(built, kw):
        draft = kw["spec_info"].draft_token_num
        short = sum(draft * p for p, _ in case.requests)
        kw["spec_info"] = SpecInfo(draft, kw["spec_info"].custom_mask[:short].clone())

    _assert_refused(hal_target, request, case, corrupt, "custom_mask")


@pytest.mark.hal_family("nan")
@pytest.mark.parametrize("where", ["q", "cache"])
@pytest.mark.parametrize("mode", _MODES, ids=lambda m: m.name)
def test_nan_propagates(hal_target, mode, where, request):
    """NaN in a query, or in a cached key every query of its request sees, gives NaN there and only there."""
    case = _first_servable(hal_target, mode)
    _record(request, case, "nan")
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    expected = built.expected.clone()
    heads, dv, group = case.tp_q_head_num, built.layer.v_head_dim, built.layer.group_size
    view = expected.view(expected.shape[0], heads, dv)
    if where == "q":
        built.q.view(built.q.shape[0], heads, -1)[0, 1] = float("nan")
        view[0, 1] = float("nan")
    else:
        r = next(i for i, (p, _) in enumerate(case.requests) if p > 0)
        fb = built.batch
        slot = int(fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[r]), 0])
        for bufs in (fb.token_to_kv_pool.k_buffer, built.expected_pool_k, built.initial_pool_k):
            bufs[built.layer.layer_id - case.start_layer][slot, 0] = float("nan")
        for t, (req, _) in enumerate(built.token_origin):
            if req == r:
                view[t, :group] = float("nan")
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert_result(built, out, expected=expected)


@pytest.mark.hal_family("fuzz")
def test_fuzz(hal_target, request):
    """``--hal-fuzz N``: N random batches from hypothesis strategies, against the reference and KV canaries."""
    from hal.conformance.fuzz import run_fuzz

    ran = run_fuzz(hal_target, request.config.getoption("hal_fuzz"), request.config.getoption("hal_seed"))
    request.node.user_properties.append(("hal_fuzz_examples", ran))
