"""Layer 2, the registry: entry-point plugins, HAL_PLUGINS, broken plugins kept apart, out-of-tree devices.

Plugins are faked by patching ``importlib.metadata.entry_points`` (as ``hal.registry``
sees it) to return the real ``cpu`` entry point plus entry points into modules written
to ``tmp_path``; the registry is reloaded after every test.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import uuid

import pytest
import torch

from hal.capability import DeviceCapability
from hal.commands.info import info
from hal.conformance import CASES, available_targets, build, tolerance
from hal.devices.cpu import CompiledBackend
from hal.errors import ConfigError, DeviceUnavailableError, HalError, PluginError
from hal.registry import (
    ENTRY_POINT_GROUP,
    Device,
    device_backends,
    get_registry,
    probe_device,
    register_device,
    unregister_device,
)
from hal.selection import create_backend, select

# the registry module itself, for patching its globals
REGISTRY_MODULE = importlib.import_module("hal.registry")
REAL_ENTRY_POINTS = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


pytestmark = pytest.mark.usefixtures("clean_hal_env")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """``add(name, source, attr="device")`` writes a plugin module and returns its entry point;
    ``install(*eps)`` makes the registry see the real cpu entry point plus those."""
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    class Plugins:
        def __init__(self):
            self.paths: dict[str, str] = {}

        def add(self, name: str, source: str, attr: str = "device") -> importlib.metadata.EntryPoint:
            module = f"hal_test_plugin_{name}_{uuid.uuid4().hex[:8]}"
            path = tmp_path / f"{module}.py"
            path.write_text(textwrap.dedent(source))
            modules.append(module)
            self.paths[name] = str(path)
            return importlib.metadata.EntryPoint(name=name, value=f"{module}:{attr}", group=ENTRY_POINT_GROUP)

        def install(self, *eps: importlib.metadata.EntryPoint) -> None:
            fake = [REAL_ENTRY_POINTS["cpu"], *eps]

            def entry_points(**kwargs):
                assert kwargs == {"group": ENTRY_POINT_GROUP}
                return fake

            monkeypatch.setattr(REGISTRY_MODULE.importlib.metadata, "entry_points", entry_points)

    importlib.invalidate_caches()
    yield Plugins()
    for module in modules:
        sys.modules.pop(module, None)


GOOD_DEVICE = """
    from hal.capability import DeviceCapability
    from hal.devices.cpu import CompiledBackend
    from hal.registry import Device

    class GoodDevice(Device):
        plugin_api = 2
        name = "{name}"
        priority = 5

        def probe(self):
            return DeviceCapability(type="{name}", available=True, dtypes=("fp32", "bf16"), graph="eager_guard")

        def backends(self):
            return [CompiledBackend]

    device = GoodDevice()
