"""Compiled CPU attention kernels (``hal.kernels.cpu``), built at first use.

:func:`paged_attention` is the fused paged kernel: it reads K/V rows in place, with no gathered copy, from a
pool of token-major, head-major or AMX-packed pages (:data:`KV_LAYOUTS`) through ``req_to_token`` or a block table
``req_to_page`` (:data:`TABLES`), one task per (request, KV head) with the GQA
group served together (decode, verify), or per (request, KV head, query tile) through
register-blocked tiles over K/V rows read in place (extend; ``at::mm`` on the plain-loops
path). Its semantics are the reference's (``hal.kernels.reference.paged_attention``),
float32 accumulation throughout.

:func:`write_and_attend` is one layer's whole forward in one call (the ``torch``
backend's hot path): the new tokens' K/V checked and written at their slots, then the
same attention, with no Python between.

The C++ source (``attention.cpp``) is compiled by ``torch.utils.cpp_extension`` the
first time a kernel is asked for, for the best x86 generation this CPU has (:data:`ISAS`:
AVX-512 with AVX512-BF16 dot products, AVX-512, AVX2+FMA, or plain loops), chosen from
its features at run time (:func:`default_isa`; ``HAL_CPU_ISA`` picks a lower one); a path whose instructions
the CPU lacks is never built or run. Each build is cached per user under a key of
everything that changes the binary (:func:`build_key`: source, torch version, install, git hash
and C++ ABI, Python, compiler and its version, flags, ISA), so environments sharing
``~/.cache/hal`` never rebuild each other's kernels; :func:`cache_state` says, without
building, whether the first use here is a cache hit. The entry points are
``torch.library`` ops (``torch.ops.hal.paged_attention_<isa>``): the dispatcher, and so
hal's eager graph guard, sees every tensor they read. Nothing here runs at import: ``pip
install`` and ``hal info`` never need a compiler. Where the build cannot run (no
compiler, no ninja, ``HAL_CPU_KERNELS=0``), :func:`status` says why and callers keep
their torch path.

A leaf module: it imports nothing of hal but its errors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hal.errors import ConfigError, HalError, InvalidBatchError, KVCacheError, expect
from hal.kernels.reference import overlaps
from hal.kernels.reference.kv_layouts import AMX_DIM_MULTIPLE, AMX_PAGE_MULTIPLE

__all__ = [
    "KernelBuildError",
    "cpu_features",
    "ISAS",
    "isa",
    "default_isa",
    "why_isa",
    "build_key",
    "cache_state",
    "compile_only",
    "status",
    "load",
    "build_record",
    "describe",
    "Kernels",
    "runnable_isas",
    "paged_attention",
    "write_and_attend",
    "TILE_ROWS",
    "KV_LAYOUTS",
    "TABLES",
    "ceilings",
]

SOURCE = Path(__file__).with_name("attention.cpp")
# Query rows (query tokens x GQA group) from which a request's queries go through extend tiles.
TILE_ROWS = 128

# Flags that decide which code paths a CPU can take (from /proc/cpuinfo).
_INTERESTING = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
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
    model = vendor = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "model name" and not model:
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = "unknown"
    return {
        "model": model,
        "vendor": vendor,
        "flags": sorted(f for f in _INTERESTING if f in flags),
        "torch_capability": capability,
        "bf16_dot": "avx512_bf16" in flags or "amx_bf16" in flags,
    }


# x86 generations, best first: the CPU flags a path needs and the compiler flags that build it.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq")
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amx": (
        (*_AVX512_FLAGS, "avx512_bf16", "amx_tile", "amx_bf16"),
        (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    ),
    "avx512_bf16": ((*_AVX512_FLAGS, "avx512_bf16"), (*_AVX512, "-mavx512bf16")),
    "avx512": (_AVX512_FLAGS, _AVX512),
    "avx2": (_AVX2_FLAGS, _AVX2),
    # the amx path's tile code over scalar stand-ins of the tile instructions: never chosen, only by
    # HAL_CPU_ISA=amx_emulated, so that an AVX2 machine tests the tile path it can only compile
    "amx_emulated": (_AVX2_FLAGS, (*_AVX2, "-DHAL_AMX_EMULATE")),
    "generic": ((), ()),
}
_COMMON_FLAGS = ("-O3", "-fopenmp", "-DNDEBUG")


def runnable_isas() -> list[str]:
    """The paths of :data:`ISAS` whose instructions this CPU has, best first (``generic`` always)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    have = set(cpu_features()["flags"])
    return [name for name, (needs, _) in ISAS.items() if not needs or (x86 and set(needs) <= have)]


