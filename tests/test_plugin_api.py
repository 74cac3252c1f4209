"""Plugin API versions: a plugin written for hal 0.1 (API 1) runs and passes ``hal check`` through the
deprecated names; one declaring an API this hal does not implement is refused with the reason.

The plugins are installed as a third party would: an entry point in a ``*.dist-info`` on the path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hal.errors import PluginError
from hal.registry import PLUGIN_API, Device, get_registry, register_device, unregister_device

PLUGINS = Path(__file__).parent / "legacy_plugins"


def _install(tmp_path: Path, module: str, device: str) -> Path:
    shutil.copy(PLUGINS / f"{module}.py", tmp_path / f"{module}.py")
    dist = tmp_path / f"{module}-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[hal.devices]\n{device} = {module}:device\n")
    return tmp_path


def _hal(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(path), "PYTHONWARNINGS": "always::DeprecationWarning"}
    return subprocess.run(
        [sys.executable, "-m", "hal.commands.cli", *args], capture_output=True, text=True, env=env, timeout=1200
    )


def test_an_api_1_plugin_passes_hal_check_through_the_deprecated_names(tmp_path):
    path = _install(tmp_path, "hal_legacy_toy", "legacytoy")
    run = _hal(path, "check", "--device", "legacytoy", "-v")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "legacy" in run.stdout and "passed" in run.stdout, run.stdout[-2000:]
    # the suite's warnings summary (stdout) and the loader's warning (stderr) name every replacement
    for replacement in ("unavailable_reasons", "unsupported_reasons", "tp_k_head_num", "declares no plugin API"):
        assert replacement in out, f"no DeprecationWarning naming {replacement}:\n{out[-4000:]}"


def test_a_plugin_ported_from_the_0_1_readme_passes_hal_check_unchanged(tmp_path):
    """tests/legacy_plugins/hal_readme01_toy.py: 0.1's batch lengths, metadata by assignment, __init__(capability)."""
    path = _install(tmp_path, "hal_readme01_toy", "readmetoy")
    run = _hal(path, "check", "--device", "readmetoy", "-v")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    summary = next(line for line in run.stdout.splitlines() if line.startswith("readmetoy/readme:"))
    assert " 0 failed" in summary and not summary.split(":")[1].strip().startswith("0 passed"), summary
    for replacement in (
        "host_lens(forward_batch).kv",
        "host_lens(forward_batch).query",
        "host_lens(forward_batch).prefix",
        "hal.batch.device_lens(forward_batch)",
        "self.set_forward_metadata(meta, forward_batch)",
    ):
        assert replacement in out, f"no DeprecationWarning naming {replacement}:\n{out[-4000:]}"
    info = _hal(path, "info")
    assert info.returncode == 0, info.stderr[-2000:]
    block = info.stdout.split("readmetoy:", 1)[1].splitlines()
    assert block[1].strip() == "runs as plugin API 1 (deprecated names)", info.stdout
    entry = next(d for d in json.loads(_hal(path, "info", "--json").stdout)["devices"] if d["name"] == "readmetoy")
    assert entry["plugin_api"] == 1 and entry["available"]
    cpu = next(d for d in json.loads(_hal(path, "info", "--json").stdout)["devices"] if d["name"] == "cpu")
    assert cpu["plugin_api"] == PLUGIN_API and "runs as plugin API 1" not in info.stdout.split("readmetoy:")[0]