"""


# -- HAL_PLUGINS ---------------------------------------------------------------------------


def test_hal_registry_names_the_registry_module(monkeypatch):
    import hal.registry as module

    assert module is REGISTRY_MODULE
    monkeypatch.setattr("hal.registry.ENTRY_POINT_GROUP", "hal.devices")


def test_installed_entry_points_are_the_in_tree_devices():
    assert {"cpu", "cuda", "npu"} <= set(REAL_ENTRY_POINTS)


def test_hal_plugins_limits_which_entry_points_load(monkeypatch, plugins):
    # the broken plugin is not named: it must not even be imported
    plugins.install(plugins.add("broken", "raise RuntimeError('must not be imported')"))
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    reg = get_registry(reload=True)
    assert list(reg.devices) == ["cpu"]
    assert reg.errors == {}


def test_hal_plugins_cpu_with_the_real_entry_points(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", " cpu , ")
    reg = get_registry(reload=True)
    assert list(reg.devices) == ["cpu"]
    assert reg.errors == {}
    assert type(reg.devices["cpu"]).__module__ == "hal.devices.cpu"


def test_registry_reloads_when_hal_plugins_changes(monkeypatch, plugins):
    plugins.install(plugins.add("good", GOOD_DEVICE.format(name="good")))
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    assert sorted(get_registry(reload=True).devices) == ["cpu"]
    monkeypatch.setenv("HAL_PLUGINS", "cpu,good")
    assert sorted(get_registry().devices) == ["cpu", "good"]  # no reload=True needed


def test_unknown_name_in_hal_plugins_lists_installed_plugins(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu,tpu")
    with pytest.raises(ConfigError) as info_:
        get_registry(reload=True)
    msg = str(info_.value)
    assert msg.startswith("HAL_PLUGINS = 'cpu,tpu'")
    assert "['tpu'] not found" in msg
    for name in REAL_ENTRY_POINTS:
        assert repr(name) in msg


# -- broken plugins are recorded, the others load -------------------------------------------


def test_plugin_whose_import_raises_is_recorded_and_others_load(plugins):
    broken = plugins.add("broken", "import os\nraise RuntimeError('vendor SDK not found')\n")
    plugins.install(broken, plugins.add("good", GOOD_DEVICE.format(name="good")))
    reg = get_registry(reload=True)
    assert sorted(reg.devices) == ["cpu", "good"]
    assert list(reg.errors) == ["broken"]
    error = reg.errors["broken"]
    assert error.startswith(f"{broken.value}: RuntimeError: vendor SDK not found")
    assert f"(at {plugins.paths['broken']}:2)" in error  # where it raised
    with pytest.raises(PluginError, match="vendor SDK not found"):
        reg.get("broken")

    sel = select()
    assert sel.device_name == "good"  # priority 5 > cpu's 0
    assert any(step.startswith("plugin broken: failed to load:") for step in sel.trace)


def test_plugin_object_that_is_not_a_device_is_rejected(plugins):
    not_device = plugins.add("notdevice", "device = {'name': 'notdevice'}\n")
    plugins.install(not_device)
    reg = get_registry(reload=True)
    assert sorted(reg.devices) == ["cpu"]
    error = reg.errors["notdevice"]
    assert error.startswith(f"{not_device.value}: PluginError: ")
    assert "is a dict, expected an instance of hal.registry.Device" in error


def test_plugin_entry_point_naming_another_device_is_rejected(plugins):
    plugins.install(plugins.add("alias", GOOD_DEVICE.format(name="other")))
    reg = get_registry(reload=True)
    assert "alias" not in reg.devices and "other" not in reg.devices
    assert "entry point 'alias' names a device called 'other'" in reg.errors["alias"]


def test_plugin_may_publish_the_device_class(plugins):
    plugins.install(plugins.add("good", GOOD_DEVICE.format(name="good"), attr="GoodDevice"))
    reg = get_registry(reload=True)
    assert isinstance(reg.devices["good"], Device)
    assert reg.errors == {}


def test_hal_device_naming_a_failed_plugin_says_why(monkeypatch, plugins):
    plugins.install(plugins.add("broken", "raise ImportError('libvendor.so: cannot open')\n"))
    get_registry(reload=True)
    monkeypatch.setenv("HAL_DEVICE", "broken")
    with pytest.raises(ConfigError, match=r"plugin failed: .*libvendor\.so: cannot open"):
        select()


def test_register_device_rejects_non_devices_and_bad_names():
    with pytest.raises(PluginError, match="expected an instance of hal.registry.Device"):
        register_device(object())

    class BadName(Device):
        plugin_api = 2
        name = "my-dev"

        def probe(self):
            return DeviceCapability(type="x", available=False)

        def backends(self):
            return []

    with pytest.raises(PluginError, match="must be a non-empty identifier"):
        register_device(BadName())
    assert "my-dev" not in get_registry().devices


# -- probe() and backends() that raise -------------------------------------------------------

FLAKY_DEVICE = """
    from hal.registry import Device

    class FlakyDevice(Device):
        plugin_api = 2
        name = "flaky"
        priority = 200

        def probe(self):
            raise RuntimeError("driver exploded")

        def backends(self):
            raise AssertionError("never asked: the device is unavailable")

    device = FlakyDevice()
