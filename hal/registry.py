"""Device plugins: the in-tree cpu, cuda and npu devices and any out-of-tree one.

A device is an object implementing :class:`Device`, published under the entry-point
group ``hal.devices`` (the in-tree ones are, in ``pyproject.toml``, exactly like an
out-of-tree package would be)::

    [project.entry-points."hal.devices"]
    mydev = "mydev_hal:device"

A plugin that fails to import or is not a ``Device`` is recorded in
``Registry.errors`` and does not take the others down. ``HAL_PLUGINS=cpu,mydev``
limits which plugins load.

Faults are contained: any exception a plugin raises at import, in ``probe()`` or in
``backends()`` (``SystemExit`` and every other ``BaseException`` included, except
``KeyboardInterrupt``) becomes a reason, never a crash; ``probe()`` runs under a time
limit (``HAL_PROBE_TIMEOUT`` seconds, default 20) and a probe that does not return is an
unavailable device whose reason says so; a plugin whose entry point reuses a built-in
device name (``cpu``, ``cuda``, ``npu``) is reported and the built-in is kept.

Plugin API: a plugin declares the hal plugin API it was written for, as ``Device.plugin_api``
or as ``HAL_PLUGIN_API`` in its entry point's module. This hal implements API
:data:`PLUGIN_API` (4) and still runs API 3 plugins (their backends' ``init_forward_metadata_*`` become their
``plan_*`` steps), API 2 plugins (hal 0.2-0.3: their backends' ``forward_*`` become their ``run_*``) and API 1
plugins (hal 0.1, which had no declaration; an undeclared plugin is taken as API 1) through deprecated names, with
warnings: each backend class is adapted once, when the device's backends are read (:func:`device_backends`). Any
other API, or a backend missing a required member, is a :class:`PluginError` reason (``hal info`` shows it, with a
pointer to ``CHANGELOG.md``); the plugin is not loaded.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
import threading
import time
import traceback
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hal.capability import DeviceCapability
from hal.errors import ConfigError, PluginError, expect
from hal.plugin_compat import adapt_backend

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
    "BUILTIN_DEVICES",
    "probe_timeout",
    "PLUGIN_API",
    "runs_as_api",
    "SUPPORTED_PLUGIN_APIS",
]

PLUGIN_API = 4
"""The hal plugin API this release implements (hal 0.4: backends implement the plan steps ``plan_out_graph`` /
``plan_in_graph`` and the run steps ``run_*``, which may take ``out=``). API 3 (hal 0.4's first form) implemented the
plan as ``init_forward_metadata_out_graph`` / ``_in_graph``; API 2 is hal 0.2-0.3's (``forward_*`` as the backend's
steps); API 1 hal 0.1's. Each older API is adapted once, at the door (:func:`hal.plugin_compat.adapt_backend`)."""
SUPPORTED_PLUGIN_APIS = (1, 2, 3, 4)
_CHANGELOG = "see CHANGELOG.md (hal's 'For porters' notes) for what changed between plugin APIs"

ENTRY_POINT_GROUP = "hal.devices"
BUILTIN_DEVICES = {"cpu": "hal.devices.cpu", "cuda": "hal.devices.cuda", "npu": "hal.devices.npu"}
"""The in-tree devices: name -> module. An entry point of another module cannot take these names."""
DEFAULT_PROBE_TIMEOUT = 20.0
_RECHECK_WAIT = 1.0  # seconds a later call waits for a probe that already timed out


class Device(ABC):
    """The plugin protocol: one device family.

    ``name`` is the device type (``cpu``, ``cuda``, ``npu``, ``mydev``); ``priority``
    orders automatic choice (highest available wins; cpu is 0).
    """

    name: str = ""
    priority: int = 50
    plugin_api: int | None = None  # the hal plugin API this plugin targets; None: undeclared (hal 0.1: API 1)

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
        if problem is None and device.name in BUILTIN_DEVICES and not _is_builtin(type(device).__module__):
            problem = f"device name {device.name!r} is a built-in device's; choose another name"
        if problem:
            raise PluginError(f"{source or device!r}: {problem}")
        self.devices[device.name] = device
        self.errors.pop(device.name, None)

    def ordered(self) -> list[Device]:
        return sorted(self.devices.values(), key=lambda d: -d.priority)


