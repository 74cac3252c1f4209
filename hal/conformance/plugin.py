"""pytest plugin: parametrizes the conformance tests over the available (device, backend) pairs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hal.capability import DeviceCapability
from hal.registry import Device, device_backends, get_registry, probe_device


@dataclass(frozen=True)
class Target:
    """One (device, backend) pair under test."""

    device: Device
    capability: DeviceCapability
    backend: type

    @property
    def id(self) -> str:
        return f"{self.device.name}-{self.backend.name}"

    def create(self):
        return self.backend(self.capability)


def available_targets(devices: list[str] | None = None, backends: list[str] | None = None) -> list[Target]:
    """Every backend that can run on an available device here, optionally filtered by name."""
    targets = []
    for device in get_registry().ordered():
        if devices and device.name not in devices:
            continue
        cap = probe_device(device)
        if not cap.available:
            continue
        for cls in device_backends(device)[0]:
            if (not backends or cls.name in backends) and not cls.available(cap):
                targets.append(Target(device, cap, cls))
    return targets


def pytest_addoption(parser):
    group = parser.getgroup("hal", "hal conformance suite")
    group.addoption("--hal-device", action="append", default=[], help="only this device (repeatable)")
    group.addoption("--hal-backend", action="append", default=[], help="only this backend (repeatable)")


def pytest_generate_tests(metafunc):
    if "hal_target" not in metafunc.fixturenames:
        return
    devices = metafunc.config.getoption("hal_device") or None
    backends = metafunc.config.getoption("hal_backend") or None
    targets = available_targets(devices, backends)
    if not targets:
        wanted = f"device {devices or 'any'}, backend {backends or 'any'}"
        pytest.fail(f"no available (device, backend) matches {wanted}: see `hal info`", pytrace=False)
    metafunc.parametrize("hal_target", targets, ids=[t.id for t in targets])