def isa() -> str:
    """The path this process runs: :func:`default_isa`, or ``HAL_CPU_ISA`` (one it has). Raises ConfigError."""
    return _isa(os.environ.get("HAL_CPU_ISA", ""))


def default_isa(runnable: list[str], vendor: str) -> str:
    """The path hal runs unless told otherwise: the best of ``runnable`` (best first), except that an Intel CPU
    with AVX512-BF16 but no AMX runs ``avx512`` (bf16 rows widened to float32 FMAs) rather than ``avx512_bf16``.
    Intel cores issue ``vdpbf16ps`` at half their FMA rate (Sapphire Rapids: bf16 dot 237 against FMA 449 GF/s,
    hal bench's ceilings), so there the dot path's bf16 extend ran at 0.67-0.69x the avx512 path's and its decode
    level with it; AMD's Zen 4 runs the dot product at 2.5x its FMA rate and keeps it. Such an Intel CPU is a
    Cooper Lake, or a later Xeon whose hypervisor hides AMX."""
    return _default(runnable, vendor)[0]


def _default(runnable: list[str], vendor: str) -> tuple[str, str]:
    """:func:`default_isa`'s path and why, in a few words."""
    if runnable[0] == "avx512_bf16" and vendor == "GenuineIntel" and "avx512" in runnable:
        return "avx512", (
            "default on an Intel CPU without AMX: vdpbf16ps runs at half the FMA rate; HAL_CPU_ISA=avx512_bf16 takes it"
        )
    return runnable[0], "the best this CPU runs"


def why_isa() -> str:
    """Why :func:`isa` is the path it is, in a few words (for ``hal info``). Raises ConfigError as :func:`isa`."""
    isa()  # a HAL_CPU_ISA this CPU cannot run raises here
    if os.environ.get("HAL_CPU_ISA", ""):
        return "HAL_CPU_ISA"
    return _default(runnable_isas(), cpu_features()["vendor"])[1]


