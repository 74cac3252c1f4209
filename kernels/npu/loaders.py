"""Loading torch_npu and op-plugin's ATB ops, and the chip generations hal routes by.

Every function here never raises: a missing library or device is a reason string.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

import torch

from . import emulation

__all__ = [
    "OP_NAMES",
    "MLA_OP_NAMES",
    "GENERATIONS",
    "generation_of_soc",
    "generation_of_arch",
    "ATB_LOADER",
    "load_torch_npu",
    "load_atb",
    "resolve_ops",
    "is_emulation",
]

OP_NAMES = (
    "_npu_reshape_and_cache",
    "npu_scatter_pa_kv_cache",
    "npu_scatter_nd_update_",
    "npu_format_cast",
    "_npu_paged_attention",
    "_npu_paged_attention_splitfuse",
    "npu_fused_infer_attention_score",
)

# The ops of the MLA path, checked apart from OP_NAMES (a torch_npu without them still serves MHA).
MLA_OP_NAMES = ("_npu_reshape_and_cache_siso", "_npu_paged_attention_mla", "npu_fused_infer_attention_score_v2")

# Chip generations as vllm-ascend names them (AscendDeviceType, vllm_ascend/device/hardware.py at 182b75e,
# 2026-08-22) -> the arch string hal's capability carries. vllm-ascend routes by generation: A2/A3 run FIA (TND)
# and npu_scatter_pa_kv_cache, _npu_paged_attention only for full-decode graph shapes (``using_paged_attention``,
# vllm_ascend/attention/utils.py, never on A5); 310P runs ATB PagedAttention / splitfuse and _npu_reshape_and_cache
# (vllm_ascend/_310p/attention/attention_v1.py, device_op.py ``Ascend310PDeviceAdaptor``).
GENERATIONS = {"A2": "Ascend910B", "A3": "Ascend910_93", "310P": "Ascend310P", "A5": "Ascend950"}


def generation_of_soc(soc_version: int) -> str | None:
    """The generation of ``torch_npu.npu.get_soc_version()``'s number (vllm-ascend's
    ``device_type_from_runtime_soc``), None when vllm-ascend does not know it either."""
    if 220 <= soc_version <= 225:
        return "A2"
    if 250 <= soc_version <= 255:
        return "A3"
    if 200 <= soc_version <= 205:
        return "310P"
    if soc_version == 260:
        return "A5"
    return None


def generation_of_arch(arch: str) -> str | None:
    """The generation of a capability's ``arch`` (one of :data:`GENERATIONS`' values), else None."""
    return next((gen for gen, name in GENERATIONS.items() if name == arch), None)


def load_torch_npu() -> tuple[ModuleType | None, str]:
    """Import ``torch_npu`` if it is usable here; never raises.

    Returns ``(module, "")`` when torch_npu imports, has the ops hal calls and sees an NPU;
    otherwise ``(None, reason)``. ``importlib.util.find_spec`` is checked first so a missing
    package costs nothing. With torch >= 2.5 an installed torch_npu is auto-loaded by
    ``import torch`` (entry point ``torch.backends``) unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``;
    if it was, the module already in ``sys.modules`` is reused. Without CANN that auto-load
    makes ``import torch`` itself fail, before hal runs: set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
    on such machines (the reason string says so).
    """
    module = sys.modules.get("torch_npu")
    if module is None:
        try:
            if importlib.util.find_spec("torch_npu") is None:
                return None, "torch_npu not installed"
        except (ImportError, ValueError) as err:  # a broken parent package or __spec__
            return None, f"torch_npu not importable: {type(err).__name__}: {err}"
        try:
            module = importlib.import_module("torch_npu")
        except BaseException as err:  # noqa: BLE001 - OSError, RuntimeError, SystemExit from native init
            if isinstance(err, KeyboardInterrupt):
                raise
            hint = ""
            if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0":
                hint = "; set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that it does not break `import torch`"
            return (
                None,
                f"torch_npu failed to import (CANN libraries missing?): {type(err).__name__}: {err}{hint}",
            )
    missing = [name for name in OP_NAMES if not hasattr(module, name)]
    if missing:
        version = getattr(module, "__version__", "?")
        return None, f"torch_npu {version} lacks {', '.join(missing)} (too old for hal's Ascend backend)"
    try:
        npu = getattr(module, "npu", None) or getattr(torch, "npu", None)
        available = bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception as err:  # noqa: BLE001 - a driver error is a reason, not a crash
        return None, f"no NPU device visible: {type(err).__name__}: {err}"
    if not available:
        return None, "no NPU device visible (torch_npu.npu.is_available() is False)"
    return module, ""


# op-plugin's lazy loader of its ATB (NNAL) ops: ``_register_atb_extensions()`` (``lru_cache``d) loads
# ``torch_npu/lib/libop_plugin_atb.so``, which needs NNAL's ``libatb.so`` (``source .../nnal/atb/set_env.sh``),
# and raises OSError when it cannot. Until then ``torch_npu._npu_paged_attention`` & co. are lazy wrappers
# that exist whether or not ATB is there (op-plugin ``op_plugin/atb/_atb_ops.py``). vllm-ascend's
# ``NPUWorker.__init__`` calls it at start-up (``vllm_ascend/worker/worker.py``:
# ``from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions``); hal's probe does the same.
ATB_LOADER = "torch_npu.op_plugin.atb._atb_ops"
_ATB_HINT = "install CANN's NNAL package and `source <nnal>/atb/set_env.sh` before starting python"


def load_atb() -> str:
    """Load op-plugin's ATB extensions as vllm-ascend's worker does; ``""`` when they loaded, else the reason.

    Never raises. A torch_npu without the loader module (older than op-plugin's lazy ATB
    loading, which registered the ops at import) has nothing to load: ``""``.
    """
    try:
        loader = importlib.import_module(ATB_LOADER)
    except ModuleNotFoundError as err:
        if ATB_LOADER.startswith(err.name or "?"):
            return ""
        return f"torch_npu's ATB loader ({ATB_LOADER}) failed to import: {type(err).__name__}: {err}"
    except BaseException as err:  # noqa: BLE001 - native init errors are reasons too
        if isinstance(err, KeyboardInterrupt):
            raise
        return f"torch_npu's ATB loader ({ATB_LOADER}) failed to import: {type(err).__name__}: {err}"
    register = getattr(loader, "_register_atb_extensions", None)
    if register is None:
        return ""
    try:
        register()
    except BaseException as err:  # noqa: BLE001 - OSError (libatb.so, undefined symbol) and anything native
        if isinstance(err, KeyboardInterrupt):
            raise
        cause = err.__cause__ or err.__context__
        detail = f"{type(err).__name__}: {err}" + (f" ({cause})" if cause and str(cause) not in str(err) else "")
        return (
            f"ATB ops (_npu_paged_attention, _npu_paged_attention_splitfuse, _npu_reshape_and_cache) "
            f"cannot load: {detail}; {_ATB_HINT}"
        )
    return ""


def resolve_ops(allow_emulation: bool = True) -> tuple[Any | None, str]:
    """``(ops, reason)``: real torch_npu with ``reason == ""``, else the emulation (or None) and why."""
    module, reason = load_torch_npu()
    if module is not None:
        return module, ""
    if allow_emulation:
        return emulation.torch_npu, f"using the CPU emulation: {reason}"
    return None, reason


def is_emulation(ops: object) -> bool:
    """True for :data:`hal.kernels.npu.emulation.torch_npu`."""
    return bool(getattr(ops, "is_emulation", False))
