"""Compiled CPU attention kernels (``hal.kernels.cpu``), built at first use.

:func:`paged_attention` is the fused paged kernel: it reads K/V slots through
``req_to_token`` with no gathered copy, one task per (request, KV head) with the GQA
group served together (decode, verify), or per (request, KV head, query tile) through
matrix-sized ``at::mm`` tiles (extend). Its semantics are the reference's
(``hal.kernels.reference.paged_attention``), float32 accumulation throughout.

The C++ source (``attention.cpp``) is compiled by ``torch.utils.cpp_extension`` the
first time a kernel is asked for, with ``-O3 -march=native`` and OpenMP, into a per-user
cache keyed by the source, the torch build and this CPU's features, so it is built once
per machine kind (and Python and torch build). Nothing here runs at import: ``pip install`` and ``hal info`` never
need a compiler. Where the build cannot run (no compiler, no ninja,
``HAL_CPU_KERNELS=0``), :func:`status` says why and callers keep their torch path.

A leaf module: it imports nothing of hal but its errors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from hal.errors import HalError, KVCacheError

__all__ = [
    "KernelBuildError",
    "cpu_features",
    "status",
    "load",
    "build_record",
    "paged_attention",
    "TILE_ROWS",
]

SOURCE = Path(__file__).with_name("attention.cpp")
# Query rows (query tokens x GQA group) from which a request's queries go through at::mm tiles.
TILE_ROWS = 128

# Flags that decide which code paths a CPU can take (from /proc/cpuinfo).
_INTERESTING = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)


class KernelBuildError(HalError, RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message says why and how to fix it."""


@functools.cache
def cpu_features() -> dict:
    """This CPU's vector features: ``{"flags": [...], "torch_capability": "AVX2", "model": ...}``."""
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "model name" and not model:
                    model = value.strip()
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = "unknown"
    return {
        "model": model,
        "flags": sorted(f for f in _INTERESTING if f in flags),
        "torch_capability": capability,
        "bf16_dot": "avx512_bf16" in flags or "amx_bf16" in flags,
    }


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _ninja() -> bool:
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
        return True
    except Exception:
        return False


def status() -> tuple[bool, str | None]:
    """``(True, None)`` when the kernels are loaded or can be built here, else ``(False, reason)``. Never compiles."""
    if os.environ.get("HAL_CPU_KERNELS", "1") in ("0", "", "off"):
        return False, "HAL_CPU_KERNELS=0 turns the compiled CPU kernels off"
    if _STATE["module"] is not None:
        return True, None
    if _STATE["error"] is not None:
        return False, _STATE["error"]
    if _compiler() is None:
        return False, "no C++ compiler found (install g++ or set CXX) to build the CPU kernels"
    if not _ninja():
        return False, "ninja is not installed (pip install ninja) to build the CPU kernels"
    return True, None


