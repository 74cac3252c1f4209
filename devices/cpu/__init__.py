"""The CPU device: always available; backends ``torch`` (compiled kernels where a compiler is, plain
torch otherwise) and, under ``TRITON_INTERPRET=1``, ``triton``."""

from __future__ import annotations

from hal.capability import DeviceCapability
from hal.devices.triton_backend import TritonBackend
from hal.registry import Device

from .capability import cpu_capability
from .compiled_backend import CompiledBackend
from .torch_backend import TorchBackend as PlainTorchBackend

# The registered ``torch`` backend: compiled kernels, the plain torch path where none can be built.
TorchBackend = CompiledBackend

__all__ = ["CpuDevice", "device", "CompiledBackend", "PlainTorchBackend", "TorchBackend"]


class CpuDevice(Device):
    name = "cpu"
    priority = 0

    def probe(self, index: int | None = None) -> DeviceCapability:
        return cpu_capability()

    def backends(self):
        # Interpreted Triton is for correctness only: it never outranks the torch backend.
        return [TorchBackend, TritonBackend]


device = CpuDevice()