@functools.cache
def _isa(forced: str) -> str:
    runnable = runnable_isas()
    if not forced:
        return default_isa(runnable, cpu_features()["vendor"])
    if forced not in ISAS:
        raise ConfigError(f"HAL_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in runnable:
        missing = sorted(set(ISAS[forced][0]) - set(cpu_features()["flags"]))
        raise ConfigError(
            f"HAL_CPU_ISA={forced}: this CPU lacks {' '.join(missing)}, so that path is never built or run here; "
            f"it can run {', '.join(runnable)}"
        )
    return forced


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    return (done.stdout.strip().splitlines() or ["unknown"])[0]


def build_key(name: str | None = None) -> dict:
    """Everything that changes the binary of path ``name`` (default: :func:`isa`): its cache key, as a dict."""
    name = name or isa()
    cxx = _compiler() or "none"
    return {
        "isa": name,
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", "unknown"),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "compiler": f"{cxx}: {_compiler_version(cxx)}",
        "flags": [*_COMMON_FLAGS, *ISAS[name][1], f"-DHAL_ISA={name}"],
    }


def _module_name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"hal_cpu_attention_{key['isa']}_{digest}"


def _ninja_dir(path: Path) -> Path:
    """Where this torch install builds the module of ``path``. Two venvs with the same torch build one binary
    (shared as ``path/<module>.so``), but their include paths differ: one ninja folder each, or ninja would
    rebuild a shared one in turn."""
    root = str(Path(torch.__file__).resolve().parent)
    return path / f"build-{hashlib.sha256(root.encode()).hexdigest()[:12]}"


def _ninja() -> bool:
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
        return True
    except Exception:
        return False


def heads_per_task() -> int | None:
    """``HAL_HEADS_PER_TASK``: KV heads per row task (the kernel's choice when unset; a tuning and test knob),
    a positive int; anything else is a ``ConfigError``."""
    raw = os.environ.get("HAL_HEADS_PER_TASK", "").strip()
    if not raw:
        return None
    expect(raw.isdigit() and int(raw) >= 1, ConfigError, "HAL_HEADS_PER_TASK", raw, "a count of KV heads >= 1")
    return int(raw)


def status() -> tuple[bool, str | None]:
    """``(True, None)`` when the kernels are loaded or can be built here, else ``(False, reason)``. Never compiles.

    Raises :class:`~hal.errors.ConfigError` for a ``HAL_CPU_ISA`` this CPU cannot run, and for a ``HAL_CPU_KERNELS``
    or ``HAL_HEADS_PER_TASK`` it cannot read."""
    switch = os.environ.get("HAL_CPU_KERNELS", "1").strip()
    expect(switch in ("", "0", "off", "1", "on"), ConfigError, "HAL_CPU_KERNELS", switch, "0 / off or 1 / on (default)")
    if switch in ("0", "", "off"):
        return False, "HAL_CPU_KERNELS=0 turns the compiled CPU kernels off"
    heads_per_task()  # a bad override is refused here, not read as 1 by the kernel
    if isa() in _STATE["loaded"]:
        return True, None
    if _STATE["error"] is not None:
        return False, _STATE["error"]
    if _compiler() is None:
        return False, "no C++ compiler found (install g++ or set CXX) to build the CPU kernels"
    if not _ninja():
        return False, "ninja is not installed (pip install ninja) to build the CPU kernels"
    return True, None


@dataclass(frozen=True)
class Kernels:
    """One loaded build: its ISA path, its ops (``torch.ops.hal.<op>_<isa>``) and what it was compiled with."""

    isa: str
    paged_attention: Callable  # the op overload; arguments as attention.cpp's paged_attention
    direct: Callable  # the same function called without the dispatcher (only where no torch mode is active)
    build_info: str
    write_and_attend: Callable | None = None  # attention.cpp's write_and_attend (no dispatcher op: unwatched only)
    peak_gflops: Callable | None = None  # attention.cpp's peak_gflops(kind, iters): this path's arithmetic ceiling


_STATE: dict = {"loaded": {}, "error": None, "records": {}}  # per ISA path: its Kernels, how they were loaded
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


def _cache_root() -> Path:
    root = os.environ.get("HAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hal"
    )
    return Path(root) / "cpu_kernels"


def cache_state(name: str | None = None) -> dict:
    """Whether path ``name``'s build (default :func:`isa`) is in the cache, without building anything.

    ``{"isa", "module", "path", "hit"}``: ``hit`` is True when loading it needs no compiler run. The build is
    shared by every venv with the same torch, compiler and flags (:func:`build_key`).
    """
    key = build_key(name)
    module = _module_name(key)
    path = _cache_root() / module
    return {"isa": key["isa"], "module": module, "path": str(path), "hit": (path / f"{module}.so").is_file()}


def _import_built(module: str, so: Path):
    """Import the extension module ``module`` from ``so`` (its ops register with torch as it loads)."""
    spec = importlib.util.spec_from_file_location(module, so)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def build_record() -> dict | None:
    """How this process got the kernels of :func:`isa`: ``{"isa", "seconds", "compiled", "cache", "path",
    "build_info"}``, or None if it has not loaded them."""
    return _STATE["records"].get(isa())


def describe() -> str:
    """One line for ``hal info``: the path that serves, whether its build is a kernel cache hit, the CPU's features."""
    flags = " ".join(cpu_features()["flags"]) or "none"
    try:
        ok, why = status()
    except ConfigError as exc:
        return f"plain torch path: {exc}; CPU features {flags}"
    if not ok:
        return f"plain torch path: {why}; CPU features {flags}"
    record = build_record()
    if record is not None:
        how = f"kernel cache {record['cache']}, loaded in {record['seconds']:.1f} s"
        return (
            f"compiled kernels, {record['isa']} path ({why_isa()}: {record['build_info']}); {how}; CPU features {flags}"
        )
    cache = cache_state()
    how = (
        "hit: loads without compiling"
        if cache["hit"]
        else "miss: the first use compiles it (a minute or two, once per CPU kind, torch install and compiler)"
    )
    return (
        f"compiled kernels, {cache['isa']} path ({why_isa()}; this CPU runs {', '.join(runnable_isas())}); "
        f"kernel cache {how} ({cache['path']}); CPU features {flags}"
    )


def _first_error(text: str) -> str:
    return next((line for line in text.splitlines() if "error" in line.lower()), text.strip()[-400:]).strip()[:400]


def load() -> Kernels:
    """This CPU's kernels (:func:`isa`), built on first use into the cache. Raises :class:`KernelBuildError`."""
    name = isa()
    if name in _STATE["loaded"]:
        return _STATE["loaded"][name]
    with _LOCK:
        if name in _STATE["loaded"]:
            return _STATE["loaded"][name]
        ok, why = status()
        if not ok:
            raise KernelBuildError(why)
        key = build_key(name)
        state = cache_state(name)
        shared = Path(state["path"]) / f"{state['module']}.so"
        build_dir = _ninja_dir(Path(state["path"]))
        start = time.perf_counter()
        try:
            if state["hit"]:
                module = _import_built(state["module"], shared)
            else:
                from torch.utils.cpp_extension import load as build

                with _build_lock(build_dir):
                    module = build(
                        name=state["module"],
                        sources=[str(SOURCE)],
                        extra_cflags=key["flags"],
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir),
                        verbose=False,
                    )
                    partial = shared.with_name(f"{shared.name}.{os.getpid()}")
                    shutil.copy2(build_dir / shared.name, partial)
                    partial.replace(shared)  # atomic: another process sees the whole file or none
            kernels = Kernels(
                isa=name,
                paged_attention=getattr(torch.ops.hal, f"paged_attention_{name}").default,
                direct=module.paged_attention,
                build_info=getattr(torch.ops.hal, f"build_info_{name}")(),
                write_and_attend=module.write_and_attend,
                peak_gflops=module.peak_gflops,
            )
        except Exception as exc:
            _STATE["error"] = (
                f"building the CPU kernels failed ({type(exc).__name__}: {_first_error(str(exc))}); "
                f"the torch path serves instead (build dir {build_dir})"
            )
            raise KernelBuildError(_STATE["error"]) from exc
        _STATE["records"][name] = {
            "isa": name,
            "seconds": round(time.perf_counter() - start, 3),
            "compiled": not state["hit"],
            "cache": "hit" if state["hit"] else "miss (compiled)",
            "path": str(shared.parent),
            "build_info": kernels.build_info,
        }
        _STATE["loaded"][name] = kernels
        return kernels


