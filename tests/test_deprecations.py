"""Every name renamed or moved (0.2.0 on) still works for one minor release, and warns naming its replacement."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys

import pytest
import torch

import hal
from hal.backend import AttentionBackend
from hal.config import AttentionConfig
from hal.devices.cpu import CompiledBackend, PlainTorchBackend, cpu_capability
from hal.errors import ConfigError, KVCacheError
from hal.kv_cache import PagedKVPool

CAP = cpu_capability()


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("hal.devices.cpu", "TorchBackend", "hal.devices.cpu.compiled_backend.CompiledBackend"),
        ("hal.devices.cpu.torch_backend", "TorchBackend", "PlainTorchBackend"),
        ("hal.devices.cuda.triton_backend", "TritonBackend", "hal.devices.triton_backend.TritonBackend"),
        ("hal.ops", "TORCH_OPS", "hal.kernels.reference"),
        ("hal.ops", "TRITON_OPS", "hal.kernels.triton"),
        ("hal.kernels.npu.ops", "paged_view", "buffer_pages"),
        ("hal.kernels.npu", "paged_view", "buffer_pages"),
    ],
)
def test_moved_names_resolve_with_a_warning_naming_the_new_home(module, old, new):
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(importlib.import_module(module), old)
    assert value is not None
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), old + "_no_such_name")


def test_cpu_torch_backend_names_say_which_path():
    with pytest.warns(DeprecationWarning):
        from hal.devices.cpu import TorchBackend
    assert TorchBackend is CompiledBackend and issubclass(CompiledBackend, PlainTorchBackend)
    assert CompiledBackend.name == PlainTorchBackend.name == "torch"


def test_old_config_keywords_map_to_the_new_ones():
    with pytest.warns(DeprecationWarning, match=r"tp_q_head_num"):
        old = AttentionConfig(num_q_heads=16, num_kv_heads=4, sliding_window=7, head_dim=64)
    assert old == AttentionConfig(tp_q_head_num=16, tp_k_head_num=4, sliding_window_size=7, head_dim=64)
    with pytest.warns(DeprecationWarning, match=r"AttentionConfig\.tp_k_head_num"):
        assert old.num_kv_heads == 4
    with pytest.raises(ConfigError, match="only tp_q_head_num"):
        AttentionConfig(num_q_heads=16, tp_q_head_num=16)


def test_old_pool_keywords_map_to_the_new_ones():
    with pytest.warns(DeprecationWarning, match=r"PagedKVPool\(layer_num=\.\.\.\)"):
        pool = PagedKVPool(num_pages=4, page_size=2, num_layers=3, kv_heads=2, head_dim=8)
    assert (pool.layer_num, pool.head_num) == (3, 2)
    assert pool.get_key_buffer(2).shape == (10, 2, 8)
    with pytest.warns(DeprecationWarning, match=r"PagedKVPool\.head_num"):
        assert pool.kv_heads == 2
    with pytest.raises(KVCacheError, match="only layer_num"):
        PagedKVPool(num_pages=4, page_size=2, num_layers=3, layer_num=3, head_num=2, head_dim=8)


def test_selection_device_is_device_name():
    sel = hal.select(AttentionConfig(dtype=torch.float32), device="cpu")
    with pytest.warns(DeprecationWarning, match="Selection.device_name"):
        assert sel.device == sel.device_name == "cpu"


def test_the_tp_group_backend_comes_from_the_capability(restore_registry):
    from hal.capability import DeviceCapability
    from hal.demo.tp import group_backend
    from hal.registry import Device, register_device

    class Accelerator(Device):
        plugin_api = 2
        name = "xaccel"

        def probe(self, index=None):
            return DeviceCapability(type="xaccel", available=True, torch_type="xpu", collective_backend="xccl")

        def backends(self):
            return []

    register_device(Accelerator())

    cap = hal.select(AttentionConfig(dtype=torch.float32), device="cpu").capability
    assert group_backend(cap) == cap.collective_backend == "gloo"
    assert group_backend(dataclasses.replace(cap, collective_backend="xccl")) == "xccl"  # a plugin's own
    with pytest.warns(DeprecationWarning, match="group_backend\\(capability\\)"):
        assert group_backend("xpu") == "xccl"  # the registered device's answer for its torch type
    with pytest.warns(DeprecationWarning):
        assert group_backend("cpu") == "gloo"


def test_old_reason_names_are_no_members_of_the_base_class():
    """0.1's ``available`` / ``validate`` (deprecated since 0.2.0) are served to plugin API 1 classes by their adapter
    (hal.plugin_compat), not as members of every backend: hal 0.4 (plugin API 4) calls them on no backend."""
    assert not hasattr(AttentionBackend, "available") and not hasattr(AttentionBackend, "validate")
    assert not hasattr(CompiledBackend, "validate")


class OldNames(PlainTorchBackend):
    """A plugin API 1 backend: overrides the old names only, and calls super() on them."""

    @classmethod
    def available(cls, capability):
        return ["the card is asleep"] + super().available(capability)

    @classmethod
    def validate(cls, config, capability):
        return super().validate(config, capability) + (["no windows"] if config.sliding_window_size >= 0 else [])


def test_a_backend_overriding_only_the_old_names_is_honoured_through_its_adapter():
    from hal.plugin_compat import adapt_backend

    adapted = adapt_backend(OldNames, 1)
    assert adapted is adapt_backend(OldNames, 1) and issubclass(adapted, OldNames)  # made once
    with pytest.warns(DeprecationWarning):
        assert adapted.unavailable_reasons(CAP) == ["the card is asleep"]
    with pytest.warns(DeprecationWarning):
        reasons = adapted.unsupported_reasons(AttentionConfig(dtype=torch.float32, sliding_window_size=4), CAP)
    assert reasons == ["the card is asleep", "no windows"]  # base checks pass; both overrides counted once
    assert OldNames.unavailable_reasons(CAP) == []  # the plugin's own class is not touched


def test_0_1_batch_lengths_are_deprecated_names_of_host_lens_and_device_lens():
    """hal 0.1's ForwardBatch.prefix_lens_cpu / query_lens_cpu / kv_lens_cpu / device_lens() (gone in 0.1.x)."""
    from hal.batch import device_lens, host_lens
    from hal.conformance import CASES, build

    case = next(c for c in CASES if c.mode.name == "EXTEND" and all(p > 0 for p, _ in c.requests))
    fb = build(case).batch
    lens = host_lens(fb)
    for old, new, want in (
        ("prefix_lens_cpu", "host_lens(forward_batch).prefix", lens.prefix),
        ("query_lens_cpu", "host_lens(forward_batch).query", lens.query),
        ("kv_lens_cpu", "host_lens(forward_batch).kv", lens.kv),
    ):
        with pytest.warns(DeprecationWarning, match=re.escape(new)):
            assert getattr(fb, old) == list(want)
    assert lens.kv == [p + q for p, q in zip(lens.prefix, lens.query)] and any(lens.prefix)
    with pytest.warns(DeprecationWarning, match=re.escape("hal.batch.device_lens(forward_batch)")):
        q_lens, kv_lens = fb.device_lens()
    expected = device_lens(fb)
    assert torch.equal(q_lens, expected[0]) and torch.equal(kv_lens, expected[1])


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("hal.cli", "hal.commands.cli", "main"),
        ("hal.bench", "hal.commands.bench", "run_bench"),
        ("hal.bench_peers", "hal.commands.bench_peers", "peer_step"),
        ("hal.step_bench", "hal.commands.step_bench", "run_step_workload"),
        ("hal.lint", "hal.commands.lint", "lint_paths"),
        ("hal.report", "hal.commands.report", "merge"),
    ],
)
def test_moved_command_modules_are_the_new_modules_under_their_old_names(monkeypatch, old, new, name):
    """hal 0.4.0 moved the commands into hal.commands; the old path is the moved module itself (so patching a
    name through it patches the command), and importing it warns naming the new home."""
    moved = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(hal, old.rpartition(".")[2], raising=False)
    with pytest.warns(
        DeprecationWarning, match=rf"{re.escape(old)} is deprecated since hal 0\.4\.0 .*{re.escape(new)}"
    ):
        module = importlib.import_module(old)
    assert module is moved and sys.modules[old] is moved
    assert getattr(hal, old.rpartition(".")[2]) is moved  # `import hal.bench; hal.bench.X` reaches the command
    original = getattr(moved, name)
    monkeypatch.setattr(module, name, lambda *a, **k: "patched")
    assert getattr(moved, name)() == "patched" != original
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old + ".no_such_module")


