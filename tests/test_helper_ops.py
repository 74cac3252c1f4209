"""support_triton() gating: the helper ops around attention come from one answer, and really run.

With ``support_triton()`` False, or a device without a Triton target, the torch ops run
and no Triton kernel launches; with both, the Triton kernels run and the torch ops do not.
The Triton half needs triton and TRITON_INTERPRET=1 (the ``triton`` tox env).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import pytest
import torch

from hal.backend import fused_forward_disabled
from hal.capability import interpreter_enabled
from hal.conformance.cases import CASES, build, tolerance
from hal.devices.cpu import CompiledBackend, device
from hal.kernels import reference as TORCH_OPS
from hal.kernels import triton as TRITON_OPS

CAP = device.probe()
WITH_TARGET = dataclasses.replace(CAP, triton_target="cpu:interpreter")
WITHOUT_TARGET = dataclasses.replace(CAP, triton_target=None)
triton_runs = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not interpreter_enabled(),
    reason="needs triton and TRITON_INTERPRET=1 (tox -e triton)",
)
KERNELS = ("write_kv", "build_kv_indices", "compute_positions")


class NoTriton(CompiledBackend):
    def support_triton(self) -> bool:
        return False


def _forward(backend, spies, case_name="extend_prefix"):
    built = build(next(c for c in CASES if c.name == case_name))
    spies.update(dict.fromkeys(spies, 0))  # building the case fills the cache through the reference's write_kv
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(built.case.dtype))
    return built


@pytest.fixture
def spies(monkeypatch):
    """Count calls of the Triton kernels and of the torch ops (both still run for real)."""
    from hal.kernels import triton as kernels

    counts = {f"triton.{n}": 0 for n in KERNELS} | {f"torch.{n}": 0 for n in KERNELS}

    def spy(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in KERNELS:
        if importlib.util.find_spec("triton") is not None:
            spy(kernels, name, f"triton.{name}")
        spy(TORCH_OPS, name, f"torch.{name}")
    return counts


def test_the_choice_is_made_in_one_place():
    assert CompiledBackend(WITH_TARGET).helper_ops is TRITON_OPS
    assert NoTriton(WITH_TARGET).helper_ops is TORCH_OPS, "support_triton() False wins over a Triton target"
    assert CompiledBackend(WITHOUT_TARGET).helper_ops is TORCH_OPS, "no Triton target: torch"


def _wrote_kv_without_triton(backend, built, spies, fused):
    """No Triton kernel ran; the KV write was the torch op's, or the compiled kernel's own (its one-call forward)."""
    assert all(spies[f"triton.{n}"] == 0 for n in KERNELS)
    assert spies["torch.write_kv"] == (0 if fused and "fused" in backend.forward_paths() else 1)
    pool, lid = built.batch.token_to_kv_pool, built.layer.layer_id
    assert torch.equal(pool.get_key_buffer(lid), built.expected_k)
    assert torch.equal(pool.get_value_buffer(lid), built.expected_v)


@pytest.mark.parametrize("fused", [True, False], ids=["one-call", "checked-prologue"])
def test_support_triton_false_runs_the_torch_ops_only(spies, fused):
    backend = NoTriton(WITH_TARGET)
    with contextlib.nullcontext() if fused else fused_forward_disabled():
        built = _forward(backend, spies)
    _wrote_kv_without_triton(backend, built, spies, fused)


@pytest.mark.parametrize("fused", [True, False], ids=["one-call", "checked-prologue"])
def test_no_triton_target_runs_the_torch_ops_only(spies, fused):
    backend = CompiledBackend(WITHOUT_TARGET)
    with contextlib.nullcontext() if fused else fused_forward_disabled():
        built = _forward(backend, spies)
    _wrote_kv_without_triton(backend, built, spies, fused)


def test_triton_helper_ops_keep_the_compiled_backend_off_its_one_call_forward():
    """Where support_triton() picks the Triton helper ops, the KV write must be theirs, not the fused kernel's."""
    assert CompiledBackend(WITH_TARGET).forward_paths() == ["checked"]
    assert ("fused" in NoTriton(WITH_TARGET).forward_paths()) == (CompiledBackend(WITHOUT_TARGET).kernels is not None)


@triton_runs
def test_triton_target_and_support_run_the_triton_kernels_only(spies):
    from hal.devices.triton_backend import TritonBackend

    _forward(CompiledBackend(WITH_TARGET), spies)
    assert spies["triton.write_kv"] == 1 and spies["torch.write_kv"] == 0
    _forward(TritonBackend(WITH_TARGET), spies, "decode")  # builds kv indices through the helper ops too
    assert spies["triton.build_kv_indices"] >= 1
    assert all(spies[f"torch.{n}"] == 0 for n in KERNELS)


def _index_inputs():
    gen = torch.Generator().manual_seed(3)
    req_to_token = torch.randint(0, 1000, (6, 40), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    start = torch.tensor([0, 5, 3])
    end = torch.tensor([7, 40, 3])
    indptr = torch.zeros(4, dtype=torch.int64)
    indptr[1:] = torch.cumsum(end - start, 0)
    expected = torch.cat([req_to_token[r, s:e] for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist())])
    return req_to_token, rows, start, end, indptr, expected


def _positions_inputs():
    prefix, extend = torch.tensor([3, 0, 9]), torch.tensor([2, 4, 1])
    start = torch.cumsum(extend, 0) - extend
    expected = torch.tensor([3, 4, 0, 1, 2, 3, 9])
    return prefix, extend, start, expected


@pytest.mark.parametrize(
    "ops", [TORCH_OPS, pytest.param(TRITON_OPS, marks=triton_runs)], ids=lambda o: o.__name__.rsplit(".", 1)[-1]
)
def test_helper_ops_compute_the_same_thing(ops):
    req_to_token, rows, start, end, indptr, expected = _index_inputs()
    out = torch.full((int(indptr[-1]) + 3,), -7, dtype=torch.int32)
    ops.build_kv_indices(req_to_token, rows, start, end, indptr, out)
    assert torch.equal(out[: len(expected)], expected) and out[len(expected) :].eq(-7).all()
    graph_sized = torch.cat([indptr, torch.zeros(5, dtype=indptr.dtype)])  # a captured graph's [max_bs + 1] buffer
    out.fill_(-7)
    ops.build_kv_indices(req_to_token, rows, start, end, graph_sized, out)
    assert torch.equal(out[: len(expected)], expected)
    prefix, extend, starts, positions = _positions_inputs()
    got = torch.empty(7, dtype=torch.int64)
    ops.compute_positions(prefix, extend, starts, got)
    assert torch.equal(got, positions)
    k_buf, v_buf = torch.zeros(10, 2, 4, dtype=torch.bfloat16), torch.zeros(10, 2, 4, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    ops.write_kv(k_buf, v_buf, torch.tensor([7, 2, 9]), k, v)
    # the interpreter's fp32 -> bf16 store truncates where torch rounds: one bf16 ulp apart at most
    torch.testing.assert_close(k_buf[[7, 2, 9]].float(), k.bfloat16().float(), atol=0, rtol=2**-7)
    torch.testing.assert_close(v_buf[[7, 2, 9]].float(), v.bfloat16().float(), atol=0, rtol=2**-7)
    assert k_buf[[0, 1, 3, 4, 5, 6, 8]].eq(0).all()