def compile_only(name: str) -> dict:
    """Compile path ``name`` to an object file in the cache, never loading or running it.

    For the paths this CPU cannot run: proves they build (with the flags and compiler of
    :func:`build_key`). Returns ``{"isa", "object", "seconds", "cached"}``; raises
    :class:`KernelBuildError` with the compiler's first error.
    """
    from torch.utils.cpp_extension import include_paths

    key = build_key(name)
    directory = _cache_root() / (_module_name(key) + "_object")
    target = directory / "attention.o"
    if target.is_file():
        return {"isa": name, "object": str(target), "seconds": 0.0, "cached": True}
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"attention.{os.getpid()}.o"
    command = [_compiler() or "c++", "-c", str(SOURCE), "-o", str(partial), "-std=c++17", "-fPIC"]
    command += [f"-D_GLIBCXX_USE_CXX11_ABI={int(key['cxx11_abi'])}", *key["flags"]]
    command += [f"-DTORCH_EXTENSION_NAME={_module_name(key)}", f"-I{sysconfig.get_paths()['include']}"]
    command += [f"-I{path}" for path in include_paths()]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KernelBuildError(f"compiling the {name} path failed: {_first_error(done.stderr)}")
    partial.replace(target)
    return {"isa": name, "object": str(target), "seconds": round(time.perf_counter() - start, 3), "cached": False}


