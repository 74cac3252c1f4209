"""The Ascend NPU device: backend ``ascend`` over torch_npu's attention ops.

Probing imports ``torch_npu`` lazily (``hal.kernels.npu.load_torch_npu``: ``find_spec`` first),
never at module import, and never raises except for an invalid ``HAL_NPU_EMULATION``.

``HAL_NPU_EMULATION=1`` (``0`` or unset: off) makes the device available on machines
without an NPU, running the same backend over :data:`hal.kernels.npu.emulation.torch_npu`
(plain-torch CPU versions of the ops, with their real argument contracts): correctness
only, never performance. A real NPU always wins over the flag. ``1`` emulates an A2
(Ascend910B); ``A2``, ``A3``, ``310P`` or ``A5`` pick the generation whose routes run.

The capability's ``arch`` is the chip generation (``Ascend910B`` = A2, ``Ascend910_93`` = A3,
``Ascend310P``, ``Ascend950`` = A5: ``hal.kernels.npu.GENERATIONS``), from
``torch_npu.npu.get_soc_version()`` as vllm-ascend reads it; the backend routes by it.
"""

from __future__ import annotations

import os

import torch

from hal.capability import DeviceCapability, cpu_memory, library_version, triton_status
from hal.errors import ConfigError
from hal.graph import EagerGraph, Graph, TorchGraph
from hal.registry import Device

from .ascend_backend import AscendBackend, _fp8_reason

__all__ = [
    "EMULATION_ENV",
    "EMULATED_NAME",
    "NpuDevice",
    "NpuGraph",
    "AscendBackend",
    "device",
    "emulation_requested",
    "npu_capability",
]

EMULATION_ENV = "HAL_NPU_EMULATION"
EMULATED_NAME = "Ascend NPU (CPU emulation of torch_npu ops)"
_HALF_ONLY = (
    "the Ascend attention ops (ATB PagedAttention, PagedAttention splitfuse, FusedInferAttentionScore) "
    "take fp16/bf16 only"
)


def emulated_generation() -> str | None:
    """The generation ``HAL_NPU_EMULATION`` asks to emulate (``1``: A2), None when off; ``ConfigError`` if bad."""
    from hal.kernels.npu import GENERATIONS

    raw = os.environ.get(EMULATION_ENV)
    if raw is None or raw == "0":
        return None
    if raw == "1":
        return "A2"
    generation = next((gen for gen in GENERATIONS if gen.lower() == raw.strip().lower()), None)
    if generation is None:
        raise ConfigError(
            f"{EMULATION_ENV} = {raw!r}: expected '1' (emulate the NPU's attention ops on the CPU, as an A2), "
            f"a generation to emulate ({', '.join(map(repr, GENERATIONS))}), '0' or unset (off)"
        )
    return generation


def emulation_requested() -> bool:
    """Whether ``HAL_NPU_EMULATION`` asks for the CPU emulation; raises ``ConfigError`` on a bad value."""
    return emulated_generation() is not None


def _memory(npu, index: int) -> int | None:
    try:
        total = getattr(npu.get_device_properties(index), "total_memory", None)
        if total:
            return int(total)
    except Exception:  # noqa: BLE001 - a missing property is no reason to fail the probe
        pass
    try:
        return int(npu.mem_get_info(index)[1])
    except Exception:  # noqa: BLE001
        return None


def _cann_version(module) -> str:
    for source in (getattr(torch, "version", None), getattr(module, "version", None)):
        value = getattr(source, "cann", None)
        if value:
            return str(value)
    return ""


def _unavailable(why: str) -> DeviceCapability:
    return DeviceCapability(
        type="npu",
        available=False,
        torch_type="npu",
        reasons={"device": why},
        libraries={"torch_npu": library_version("torch-npu") or ""},
    )