def test_an_api_1_backend_answers_through_its_old_overrides(monkeypatch):
    """Through the door (the device's backends as hal reads them): the class adapted once, the plugin's untouched."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    import torch
    from hal_legacy_toy import device

    from hal.config import AttentionConfig
    from hal.registry import device_backends

    (LegacyBackend,), error = device_backends(device)
    assert error is None and LegacyBackend.__name__ == "LegacyBackend"
    cap = device.probe()
    with pytest.warns(DeprecationWarning, match="unsupported_reasons"):
        assert LegacyBackend.unsupported_reasons(AttentionConfig(dtype=torch.float32), cap) == []
    with pytest.warns(DeprecationWarning):
        reasons = LegacyBackend.unsupported_reasons(
            AttentionConfig(dtype=torch.float32, tp_k_head_num=128, tp_q_head_num=128), cap
        )
    assert reasons == ["128 kv heads: at most 64"]
    absent = type(cap)(type="legacytoy", available=False)
    with pytest.warns(DeprecationWarning, match="unavailable_reasons"):
        assert LegacyBackend.unavailable_reasons(absent) == ["no legacy card"]


def test_a_plugin_for_another_api_is_refused_by_hal_info_with_the_reason(tmp_path):
    path = _install(tmp_path, "hal_future_toy", "futuretoy")
    info = _hal(path, "info", "--json")
    assert info.returncode == 0, info.stderr[-2000:]
    entry = next(d for d in json.loads(info.stdout)["devices"] if d["name"] == "futuretoy")
    reason = entry["reasons"]["plugin"]
    assert "plugin API 99" in reason and "CHANGELOG.md" in reason and entry["available"] is False
    check = _hal(path, "check", "--device", "futuretoy")
    assert check.returncode != 0
    assert "plugin API 99" in check.stdout + check.stderr and "Traceback" not in check.stderr


class _Declares(Device):
    name = "declares"

    def probe(self, index=None):
        raise AssertionError("not probed")

    def backends(self):
        return []


@pytest.mark.parametrize("api", [0, 5, "2", True])
def test_register_device_refuses_an_api_it_does_not_implement(api):
    device = _Declares()
    device.plugin_api = api
    with pytest.raises(PluginError, match=r"plugin API .* CHANGELOG\.md"):
        register_device(device)
    assert "declares" not in get_registry().devices


def test_the_current_api_registers_without_a_warning(recwarn):
    device = _Declares()
    device.plugin_api = PLUGIN_API
    register_device(device)
    try:
        assert get_registry().devices["declares"] is device
        assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    finally:
        unregister_device("declares")


def test_a_backend_missing_a_required_member_is_a_plugin_error_reason():
    from hal.backend import AttentionBackend
    from hal.registry import device_backends

    class Half(AttentionBackend):
        name = "half"

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return q

    device = _Declares()
    device.backends = lambda: [Half]
    classes, error = device_backends(device)
    assert classes == [] and "does not implement run_extend (forward_extend in plugin API 2)" in error
    assert "CHANGELOG.md" in error


def test_a_plugin_api_2_port_runs_unchanged_its_forward_methods_become_its_run_steps(tmp_path):
    """The porting kit's device as hal 0.3 shipped it (its backend's ``forward_decode`` / ``_extend`` / ``_mixed``
    are the steps after the checks): hal 0.4 runs it as its ``run_*`` steps and says so, and the whole suite
    passes, the new output-buffer family included."""
    path = _install(tmp_path, "hal_api2_toy", "api2toy")
    run = _hal(path, "check", "--device", "api2toy", "-v")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "out_buffer" in run.stdout and " 0 failed" in run.stdout, run.stdout[-3000:]
    for replacement in ("ToyBackend.run_decode", "ToyBackend.run_extend"):
        assert replacement in out, f"no DeprecationWarning naming {replacement}:\n{out[-4000:]}"


def test_a_plugin_api_2_hook_that_calls_super_edge_is_refused_with_what_changed():
    """A 0.3 subclass whose ``forward_decode`` called ``super().forward_decode`` would recurse through the 0.4 edge:
    it is a PluginError saying to call ``super().run_decode``; a 0.3 hook calling a sibling ``forward_*`` of its
    own backend reaches that sibling's run step once, with no second KV write."""
    import warnings

    import torch

    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build
    from hal.devices.cpu import PlainTorchBackend, cpu_capability

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        class Recurses(PlainTorchBackend):
            def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

        class Sibling(PlainTorchBackend):
            writes = 0

            def save_kv(self, layer, forward_batch, k, v):
                Sibling.writes += 1
                super().save_kv(layer, forward_batch, k, v)

            def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    decode = build(Case("api2_decode", ForwardMode.DECODE, ((4, 1), (7, 1))))
    backend = Recurses(cpu_capability())
    backend.init_forward_metadata(decode.batch)
    with pytest.raises(PluginError, match=r"super\(\)\.run_decode"):
        backend.forward(decode.q, decode.k, decode.v, decode.layer, decode.batch)

    extend = build(Case("api2_extend", ForwardMode.EXTEND, ((0, 3), (2, 2))))
    backend = Sibling(cpu_capability())
    backend.init_forward_metadata(extend.batch)
    out = backend.forward(extend.q, extend.k, extend.v, extend.layer, extend.batch)
    assert Sibling.writes == 1
    torch.testing.assert_close(out, extend.expected, atol=2e-5, rtol=1e-4)