def ceilings(seconds: float = 0.05) -> dict:
    """This path's arithmetic ceilings, measured now over all torch threads, in GFLOP/s.

    ``{"isa", "fma_GFLOPs", "bf16_dot_GFLOPs", "amx_bf16_GFLOPs"}``: float32 multiply-adds at the path's
    vector width (``fma``), bf16 dot products (``vdpbf16ps``) and AMX bf16 tile products (``tdpbf16ps``,
    four independent 16 x 16 accumulators; None on a path without them), each from registers for about
    ``seconds``. Against them a kernel's rate says how much of what *this path* can reach it
    gets (a bf16 matmul rate measured by torch may use instructions the path does not). Raises
    :class:`KernelBuildError` where the kernels cannot be built.
    """
    kernels = load()
    out: dict = {"isa": kernels.isa}
    for kind in ("fma", "bf16_dot", "amx_bf16"):
        rate = kernels.peak_gflops(kind, 1000)  # a first short run: sizes the timed one
        if rate <= 0:
            out[f"{kind}_GFLOPs"] = None
            continue
        flops_per_iter = {"fma": 32.0 * 16, "bf16_dot": 64.0 * 16, "amx_bf16": 4 * 16 * 16 * 32 * 2.0}[kind]
        flops_per_iter *= max(1, torch.get_num_threads())
        iters = max(1000, int(seconds * rate * 1e9 / flops_per_iter))
        out[f"{kind}_GFLOPs"] = max(kernels.peak_gflops(kind, iters) for _ in range(2))
    return out


def _index(t) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t if t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" else t.to("cpu", torch.int64)


# KV pool layouts the kernels read: the shapes a layer's K (V alike, its own last dim) may take in each.
KV_LAYOUTS = {
    "token_major": "[slots, kv_heads, dim] (SGLang's pool) or [pages, page, kv_heads, dim]",
    "head_major": "[pages, kv_heads, page, dim] (vLLM's CPU cache)",
    "amx_packed": "[pages, kv_heads, page, dim], each (page, head) slab dense and permuted into AMX tiles "
    "(vLLM's AMX CPU cache; hal.kernels.reference.kv_layouts), page and dims multiples of 32",
}
# How a request's keys are found: its slots (req_to_token [rows, context]) or its pages (req_to_page [rows,
# max_pages], key i on page req_to_page[r, i // page] at offset i % page).
TABLES = ("req_to_token", "req_to_page")