def probe_timeout() -> float:
    """``HAL_PROBE_TIMEOUT``: seconds a device's ``probe()`` may take (default 20; ``inf`` waits forever)."""
    raw = os.environ.get("HAL_PROBE_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0:  # also rejects nan
        raise ConfigError(f"HAL_PROBE_TIMEOUT = {raw!r}: expected a number of seconds > 0 (or 'inf' for no limit)")
    return value


class _Call:
    """One call of a plugin function in a daemon thread: a hang stays in that thread."""

    def __init__(self, fn):
        self.result = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        index = _current_device_index()
        self.thread = threading.Thread(target=self._run, args=(fn, index), name="hal-probe", daemon=True)
        self.thread.start()

    def _run(self, fn, index: int | None) -> None:
        try:
            if index is not None:  # the current device is per thread: give the probe the caller's
                torch.accelerator.set_device_index(index)
            self.result = fn()
        except BaseException as exc:  # SystemExit from a plugin is a reason too
            self.error = exc

    def wait(self, timeout: float) -> bool:
        """True when the call finished within ``timeout`` seconds."""
        self.thread.join(None if math.isinf(timeout) else timeout)
        return not self.thread.is_alive()


def _current_device_index() -> int | None:
    """The caller's current accelerator index when its runtime is already initialised (never initialises it)."""
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is None or not acc.is_available():
            return None
        module = getattr(torch, acc.current_accelerator().type, None)
        if module is None or not module.is_initialized():
            return None
        return acc.current_device_index()
    except Exception:  # an odd runtime: the probe then sees its own thread's default
        return None


_HANGING: dict[tuple[int, int | None], tuple[Device, _Call]] = {}  # (id(device), index) -> its probe still running
_HANGING_LOCK = threading.Lock()


def _unavailable(device: Device, why: str) -> DeviceCapability:
    return DeviceCapability(type=device.name, available=False, reasons={"device": why})


def probe_device(device: Device, index: int | None = None) -> DeviceCapability:
    """``device.probe(index)`` under the ``HAL_PROBE_TIMEOUT`` limit, any fault turned into an unavailable capability.

    Whatever the plugin raises (``SystemExit`` included; ``KeyboardInterrupt`` is the
    user's and propagates) is a reason. A probe that does not return in time is left
    running in its daemon thread and the device is unavailable; later calls do not start
    another one: they give it a short grace (a second at most) and use its answer once
    it comes, so ``hal info`` and ``select()`` wait for a hanging plugin once per
    process. A ``ConfigError`` (a bad ``HAL_*`` value the plugin reads) is the user's to
    fix and propagates: a device must not quietly vanish from selection because of a
    typo.
    """
    timeout = probe_timeout()
    key = (id(device), index)
    with _HANGING_LOCK:
        pending = _HANGING.pop(key, None)
    if pending is not None and pending[0] is device:
        call, wait = pending[1], min(timeout, _RECHECK_WAIT)  # it already had its time: only a short grace
    else:
        call, wait = _Call(device.probe if index is None else lambda: device.probe(index)), timeout
    if not call.wait(wait):
        with _HANGING_LOCK:
            _HANGING[key] = (device, call)
        waited = time.monotonic() - call.started
        return _unavailable(
            device,
            f"plugin {device.name!r} probe() did not return within {timeout:g} s (still running after "
            f"{waited:.1f} s; HAL_PROBE_TIMEOUT sets the limit)",
        )
    exc = call.error
    if exc is None:
        cap = call.result
        if isinstance(cap, DeviceCapability):
            return cap
        exc = PluginError(f"probe() returned {type(cap).__name__}, expected a DeviceCapability")
    if isinstance(exc, (ConfigError, KeyboardInterrupt)):
        raise exc
    return _unavailable(device, f"plugin {device.name!r} probe() raised {_describe_exception(exc)}")


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit (code {exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def device_backends(device: Device | str) -> tuple[list[type[AttentionBackend]], str | None]:
    """``device.backends()`` and None, or ``[]`` and the error a broken plugin raised (``SystemExit`` included).
    ``device``: a :class:`Device`, or a registered device's name (``"cpu"``; an unknown one is a ``ConfigError``)."""
    if isinstance(device, str):
        device = get_registry().get(device)
    expect(
        isinstance(device, Device),
        ConfigError,
        "device",
        type(device).__name__,
        "a hal.registry.Device or a device name",
    )
    try:
        classes = list(device.backends())
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin's SystemExit must not end the caller
        return [], f"plugin {device.name!r} backends() raised {_describe_exception(exc)}"
    api = runs_as_api(device)
    adapted = []
    for cls in classes:
        problem = _backend_problem(cls)
        if problem is None:
            try:
                cls = adapt_backend(cls, api)  # the door: the class hal runs for one written against `api`
            except PluginError as exc:
                problem = str(exc)
        problem = problem or _steps_problem(cls)
        if problem:
            return [], f"PluginError: plugin {device.name!r}: {problem} ({_CHANGELOG})"
        adapted.append(cls)
    return adapted, None


def runs_as_api(device: Device) -> int:
    """The plugin API hal runs ``device`` as: what it declares, 1 when a plugin declares nothing (hal 0.1),
    this hal's API for a built-in device."""
    declared = declared_plugin_api(device)
    if declared is None:
        return PLUGIN_API if _is_builtin(type(device).__module__) else 1
    return declared


def _is_builtin(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in BUILTIN_DEVICES.values())


def _check_device(device: object, module: str | None = None) -> str | None:
    if not isinstance(device, Device):
        return f"is a {type(device).__name__}, expected an instance of hal.registry.Device"
    if not isinstance(device.name, str) or not device.name.isidentifier():
        return f"device name {device.name!r} must be a non-empty identifier"
    return _plugin_api_problem(device, module)


def declared_plugin_api(device: Device, module: str | None = None) -> object:
    """The plugin API ``device`` declares (``Device.plugin_api``, else its module's ``HAL_PLUGIN_API``), or None."""
    declared = getattr(device, "plugin_api", None)
    if declared is None:
        for name in (module, type(device).__module__):
            declared = getattr(sys.modules.get(name or ""), "HAL_PLUGIN_API", None)
            if declared is not None:
                break
    return declared


def _plugin_api_problem(device: Device, module: str | None) -> str | None:
    declared = declared_plugin_api(device, module)
    if declared is None:
        if not _is_builtin(type(device).__module__):
            warnings.warn(
                f"hal plugin {device.name!r} declares no plugin API, so it is taken as API 1 (hal 0.1) and runs "
                f"through deprecated names; declare plugin_api = {PLUGIN_API} once it is ported ({_CHANGELOG})",
                DeprecationWarning,
                stacklevel=4,
            )
        return None
    if isinstance(declared, bool) or declared not in SUPPORTED_PLUGIN_APIS:
        return (
            f"targets hal plugin API {declared!r}, which this hal does not implement (it implements API "
            f"{PLUGIN_API} and still runs API 1, 2 and 3 plugins); install a hal release for that API, or port the "
            f"plugin: {_CHANGELOG}"
        )
    return None


def _backend_problem(cls: object) -> str | None:
    """What a backend class lacks of the members hal calls, or None."""
    from hal.backend import AttentionBackend

    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        return f"backend {cls!r} is not a subclass of hal.backend.AttentionBackend"
    try:
        cls.declaration()  # what selection reads: each declared attribute (its name first) of the type it must have
    except PluginError as exc:
        return f"backend declaration: {exc}"
    return None


def _steps_problem(cls: type) -> str | None:
    """What run step an (adapted) backend class lacks, or None."""
    from hal.backend import AttentionBackend

    missing = [m for m in ("run_decode", "run_extend") if getattr(cls, m) is getattr(AttentionBackend, m)]
    if missing:
        old = ", ".join(m.replace("run_", "forward_") for m in missing)
        return f"backend {cls.__qualname__} does not implement {', '.join(missing)} ({old} in plugin API 2)"
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
    """Load every plugin of the ``hal.devices`` group that ``HAL_PLUGINS`` allows.

    An entry point reusing a built-in device's name (``cpu``, ``cuda``, ``npu``) is
    recorded in ``errors`` under ``"<name> (<entry point>)"`` and the built-in is kept.
    """
    reg = Registry()
    entry_points: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        builtin = BUILTIN_DEVICES.get(ep.name)
        if builtin is not None and not _is_builtin(ep.module):
            reg.errors[f"{ep.name} ({ep.value})"] = (
                f"{ep.value}: entry point {ep.name!r} reuses the name of the built-in device {ep.name!r} "
                f"({builtin}); the built-in is kept: publish the plugin under another name"
            )
            continue
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
            problem = _check_device(device, ep.module)
            if problem is None and device.name != name:
                problem = f"entry point {name!r} names a device called {device.name!r}"
            if problem:
                raise PluginError(problem)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit at a plugin's import is contained too
            last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
            reg.errors[name] = f"{ep.value}: {_describe_exception(exc)}{where}"
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
