"""``out=`` on the CPU's compiled kernels: ``hal.kernels.cpu.paged_attention`` writes the caller's ``[T, Hq, Dv]`` view
itself (float32: the kernel takes its row and head strides) or casts its float32 result into it once (bfloat16);
``hal.kernels.cpu.write_and_attend`` (the fused call) writes its rows there in either dtype; and the compiled
backend hands ``forward(out=)``'s buffer through on both paths, so the base class copies nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_head_major import _head_major

import hal.backend
from hal.batch import ForwardMode, host_lens
from hal.conformance.cases import Case, build, tolerance
from hal.conformance.output import OUT_LAYOUTS, output_buffer
from hal.devices.cpu import CompiledBackend
from hal.devices.cpu.capability import cpu_capability
from hal.errors import InvalidBatchError
from hal.kernels import cpu as cpu_kernels
from hal.prologue import fused_forward_disabled

BUILDABLE, WHY_NOT = cpu_kernels.status()
pytestmark = pytest.mark.skipif(not BUILDABLE, reason=f"no compiled CPU kernels here: {WHY_NOT}")

CASES = {
    "decode": Case("out_decode", ForwardMode.DECODE, ((5, 1), (17, 1), (0, 1)), tp_q_head_num=4, tp_k_head_num=2),
    "extend": Case("out_extend", ForwardMode.EXTEND, ((9, 4), (0, 7)), tp_q_head_num=4, tp_k_head_num=2),
}


def _padded(tokens: int, heads: int, v_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, whole)``: a ``[tokens, heads, v_dim]`` view of a larger buffer whose rows are strided past their width
    (an engine's padded buffer), and that buffer, filled with a value no output takes."""
    whole = torch.full((tokens + 2, heads * v_dim + 8), -7.0, dtype=dtype)
    return whole[:tokens, : heads * v_dim].unflatten(1, (heads, v_dim)), whole