def _real_capability(module, index: int | None) -> DeviceCapability:
    npu = getattr(module, "npu", None) or torch.npu
    try:
        count = int(npu.device_count())
        index = int(npu.current_device()) if index is None else index
        if not 0 <= index < count:
            return _unavailable(f"npu:{index} does not exist: {count} device(s) visible")
        name = str(npu.get_device_name(index))
        soc = int(npu.get_soc_version()) if hasattr(npu, "get_soc_version") else None
    except Exception as exc:  # noqa: BLE001 - a driver error is a reason, not a crash
        return _unavailable(f"NPU runtime error: {type(exc).__name__}: {exc}")
    from hal.kernels.npu import GENERATIONS, generation_of_soc

    generation = None if soc is None else generation_of_soc(soc)
    reasons = {"fp32": _HALF_ONLY, "fp8": _fp8_reason(generation)}
    if generation is None:
        reasons["generation"] = (
            f"{name}: soc_version {soc} is none of vllm-ascend's A2/A3/310P/A5 ranges"
            if soc is not None
            else f"torch_npu {getattr(module, '__version__', '?')} has no torch.npu.get_soc_version()"
        ) + ": hal routes the attention ops by generation"
    dtypes = ["fp16", "bf16"]
    if generation == "310P":  # Atlas 300I (Ascend 310P): no bf16 compute
        dtypes.remove("bf16")
        reasons["bf16"] = f"{name} (Ascend 310P) has no bf16 support"
    graph = "npu_graph" if hasattr(npu, "NPUGraph") else None
    if graph is None:
        version = getattr(module, "__version__", "?")
        reasons["graph"] = f"torch_npu {version} has no torch.npu.NPUGraph (graph capture needs torch_npu >= 2.1)"
    target, why_not = triton_status("npu", ("npu",), " (install triton-ascend)")
    if why_not:
        reasons["triton"] = why_not
    from hal.kernels.npu import load_atb

    atb_why_not = load_atb()  # the op names exist whether or not NNAL's ATB loads: load it, as vllm-ascend does
    if atb_why_not:
        reasons["atb"] = atb_why_not
    return DeviceCapability(
        type="npu",
        available=True,
        torch_type="npu",
        collective_backend="hccl",
        index=index,
        count=count,
        name=name,
        vendor="Huawei",
        arch=GENERATIONS.get(generation, name),
        memory_bytes=_memory(npu, index),
        dtypes=tuple(dtypes),
        graph=graph,
        triton_target=target,
        fused_mixed=True,
        libraries={
            "torch": torch.__version__,
            "torch_npu": str(getattr(module, "__version__", "") or library_version("torch-npu") or ""),
            "cann": _cann_version(module),
            "atb": "" if atb_why_not else "loaded",
            "triton": library_version("triton") or library_version("triton-ascend") or "",
        },
        reasons=reasons,
    )


def _emulated_capability(why_no_npu: str, generation: str) -> DeviceCapability:
    from hal.kernels.npu import GENERATIONS

    # the emulation computes every dtype in float32 (fp16 costs nothing extra); a 310P has no bf16
    dtypes = ("fp32", "fp16") if generation == "310P" else ("fp32", "bf16", "fp16")
    extra = {"bf16": "Ascend 310P (emulated) has no bf16 support"} if generation == "310P" else {}
    return DeviceCapability(
        type="npu",
        available=True,
        torch_type="cpu",
        index=0,
        count=1,
        name=EMULATED_NAME,
        vendor="Huawei (emulated)",
        arch=GENERATIONS[generation],
        memory_bytes=cpu_memory(),
        dtypes=dtypes,
        graph="eager_guard",
        triton_target=None,
        libraries={"torch": torch.__version__, "torch_npu": "", "cann": ""},
        emulated=True,
        fused_mixed=True,
        reasons={
            "emulated": (
                f"correctness only, never performance ({EMULATION_ENV}=1 and {why_no_npu}); the "
                "torch_npu ops run as plain-torch CPU code (hal.kernels.npu.emulation), tensors stay on the CPU; "
                "fp32 is allowed here because the emulation computes it, although " + _HALF_ONLY
            ),
            "npu_graph": "emulated: graphs run as hal's checked eager graph (eager_guard), not torch.npu.NPUGraph",
            "triton": "emulated: no Triton NPU target (triton-ascend needs an NPU); helper ops use torch",
            "fp8": _fp8_reason(generation),
            **extra,
        },
    )