"""


def test_plugin_whose_probe_raises_is_unavailable_with_the_error(monkeypatch, plugins):
    plugins.install(plugins.add("flaky", FLAKY_DEVICE))
    reg = get_registry(reload=True)
    cap = probe_device(reg.devices["flaky"])
    assert cap.type == "flaky" and not cap.available
    assert cap.reasons["device"] == "plugin 'flaky' probe() raised RuntimeError: driver exploded"

    data = info()
    by_name = {d["name"]: d for d in data["devices"]}
    assert set(by_name) == {"cpu", "flaky"}
    assert by_name["cpu"]["available"] and by_name["cpu"]["capability"]["type"] == "cpu"
    assert not by_name["flaky"]["available"]
    assert "driver exploded" in by_name["flaky"]["reasons"]["device"]
    assert data["selection"]["device"] == "cpu"
    assert (
        "device flaky: unavailable: plugin 'flaky' probe() raised RuntimeError: driver exploded"
        in (data["selection"]["trace"])
    )

    monkeypatch.setenv("HAL_DEVICE", "flaky")
    with pytest.raises(DeviceUnavailableError, match="driver exploded"):
        select()


def test_probe_returning_something_else_is_unavailable(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")

    class Sloppy(Device):
        plugin_api = 2
        name = "sloppy"

        def probe(self):
            return {"available": True}

        def backends(self):
            return [CompiledBackend]

    register_device(Sloppy())
    cap = probe_device(get_registry().devices["sloppy"])
    assert not cap.available
    assert "probe() returned dict, expected a DeviceCapability" in cap.reasons["device"]
    assert select().device_name == "cpu"


class NoKernels(Device):
    """Available, but its backend module does not import (the cuda plugin while flashinfer_backend is missing)."""

    plugin_api = 2

    name = "nokernels"
    priority = 100

    def probe(self):
        return DeviceCapability(type="nokernels", available=True, dtypes=("fp32", "bf16"))

    def backends(self):
        from hal_missing_kernels import Backend  # noqa: F401


def test_device_backends_takes_a_name_and_refuses_anything_else():
    by_name, error = device_backends("cpu")
    assert error is None
    assert by_name == device_backends(get_registry().get("cpu"))[0]
    with pytest.raises(ConfigError, match="'nope' is not registered"):
        device_backends("nope")
    for bad in (3, None, object()):
        with pytest.raises(ConfigError, match="expected a hal.registry.Device or a device name"):
            device_backends(bad)


def test_available_device_whose_backends_raise_is_skipped(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    register_device(NoKernels())
    classes, error = device_backends(get_registry().devices["nokernels"])
    assert classes == []
    assert "backends() raised ModuleNotFoundError" in error and "hal_missing_kernels" in error

    sel = select()
    assert sel.device_name == "cpu"
    assert any("nokernels" in step and "hal_missing_kernels" in step for step in sel.trace)
    rows = {d["name"]: d["backends"] for d in info()["devices"]}
    assert rows["cpu"][0]["name"] == "torch"
    assert rows["nokernels"][0]["selected"] is False and "hal_missing_kernels" in rows["nokernels"][0]["reasons"][0]


def test_forced_device_whose_backends_raise_says_why(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    register_device(NoKernels())
    monkeypatch.setenv("HAL_DEVICE", "nokernels")
    with pytest.raises(HalError) as info_:
        select()
    assert "hal_missing_kernels" in str(info_.value)
    assert "no device is available" not in str(info_.value)


def test_forced_backend_on_a_device_whose_backends_raise_says_why(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    register_device(NoKernels())
    monkeypatch.setenv("HAL_DEVICE", "nokernels")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "vendor")
    with pytest.raises(HalError, match="hal_missing_kernels"):
        select()


def test_info_survives_every_installed_plugin_whatever_its_state():
    """The real cuda/npu plugins may be incomplete: info() still reports every one of them."""
    data = info()
    names = [d["name"] for d in data["devices"]]
    assert sorted(names) == sorted(REAL_ENTRY_POINTS)
    assert data["selection"]["device"] is not None or "error" in data["selection"]
    cpu = next(d for d in data["devices"] if d["name"] == "cpu")
    assert cpu["available"]


# -- an out-of-tree device ---------------------------------------------------------------


class VendorTorch(CompiledBackend):
    name = "vendortorch"


class VendorDevice(Device):
    plugin_api = 2
    name = "vendor"
    priority = 1

    def probe(self):
        return DeviceCapability(
            type="vendor",
            available=True,
            torch_type="cpu",
            count=1,
            name="Vendor NPU (emulated)",
            dtypes=("fp32", "bf16"),
            graph="eager_guard",
            emulated=True,
        )

    def backends(self):
        return [VendorTorch]


def test_out_of_tree_device_is_a_first_class_citizen(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    register_device(VendorDevice())
    # kept across reloads
    assert "vendor" in get_registry(reload=True).devices

    monkeypatch.setenv("HAL_DEVICE", "vendor")
    sel = select()
    assert (sel.device_name, sel.prefill_backend, sel.decode_backend) == ("vendor", VendorTorch, VendorTorch)
    assert "device vendor: chosen by HAL_DEVICE" in sel.trace

    data = info()
    vendor = next(d for d in data["devices"] if d["name"] == "vendor")
    assert vendor["available"] and vendor["emulated"]
    assert vendor["capability"]["name"] == "Vendor NPU (emulated)"
    assert [(b["name"], b["selected"]) for b in vendor["backends"]] == [("vendortorch", True)]
    assert data["selection"] == {**data["selection"], "device": "vendor", "backend": "vendortorch"}

    targets = {(t.device.name, t.backend.name) for t in available_targets()}
    assert {("vendor", "vendortorch"), ("cpu", "torch")} <= targets
    [target] = available_targets(devices=["vendor"])
    assert target.id == "vendor-vendortorch" and target.capability.type == "vendor"

    # and it computes attention like the oracle
    c = next(c for c in CASES if c.name == "extend_prefix_page16")
    backend = create_backend(c.config())
    assert type(backend) is VendorTorch
    built = build(c)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(c.dtype))


def test_unregister_device_removes_it_for_good(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    register_device(VendorDevice())
    unregister_device("vendor")
    assert "vendor" not in get_registry().devices
    assert "vendor" not in get_registry(reload=True).devices


# -- faults contained: hanging probes, SystemExit, built-in names -----------------------------

HANGING_DEVICE = """
    import threading

    from hal.capability import DeviceCapability
    from hal.registry import Device

    release = threading.Event()
    calls = []

    class HangingDevice(Device):
        plugin_api = 2
        name = "hanging"
        priority = 300

        def probe(self):
            calls.append(1)
            release.wait(600)  # a driver call that never returns
            return DeviceCapability(type="hanging", available=False, reasons={{"device": "{why}"}})

        def backends(self):
            return []

    device = HangingDevice()
