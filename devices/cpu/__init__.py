"""The CPU device: always available; backends ``torch`` and, under ``TRITON_INTERPRET=1``, ``triton``."""

from __future__ import annotations

from hal.capability import DeviceCapability, cpu_capability
from hal.devices.cuda.triton_backend import TritonBackend
from hal.registry import Device

from .torch_backend import TorchBackend

__all__ = ["CpuDevice", "device", "TorchBackend"]


class CpuDevice(Device):
    name = "cpu"
    priority = 0

    def probe(self, index: int | None = None) -> DeviceCapability:
        return cpu_capability()

    def backends(self):
        # Interpreted Triton is for correctness only: it never outranks the torch backend.
        return [TorchBackend, TritonBackend]


device = CpuDevice()