def _pool_views(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_layout: str, table: str, page_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V buffers as the kernels take them: ``[slots, kv_heads, dim]`` as given where ``table`` is
    req_to_token over a token-major pool of that shape, else views ``[pages, kv_heads, page, dim]`` (no copy: the
    layout is in their strides). ``page_size``: the page, where the buffers' shape does not say it (a
    ``[slots, kv_heads, dim]`` pool read through req_to_page); where it does, it must agree. Raises
    :class:`~hal.errors.ConfigError` for an unknown layout or table, :class:`~hal.errors.KVCacheError` for
    buffers that are not of the layout or do not match each other."""
    expect(kv_layout in KV_LAYOUTS, ConfigError, "kv_layout", kv_layout, " or ".join(KV_LAYOUTS))
    expect(table in TABLES, ConfigError, "table", table, " or ".join(TABLES))
    expect(
        page_size is None or (isinstance(page_size, int) and page_size >= 1),
        ConfigError,
        "page_size",
        page_size,
        "a page of at least 1 slot, or None (the buffers' shape says it)",
    )
    dims = k_buffer.dim()
    if v_buffer.dim() != dims or k_buffer.shape[:-1] != v_buffer.shape[:-1] or dims not in (3, 4):
        raise KVCacheError(
            f"k/v buffers {list(k_buffer.shape)} / {list(v_buffer.shape)}: expected {KV_LAYOUTS[kv_layout]}, "
            "the same but for the last dim"
        )
    if kv_layout == "amx_packed":
        _check_amx_packed(k_buffer, v_buffer, page_size)
        return k_buffer, v_buffer
    if kv_layout == "head_major" or dims == 4:
        page_dim = 2 if kv_layout == "head_major" else 1
        if dims != 4 or (page_size is not None and page_size != k_buffer.shape[page_dim]):
            raise KVCacheError(
                f"k/v buffers {list(k_buffer.shape)} with kv_layout={kv_layout!r}, page_size={page_size}: "
                f"expected {KV_LAYOUTS[kv_layout]}, whose page is the page size"
            )
        if kv_layout == "head_major":
            return k_buffer, v_buffer
        return k_buffer.transpose(1, 2), v_buffer.transpose(1, 2)
    if table == "req_to_token":
        return k_buffer, v_buffer
    slots = k_buffer.shape[0]
    if page_size is None or slots % page_size:
        raise KVCacheError(
            f"k/v buffers {list(k_buffer.shape)} read through req_to_page with page_size={page_size}: expected the "
            "page size, a divisor of the slots"
        )
    pages = slots // page_size
    return (
        k_buffer.unflatten(0, (pages, page_size)).transpose(1, 2),
        v_buffer.unflatten(0, (pages, page_size)).transpose(1, 2),
    )


def _check_amx_packed(k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_size: int | None) -> None:
    """Raises :class:`~hal.errors.KVCacheError` unless the buffers are AMX-packed pages as the kernels read them:
    ``[pages, kv_heads, page, dim]`` (K and V alike but for dim), page and dims multiples of 32, each (page, head)
    slab of ``page * dim`` values dense (its last two dims contiguous), the page ``page_size`` where given."""
    shape = f"k/v buffers {list(k_buffer.shape)} / {list(v_buffer.shape)} with kv_layout='amx_packed'"
    if k_buffer.dim() != 4 or (page_size is not None and page_size != k_buffer.shape[2]):
        raise KVCacheError(
            f"{shape}, page_size={page_size}: expected {KV_LAYOUTS['amx_packed']}, whose page is the page size"
        )
    page = k_buffer.shape[2]
    if page % AMX_PAGE_MULTIPLE or k_buffer.shape[3] % AMX_DIM_MULTIPLE or v_buffer.shape[3] % AMX_DIM_MULTIPLE:
        raise KVCacheError(
            f"{shape}: expected a page of a multiple of {AMX_PAGE_MULTIPLE} slots and dims of {AMX_DIM_MULTIPLE} "
            "(whole AMX tiles)"
        )
    for name, x in (("k", k_buffer), ("v", v_buffer)):
        if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
            raise KVCacheError(
                f"{shape}: {name}_buffer's strides {list(x.stride())}: expected each (page, head) slab of "
                f"page x dim values dense (strides [.., .., {x.shape[3]}, 1]), as the tiles lie in it"
            )


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
    sinks: torch.Tensor | None = None,
    tile_rows: int = TILE_ROWS,
    kv_layout: str = "token_major",
    table: str = "req_to_token",
    page_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's ``paged_attention``, compiled: ``[T, Hq, D]`` queries -> ``[T, Hq, Dv]`` in ``q.dtype``
    (``out`` where given).

    ``seq_lens`` are the keys each request attends over (its query tokens included),
    ``extend_lens`` its query tokens; ``q_start`` / ``mask_start`` (int64 ``[B]``, each
    request's first query row and custom-mask entry) are derived when not given;
    ``sinks``: ``[Hq]`` sink logits (gpt-oss's attention sinks, any float dtype), or None.
    ``kv_layout`` (:data:`KV_LAYOUTS`): ``token_major`` buffers ``[slots, kv_heads, dim]`` or
    ``[pages, page, kv_heads, dim]``, ``head_major`` ``[pages, kv_heads, page, dim]`` (float32 or bfloat16, any
    strides but the last), ``amx_packed`` the same shape with each (page, head) slab dense and permuted into AMX
    tiles (page and dims multiples of 32; read through tiles on the AMX paths, bf16); ``table``: ``req_to_token``
    (the 4th argument int32 ``[rows, context]``, each request's
    slots, slot = page * page_size + offset) or ``req_to_page`` (int32 ``[rows, max_pages]``, each request's
    pages); ``page_size`` where the buffers' shape does not say it (:func:`_pool_views`). ``out``: a ``[T, Hq, Dv]``
    tensor in ``q.dtype``, last dim contiguous, any row and head strides (a view of an engine's buffer): the kernel
    writes a float32 one in place, another dtype gets its float32 result cast into it once. Reads
    no tensor on the host (graph-safe); out-of-range rows, lengths, slots or pages raise
    :class:`~hal.errors.KVCacheError` from the kernel's own checks, before or instead of
    any out-of-bounds read.
    """
    kernels = load()
    if q.dim() != 3 or req_to_token.dim() != 2:
        raise KVCacheError(
            f"q {list(q.shape)}, {table} {list(req_to_token.shape)}: expected [tokens, q_heads, dim] and "
            f"[rows, {'context' if table == 'req_to_token' else 'max_pages'}]"
        )
    k_buffer, v_buffer = _pool_views(k_buffer, v_buffer, kv_layout, table, page_size)
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if k_buffer.shape[-1] != head_dim or q_heads % kv_heads:
        raise KVCacheError(f"q {list(q.shape)} does not match the k/v buffers {list(k_buffer.shape)}")
    if k_buffer.dtype not in (torch.float32, torch.bfloat16) or v_buffer.dtype != k_buffer.dtype:
        raise KVCacheError(f"KV buffers are {k_buffer.dtype}/{v_buffer.dtype}: expected float32 or bfloat16")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
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
    sink_logits = _NO_SINKS if sinks is None else _sinks(sinks, q_heads)
    if sink_logits is None:
        shape = list(sinks.shape) if isinstance(sinks, torch.Tensor) else repr(sinks)
        raise KVCacheError(f"sinks {shape}: expected a tensor of one sink logit per q head ({q_heads})")
    qf = q if q.dtype == torch.float32 and q.stride(2) == 1 else q.float().contiguous()
    v_dim = v_buffer.shape[-1]
    if out is not None:
        _check_out(out, q.dtype, (tokens, q_heads, v_dim))
    # the kernel writes float32 rows through their strides: into out itself where it is float32
    direct = out is not None and out.dtype == torch.float32
    result = out if direct else torch.empty(tokens, q_heads, v_dim, dtype=torch.float32)
    try:
        (kernels.paged_attention if watched() else kernels.direct)(
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
            sink_logits,
            result,
            float(scale),
            float(logit_cap),
            int(sliding_window),
            bool(causal),
            int(tile_rows),
            table == "req_to_page",
            kv_layout == "amx_packed",
        )
    except RuntimeError as exc:
        _raise_hal_error(exc)
    if out is None:
        return result if q.dtype == torch.float32 else result.to(q.dtype)
    return out if direct else out.copy_(result)


