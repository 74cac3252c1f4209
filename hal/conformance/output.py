"""Output buffers (``forward(..., out=)``): the conformance cases of the engine-provided output contract.

An engine that owns its output buffer (vLLM's ``output``, a graph's static buffer) hands it to ``forward``:
rows ``[:T]`` receive the layer's output, every other byte of the buffer keeps its value, and ``forward`` returns
those rows as a view of the buffer. The family ``out_buffer`` checks it on every backend, in each mode, for a
flat ``[R, q_heads * v_head_dim]`` buffer, a ``[R, q_heads, v_head_dim]`` one and rows strided past their width
(a padded engine buffer); and that a buffer the kernel cannot write (another dtype, too few rows, a strided last
dimension, one that shares memory with ``q`` or the KV cache) is refused with ``InvalidBatchError`` before
anything is written. Graph replays write into a static buffer (:class:`hal.graph.GraphRunner` passes ``out=``),
so every graph case runs this contract under capture too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hal.batch import ForwardMode
from hal.conformance.builder import build
from hal.conformance.compare import check_cache, check_output, describe
from hal.conformance.targets import _backend_for, _first_servable, _record
from hal.errors import InvalidBatchError

__all__ = ["OUT_LAYOUTS", "OUT_REFUSALS", "output_buffer"]

_SENTINEL = -7.0  # a value no attention output takes from the suite's inputs: a touched byte shows
_MODES = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY]
OUT_LAYOUTS = ("flat", "heads", "strided_rows")
OUT_REFUSALS = ("other_dtype", "too_few_rows", "strided_last_dim", "aliases_q", "aliases_kv_cache")


def output_buffer(
    layout: str, rows: int, heads: int, v_dim: int, dtype, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, whole)``: an engine's output buffer of ``rows`` rows in ``layout`` (:data:`OUT_LAYOUTS`: ``flat``
    ``[rows, heads * v_dim]``, ``heads`` ``[rows, heads, v_dim]``, ``strided_rows`` a flat view of rows strided past
    their width) and the whole allocation behind it (to check every byte), filled with a value no output takes."""
    width = heads * v_dim
    if layout == "strided_rows":
        whole = torch.full((rows, width + 24), _SENTINEL, dtype=dtype, device=device)
        return whole[:, :width], whole
    whole = torch.full((rows, width), _SENTINEL, dtype=dtype, device=device)
    return (whole if layout == "flat" else whole.view(rows, heads, v_dim)), whole


@pytest.mark.hal_family("out_buffer")
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
@pytest.mark.parametrize("mode", _MODES, ids=lambda m: m.name)
def test_out_buffer_receives_the_rows_in_place(hal_target, mode, layout, request):
    """``forward(out=)``: rows ``[:T]`` equal the reference, the return value is a view of the buffer, the KV lands
    as without ``out``, and every other byte of the allocation (rows past ``T``, the padding past each strided
    row) keeps its value."""
    case = _first_servable(hal_target, mode)
    case = replace(case, name=f"{case.name}_out_{layout}")
    _record(request, case, "out_buffer")
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    layer, tokens = built.layer, built.q.shape[0]
    out, whole = output_buffer(layout, tokens + 3, layer.tp_q_head_num, layer.v_head_dim, built.q.dtype, built.q.device)
    before = whole.clone()
    backend.init_forward_metadata(built.batch)
    result = backend.forward(built.q, built.k, built.v, layer, built.batch, out=out, **built.forward_kwargs)
    where = f"{describe(case)}\nout= {layout} buffer {list(out.shape)} stride {out.stride()}"
    assert result.data_ptr() == out.data_ptr(), f"{where}: forward returned a tensor that is not the buffer's rows"
    problem = check_cache(built) or check_output(built, out[:tokens].reshape(tokens, -1))
    assert problem is None, f"{where}\n{problem}"
    touched = whole.ne(before)
    touched[:tokens, : layer.tp_q_head_num * layer.v_head_dim] = False
    assert not touched.any(), f"{where}: bytes outside rows [:{tokens}] changed at {touched.nonzero()[:4].tolist()}"


def _bad_buffer(problem: str, built) -> torch.Tensor:
    layer, q = built.layer, built.q
    tokens, width = q.shape[0], layer.tp_q_head_num * layer.v_head_dim
    if problem == "other_dtype":
        other = torch.float32 if q.dtype != torch.float32 else torch.bfloat16
        return torch.zeros(tokens, width, dtype=other, device=q.device)
    if problem == "too_few_rows":
        return q.new_zeros(tokens - 1, width)
    if problem == "strided_last_dim":
        return q.new_zeros(tokens, width * 2)[:, ::2]
    if problem == "aliases_q":
        return q.reshape(tokens, -1)[:, :width] if q.reshape(tokens, -1).shape[1] >= width else q
    pool = built.batch.token_to_kv_pool
    return pool.get_key_buffer(layer.layer_id).view(-1)[: tokens * width].view(tokens, width)


@pytest.mark.hal_family("out_buffer")
@pytest.mark.parametrize("problem", OUT_REFUSALS)
def test_an_output_buffer_the_kernel_cannot_write_is_refused(hal_target, problem, request):
    """A buffer of another dtype, too few rows, a strided last dimension, or sharing memory with ``q`` or the
    layer's KV cache: ``InvalidBatchError`` naming ``out``, with no KV written."""
    case = _first_servable(hal_target, ForwardMode.EXTEND)
    case = replace(case, name=f"{case.name}_bad_out_{problem}")
    _record(request, case, "out_buffer")
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    if problem == "aliases_q" and built.q.reshape(built.q.shape[0], -1).shape[1] < built.layer.v_head_dim:
        pytest.skip("q is narrower than the output")
    out = _bad_buffer(problem, built)
    pool_before = [b.clone() for b in built.batch.token_to_kv_pool.k_buffer]
    backend.init_forward_metadata(built.batch)
    with pytest.raises(InvalidBatchError, match="out"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch, out=out, **built.forward_kwargs)
    after = built.batch.token_to_kv_pool.k_buffer
    assert all(torch.equal(a, b) for a, b in zip(after, pool_before)), f"{describe(case)}: a refused call wrote KV"