"""


def test_hanging_probe_is_unavailable_and_info_and_select_still_answer(monkeypatch, plugins):
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", "0.2")
    plugins.install(plugins.add("hanging", HANGING_DEVICE.format(why="woke up late")))
    reg = get_registry(reload=True)
    device = reg.devices["hanging"]
    module = sys.modules[type(device).__module__]
    try:
        cap = probe_device(device)
        assert not cap.available
        assert "probe() did not return within 0.2 s" in cap.reasons["device"]
        assert "HAL_PROBE_TIMEOUT" in cap.reasons["device"]

        sel = select()
        assert sel.device_name == "cpu"
        assert any(s.startswith("device hanging: unavailable:") and "did not return" in s for s in sel.trace)
        by_name = {d["name"]: d for d in info()["devices"]}
        assert not by_name["hanging"]["available"] and by_name["cpu"]["available"]
        assert len(module.calls) == 1  # the hung probe is waited for again, never started twice

        monkeypatch.setenv("HAL_DEVICE", "hanging")
        with pytest.raises(DeviceUnavailableError, match="did not return within"):
            select()
    finally:
        module.release.set()
    # once the probe returns, its answer is used
    cap = probe_device(device)
    assert cap.reasons["device"] == "woke up late"
    assert len(module.calls) == 1


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan"])
def test_bad_probe_timeout_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", raw)
    with pytest.raises(ConfigError, match=r"HAL_PROBE_TIMEOUT = .*expected a number of seconds > 0"):
        probe_device(get_registry().get("cpu"))


def test_probe_timeout_default_and_inf(monkeypatch):
    from hal.registry import DEFAULT_PROBE_TIMEOUT, probe_timeout

    monkeypatch.delenv("HAL_PROBE_TIMEOUT", raising=False)
    assert probe_timeout() == DEFAULT_PROBE_TIMEOUT
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", "inf")
    assert probe_timeout() == float("inf")
    assert probe_device(get_registry().get("cpu")).available


def test_plugin_calling_sys_exit_at_import_is_contained(plugins):
    plugins.install(plugins.add("quitter", "import sys\nsys.exit('no licence')\n"))
    reg = get_registry(reload=True)
    assert "quitter" not in reg.devices
    assert "SystemExit (code 'no licence')" in reg.errors["quitter"]
    sel = select()
    assert sel.device_name == "cpu"
    assert any(s.startswith("plugin quitter: failed to load:") for s in sel.trace)
    assert {d["name"] for d in info()["devices"]} == {"cpu", "quitter"}


class _Odd(BaseException):
    pass


@pytest.mark.parametrize(
    ("exc", "said"),
    [(SystemExit(3), "SystemExit (code 3)"), (_Odd("weird"), "_Odd: weird"), (GeneratorExit(), "GeneratorExit")],
)
def test_probe_raising_any_base_exception_is_contained(monkeypatch, exc, said):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")

    class Raiser(Device):
        plugin_api = 2
        name = "raiser"
        priority = 100

        def probe(self):
            raise exc

        def backends(self):
            raise exc

    register_device(Raiser())
    device = get_registry().devices["raiser"]
    cap = probe_device(device)
    assert not cap.available and said in cap.reasons["device"]
    classes, error = device_backends(device)
    assert classes == [] and f"plugin 'raiser' backends() raised {said}" in error
    assert select().device_name == "cpu"


def test_keyboard_interrupt_in_probe_propagates(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")

    class Interrupted(Device):
        plugin_api = 2
        name = "interrupted"

        def probe(self):
            raise KeyboardInterrupt

        def backends(self):
            return []

    with pytest.raises(KeyboardInterrupt):
        probe_device(Interrupted())


def test_plugin_reusing_a_builtin_name_is_reported_and_the_builtin_kept(plugins):
    impostor = plugins.add("cpu", GOOD_DEVICE.format(name="cpu"))
    plugins.install(impostor)
    reg = get_registry(reload=True)
    assert type(reg.devices["cpu"]).__module__ == "hal.devices.cpu"
    key = f"cpu ({impostor.value})"
    assert "reuses the name of the built-in device 'cpu'" in reg.errors[key]
    assert "the built-in is kept" in reg.errors[key]
    sel = select()
    assert sel.device_name == "cpu" and sel.backend == "torch"
    names = [d["name"] for d in info()["devices"]]
    assert names.count("cpu") == 1 and key in names


def test_register_device_cannot_take_a_builtin_name():
    class FakeCpu(Device):
        plugin_api = 2
        name = "cpu"

        def probe(self):
            return DeviceCapability(type="cpu", available=True)

        def backends(self):
            return []

    with pytest.raises(PluginError, match="'cpu' is a built-in device's"):
        register_device(FakeCpu())
    assert type(get_registry().devices["cpu"]).__module__ == "hal.devices.cpu"


def test_probe_by_index_runs_under_the_limit_too(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", "5")
    seen = []

    class Indexed(Device):
        plugin_api = 2
        name = "indexed"

        def probe(self, index=None):
            seen.append(index)
            return DeviceCapability(type="indexed", available=index == 1, index=index or 0)

        def backends(self):
            return []

    device = Indexed()
    assert probe_device(device, 1).available and probe_device(device, 1).index == 1
    assert not probe_device(device).available
    assert seen == [1, 1, None]