def test_python_dash_m_runs_the_hal_command_through_its_old_path_too():
    for module in ("hal", "hal.cli"):
        done = subprocess.run(
            [sys.executable, "-m", module, "lint", "--json", __file__], capture_output=True, text=True, timeout=300
        )
        assert done.returncode in (0, 1) and done.stdout.lstrip().startswith("["), (module, done.stderr)
    done = subprocess.run([sys.executable, "-m", "hal.cli", "info", "--no-such-option"], capture_output=True, text=True)
    assert done.returncode == 2 and "unrecognized arguments: --no-such-option" in done.stderr


def test_no_warning_announces_a_removal_this_release_has_passed():
    """A deprecation's "goes in X" is a promise: X is after the running release (0.4.0.dev0 -> 0.5.0 or later)."""
    import warnings

    from hal.deprecation import warn_renamed

    running = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", hal.__version__).groups())
    for since in ("0.2.0", "0.3.0", "0.4.0", "0.5.0"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_renamed("old", "new", since=since)
        announced = re.search(r"goes in (\d+)\.(\d+)", str(caught[0].message)).groups()
        assert tuple(int(part) for part in announced) > running, (since, str(caught[0].message))
        assert tuple(int(part) for part in announced) > tuple(int(p) for p in since.split(".")[:2])