def test_a_delegating_backend_that_opts_out_of_the_prologue_keeps_its_own_edges():
    """hal 0.2-0.3's ``runs_prologue = False`` (a backend whose ``forward_*`` and plan delegate to another backend):
    ``forward`` routes by mode to the class's own ``forward_*`` with no checks of its own, and the backend it
    delegates to runs its checks and writes the KV once; the answer is the reference's."""
    import torch

    from hal.backend import AttentionBackend
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build
    from hal.devices.cpu import PlainTorchBackend, cpu_capability

    class Delegating(AttentionBackend):
        name = "delegating"
        runs_prologue = False

        def __init__(self, capability, config=None, **options):
            super().__init__(capability, config, **options)
            self.inner, self.calls = PlainTorchBackend(capability, config), []

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.inner.init_forward_metadata_out_graph(fb, in_capture)

        def init_forward_metadata_in_graph(self, fb):
            self.inner.init_forward_metadata_in_graph(fb)

        def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
            self.calls.append("decode")
            return self.inner.forward_decode(q, k, v, layer, fb, save_kv_cache, **kwargs)

        def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
            self.calls.append("extend")
            return self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache, **kwargs)

    for mode, kind in ((ForwardMode.DECODE, "decode"), (ForwardMode.EXTEND, "extend")):
        built = build(Case(f"delegating_{kind}", mode, ((3, 1), (0, 5)) if kind == "extend" else ((3, 1), (7, 1))))
        backend = Delegating(cpu_capability())
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
        assert backend.calls == [kind]
        torch.testing.assert_close(out, built.expected, atol=2e-4, rtol=1e-3)
        assert torch.equal(built.batch.token_to_kv_pool.get_key_buffer(0), built.expected_k)  # written once, right


def test_an_api_3_plan_is_adapted_at_the_door_and_its_super_call_reaches_the_plan_below():
    """A class written for plugin API 3 (its plan as ``init_forward_metadata_out_graph`` / ``_in_graph``, calling
    ``super()``'s) runs as API 4's ``plan_*`` through its adapter, made once; a device declaring API 4 whose backend
    still defines them is refused with the change named."""
    import torch

    from hal.backend import AttentionBackend
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build
    from hal.devices.cpu import PlainTorchBackend, cpu_capability
    from hal.plugin_compat import adapt_backend
    from hal.registry import device_backends

    class Api3(PlainTorchBackend):
        planned = 0

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            type(self).planned += 1
            super().init_forward_metadata_out_graph(fb, in_capture)  # API 3: the torch backend's plan

    with pytest.warns(DeprecationWarning, match=r"Api3\.plan_out_graph"):
        adapted = adapt_backend(Api3, 3)
    assert adapted is adapt_backend(Api3, 3) and issubclass(adapted, Api3) and adapted.__name__ == "Api3"
    assert adapted.init_forward_metadata_out_graph is AttentionBackend.init_forward_metadata_out_graph
    built = build(Case("api3_plan", ForwardMode.DECODE, ((3, 1), (9, 1))))
    backend = adapted(cpu_capability())
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, atol=2e-4, rtol=1e-3)
    assert adapted.planned == 1

    device = _Declares()
    device.plugin_api = 4
    device.backends = lambda: [Api3]
    classes, error = device_backends(device)
    assert classes == [] and "defines init_forward_metadata_out_graph" in error and "plan_out_graph" in error


def test_a_plugin_api_3_port_runs_unchanged_its_plan_becomes_its_plan_steps(tmp_path):
    """The porting kit's device as hal 0.4's first form shipped it (plugin API 3: the plan written as
    ``init_forward_metadata_out_graph`` / ``_in_graph``): adapted once at the door, it passes the whole suite, graphs
    included, and the warnings name the plan steps."""
    path = _install(tmp_path, "hal_api3_toy", "api3toy")
    run = _hal(path, "check", "--device", "api3toy", "-v")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "graph" in run.stdout and " 0 failed" in run.stdout, run.stdout[-3000:]
    for replacement in ("ToyBackend.plan_out_graph", "ToyBackend.plan_in_graph", "backend.plan.set_metadata"):
        assert replacement in out, f"no DeprecationWarning naming {replacement}:\n{out[-4000:]}"
