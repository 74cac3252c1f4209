"""The base class owns the fast path: a backend offers ``forward_fused`` (check + write + attend in one call) and
``AttentionBackend`` decides, in ``prepare_forward``'s place, when it may run: nothing it stands in for overridden
(per class), no torch mode watching, the KV to be written, ``fused_forward_disabled()`` / ``HAL_FUSED_FORWARD``
not in force, the backend's instance ready. The output is shaped in one place. No compiled kernels needed: a toy
backend whose fused and checked paths give different markers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hal.backend import AttentionBackend, fused_forward_disabled, fused_forward_enabled
from hal.batch import ForwardMode
from hal.capability import DeviceCapability
from hal.conformance.cases import Case, build
from hal.errors import ConfigError, InvalidBatchError, UnsupportedError
from hal.prologue import forward_paths

CPU = DeviceCapability(type="cpu", available=True, dtypes=("fp32", "bf16"))
FUSED, CHECKED = 2.0, 1.0


class Toy(AttentionBackend):
    """Fused: ``[T, q_heads, v_head_dim]`` of 2 (shaped by the base class); checked: ``[T, q_heads * v_head_dim]``
    of 1. Counts the calls of each."""

    name = "toy"

    def __init__(self, capability=CPU, **options):
        super().__init__(capability, **options)
        self.calls: list[str] = []
        self.ready = True

    def plan_out_graph(self, fb, in_capture=False):
        self.set_forward_metadata(None, fb)

    def run_fused(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append("fused")
        if kwargs.get("decline"):
            return None
        return torch.full((q.shape[0], layer.tp_q_head_num, layer.v_head_dim), FUSED)

    def fused_forward_ready(self) -> bool:
        return self.ready

    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append("checked")
        return torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), CHECKED)

    run_extend = run_mixed = run_decode


class OverridesSaveKV(Toy):
    writes = 0

    def save_kv(self, layer, forward_batch, k, v):
        type(self).writes += 1
        super().save_kv(layer, forward_batch, k, v)


class OverridesCheckLayer(Toy):
    def check_layer(self, layer):
        raise UnsupportedError("this layer, on purpose")


@pytest.fixture(scope="module")
def built():
    return build(Case("fused_decode", ForwardMode.DECODE, ((5, 1), (9, 1), (0, 1)), dtype=torch.bfloat16))


def _run(backend, built, **kwargs):
    backend.init_forward_metadata(built.batch)
    return backend.forward(built.q, built.k, built.v, built.layer, built.batch, **kwargs)


def test_forward_paths_answer_for_classes_and_instances():
    assert forward_paths(Toy) == ["fused", "checked"] and Toy().steps.forward_paths() == ["fused", "checked"]
    assert forward_paths(AttentionBackend) == ["checked"]
    assert forward_paths(OverridesSaveKV) == ["checked"], "a hook the fused call stands in for is overridden"
    assert forward_paths(OverridesCheckLayer) == ["fused", "checked"], "check_layer runs on both paths"
    not_ready = Toy()
    not_ready.ready = False
    assert not_ready.steps.forward_paths() == ["checked"]
    with pytest.warns(DeprecationWarning, match=r"backend\.steps\.forward_paths"):
        assert not_ready.forward_paths() == ["checked"]  # the name it had on the class, on an instance


def test_the_fused_call_runs_and_its_output_is_shaped_by_the_base_class(built):
    backend = Toy()
    out = _run(backend, built)
    assert backend.calls == ["fused"]
    assert out.shape == built.expected.shape and out.dtype == built.q.dtype
    assert torch.all(out == FUSED)


def test_fused_forward_disabled_forces_the_checked_path_within_the_block(built):
    backend = Toy()
    assert fused_forward_enabled()
    with fused_forward_disabled():
        assert not fused_forward_enabled()
        assert torch.all(_run(backend, built) == CHECKED)
    assert torch.all(_run(backend, built) == FUSED)
    assert backend.calls == ["checked", "fused"]


@pytest.mark.parametrize(("value", "path"), [("0", CHECKED), ("1", FUSED), ("", FUSED)])
def test_hal_fused_forward_is_read_when_the_backend_is_created(monkeypatch, built, value, path):
    monkeypatch.setenv("HAL_FUSED_FORWARD", value)
    backend = Toy()
    assert torch.all(_run(backend, built) == path)


@pytest.mark.parametrize("value", ["off", "no", "2", "true"])
def test_a_bad_hal_fused_forward_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("HAL_FUSED_FORWARD", value)
    with pytest.raises(ConfigError, match=r"HAL_FUSED_FORWARD = .*expected 0 .* or 1"):
        Toy()
    with pytest.raises(ConfigError, match="HAL_FUSED_FORWARD"):
        fused_forward_enabled()


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [_FunctionMode, _DispatchMode])
def test_a_torch_mode_watching_takes_the_checked_path(built, mode):
    backend = Toy()
    backend.init_forward_metadata(built.batch)
    with mode():
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert backend.calls == ["checked"] and torch.all(out == CHECKED)


def test_without_a_kv_write_or_when_the_fused_call_declines_the_checked_path_runs(built):
    backend = Toy()
    pool = built.batch.token_to_kv_pool
    pool.k_buffer[0].copy_(built.expected_k)
    pool.v_buffer[0].copy_(built.expected_v)
    assert torch.all(_run(backend, built, save_kv_cache=False) == CHECKED)
    assert backend.calls == ["checked"]
    assert torch.all(_run(backend, built, decline=True) == CHECKED)
    assert backend.calls == ["checked", "fused", "checked"]


def test_an_overridden_hook_is_kept_and_the_fused_call_skipped(built):
    backend = OverridesSaveKV()
    assert torch.all(_run(backend, built) == CHECKED)
    assert backend.calls == ["checked"] and OverridesSaveKV.writes == 1


def test_the_fused_path_runs_check_layer_and_the_metadata_stamp_first(built):
    with pytest.raises(UnsupportedError, match="on purpose"):
        _run(OverridesCheckLayer(), built)
    backend = Toy()
    other = build(Case("fused_other", ForwardMode.DECODE, ((3, 1),), dtype=torch.bfloat16))
    backend.init_forward_metadata(other.batch)
    with pytest.raises(InvalidBatchError, match="forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert backend.calls == []


def test_no_backend_reads_the_base_classes_private_prologue_state():
    """The CPU backend decides nothing about the prologue itself any more (issue 23): no hook list, no flag."""
    import inspect

    from hal.devices.cpu import compiled_backend

    source = inspect.getsource(compiled_backend)
    assert "_in_prologue_call" not in source and "_PROLOGUE_HOOKS" not in source


def test_a_layer_output_of_the_wrong_size_is_not_reshaped_silently(built):
    class Wrong(Toy):
        def run_fused(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return torch.zeros(q.shape[0] + 1, layer.tp_q_head_num, layer.v_head_dim)

    with pytest.raises(RuntimeError):
        _run(Wrong(), built)


def test_the_declaration_is_plain_frozen_data_read_from_the_class_attributes():
    declared = Toy.declaration()
    assert declared.name == "toy" and declared.dtypes == frozenset({"fp32", "bf16", "fp16"})  # the field default
    assert declared.kv_cache_dtypes == declared.dtypes, "kv_cache_dtypes None: the same as dtypes"
    with pytest.raises(dataclasses.FrozenInstanceError):
        declared.name = "other"

    class Paged(Toy):
        page_sizes = {16, 64}
        supports_graph = False

    assert Paged.declaration().page_sizes == frozenset({16, 64}) and not Paged.declaration().supports_graph


def test_a_malformed_declaration_is_a_plugin_error_reason_not_a_crash_in_selection():
    from hal.registry import _backend_problem

    class Typo(Toy):
        dtypes = "bf16"  # a str, not a set of names

    class Flag(Toy):
        supports_graph = "yes"

    assert "Typo.dtypes = 'bf16': expected a set of str" in _backend_problem(Typo)
    assert "Flag.supports_graph = 'yes': expected True or False" in _backend_problem(Flag)
    assert _backend_problem(Toy) is None


def test_a_float32_result_is_cast_to_the_query_dtype_on_either_path(built):
    """A port's ``forward_*`` may return float32 for bf16 queries: the base class casts it (``forward_output``).
    Until 0.3.0 each port cast its own output, and the suite's mutant ``OutputFloat32`` forgot to; that class of
    bug is now unreachable, so this test stands where the mutant stood."""
    assert built.q.dtype == torch.bfloat16
    for path, block in (("fused", contextlib.nullcontext), ("checked", fused_forward_disabled)):
        backend = Toy()
        with block():
            out = _run(backend, built)
        assert backend.calls == [path] and out.dtype == torch.bfloat16, (path, out.dtype)
