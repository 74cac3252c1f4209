"""The ``torch`` backend's fused forward: one kernel call (``hal.kernels.cpu.write_and_attend``) that checks the
inputs, writes the new tokens' KV and attends, standing in for the checked prologue on the hot path.

Every conformance case the kernels serve goes through it (and must match the reference, write exactly the
expected pool and touch nothing else); bad input must still raise the hal error the checked prologue raises,
with nothing written; anything it does not take (sinks, save_kv_cache=False, a dtype other than the pool's, a
torch mode watching, a subclass overriding a prologue hook) must go the checked way.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hal.backend import fused_forward_disabled
from hal.conformance.cases import CASES, build, tolerance
from hal.conformance.cases_models import MODEL_CASES
from hal.devices.cpu import CompiledBackend
from hal.devices.cpu.capability import cpu_capability
from hal.errors import InvalidBatchError, KVCacheError
from hal.kernels import cpu as cpu_kernels

CAP = cpu_capability()
BUILDABLE, WHY_NOT = cpu_kernels.status()
pytestmark = pytest.mark.skipif(not BUILDABLE, reason=f"no compiled CPU kernels here: {WHY_NOT}")
CPU_CASES = [c for c in CASES + MODEL_CASES if not CompiledBackend.unsupported_reasons(c.config(), CAP)]
# The cases the fused call serves (attention sinks included): no fp8 pool, no MLA latent value.
FUSED_CASES = [c for c in CPU_CASES if not c.kv_cache_dtype and not c.kv_lora_rank]


@pytest.fixture
def backend():
    """A CompiledBackend whose checked forwards are counted (its ``run_*`` spied on, the fused path kept on)."""
    impl = CompiledBackend(CAP)
    calls = []
    for name in ("run_decode", "run_extend", "run_mixed"):
        checked = getattr(impl, name)
        setattr(impl, name, lambda *a, _checked=checked, **kw: calls.append(1) or _checked(*a, **kw))
    impl.checked_calls = calls
    return impl


def _pools(built):
    pool = built.batch.token_to_kv_pool
    return [b.clone() for b in pool.k_buffer], [b.clone() for b in pool.v_buffer]


def _assert_pools(built, expected_k, expected_v):
    pool = built.batch.token_to_kv_pool
    for got, want in zip(pool.k_buffer + pool.v_buffer, expected_k + expected_v):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["flat", "heads"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.name for c in FUSED_CASES])
def test_the_fused_forward_matches_the_reference_and_writes_exactly_the_new_kv(case, layout, backend):
    built = build(case)
    layer = built.layer
    q, k, v = built.q, built.k, built.v
    if layout == "heads":
        q = q.unflatten(1, (layer.tp_q_head_num, layer.head_dim))
        k = k.unflatten(1, (layer.tp_k_head_num, layer.head_dim))
        v = v.unflatten(1, (layer.tp_v_head_num, layer.v_head_dim))
    backend.init_forward_metadata(built.batch)
    out = backend.forward(q, k, v, layer, built.batch, **built.forward_kwargs)
    assert backend.checked_calls == [], "the fused call served this case"
    assert out.dtype == built.q.dtype and out.shape == built.expected.shape
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    _assert_pools(built, built.expected_pool_k, built.expected_pool_v)


def _decode():
    built = build(next(c for c in FUSED_CASES if c.mode.is_decode() and c.tp_k_head_num > 1))
    return built


def _bad_inputs(built):
    """(what to change, expected error): each leaves q/k/v otherwise as built."""
    q, k, v = built.q, built.k, built.v
    return {
        "q one token short": ((q[1:], k, v), InvalidBatchError, "q.shape"),
        "k with a head too many": ((q, torch.cat([k, k[:, :8]], 1), v), InvalidBatchError, "k.shape"),
        "v None": ((q, k, None), InvalidBatchError, "k, v"),
        "k in another dtype": ((q, k.double(), v), InvalidBatchError, "dtype"),
        "q a list": ((q.tolist(), k, v), InvalidBatchError, "q"),
    }


@pytest.mark.parametrize("bad", list(_bad_inputs(_decode())))
def test_bad_input_raises_the_checked_prologues_error_with_nothing_written(bad, backend):
    built = _decode()
    args, error, match = _bad_inputs(built)[bad]
    before_k, before_v = _pools(built)
    backend.init_forward_metadata(built.batch)
    with pytest.raises(error, match=match):
        backend.forward(*args, built.layer, built.batch)
    _assert_pools(built, before_k, before_v)


def test_a_slot_outside_the_pool_is_a_kv_cache_error_with_nothing_written(backend):
    built = _decode()
    backend.init_forward_metadata(built.batch)
    loc = built.batch.out_cache_loc
    loc[-1] = built.batch.token_to_kv_pool.k_buffer[0].shape[0] + 3
    before_k, before_v = _pools(built)
    with pytest.raises(KVCacheError, match=r"out_cache_loc\[\d+\]"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    _assert_pools(built, before_k, before_v)


def test_metadata_of_another_step_is_refused_before_anything_is_written(backend):
    built = _decode()
    other = build(next(c for c in FUSED_CASES if c.mode.is_extend()))
    backend.init_forward_metadata(other.batch)
    before_k, before_v = _pools(built)
    with pytest.raises(InvalidBatchError, match="forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    _assert_pools(built, before_k, before_v)


class _Watching(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "how",
    ["save_kv_cache=False", "q in float32 over a bf16 pool", "a torch mode watching", "fused_forward_disabled()"],
)
def test_what_the_fused_call_does_not_take_goes_the_checked_way(how, backend):
    case = next(c for c in FUSED_CASES if c.mode.is_decode() and c.dtype == torch.bfloat16)
    built = build(case)
    q, k, v, kwargs = built.q, built.k, built.v, {}
    if how == "save_kv_cache=False":
        built.batch.token_to_kv_pool.k_buffer[0].copy_(built.expected_pool_k[0])
        built.batch.token_to_kv_pool.v_buffer[0].copy_(built.expected_pool_v[0])
        kwargs["save_kv_cache"] = False
    if how == "q in float32 over a bf16 pool":
        q, k, v = q.float(), k.float(), v.float()
    backend.init_forward_metadata(built.batch)
    if how in ("a torch mode watching", "fused_forward_disabled()"):
        with _Watching() if how == "a torch mode watching" else fused_forward_disabled():
            out = backend.forward(q, k, v, built.layer, built.batch)
    else:
        out = backend.forward(q, k, v, built.layer, built.batch, **kwargs)
    assert backend.checked_calls == [1]
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    _assert_pools(built, built.expected_pool_k, built.expected_pool_v)


def test_a_subclass_overriding_a_prologue_hook_keeps_it():
    class Recording(CompiledBackend):
        writes = 0

        def save_kv(self, layer, fb, k, v):
            type(self).writes += 1
            super().save_kv(layer, fb, k, v)

    built = _decode()
    impl = Recording(CAP)
    assert impl.forward_paths() == ["checked"] and CompiledBackend(CAP).forward_paths() == ["fused", "checked"]
    impl.init_forward_metadata(built.batch)
    out = impl.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert Recording.writes == 1
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(built.case.dtype))


def test_fused_forward_stays_readable_with_a_deprecation_warning():
    impl = CompiledBackend(CAP)
    with pytest.warns(DeprecationWarning, match=r"fused_forward.*forward_paths\(\)"):
        assert impl.fused_forward is True
    with pytest.warns(DeprecationWarning, match="fused_forward_disabled"):
        impl.fused_forward = False
    assert impl.forward_paths() == ["checked"]