def _kernel(built, **kwargs) -> torch.Tensor:
    fb, layer = built.batch, built.layer
    lens = host_lens(fb)
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    k_buffer.copy_(built.expected_k)
    v_buffer.copy_(built.expected_v)
    return cpu_kernels.paged_attention(
        built.q.view(lens.num_tokens, layer.tp_q_head_num, layer.head_dim),
        k_buffer,
        v_buffer,
        fb.req_to_token_pool.req_to_token,
        fb.req_pool_indices,
        torch.tensor(lens.kv),
        torch.tensor(lens.query),
        scale=layer.scaling,
        causal=layer.causal,
        **kwargs,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_writes_a_strided_out_view(name, dtype):
    """The rows land in ``out`` (returned as is), equal to the kernel's own output; the padding stays untouched."""
    built = build(dataclasses.replace(CASES[name], dtype=dtype))
    layer, tokens = built.layer, built.q.shape[0]
    out, whole = _padded(tokens, layer.tp_q_head_num, layer.v_head_dim, dtype)
    assert not out.is_contiguous()
    assert _kernel(built, out=out) is out
    assert torch.equal(out, _kernel(built))
    untouched = torch.ones_like(whole, dtype=torch.bool)
    untouched[:tokens, : layer.tp_q_head_num * layer.v_head_dim] = False
    assert (whole[untouched] == -7.0).all()


def test_paged_attention_refuses_an_out_it_cannot_write():
    built = build(CASES["decode"])
    layer, tokens = built.layer, built.q.shape[0]
    shape = (tokens, layer.tp_q_head_num, layer.v_head_dim)
    for bad in (
        torch.empty(shape, dtype=torch.bfloat16),  # not q's dtype
        torch.empty(tokens + 1, *shape[1:]),  # not this step's rows
        torch.empty(*shape[:2], shape[2] * 2)[..., ::2],  # a strided last dim
    ):
        with pytest.raises(InvalidBatchError, match="out"):
            _kernel(built, out=bad)


@pytest.mark.parametrize("fused", [False, True], ids=["checked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_out_needs_no_copy_on_either_path(monkeypatch, name, dtype, fused):
    """``forward(out=)`` on the compiled backend: the checked path's kernel writes the caller's buffer (float32) or
    casts into it once (bfloat16), the fused call's kernel writes it in either dtype, so the base class copies
    nothing."""
    built = build(dataclasses.replace(CASES[name], dtype=dtype))
    layer, tokens = built.layer, built.q.shape[0]
    out, whole = _padded(tokens, layer.tp_q_head_num, layer.v_head_dim, dtype)
    written_in_place = []
    write_output = hal.backend.write_output

    def watched(result, q, layer, rows):
        written_in_place.append(result.data_ptr() == rows.data_ptr())
        return write_output(result, q, layer, rows)

    monkeypatch.setattr(hal.backend, "write_output", watched)
    backend = CompiledBackend(cpu_capability())
    if fused and "fused" not in backend.forward_paths():
        pytest.skip("this instance has no fused call")
    with fused_forward_disabled() if not fused else torch.no_grad():
        backend.init_forward_metadata(built.batch)
        result = backend.forward(built.q, built.k, built.v, layer, built.batch, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.reshape(tokens, -1).float(), built.expected.float(), **tolerance(dtype))
    assert (whole[tokens:] == -7.0).all() and (whole[:, layer.tp_q_head_num * layer.v_head_dim :] == -7.0).all()
    assert written_in_place == [True]


# The fused call's cases: decode rows, and an extend whose second request's rows (70 tokens x a GQA group of 2) take
# the kernel's query tiles.
FUSED_CASES = {
    "decode": CASES["decode"],
    "extend": Case("out_tiles", ForwardMode.EXTEND, ((9, 4), (30, 70)), tp_q_head_num=4, tp_k_head_num=2),
}


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("form", OUT_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_the_fused_call_writes_the_callers_buffer_with_no_copy(monkeypatch, name, dtype, form, layout):
    """``forward(out=)`` on the fused call: ``write_and_attend`` writes the rows of the caller's buffer itself (the
    base class gets back the very view it handed over, and copies nothing), equal to its own output without
    ``out``; the buffer's rows past the step's tokens, and the padding past each row, stay untouched."""
    built = build(dataclasses.replace(FUSED_CASES[name], dtype=dtype))
    fb = built.batch if layout == "token_major" else _head_major(built.batch)
    layer, tokens = built.layer, built.q.shape[0]
    width = layer.tp_q_head_num * layer.v_head_dim
    backend = CompiledBackend(cpu_capability())
    if "fused" not in backend.forward_paths():
        pytest.skip("this instance has no fused call")
    for step in ("run_decode", "run_extend", "run_mixed"):
        monkeypatch.setattr(backend, step, lambda *a, **kw: pytest.fail("the checked path ran"))
    backend.init_forward_metadata(fb)
    without_out = backend.forward(built.q, built.k, built.v, layer, fb).clone()

    handed_back = []
    write_output = hal.backend.write_output

    def watched(result, q, layer, rows):
        handed_back.append(result is rows)
        return write_output(result, q, layer, rows)

    monkeypatch.setattr(hal.backend, "write_output", watched)
    out, whole = output_buffer(form, tokens + 3, layer.tp_q_head_num, layer.v_head_dim, dtype)
    result = backend.forward(built.q, built.k, built.v, layer, fb, out=out)
    assert handed_back == [True], "the fused call returned the caller's view itself: nothing to copy"
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(result.reshape(tokens, width), without_out)
    torch.testing.assert_close(without_out.float(), built.expected.float(), **tolerance(dtype))
    flat = whole.reshape(whole.shape[0], -1)
    assert (flat[tokens:] == -7.0).all() and (flat[:, width:] == -7.0).all()


def _fused_kernel(built, out):
    """``hal.kernels.cpu.write_and_attend`` over ``built``'s step (its pool's new tokens written again) into ``out``."""
    fb, layer = built.batch, built.layer
    lens = host_lens(fb)
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    heads = (layer.tp_q_head_num, layer.tp_k_head_num, layer.tp_v_head_num, layer.head_dim, layer.v_head_dim)
    q_lens = torch.tensor(lens.query)
    return cpu_kernels.write_and_attend(
        built.q,
        built.k,
        built.v,
        fb.out_cache_loc,
        k_buffer,
        v_buffer,
        fb.req_to_token_pool.req_to_token,
        fb.req_pool_indices.long(),
        torch.tensor(lens.kv),
        q_lens,
        torch.cumsum(q_lens, 0) - q_lens,
        heads,
        layer.scaling,
        out=out,
    )


def test_write_and_attend_refuses_an_out_it_cannot_write_with_nothing_written():
    built = build(CASES["decode"])
    layer, tokens = built.layer, built.q.shape[0]
    shape = (tokens, layer.tp_q_head_num, layer.v_head_dim)
    k_buffer, v_buffer = built.batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    pool_before = (k_buffer.clone(), v_buffer.clone())
    for bad in (
        torch.empty(shape, dtype=torch.bfloat16),  # not q's dtype
        torch.empty(tokens + 1, *shape[1:]),  # not this step's rows
        torch.empty(*shape[:2], shape[2] * 2)[..., ::2],  # a strided last dim
        torch.empty(tokens, shape[1] * shape[2]),  # flat: the kernels take the [T, Hq, Dv] view
    ):
        with pytest.raises(InvalidBatchError, match="out"):
            _fused_kernel(built, bad)
    rows = shape[0] * shape[1] * shape[2]
    for aliased in (  # the kernel would write what it reads
        built.q.reshape(-1)[:rows].view(shape),
        k_buffer.reshape(-1)[:rows].view(shape),
        v_buffer.reshape(-1)[-rows:].view(shape),
    ):
        with pytest.raises(InvalidBatchError, match="sharing memory"):
            _fused_kernel(built, aliased)
    assert torch.equal(k_buffer, pool_before[0]) and torch.equal(v_buffer, pool_before[1])
    out = torch.empty(shape)
    assert _fused_kernel(built, out) is out
