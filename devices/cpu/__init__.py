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

# ``TorchBackend`` (deprecated) named the compiled backend here and the plain one in .torch_backend.
__getattr__ = moved_names(__name__, {"TorchBackend": "hal.devices.cpu.compiled_backend:CompiledBackend"})


class CpuDevice(Device):
    name = "cpu"
    priority = 0
    plugin_api = 4

    def probe(self, index: int | None = None) -> DeviceCapability:
        return cpu_capability()

    def backends(self):
        # Interpreted Triton is for correctness only: it never outranks the torch backend.
        return [CompiledBackend, TritonBackend]

    def bench_facts(self) -> dict:
        """What ``hal bench`` records and measures on this device (:func:`hal.commands.bench.device_facts`)."""
        from .bench_facts import bench_facts

        return bench_facts()

    def conformance_paths(self, backend_cls, capability) -> list[dict]:
        """The compiled kernels' ISA paths besides the one this process runs, for ``hal check``
        (``hal.conformance.paths``): each one this CPU can run, under ``HAL_CPU_ISA``, on every family, one case per
        shape (``"sample"``: every mode at every head-dim combination, request table and KV layout, every family,
        page size, dtype and task shape the default path meets); each one it cannot, unreached with the
        instructions it lacks."""
        from hal.kernels import cpu as cpu_kernels

        if not issubclass(backend_cls, CompiledBackend):
            return []
        ok, why = cpu_kernels.status()
        current = cpu_kernels.isa()
        if not ok:
            return [{"name": f"isa={name}", "unreached": why} for name in cpu_kernels.ISAS if name != current]
        runnable, flags = cpu_kernels.runnable_isas(), set(cpu_kernels.cpu_features()["flags"])
        paths = []
        for name, (needs, _) in cpu_kernels.ISAS.items():
            if name == current:
                continue
            if name in runnable:
                paths.append({"name": f"isa={name}", "env": {"HAL_CPU_ISA": name}, "sample": True})
            else:
                lacks = " ".join(sorted(set(needs) - flags))
                paths.append({"name": f"isa={name}", "unreached": f"this CPU lacks {lacks}: never built or run here"})
        return paths

    def matrix_paths(self, backend_cls, capability) -> list[dict]:
        """The columns ``hal report --matrix`` (``hal.conformance.matrix``) runs besides the default path and the ISA
        paths: the compiled backend's plain torch path (what serves where no kernels are built), and the Triton
        backend interpreted (standing for the CUDA / ROCm Triton route)."""
        if issubclass(backend_cls, CompiledBackend):
            return [{"name": "kernels=off", "env": {"HAL_CPU_KERNELS": "0"}}]
        if issubclass(backend_cls, TritonBackend):
            return [{"name": "interpreted", "env": {"TRITON_INTERPRET": "1"}}]
        return []


device = CpuDevice()
