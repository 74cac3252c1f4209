"""The CPU device: always available; backends ``torch`` (:class:`CompiledBackend`: compiled kernels where a
compiler is, the :class:`PlainTorchBackend` path otherwise) and, under ``TRITON_INTERPRET=1``, ``triton``."""

from __future__ import annotations

from hal.capability import DeviceCapability
from hal.deprecation import moved_names
from hal.devices.triton_backend import TritonBackend
from hal.registry import Device

from .capability import cpu_capability
from .compiled_backend import CompiledBackend
from .torch_backend import PlainTorchBackend

__all__ = ["CpuDevice", "device", "CompiledBackend", "PlainTorchBackend", "cpu_capability"]

# ``TorchBackend`` named the compiled backend here and the plain one in .torch_backend: deprecated in 0.2.0.
__getattr__ = moved_names(__name__, {"TorchBackend": "hal.devices.cpu.compiled_backend:CompiledBackend"})


class CpuDevice(Device):
    name = "cpu"
    priority = 0
    plugin_api = 2

    def probe(self, index: int | None = None) -> DeviceCapability:
        return cpu_capability()

    def backends(self):
        # Interpreted Triton is for correctness only: it never outranks the torch backend.
        return [CompiledBackend, TritonBackend]

    def bench_facts(self) -> dict:
        """What ``hal bench`` records and measures on this device (:func:`hal.bench.device_facts`)."""
        from .bench_facts import bench_facts

        return bench_facts()


device = CpuDevice()