_STATE: dict = {"module": None, "error": None, "record": None}
_LOCK = threading.Lock()


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Serialise builds of ``build_dir`` across processes with a lock the OS drops when its holder dies.

    torch's own build lock is a plain ``lock`` file: a build killed midway leaves it behind
    and every later build waits on it forever. Holding this lock, any such file is stale.
    """
    import fcntl  # POSIX; the kernels build only where a C++ toolchain and OpenMP are (Linux here)

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_dir(name: str) -> Path:
    root = os.environ.get("HAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hal"
    )
    path = Path(root) / "cpu_kernels" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_record() -> dict | None:
    """How the kernels were obtained: ``{"seconds", "compiled", "path", "build_info"}``, or None if never loaded."""
    return _STATE["record"]


def load():
    """The compiled module, built on first use (cached per user and CPU kind). Raises :class:`KernelBuildError`."""
    if _STATE["module"] is not None:
        return _STATE["module"]
    with _LOCK:
        if _STATE["module"] is not None:
            return _STATE["module"]
        ok, why = status()
        if not ok:
            raise KernelBuildError(why)
        source = SOURCE.read_text()
        flags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
        # the build depends on the source, the torch and Python it links against, the flags and this CPU
        python = f"{sys.implementation.cache_tag}-{platform.machine()}"
        key = "|".join([source, torch.__version__, python, " ".join(flags), " ".join(cpu_features()["flags"])])
        name = "hal_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]
        build_dir = _build_dir(name)
        cached = any(build_dir.glob(f"{name}*.so"))
        start = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load_inline

            with _build_lock(build_dir):
                module = load_inline(
                    name=name,
                    cpp_sources=[source],
                    functions=["paged_attention", "build_info"],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as exc:
            text = str(exc)
            first = next((line for line in text.splitlines() if "error" in line.lower()), text.strip()[-400:])
            _STATE["error"] = (
                f"building the CPU kernels failed ({type(exc).__name__}: {first.strip()[:400]}); "
                f"the torch path serves instead (build dir {build_dir})"
            )
            raise KernelBuildError(_STATE["error"]) from exc
        _STATE["record"] = {
            "seconds": round(time.perf_counter() - start, 3),
            "compiled": not cached,
            "path": str(build_dir),
            "build_info": module.build_info(),
        }
        _STATE["module"] = module
        return module


def _index(t) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t if t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" else t.to("cpu", torch.int64)


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    scale: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    causal: bool = True,
    custom_mask: torch.Tensor | None = None,
    q_start: torch.Tensor | None = None,
    mask_start: torch.Tensor | None = None,
    tile_rows: int = TILE_ROWS,
) -> torch.Tensor:
    """The reference's ``paged_attention``, compiled: ``[T, Hq, D]`` queries -> ``[T, Hq, Dv]`` in ``q.dtype``.

    ``seq_lens`` are the keys each request attends over (its query tokens included),
    ``extend_lens`` its query tokens; ``q_start`` / ``mask_start`` (int64 ``[B]``, each
    request's first query row and custom-mask entry) are derived when not given. Reads
    no tensor on the host (graph-safe); out-of-range rows, lengths or slots raise
    :class:`~hal.errors.KVCacheError` from the kernel's own checks, before or instead of
    any out-of-bounds read.
    """
    module = load()
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3 or req_to_token.dim() != 2:
        raise KVCacheError(
            f"q {list(q.shape)}, k/v buffers {list(k_buffer.shape)} / {list(v_buffer.shape)}, req_to_token "
            f"{list(req_to_token.shape)}: expected [tokens, q_heads, dim], [slots, kv_heads, dim] and [rows, context]"
        )
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if k_buffer.shape[:2] != v_buffer.shape[:2] or k_buffer.shape[2] != head_dim or q_heads % kv_heads:
        raise KVCacheError(f"q {list(q.shape)} does not match the k/v buffers {list(k_buffer.shape)}")
    if k_buffer.dtype not in (torch.float32, torch.bfloat16) or v_buffer.dtype != k_buffer.dtype:
        raise KVCacheError(f"KV buffers are {k_buffer.dtype}/{v_buffer.dtype}: expected float32 or bfloat16")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        k_buffer, v_buffer = k_buffer.contiguous(), v_buffer.contiguous()
    r2t = req_to_token
    if r2t.dtype != torch.int32 or r2t.stride(1) != 1:
        r2t = r2t.to(torch.int32).contiguous()
    rows, kv_lens, q_lens = _index(req_pool_indices), _index(seq_lens), _index(extend_lens)
    q_start = _index(q_start) if q_start is not None else torch.cumsum(q_lens, 0) - q_lens
    mask = torch.empty(0, dtype=torch.bool)
    if custom_mask is not None:
        mask = custom_mask.reshape(-1).to(torch.bool)
        if mask_start is None:
            sizes = q_lens * kv_lens
            mask_start = torch.cumsum(sizes, 0) - sizes
    mask_start = _index(mask_start) if mask_start is not None else torch.empty(0, dtype=torch.int64)
    qf = q if q.dtype == torch.float32 and q.stride(2) == 1 else q.float().contiguous()
    out = torch.empty(tokens, q_heads, v_buffer.shape[2], dtype=torch.float32)
    try:
        bad, slot = module.paged_attention(
            qf,
            k_buffer,
            v_buffer,
            r2t,
            rows,
            kv_lens,
            q_lens,
            q_start,
            mask,
            mask_start,
            out,
            float(scale),
            float(logit_cap),
            int(sliding_window),
            bool(causal),
            int(tile_rows),
        )
    except RuntimeError as exc:
        message = str(exc).split("\n")[0]
        if "hal: " in message:
            raise KVCacheError(message.split("hal: ", 1)[1]) from None
        raise
    if bad:
        raise KVCacheError(f"req_to_token holds slot {slot}: expected a slot in [0, {k_buffer.shape[0]})")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
