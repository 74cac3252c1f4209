"""FlashInfer's environment on this host: is it installed and importable, and where would its kernels
come from (prebuilt, or nvcc + ninja to JIT them). Read by the cuda device's probe and by the
``flashinfer`` backend; nothing here imports flashinfer except :func:`import_flashinfer`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil

from hal.capability import library_version
from hal.errors import DeviceUnavailableError

__all__ = ["MIN_SM", "DEFAULT_CUDA_HOME", "flashinfer_kernels", "import_flashinfer"]

MIN_SM = 75  # FlashInfer's JIT refuses GPUs below sm_75 (flashinfer/jit/core.py)
# flashinfer/jit/cpp_ext.py get_cuda_path(): CUDA_HOME, CUDA_PATH, the parent of `which nvcc`, then this.
DEFAULT_CUDA_HOME = "/usr/local/cuda"


def _sm(arch: str) -> int | None:
    """``sm_90`` -> 90, ``sm_100`` -> 100; None when ``arch`` is not an NVIDIA SM name."""
    found = re.fullmatch(r"sm_?(\d+)[a-z]?", (arch or "").strip().lower())
    return int(found.group(1)) if found else None


def _flashinfer_missing() -> str | None:
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError) as exc:  # a broken or half-imported package
        return f"flashinfer cannot be found: {type(exc).__name__}: {exc}"
    if spec is None:
        return "flashinfer is not installed (pip install flashinfer-python, or 'hal-attention[cuda]')"
    return None


def import_flashinfer():
    """``import flashinfer``; a missing or broken install is a :class:`DeviceUnavailableError` saying why."""
    missing = _flashinfer_missing()
    if missing:
        raise DeviceUnavailableError(missing)
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - a version mismatch (RuntimeError), a missing .so (OSError)...
        raise DeviceUnavailableError(
            f"flashinfer failed to import: {type(exc).__name__}: {exc} "
            f"(flashinfer-python {library_version('flashinfer-python') or '?'}; the flashinfer backend cannot run)"
        ) from exc


def _nvcc() -> str | None:
    """The nvcc FlashInfer's JIT would run, if it exists (its lookup order, flashinfer/jit/cpp_ext.py)."""
    if os.environ.get("FLASHINFER_NVCC"):
        return shutil.which(os.environ["FLASHINFER_NVCC"])
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        found = shutil.which("nvcc")
        if found:
            return found
        home = DEFAULT_CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc")
    return nvcc if os.access(nvcc, os.X_OK) else None


def _packaged_aot(version: str) -> bool:
    """Whether the flashinfer package itself ships prebuilt kernels (the AOT wheels of 0.2.x: ``data/aot``
    or ``_kernels*.so``), found without importing it."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return False
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        aot = os.path.join(root, "data", "aot")
        if (os.path.isdir(aot) and os.listdir(aot)) or any(n.startswith("_kernels") for n in os.listdir(root)):
            return True
    return False


def flashinfer_kernels() -> tuple[str, str | None]:
    """Where FlashInfer's attention kernels would come from here: ``(state, None)`` or ``("none", reason)``.

    flashinfer-python (0.3+) compiles each kernel with nvcc at its first ``plan``/``run`` unless a
    prebuilt one is found: flashinfer-jit-cache (the JIT modules prebuilt, ``flashinfer/jit/env.py``
    ``FLASHINFER_AOT_DIR``) or, for 0.2.x AOT wheels, kernels inside the package. flashinfer-cubin
    holds downloaded cubins (TRT-LLM kernels), not the FA2 modules hal plans, so it does not count.
    ``import flashinfer`` raises when flashinfer-jit-cache / flashinfer-cubin do not match its
    version (unless ``FLASHINFER_DISABLE_VERSION_CHECK`` is set): reported here without importing it.
    States: ``prebuilt: <what>``, ``jit: nvcc <path>``.
    """
    version = library_version("flashinfer-python")
    if version is None or _flashinfer_missing():
        return "none", _flashinfer_missing() or "flashinfer-python is not installed"
    jit_cache, cubin = library_version("flashinfer-jit-cache"), library_version("flashinfer-cubin")
    if not os.environ.get("FLASHINFER_DISABLE_VERSION_CHECK"):
        for dist, found, ok in (
            ("flashinfer-jit-cache", jit_cache, jit_cache is None or jit_cache.startswith(version)),
            ("flashinfer-cubin", cubin, cubin is None or cubin == version),
        ):
            if not ok:
                return "none", (
                    f"{dist} {found} does not match flashinfer-python {version}: `import flashinfer` raises "
                    f"(install the same version of both, or set FLASHINFER_DISABLE_VERSION_CHECK=1)"
                )
    if jit_cache:
        return f"prebuilt: flashinfer-jit-cache {jit_cache}", None
    if _packaged_aot(version):
        return f"prebuilt: AOT kernels in flashinfer-python {version}", None
    nvcc, ninja = _nvcc(), shutil.which("ninja")
    if nvcc and ninja:
        return f"jit: nvcc {nvcc}", None
    missing = " and ".join(
        what
        for what, found in (
            ("nvcc (set CUDA_HOME or CUDA_PATH, or put nvcc on PATH)", nvcc),
            ("ninja (pip install ninja)", ninja),
        )
        if not found
    )
    return "none", (
        f"flashinfer-python {version} has no prebuilt kernels (pip install flashinfer-jit-cache=={version} "
        f"from flashinfer.ai's wheel index for this CUDA) and no JIT toolchain: no {missing}; "
        "its first plan() would fail"
    )