def npu_capability(index: int | None = None) -> DeviceCapability:
    """NPU ``index`` (None: the current one) as hal sees it: real, emulated (``HAL_NPU_EMULATION=1``,
    no NPU) or unavailable with the reason. Its ``fused_mixed``: MIXED batches go to one splitfuse call."""
    from hal.kernels.npu import load_torch_npu

    emulate = emulated_generation()  # validated even when a real NPU makes it moot
    module, why_not = load_torch_npu()
    if module is not None:
        return _real_capability(module, index)
    if emulate:
        return _emulated_capability(why_not, emulate)
    return _unavailable(why_not)


class NpuGraph(TorchGraph):
    """``torch.npu.NPUGraph`` whose replay first synchronises the current stream, as vllm-ascend does before
    every FULL graph replay (vllm_ascend/compilation/acl_graph.py ``ACLGraphWrapper.__call__`` at 182b75e:
    ``torch.npu.current_stream().synchronize()`` then ``entry.aclgraph.replay()``): the attention tasks'
    parameter update (``GraphTasks.update``, on another stream, fenced by an ExternalEvent)
    must not race the previous replay still reading them."""

    def replay(self):
        self.module.current_stream().synchronize()
        super().replay()


# The case families whose ops differ per generation (routes, MLA and sinks support, graph ops, the KV-write op that
# padding slots reach): each other generation's emulated path reruns these.
GENERATION_FAMILIES = (
    "basic",
    "paged",
    "head_dim",
    "window",
    "non_causal_window",
    "mla",
    "sinks",
    "graph",
    "padding_slots",
)


class NpuDevice(Device):
    name = "npu"
    priority = 90
    plugin_api = 4

    def probe(self, index: int | None = None) -> DeviceCapability:
        return npu_capability(index)

    def backends(self):
        return [AscendBackend]

    def conformance_paths(self, backend_cls, capability: DeviceCapability) -> list[dict]:
        """The other generations' routes, for ``hal check`` (``hal.conformance.paths``): under the emulation,
        each other generation emulated (``HAL_NPU_EMULATION=<gen>``) on the families whose ops differ per
        generation; on a real NPU they are unreached (a chip runs its own generation's ops only)."""
        from hal.kernels.npu import GENERATIONS

        if not issubclass(backend_cls, AscendBackend):
            return []
        current = emulated_generation() if capability.emulated else None
        paths = []
        for generation in GENERATIONS:
            if generation == current:
                continue
            name = f"generation={generation}"
            if capability.emulated:
                paths.append({"name": name, "env": {EMULATION_ENV: generation}, "families": GENERATION_FAMILIES})
            else:
                paths.append({"name": name, "unreached": f"a real NPU ({capability.name}) runs its own ops only"})
        return paths

    def matrix_paths(self, backend_cls, capability: DeviceCapability) -> list[dict]:
        """The columns ``hal report --matrix`` (``hal.conformance.matrix``) runs besides this device's own: off a real
        NPU, each generation under the emulation (``HAL_NPU_EMULATION=<gen>``), every engine path on it."""
        from hal.kernels.npu import GENERATIONS

        if not issubclass(backend_cls, AscendBackend) or (capability.available and not capability.emulated):
            return []
        return [{"name": f"emulated={gen}", "env": {EMULATION_ENV: gen}} for gen in GENERATIONS]

    def make_graph(self, capability: DeviceCapability) -> Graph:
        if capability.emulated:
            return EagerGraph()
        return NpuGraph(torch.npu, torch.npu.NPUGraph)


device = NpuDevice()
