"""Device plugins: the in-tree cpu, cuda and npu devices and any out-of-tree one.

A device is an object implementing :class:`Device`, published under the entry-point
group ``hal.devices`` (the in-tree ones are, in ``pyproject.toml``, exactly like an
out-of-tree package would be)::

    [project.entry-points."hal.devices"]
    mydev = "mydev_hal:device"

A plugin that fails to import or is not a ``Device`` is recorded in
``Registry.errors`` and does not take the others down. ``HAL_PLUGINS=cpu,mydev``
limits which plugins load.
"""

from __future__ import annotations

import importlib.metadata
import os
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hal.capability import DeviceCapability
from hal.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from hal.backend import AttentionBackend
    from hal.graph import Graph

__all__ = [
    "Device",
    "Registry",
    "get_registry",
    "register_device",
    "probe_device",
    "device_backends",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "hal.devices"


class Device(ABC):
    """The plugin protocol: one device family.

    ``name`` is the device type (``cpu``, ``cuda``, ``npu``, ``mydev``); ``priority``
    orders automatic choice (highest available wins; cpu is 0).
    """

    name: str = ""
    priority: int = 50

    @abstractmethod
    def probe(self, index: int | None = None) -> DeviceCapability:
        """Describe device ``index`` of this family (None: the current one). Must not raise and must be cheap."""

    @abstractmethod
    def backends(self) -> list[type[AttentionBackend]]:
        """Backend classes in priority order (the first that can serve a config wins)."""

    def make_graph(self, capability: DeviceCapability) -> Graph:
        """A fresh graph object for :class:`hal.graph.GraphRunner` (default: the checked eager graph)."""
        from hal.graph import EagerGraph

        return EagerGraph()


@dataclass
class Registry:
    """The devices that loaded, and for each plugin that did not, its error."""

    devices: dict[str, Device] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Device] = field(default_factory=dict)  # added by register_device()

    def get(self, name: str) -> Device:
        if name in self.devices:
            return self.devices[name]
        if name in self.errors:
            raise PluginError(f"device plugin {name!r} failed to load: {self.errors[name]}")
        raise ConfigError(f"device {name!r} is not registered: expected one of {sorted(self.devices)}")

    def add(self, device: Device, source: str = "") -> None:
        problem = _check_device(device)
        if problem:
            raise PluginError(f"{source or device!r}: {problem}")
        self.devices[device.name] = device
        self.errors.pop(device.name, None)

    def ordered(self) -> list[Device]:
        return sorted(self.devices.values(), key=lambda d: -d.priority)


def probe_device(device: Device, index: int | None = None) -> DeviceCapability:
    """``device.probe(index)``, with a plugin's exception turned into an unavailable capability.

    A ``ConfigError`` (a bad ``HAL_*`` value the plugin reads) is the user's to fix and
    propagates: a device must not quietly vanish from selection because of a typo.
    """
    try:
        cap = device.probe(index) if index is not None else device.probe()
        if not isinstance(cap, DeviceCapability):
            raise PluginError(f"probe() returned {type(cap).__name__}, expected a DeviceCapability")
        return cap
    except ConfigError:
        raise
    except Exception as exc:
        why = f"plugin {device.name!r} probe() raised {type(exc).__name__}: {exc}"
        return DeviceCapability(type=device.name, available=False, reasons={"device": why})


def device_backends(device: Device) -> tuple[list[type[AttentionBackend]], str | None]:
    """``device.backends()`` and None, or ``[]`` and the error a broken plugin raised."""
    try:
        return list(device.backends()), None
    except Exception as exc:
        return [], f"plugin {device.name!r} backends() raised {type(exc).__name__}: {exc}"


def _check_device(device: object) -> str | None:
    if not isinstance(device, Device):
        return f"is a {type(device).__name__}, expected an instance of hal.registry.Device"
    if not isinstance(device.name, str) or not device.name.isidentifier():
        return f"device name {device.name!r} must be a non-empty identifier"
    return None


def _wanted_plugins(available: list[str]) -> list[str]:
    raw = os.environ.get("HAL_PLUGINS", "").strip()
    if not raw:
        return available
    wanted = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise ConfigError(
            f"HAL_PLUGINS = {raw!r}: {unknown} not found; expected a comma list of installed "
            f"'{ENTRY_POINT_GROUP}' plugins: {sorted(available)}"
        )
    return wanted


def load_registry() -> Registry:
    """Load every plugin of the ``hal.devices`` group that ``HAL_PLUGINS`` allows."""
    reg = Registry()
    entry_points = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in entry_points and entry_points[ep.name].value != ep.value:
            reg.errors[ep.name] = f"two plugins are named {ep.name!r}: {entry_points[ep.name].value} and {ep.value}"
        entry_points[ep.name] = ep
    for name in _wanted_plugins(list(entry_points)):
        if name in reg.errors:
            continue
        ep = entry_points[name]
        try:
            obj = ep.load()
            device = obj() if isinstance(obj, type) else obj
            problem = _check_device(device)
            if problem is None and device.name != name:
                problem = f"entry point {name!r} names a device called {device.name!r}"
            if problem:
                raise PluginError(problem)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
            reg.errors[name] = f"{ep.value}: {type(exc).__name__}: {exc}{where}"
            continue
        reg.devices[name] = device
    return reg


_REGISTRY: Registry | None = None
_REGISTRY_KEY: str | None = None


def get_registry(reload: bool = False) -> Registry:
    """The process-wide registry, reloaded when ``HAL_PLUGINS`` changes or on ``reload``."""
    global _REGISTRY, _REGISTRY_KEY
    key = os.environ.get("HAL_PLUGINS", "")
    if reload or _REGISTRY is None or key != _REGISTRY_KEY:
        extra = {} if _REGISTRY is None else _REGISTRY.extra
        _REGISTRY, _REGISTRY_KEY = load_registry(), key
        _REGISTRY.extra = extra
        for device in extra.values():
            _REGISTRY.add(device)
    return _REGISTRY


def register_device(device: Device) -> None:
    """Register a device without packaging it (tests, notebooks); kept across reloads."""
    reg = get_registry()
    reg.add(device, source="register_device")
    reg.extra[device.name] = device


def unregister_device(name: str) -> None:
    reg = get_registry()
    reg.extra.pop(name, None)
    reg.devices.pop(name, None)