def _check_out(out, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """Raises :class:`~hal.errors.InvalidBatchError` unless ``out`` is a CPU tensor of ``dtype`` and ``shape``
    (``[T, Hq, Dv]``) whose last dim is contiguous: an output buffer the kernels write through its strides."""
    expect(
        isinstance(out, torch.Tensor)
        and out.shape == shape
        and out.dtype == dtype
        and out.device.type == "cpu"
        and out.stride(-1) == 1,
        InvalidBatchError,
        "out",
        f"{out.dtype}{list(out.shape)} stride {out.stride()} on {out.device}"
        if isinstance(out, torch.Tensor)
        else type(out),
        f"a {dtype} CPU tensor {list(shape)} with a contiguous last dim",
    )


def watched() -> bool:
    """Whether a torch mode watches the ops this thread runs (hal's eager graph guard, a profiler's mode,
    FakeTensor). The kernels then go through the dispatcher (``torch.ops.hal``), which shows the mode every tensor
    they read; otherwise they are called straight, saving the dispatcher's argument parsing (about 15 us a call
    on a 2-core Zen 2)."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


def _raise_hal_error(exc: RuntimeError):
    """Re-raise a kernel's own check (a message starting ``hal: ``) as :class:`KVCacheError`, anything else as is."""
    message = str(exc).split("\n")[0]
    if "hal: " in message:
        raise KVCacheError(message.split("hal: ", 1)[1]) from None
    raise exc


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_STARTS = torch.empty(0, dtype=torch.int64)
_NO_SINKS = torch.empty(0, dtype=torch.float32)


def _sinks(sinks, q_heads: int) -> torch.Tensor | None:
    """``sinks`` as the kernels read them: float32 ``[q_heads]``, contiguous, on the CPU; None where ``sinks`` is
    no tensor of one logit per q head."""
    if not isinstance(sinks, torch.Tensor) or sinks.numel() != q_heads:
        return None
    return sinks.reshape(-1).to("cpu", torch.float32).contiguous()


def write_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_start: torch.Tensor,
    heads: tuple[int, int, int, int, int],
    scale: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    causal: bool = True,
    custom_mask: torch.Tensor | None = None,
    mask_start: torch.Tensor | None = None,
    tile_rows: int = TILE_ROWS,
    sinks: torch.Tensor | None = None,
    *,
    kv_layout: str = "token_major",
    table: str = "req_to_token",
    page_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One layer's forward in one kernel call: the new tokens' ``k``/``v`` written at ``out_cache_loc``, then
    :func:`paged_attention`; returns ``[T, q_heads * v_head_dim]`` in the pool's dtype, or ``out`` where given: a
    ``[T, q_heads, v_head_dim]`` tensor in ``q.dtype``, last dim contiguous, any row and head strides (a view of an
    engine's buffer), whose rows the kernel writes in place (bfloat16 rounded once from its float32 result), with
    no output allocated; any other ``out`` raises :class:`~hal.errors.InvalidBatchError`.

    ``kv_layout``, ``table`` (``req_to_token`` holds each request's slots, ``req_to_page`` its pages) and
    ``page_size`` as :func:`paged_attention`'s; ``out_cache_loc`` holds slots (page * page_size + offset) in
    either layout.

    ``q``/``k``/``v``: ``[T, heads * dim]`` or ``[T, heads, dim]`` in the pool's dtype (float32 or bfloat16);
    ``heads``: the layer's ``(q_heads, kv_heads, v_heads, head_dim, v_head_dim)``; the per-request tensors are
    int64 ``[B]`` contiguous (``q_start`` each request's first query row), ``custom_mask`` flat bool with
    ``mask_start`` (TARGET_VERIFY) or None; ``sinks`` ``[q_heads]`` on the CPU, or None. Returns None, having
    written nothing, for inputs this path does not take (another layout, dtype or device, shapes that do not match
    the layer or pool, an MLA pool, a torch mode watching): the caller's checked path then serves them or names
    what is wrong. Out-of-range request rows, lengths or ``out_cache_loc`` slots raise
    :class:`~hal.errors.KVCacheError` before anything is written.
    """
    kernels = load()
    if kernels.write_and_attend is None or watched():
        return None
    if not isinstance(k_buffer, torch.Tensor) or not isinstance(v_buffer, torch.Tensor):
        return None
    try:
        k_buffer, v_buffer = _pool_views(k_buffer, v_buffer, kv_layout, table, page_size)
    except KVCacheError:  # buffers not of the layout: the checked path names them
        return None
    sink_logits = _NO_SINKS if sinks is None else _sinks(sinks, heads[0])
    if sink_logits is None or (sinks is not None and sinks.device.type != "cpu"):
        return None
    if out is not None:
        if not isinstance(q, torch.Tensor) or q.dim() not in (2, 3):
            return None  # the checked path names what is wrong with q
        _check_out(out, q.dtype, (q.shape[0], heads[0], heads[4]))
        expect(
            not any(overlaps(out, t) for t in (q, k, v, k_buffer, v_buffer) if isinstance(t, torch.Tensor)),
            InvalidBatchError,
            "out",
            f"a buffer at {out.data_ptr():#x} sharing memory with q, k, v or the KV pool",
            "a buffer of its own: the kernel writes it while it reads them",
        )
    try:
        return kernels.write_and_attend(
            q,
            k,
            v,
            out_cache_loc,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_lens,
            q_start,
            _NO_MASK if custom_mask is None else custom_mask,
            _NO_STARTS if mask_start is None else mask_start,
            sink_logits,
            *heads,
            scale,
            logit_cap,
            sliding_window,
            causal,
            tile_rows,
            table == "req_to_page",
            kv_layout == "amx_packed",
            out,
        )
    except TypeError:  # an argument that is no tensor (k or v None...): the checked path says which
        return None
    except RuntimeError as exc:
        _raise_hal_error(exc)
