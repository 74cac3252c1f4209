"""``DeviceCapability``: what one device can do, and for everything it cannot, why.

Probes are cheap, never raise, and never initialise a device context they do not need:
a missing library or device is a reason, not a crash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch

from hal.deprecation import warn_renamed
from hal.errors import ConfigError
from hal.kv_dtypes import DTYPE_FAMILIES

__all__ = [
    "DeviceCapability",
    "triton_status",
    "triton_interpreter_status",
    "library_version",
    "interpreter_enabled",
    "resolve_device",
    "current_index",
    "host_cpu_name",
    "cpu_memory",
]


@dataclass(frozen=True)
class DeviceCapability:
    """One device as hal sees it.

    ``type`` is ``cpu``/``cuda``/``npu`` or a plugin's name; ``torch_type`` the torch
    device type its tensors live on (an emulated device keeps them on ``cpu``).
    ``reasons`` maps every feature that is off (``device``, ``bf16``, ``graph``,
    ``triton``, a library name...) to why. ``graph`` is the capture mechanism:
    ``cuda_graph``, ``npu_graph`` or ``eager_guard`` (the CPU's checked eager runner).
    ``triton_target`` is Triton's target for the device (``cuda:90``, ``hip:gfx942``,
    ``cpu:interpreter``) or None. ``fused_mixed``: the device has one kernel for a batch
    mixing prefill chunks and decodes, so ``AttentionBackend.forward`` sends MIXED
    batches to ``forward_mixed`` (SGLang does so on NPUs) instead of ``forward_extend``.
    ``compute_units``: the parallel units a kernel grid should fill (CUDA SMs...), None when unknown.
    ``dtypes`` lists dtype *families* (``fp32``, ``bf16``, ``fp16``, ``fp8``), the ``family`` of the rows of
    ``hal.kv_dtypes``: ``fp8`` covers the KV-cache dtypes ``fp8_e4m3`` and ``fp8_e5m2``.
    """

    type: str
    available: bool
    torch_type: str = "cpu"
    index: int = 0
    count: int = 0
    name: str = ""
    vendor: str = ""
    arch: str = ""
    memory_bytes: int | None = None
    dtypes: tuple[str, ...] = ()
    graph: str | None = None
    triton_target: str | None = None
    libraries: Mapping[str, str] = field(default_factory=dict)
    emulated: bool = False
    fused_mixed: bool = False
    reasons: Mapping[str, str] = field(default_factory=dict)
    features: tuple[str, ...] = ()  # CPU: the vector features kernels choose paths by (avx2, avx512_bf16, amx_bf16...)
    compute_units: int | None = None  # SMs / CUs / AI cores a kernel's grid should fill; None: unknown
    collective_backend: str = "gloo"  # torch.distributed backend of a tensor-parallel group (nccl, hccl...)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_type, self.index) if self.torch_type != "cpu" else torch.device("cpu")

    @property
    def on_host(self) -> bool:
        """Whether this device computes on the host's cores, in host memory (the CPU, or an emulation whose
        tensors stay on the CPU): commands then size torch's host threads for it, and it has no device index."""
        return self.torch_type == "cpu"

    @property
    def triton_interpreted(self) -> bool:
        return bool(self.triton_target) and self.triton_target.endswith(":interpreter")

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the family of ``dtype`` (a torch dtype of the KV-dtype table) is among ``dtypes``."""
        return DTYPE_FAMILIES.get(dtype) in self.dtypes

    def to_dict(self) -> dict:
        data = asdict(self)
        data["libraries"], data["reasons"] = dict(self.libraries), dict(self.reasons)
        data["dtypes"], data["features"] = list(self.dtypes), list(self.features)
        return data


def library_version(dist: str) -> str | None:
    """Installed version of distribution ``dist``, or None (never imports it)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_interpreter_status() -> tuple[str | None, str | None]:
    """``("cpu:interpreter", None)`` when Triton's interpreter is on (``TRITON_INTERPRET=1``), else
    ``(None, reason)``."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (pip install 'hal-attention[triton]')"
    if interpreter_enabled():
        return "cpu:interpreter", None
    return None, "Triton has no CPU code generator; set TRITON_INTERPRET=1 to run its kernels interpreted"


def triton_status(
    torch_type: str, backends: tuple[str, ...] | None = None, hint: str = ""
) -> tuple[str | None, str | None]:
    """``(target, None)`` when Triton compiles for ``torch_type`` here, else ``(None, reason)``.

    ``backends``: the names of Triton's active-driver backends that serve this device (the
    device declares them: ``("cuda", "hip")`` for CUDA and ROCm); default ``(torch_type,)``.
    ``hint`` is added to the reason when the active backend is another one (how to get the right one).
    The target is ``"<backend>:<arch>"``, e.g. ``cuda:90``, ``hip:gfx942``.
    """
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (pip install 'hal-attention[triton]')"
    if interpreter_enabled():
        return None, f"TRITON_INTERPRET=1 runs Triton on the CPU only; unset it to compile for {torch_type}"
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception as exc:  # no driver, no device, broken install: all are reasons
        return None, f"Triton has no active driver: {type(exc).__name__}: {exc}"
    if target.backend not in (backends or (torch_type,)):
        return None, f"Triton's active target is {target.backend}, not {torch_type}{hint}"
    return f"{target.backend}:{target.arch}", None


def current_index(torch_type: str) -> int:
    """The current device index of ``torch_type`` (what ``torch.cuda.set_device`` chose), 0 when unknown."""
    if torch_type == "cpu":
        return 0
    module = getattr(torch, torch_type, None)  # torch.cuda; torch.npu once torch_npu is imported
    try:
        if module is not None and module.is_available():
            return int(module.current_device())
    except Exception:  # a broken runtime is the probe's to report, not the index's
        pass
    return 0


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` with its index: ``"cuda"`` is the current CUDA device (``cuda:3`` after
    ``torch.cuda.set_device(3)``), ``"npu"`` likewise; ``"cpu"`` and ``"cpu:0"`` are ``cpu``.

    Raises ``ConfigError`` for something that is not a device.
    """
    if device is None:
        return torch.device("cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device = {device!r}: expected a torch device such as 'cpu', 'cuda', 'cuda:1', 'npu:0'"
        ) from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.index is None:
        return torch.device(dev.type, current_index(dev.type))
    return dev


def host_cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``, else ``platform``): a host fact, for any device's report."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_memory() -> int | None:
    """The host's physical memory in bytes, None when unknown: a host fact (emulated devices use it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def __getattr__(name: str):
    if name == "DTYPE_NAMES":  # deprecated in 0.4.0: read as the compute dtypes, which it is not (fp8 included)
        warn_renamed(f"{__name__}.{name}", "hal.kv_dtypes.DTYPE_FAMILIES", since="0.4.0")
        return DTYPE_FAMILIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
