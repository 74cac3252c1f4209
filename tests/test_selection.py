"""Layer 3, selection: which device and backend serve a config, the HAL_* overrides, and why.

Every test runs with ``HAL_PLUGINS=cpu`` (the cuda and npu plugins are not needed) plus,
where a test needs more than the CPU, fake devices added with ``register_device``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import SELECTION_ENV

import hal
from hal.backend import AttentionBackend
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.conformance.cases import CASES, build, tolerance
from hal.devices.cpu import CompiledBackend
from hal.devices.triton_backend import TritonBackend
from hal.errors import ConfigError, DeviceUnavailableError, HalError, NoBackendError
from hal.registry import Device, Registry, register_device
from hal.selection import HybridBackend, Selection, create_backend, detect, select

pytestmark = pytest.mark.usefixtures("cpu_only")


def case(name: str):
    return next(c for c in CASES if c.name == name)


# -- fake devices ------------------------------------------------------------------------


class FakeDevice(Device):
    """A device whose capability and backends are given."""

    plugin_api = 4

    def __init__(self, name, backends=(), available=True, priority=50, reasons=None, dtypes=("fp32", "bf16")):
        self.name, self.priority, self._backends = name, priority, list(backends)
        self._cap = DeviceCapability(
            type=name,
            available=available,
            torch_type="cpu",
            count=1 if available else 0,
            dtypes=dtypes if available else (),
            graph="eager_guard" if available else None,
            reasons=reasons or {},
        )

    def probe(self):
        return self._cap

    def backends(self):
        return self._backends


def recording_backends():
    """Two backends that record which of their methods ran and return a constant of their own."""
    calls: list[tuple[str, str, str]] = []

    class Recording(AttentionBackend):
        dtypes = frozenset({"fp32", "bf16"})
        fill = 0.0

        def _note(self, what, fb):
            calls.append((self.name, what, fb.forward_mode.name))

        def plan_out_graph(self, fb, in_capture=False):
            self._note("out_graph", fb)
            self.set_forward_metadata(None, fb)  # the forward prologue looks this step's metadata up

        def plan_in_graph(self, fb):
            self._note("in_graph", fb)

        def _out(self, q, layer):
            return torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), self.fill, dtype=q.dtype)

        def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            self._note("forward_decode", forward_batch)
            return self._out(q, layer)

        def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            self._note("forward_extend", forward_batch)
            return self._out(q, layer)

        def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            self._note("forward_mixed", forward_batch)
            return self._out(q, layer)

    class Alpha(Recording):
        name = "alpha"
        fill = 1.0
        needs_cpu_seq_lens = False

    class Beta(Recording):
        name = "beta"
        fill = 2.0
        needs_cpu_seq_lens = True

    return Alpha, Beta, calls


@pytest.fixture
def fake_pair():
    alpha, beta, calls = recording_backends()
    register_device(FakeDevice("fakedev", [alpha, beta], priority=10))
    return alpha, beta, calls


# -- the default choice --------------------------------------------------------------------


def test_default_config_selects_cpu_torch_and_the_trace_says_why():
    sel = select()
    assert isinstance(sel, Selection)
    assert sel.device_name == "cpu"
    assert sel.capability.type == "cpu" and sel.capability.available
    assert sel.prefill_backend is CompiledBackend and sel.decode_backend is CompiledBackend
    assert sel.backend == "torch"
    assert "device cpu: available (priority 0)" in sel.trace
    for phase in ("prefill", "decode"):
        assert f"cpu/torch: selected for {phase} (first in priority order with no reasons against it)" in sel.trace
    # the device decision precedes the backend decisions
    assert sel.trace.index("device cpu: available (priority 0)") < sel.trace.index(
        "cpu/torch: selected for prefill (first in priority order with no reasons against it)"
    )


def test_torch_outranks_interpreted_triton_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sel = select(AttentionConfig(dtype=torch.float32))
    assert (sel.device_name, sel.backend) == ("cpu", "torch")


def test_trace_records_the_rejected_backend_and_its_reason():
    class NoWindow(CompiledBackend):
        name = "nowindow"
        supports_sliding_window = False

    class Fallback(CompiledBackend):
        name = "fallback"

    register_device(FakeDevice("fakedev", [NoWindow, Fallback], priority=10))
    sel = select(AttentionConfig(sliding_window_size=8))
    assert (sel.device_name, sel.backend) == ("fakedev", "fallback")
    assert "fakedev/nowindow: rejected for prefill: sliding window not supported" in sel.trace
    assert "fakedev/fallback: selected for decode (first in priority order with no reasons against it)" in sel.trace
    # without a window the first one wins
    assert select(AttentionConfig()).backend == "nowindow"


def test_highest_priority_available_device_wins_and_unavailable_ones_are_traced():
    register_device(FakeDevice("fast", [CompiledBackend], priority=90))
    register_device(
        FakeDevice("absent", [CompiledBackend], available=False, priority=99, reasons={"device": "no card"})
    )
    sel = select()
    assert sel.device_name == "fast"
    assert "device absent: unavailable: no card" in sel.trace
    assert "device fast: available (priority 90)" in sel.trace


# -- nothing can serve the config ------------------------------------------------------


def test_no_backend_error_lists_every_backend_of_every_available_device_with_reasons():
    class Fp32Only(CompiledBackend):
        name = "fp32only"
        dtypes = frozenset({"fp32"})

    register_device(FakeDevice("fakedev", [Fp32Only], priority=10, dtypes=("fp32", "fp16")))
    config = AttentionConfig(dtype="fp16")
    with pytest.raises(NoBackendError) as info:
        select(config)
    msg = str(info.value)
    assert isinstance(info.value, HalError)
    assert "no attention backend can serve" in msg and "'dtype': 'fp16'" in msg
    lines = {line.strip().split(":", 1)[0]: line for line in msg.splitlines()[1:]}
    assert set(lines) == {"cpu/torch", "cpu/triton", "fakedev/fp32only"}
    assert "dtype fp16 not supported (supports ['bf16', 'fp32'])" in lines["cpu/torch"]
    assert "no Triton target" in lines["cpu/triton"]
    assert "device has no fp16: fp16 matmul on CPUs" in lines["cpu/triton"]
    assert "dtype fp16 not supported (supports ['fp32'])" in lines["fakedev/fp32only"]


def test_no_backend_error_gives_every_reason_of_a_backend():
    class Strict(CompiledBackend):
        name = "strict"
        supports_logit_cap = False
        supports_custom_mask = False
        supports_graph = False
        page_sizes = frozenset({1})

    register_device(FakeDevice("fakedev", [Strict], priority=10))
    cfg = AttentionConfig(logit_cap=30.0, custom_mask=True, graph=True, page_size=64, dtype="fp16")
    with pytest.raises(NoBackendError) as info:
        select(cfg, device="fakedev")
    msg = str(info.value)
    for reason in (
        "logit cap not supported",
        "custom mask (TARGET_VERIFY) not supported",
        "graph capture not supported",
        "page_size 64 not supported (supports [1])",
        "dtype fp16 not supported",
    ):
        assert reason in msg


# -- HAL_DEVICE ----------------------------------------------------------------------------


def test_hal_device_unknown_is_a_config_error_listing_registered_devices(monkeypatch):
    register_device(FakeDevice("fakedev", [CompiledBackend]))
    monkeypatch.setenv("HAL_DEVICE", "tpu")
    with pytest.raises(ConfigError) as info:
        select()
    msg = str(info.value)
    assert msg.startswith("HAL_DEVICE = 'tpu'")
    assert "['cpu', 'fakedev']" in msg


def test_hal_device_registered_but_unavailable_gives_its_reason(monkeypatch):
    register_device(FakeDevice("absent", [CompiledBackend], available=False, reasons={"device": "driver 535 missing"}))
    monkeypatch.setenv("HAL_DEVICE", "absent")
    with pytest.raises(DeviceUnavailableError, match="device 'absent' is not available: driver 535 missing"):
        select()


def test_hal_device_forces_a_lower_priority_device(monkeypatch):
    register_device(FakeDevice("fast", [CompiledBackend], priority=90))
    monkeypatch.setenv("HAL_DEVICE", "cpu")
    sel = select()
    assert sel.device_name == "cpu"
    assert "device cpu: chosen by HAL_DEVICE" in sel.trace
    assert not any(step.startswith("device fast") for step in sel.trace)


def test_hal_device_overrides_the_device_argument(monkeypatch):
    """An operator's variable beats the code's argument, as for the backend variables."""
    sel = select(device="cpu:0")
    assert sel.device_name == "cpu" and "device cpu: chosen by device" in sel.trace
    with pytest.raises(ConfigError, match=r"^device = 'nope'"):
        select(device="nope")
    with pytest.raises(ConfigError, match=r"^device = 'cpu:x'"):
        select(device="cpu:x")
    monkeypatch.setenv("HAL_DEVICE", "nosuchdevice")
    with pytest.raises(ConfigError, match=r"^HAL_DEVICE = 'nosuchdevice'"):
        select(device="cpu")


def test_blank_hal_variables_mean_unset(monkeypatch):
    for name in SELECTION_ENV:
        monkeypatch.setenv(name, "  ")
    sel = select()
    assert (sel.device_name, sel.backend) == ("cpu", "torch")


# -- HAL_ATTENTION_BACKEND -----------------------------------------------------------------


def test_hal_attention_backend_unknown_lists_the_device_backends(monkeypatch):
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "flashattn")
    with pytest.raises(ConfigError) as info:
        select()
    msg = str(info.value)
    assert msg.startswith("HAL_ATTENTION_BACKEND = 'flashattn'")
    assert "cpu backends ['torch', 'triton']" in msg
    monkeypatch.delenv("HAL_ATTENTION_BACKEND")
    with pytest.raises(ConfigError, match=r"^backend = 'flashattn'"):
        select(backend="flashattn")


def test_forced_triton_without_interpreter_is_an_error_never_a_fallback(monkeypatch):
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "triton")
    with pytest.raises(NoBackendError) as info:
        select()
    msg = str(info.value)
    assert msg.startswith("HAL_ATTENTION_BACKEND = 'triton' cannot serve this config on any device")
    assert "no Triton target" in msg
    # the reason says how to fix it
    fix = "TRITON_INTERPRET=1" if importlib.util.find_spec("triton") else "pip install 'hal-attention[triton]'"
    assert fix in msg


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_forced_triton_under_the_interpreter_is_selected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "triton")
    sel = select(AttentionConfig(dtype=torch.float32))
    assert sel.prefill_backend is TritonBackend and sel.decode_backend is TritonBackend
    assert "cpu/triton: selected for prefill (forced by HAL_ATTENTION_BACKEND)" in sel.trace
    assert sel.capability.triton_target == "cpu:interpreter"


def test_forced_backend_that_rejects_the_config_reports_its_reasons(monkeypatch):
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "torch")
    with pytest.raises(NoBackendError, match=r"HAL_ATTENTION_BACKEND = 'torch' cannot serve .* dtype fp16"):
        select(AttentionConfig(dtype="fp16"))


def test_forced_decode_backend_that_cannot_serve_names_hal_decode_backend(monkeypatch):
    monkeypatch.setenv("HAL_DECODE_BACKEND", "triton")
    with pytest.raises(NoBackendError, match=r"^HAL_DECODE_BACKEND = 'triton' cannot serve"):
        select()


def test_unknown_prefill_backend_names_hal_prefill_backend(monkeypatch):
    monkeypatch.setenv("HAL_PREFILL_BACKEND", "nope")
    with pytest.raises(ConfigError, match=r"^HAL_PREFILL_BACKEND = 'nope': expected one of the cpu backends"):
        select()


# -- HAL_PREFILL_BACKEND / HAL_DECODE_BACKEND: the hybrid ----------------------------------


def test_split_backends_build_a_hybrid_routing_decode_and_extend(monkeypatch, fake_pair):
    alpha, beta, calls = fake_pair
    monkeypatch.setenv("HAL_DEVICE", "fakedev")
    monkeypatch.setenv("HAL_PREFILL_BACKEND", "alpha")
    monkeypatch.setenv("HAL_DECODE_BACKEND", "beta")
    sel = select(case("decode").config())
    assert (sel.prefill_backend, sel.decode_backend) == (alpha, beta)
    assert sel.backend == "alpha (prefill) + beta (decode)"
    assert "fakedev/alpha: selected for prefill (forced by HAL_PREFILL_BACKEND)" in sel.trace
    assert "fakedev/beta: selected for decode (forced by HAL_DECODE_BACKEND)" in sel.trace

    backend = sel.create()
    assert isinstance(backend, HybridBackend)
    assert backend.prefill_attention_backend_str == "alpha"
    assert backend.decode_attention_backend_str == "beta"
    assert backend.needs_cpu_seq_lens is True  # beta needs them

    expected_route = {
        "decode": ("beta", "forward_decode", 2.0),
        "extend_prefix": ("alpha", "forward_extend", 1.0),
        "mixed": ("alpha", "forward_extend", 1.0),  # MIXED off an NPU goes to forward_extend
        "verify": ("alpha", "forward_extend", 1.0),
        "draft_extend": ("alpha", "forward_extend", 1.0),
    }
    for name, (who, method, fill) in expected_route.items():
        built = build(case(name))
        calls.clear()
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
        mode = built.batch.forward_mode.name
        assert calls == [(who, "out_graph", mode), (who, "in_graph", mode), (who, method, mode)], name
        assert out.shape == built.expected.shape
        assert torch.all(out == fill), name


def test_attention_backend_with_one_phase_override(monkeypatch, fake_pair):
    alpha, beta, _ = fake_pair
    monkeypatch.setenv("HAL_DEVICE", "fakedev")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "beta")
    monkeypatch.setenv("HAL_DECODE_BACKEND", "alpha")
    sel = select()
    assert (sel.prefill_backend, sel.decode_backend) == (beta, alpha)
    assert "fakedev/beta: selected for prefill (forced by HAL_ATTENTION_BACKEND)" in sel.trace
    assert "fakedev/alpha: selected for decode (forced by HAL_DECODE_BACKEND)" in sel.trace


def test_same_backend_for_both_phases_is_not_a_hybrid(monkeypatch, fake_pair):
    alpha, beta, _ = fake_pair
    monkeypatch.setenv("HAL_DEVICE", "fakedev")
    monkeypatch.setenv("HAL_PREFILL_BACKEND", "beta")
    monkeypatch.setenv("HAL_DECODE_BACKEND", "beta")
    backend = select().create()
    assert type(backend) is beta
    assert (backend.prefill_attention_backend_str, backend.decode_attention_backend_str) == ("beta", "beta")


def test_decode_override_alone_keeps_automatic_prefill(monkeypatch, fake_pair):
    alpha, beta, _ = fake_pair
    monkeypatch.setenv("HAL_DECODE_BACKEND", "beta")
    sel = select()  # fakedev outranks cpu
    assert sel.device_name == "fakedev"
    assert (sel.prefill_backend, sel.decode_backend) == (alpha, beta)
    assert "fakedev/alpha: selected for prefill (first in priority order with no reasons against it)" in sel.trace


# -- AttentionConfig -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tp_q_head_num": 0}, "tp_q_head_num"),
        ({"tp_k_head_num": -2}, "tp_k_head_num"),
        ({"tp_q_head_num": 6, "tp_k_head_num": 4}, "tp_q_head_num"),
        ({"tp_q_head_num": "32"}, "tp_q_head_num"),
        ({"head_dim": 0}, "head_dim"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 3}, "page_size"),
        ({"page_size": 48}, "page_size"),
        ({"dtype": "fp64"}, "dtype"),
        ({"dtype": "float16"}, "dtype"),
        ({"dtype": torch.float64}, "dtype"),
        ({"dtype": torch.int8}, "dtype"),
    ],
)
def test_attention_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        AttentionConfig(**kwargs)
    assert str(info.value).startswith(f"{field} = ")
    assert "expected" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("v_head_dim", [0, -64])
def test_attention_config_rejects_non_positive_v_head_dim(v_head_dim):
    with pytest.raises(ConfigError, match=r"^v_head_dim = "):
        AttentionConfig(v_head_dim=v_head_dim)


def test_attention_config_accepts_dtype_names_and_defaults_v_head_dim():
    cfg = AttentionConfig(tp_q_head_num=8, tp_k_head_num=8, head_dim=64, dtype="fp32", page_size=128)
    assert cfg.dtype is torch.float32 and cfg.dtype_name == "fp32"
    assert cfg.v_head_dim == 64
    assert cfg.to_dict()["dtype"] == "fp32"
    assert AttentionConfig(dtype="bf16") == AttentionConfig(dtype=torch.bfloat16)
    assert AttentionConfig(head_dim=192, v_head_dim=128).v_head_dim == 128


# -- detect() and create_backend() ---------------------------------------------------------


def test_detect_returns_the_capability_of_the_chosen_device():
    cap = detect()
    assert cap.type == "cpu" and cap.available
    assert "bf16" in cap.dtypes and "fp16" not in cap.dtypes
    assert "fp16" in cap.reasons
    register_device(FakeDevice("fast", [CompiledBackend], priority=90))
    assert detect().type == "fast"
    assert detect("cpu").type == "cpu"


def test_detect_of_an_unavailable_device_raises_with_the_reason():
    register_device(FakeDevice("absent", [], available=False, reasons={"device": "powered off"}))
    with pytest.raises(DeviceUnavailableError, match="powered off"):
        detect("absent")


def test_detect_with_no_available_device_raises_a_hal_error(monkeypatch):
    only_absent = Registry(devices={"absent": FakeDevice("absent", [], available=False, reasons={"device": "off"})})
    monkeypatch.setattr(hal.selection, "get_registry", lambda: only_absent)
    with pytest.raises(HalError, match="off"):
        detect()


def test_create_backend_runs_a_conformance_case_on_the_cpu():
    c = case("decode_page16")
    backend = create_backend(c.config())
    assert type(backend) is CompiledBackend
    assert backend.capability.type == "cpu" and backend.device == torch.device("cpu")
    assert (backend.prefill_attention_backend_str, backend.decode_attention_backend_str) == ("torch", "torch")
    built = build(c)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(c.dtype))


def test_create_backend_on_a_named_device():
    class Renamed(CompiledBackend):
        name = "renamed"

    register_device(FakeDevice("fakedev", [Renamed]))
    backend = create_backend(device="fakedev")
    assert type(backend) is Renamed
    assert backend.capability.type == "fakedev"
    assert backend.prefill_attention_backend_str == "renamed"
    with pytest.raises(NoBackendError):
        create_backend(AttentionConfig(dtype="fp16"), device="cpu")


def test_an_index_less_accelerator_name_means_the_current_device(monkeypatch):
    """A tensor-parallel worker calls torch.cuda.set_device(3): "cuda" must then mean cuda:3 everywhere."""
    import types

    from hal.capability import resolve_device
    from hal.devices.cuda import cuda_capability

    props = types.SimpleNamespace(name="Fake H200", major=9, minor=0, total_memory=141 << 30, gcnArchName="")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    cap = cuda_capability()
    assert cap.index == 3 and cap.torch_device == torch.device("cuda", 3)
    assert cuda_capability(1).index == 1
    assert "does not exist" in cuda_capability(7).reasons["device"]
