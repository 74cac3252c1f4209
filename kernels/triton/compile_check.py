"""Compile every Triton kernel variant the sizing tables can choose, for real GPU targets, on any machine.

Triton's own compiler (``triton.compile(ASTSource(...), target=GPUTarget("cuda", sm, 32))``)
lowers each kernel to PTX and assembles it with the ``ptxas`` its wheel ships; no GPU and
no driver are needed. From each binary it reads the shared memory the launch will ask
for (``metadata.shared``) and ptxas's register and spill report, and checks them
against the target: shared memory within the architecture's opt-in limit
(:data:`hal.kernels.triton.sizing.SHARED_MEMORY_LIMIT`), spilled bytes within
:data:`SPILL_BUDGET`. A launch that would raise ``OutOfResources`` on the first call, or
run from local memory, is found here instead of on the GPU.

    python -m hal.kernels.triton.compile_check [--arch sm_90 ...] [--jobs N] [--json FILE] [--markdown FILE]

Exit status 0 when every variant compiles within its limits, 1 otherwise, 2 when this
Triton cannot compile for NVIDIA targets (no nvidia backend or no ptxas). Set
``TRITON_INTERPRET=0`` for it (the CLI does, in the processes that compile).

The variants: for each architecture, dtype (fp32, bf16, fp16) and head dim in
:data:`HEAD_DIMS` (plus MLA's 576/512), the extend kernel with the tiles
:func:`~hal.kernels.triton.sizing.extend_blocks` returns, plain (causal) and with every
feature on (custom mask, sliding window, logit cap: the most registers); the decode
stage-1 kernel with :func:`~hal.kernels.triton.sizing.decode_blocks`' tiles for the
GQA groups in :data:`DECODE_GROUPS`, with and without the cap; the split merge at the
largest split count; and the KV-cache helper kernels.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

from hal.errors import UnsupportedError
from hal.kernels.kv_dtypes import COMPUTE_DTYPES

from .sizing import (
    ARCHS,
    MAX_DECODE_SPLITS,
    SHARED_MEMORY_LIMIT,
    decode_blocks,
    extend_blocks,
    next_power_of_2,
    write_kv_heads,
)

__all__ = ["Variant", "variants", "compile_variant", "run", "SPILL_BUDGET", "HEAD_DIMS", "DECODE_GROUPS", "main"]

DTYPES = tuple(COMPUTE_DTYPES)  # fp32, bf16, fp16
#: Head dims served (q/k, v); MLA's 576/512 (DeepSeek) is the one with v_head_dim != head_dim.
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256), (576, 512))
#: GQA groups (q heads per KV head) decode is checked at: MHA, common GQA, MLA at TP 1 (128 heads, one latent KV head).
DECODE_GROUPS = (1, 8, 16, 128)
#: Spilled bytes per thread (ptxas "spill stores") a variant may have. The tables before this check
#: spilled up to 153,060 bytes (fp32 extend, head dim 256 on sm_90: 44 KB of stack per thread). 16-bit
#: extend tiles with 64 query rows spill a few hundred bytes with every feature on (the gathered K/V
#: address tiles); below that, tiles of 16-32 rows waste the tensor cores. Which of the tiles under
#: this budget is fastest is for a GPU run's `hal bench` to say, not for this check.
SPILL_BUDGET = 1024
_HELPER_KV_HEADS = (1, 8, 64)  # write_kv's BLOCK_H: one head, GQA, MHA at TP 1


@dataclass(frozen=True)
class Variant:
    """One kernel compiled for one target: every constexpr and launch option fixed."""

    kernel: str  # "extend", "decode", "decode_merge", "write_kv", "build_kv_indices", "positions"
    arch: str  # "sm_90"
    dtype: str  # storage dtype of q/k/v/out: "fp32", "bf16", "fp16"
    head_dim: int
    v_head_dim: int
    features: tuple[str, ...] = ()  # of "mask", "window", "cap"
    constexprs: tuple[tuple[str, object], ...] = ()  # block sizes and flags, as the launcher passes them
    num_warps: int = 4
    num_stages: int = 2

    @property
    def label(self) -> str:
        feats = "+".join(self.features) or "plain"
        tiles = ",".join(f"{k}={v}" for k, v in self.constexprs if k.startswith("BLOCK"))
        return (
            f"{self.kernel} {self.arch} {self.dtype} d{self.head_dim}/{self.v_head_dim} {feats} "
            f"[{tiles} w{self.num_warps} s{self.num_stages}]"
        )


@dataclass
class Result:
    variant: Variant
    ok: bool
    shared: int | None = None
    shared_limit: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["variant"] = {
            **asdict(self.variant),
            "constexprs": dict(self.variant.constexprs),
            "label": self.variant.label,
        }
        return d


def _dot_dtype(dtype: str) -> tuple[str, bool]:
    """The dots' operand dtype and IEEE flag on a GPU, as ``_common.dot_config`` picks them."""
    return (dtype, False) if dtype in ("bf16", "fp16") else ("fp32", True)


def _extend_variants(arch: str, dtype: str, d: int, dv: int, worst_only: bool) -> list[Variant]:
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))
    dot, ieee = _dot_dtype(dtype)
    try:
        bm, bn, warps, stages = extend_blocks(arch, max(block_d, block_dv), dtype)
    except UnsupportedError:  # the table refuses this shape on this arch: nothing to compile
        return []
    out = []
    for features in (("mask", "window", "cap"),) if worst_only else ((), ("mask", "window", "cap")):
        consts = {
            "GROUP": 8,
            "CAUSAL": "mask" not in features,
            "USE_WINDOW": "window" in features,
            "USE_CAP": "cap" in features,
            "USE_MASK": "mask" in features,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_D": block_d,
            "BLOCK_DV": block_dv,
            "QK_DTYPE": dot,
            "QK_IEEE": ieee,
            "PV_DTYPE": dot,
            "PV_IEEE": ieee,
        }
        out.append(Variant("extend", arch, dtype, d, dv, features, tuple(consts.items()), warps, stages))
    return out


def _decode_variants(arch: str, dtype: str, d: int, dv: int, worst_only: bool) -> list[Variant]:
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))
    dot, ieee = _dot_dtype(dtype)
    out, tiles_seen = [], set()
    for group in sorted(DECODE_GROUPS, reverse=True):  # the largest group of each tile: the fullest head block
        try:
            tiles = decode_blocks(arch, max(block_d, block_dv), dtype, group)
        except UnsupportedError:
            return []
        if tiles in tiles_seen:
            continue
        tiles_seen.add(tiles)
        block_h, block_n, warps, stages = tiles
        for features in (("cap",),) if worst_only else ((), ("cap",)):
            consts = {
                "GROUP": group,
                "HEAD_BLOCKS": -(-group // block_h),
                "BLOCK_H": block_h,
                "BLOCK_N": block_n,
                "BLOCK_D": block_d,
                "BLOCK_DV": block_dv,
                "USE_CAP": bool(features),
                "QK_DTYPE": dot,
                "QK_IEEE": ieee,
                "PV_DTYPE": dot,
                "PV_IEEE": ieee,
            }
            out.append(Variant("decode", arch, dtype, d, dv, features, tuple(consts.items()), warps, stages))
    consts = {"BLOCK_S": next_power_of_2(MAX_DECODE_SPLITS), "BLOCK_DV": block_dv}
    out.append(Variant("decode_merge", arch, dtype, d, dv, (), tuple(consts.items()), 4, 3))
    for kv_heads in _HELPER_KV_HEADS[-1:] if worst_only else _HELPER_KV_HEADS:
        consts = {"BLOCK_H": write_kv_heads(kv_heads, max(block_d, block_dv)), "BLOCK_D": block_d, "BLOCK_DV": block_dv}
        out.append(Variant("write_kv", arch, dtype, d, dv, (), tuple(consts.items()), 4, 3))
    return out


def variants(
    archs: tuple[str, ...] = ARCHS, dtypes: tuple[str, ...] = DTYPES, worst_only: bool = False
) -> list[Variant]:
    """Every variant to compile: the kernels x archs x dtypes x head dims x features (module docstring).

    Variants that compile to the same binary (head dims with one power-of-two block,
    e.g. 80/96/128) are kept once, under the first head dim; the split merge, whose
    inputs are fp32 whatever the model's dtype, once per architecture and block.
    ``worst_only``: each tile only with every feature on (the most registers and shared
    memory), ``write_kv`` only at the most KV heads, and fp16 (which shares bf16's tiles)
    on sm_90 only: what the test compiles.
    """
    seen, out = set(), []
    for arch in archs:
        for dtype in dtypes:
            if worst_only and dtype == "fp16" and arch != "sm_90" and "bf16" in dtypes:
                continue  # fp16 reads bf16's tiles: one arch shows its codegen, bf16 covers the tiles elsewhere
            for d, dv in HEAD_DIMS:
                for v in _extend_variants(arch, dtype, d, dv, worst_only) + _decode_variants(
                    arch, dtype, d, dv, worst_only
                ):
                    dtype_key = "any" if v.kernel == "decode_merge" else v.dtype
                    key = (v.kernel, v.arch, dtype_key, v.features, v.constexprs, v.num_warps, v.num_stages)
                    if key not in seen:
                        seen.add(key)
                        out.append(v)
        for kernel, consts in (("build_kv_indices", {"HAS_START": True, "BLOCK": 512}), ("positions", {"BLOCK": 512})):
            out.append(Variant(kernel, arch, "int32", 0, 0, (), tuple(consts.items()), 4, 3))
    return out


_INDEX_ARGS = {
    "new_loc_ptr",
    "qo_indptr_ptr",
    "kv_indptr_ptr",
    "kv_indices_ptr",
    "mask_indptr_ptr",
    "loc_ptr",
    "req_pool_indices_ptr",
    "kv_start_ptr",
    "kv_end_ptr",
    "prefix_lens_ptr",
    "seq_lens_ptr",
    "start_loc_ptr",
    "positions_ptr",
    "req_to_token_ptr",
}
_FP32_ARGS = {"part_out_ptr", "part_lse_ptr", "sinks_ptr"}  # decode's scratch is fp32 whatever the dtype
_SCALARS = {"scale": "fp32", "logit_cap": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
# the model features' constexprs (MLA, fp8, sinks), off unless a variant sets them: no rope tile, a plain pool, no sinks
_FEATURE_DEFAULTS = {"BLOCK_DPE": 0, "KV_FP8": 0, "NEW_FROM_POOL": False, "HAS_SINKS": False, "WRITE_V": True}
_POOL_ARGS = {"k_buf_ptr", "v_buf_ptr"}  # an fp8 pool reaches the kernels as bytes


def _kernel(name: str):
    from . import decode, extend, kv_cache

    return {
        "extend": extend._extend_kernel,
        "decode": decode._decode_split_kernel,
        "decode_merge": decode._decode_merge_kernel,
        "write_kv": kv_cache._write_kv_kernel,
        "build_kv_indices": kv_cache._build_kv_indices_kernel,
        "positions": kv_cache._positions_kernel,
    }[name]


def _source(v: Variant):
    import triton.language as tl
    from triton.compiler import ASTSource

    fn = _kernel(v.kernel)
    tl_dtypes = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
    consts = {k: tl_dtypes.get(c, c) if k.endswith("_DTYPE") else c for k, c in v.constexprs}
    consts = {**{k: c for k, c in _FEATURE_DEFAULTS.items() if k in fn.arg_names}, **consts}
    ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16", "int32": "*i32"}[v.dtype]
    signature = {}
    for arg in fn.arg_names:
        if arg in consts:
            signature[arg] = "constexpr"
        elif arg == "mask_ptr" or arg in _POOL_ARGS and consts.get("KV_FP8"):
            signature[arg] = "*u8"
        elif arg in _INDEX_ARGS:
            signature[arg] = "*i32"
        elif arg in _FP32_ARGS:
            signature[arg] = "*fp32"
        elif arg.endswith("_ptr"):
            signature[arg] = ptr
        else:
            signature[arg] = _SCALARS.get(arg, "i32")
    return ASTSource(fn, signature, consts)


_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def compile_variant(v: Variant) -> Result:
    """Compile ``v`` for its target with Triton's compiler and ptxas; never raises."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    limit = SHARED_MEMORY_LIMIT[v.arch]
    result = Result(v, ok=False, shared_limit=limit)
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report is printed, not kept: read it from stdout
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its report
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton_compile(
                _source(v),
                target=GPUTarget("cuda", int(v.arch[3:]), 32),
                options={"num_warps": v.num_warps, "num_stages": v.num_stages},
            )
    except Exception as exc:  # a compiler error is this variant's result, not the run's end
        result.seconds = time.perf_counter() - start
        result.problems.append(f"compile failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}")
        return result
    result.seconds = round(time.perf_counter() - start, 2)
    result.shared = int(compiled.metadata.shared)
    text = log.getvalue()
    if _PTXAS_SPILLS.search(text) is None:  # a Triton without the ptxas-log knob: assemble the PTX once more
        text = _ptxas_report(compiled.asm["ptx"], int(v.arch[3:]))
    spills, regs = _PTXAS_SPILLS.search(text), _PTXAS_REGS.search(text)
    if spills is None or regs is None:
        result.problems.append("no ptxas -v report in the compiler's output")
    else:
        result.spill_stores, result.spill_loads = int(spills[1]), int(spills[2])
        result.registers = int(regs[1])
        if result.spill_stores > SPILL_BUDGET:
            result.problems.append(f"{result.spill_stores} bytes of register spill stores > budget {SPILL_BUDGET}")
    if result.shared > limit:
        result.problems.append(f"shared memory {result.shared} B > {v.arch}'s limit {limit} B")
    result.ok = not result.problems
    return result


def _ptxas_report(ptx: str, capability: int) -> str:
    """``ptxas -v``'s report for ``ptx`` from the ptxas Triton uses for ``capability``."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}", src]
        proc = subprocess.run([*cmd, "-o", os.path.join(tmp, "kernel.o")], capture_output=True, text=True)
    return proc.stdout + proc.stderr


def _init_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "0"


def nvidia_backend_missing() -> str | None:
    """Why this Triton cannot compile for NVIDIA targets here, or None when it can."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception as exc:
        return f"triton does not import: {type(exc).__name__}: {exc}"
    if "nvidia" not in backends:
        return f"this triton has no nvidia backend (has: {sorted(backends)})"
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as exc:
        return f"no ptxas for the nvidia backend: {type(exc).__name__}: {exc}"
    if not path or not os.access(path, os.X_OK):
        return f"ptxas {path!r} is not executable"
    return None


def run(selected: list[Variant], jobs: int = 0, progress=None) -> list[Result]:
    """Compile ``selected`` in ``jobs`` processes (0: one per CPU), longest-running kinds first."""
    jobs = jobs or os.cpu_count() or 1
    order = sorted(selected, key=lambda v: (v.kernel != "extend", v.dtype != "fp32", -v.head_dim))
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: TRITON_INTERPRET=0 before Triton's jit runs
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker) as pool:
        results = []
        for result in pool.map(compile_variant, order):
            results.append(result)
            if progress:
                progress(result)
    index = {v: i for i, v in enumerate(selected)}
    return sorted(results, key=lambda r: index[r.variant])


def markdown(results: list[dict], triton_version: str) -> str:
    """The tile table, one row per result (``Result.to_dict()``), as docs/triton-tiles.md shows it."""
    lines = [
        f"# Triton kernel tiles, compiled for each target (triton {triton_version})",
        "",
        "Generated by `python -m hal.kernels.triton.compile_check --worst-only --markdown docs/triton-tiles.md "
        "--json bench/results/triton-compile-<version>.json` (or `--from-json` of that record); do not edit. "
        "Each variant has every feature on (custom mask, sliding window, logit cap): the most registers. "
        "Each row is one binary that Triton's "
        "compiler and its ptxas built on a CPU machine for the target; shared memory is checked against the "
        f"target's opt-in limit, register spills against a budget of {SPILL_BUDGET} bytes.",
        "",
        "| kernel | arch | dtype | head dim | features | tiles | warps | stages | shared B (limit) | regs | spills B"
        " | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        v = r["variant"]
        tiles = " ".join(f"{k[6:]}={c}" for k, c in v["constexprs"].items() if k.startswith("BLOCK_"))
        ok = "yes" if r["ok"] else "**no**: " + "; ".join(r["problems"])
        lines.append(
            f"| {v['kernel']} | {v['arch']} | {v['dtype']} | {v['head_dim']}/{v['v_head_dim']} "
            f"| {'+'.join(v['features']) or '-'} | {tiles} | {v['num_warps']} | {v['num_stages']} "
            f"| {r['shared']} ({r['shared_limit']}) | {r['registers']} | {r['spill_stores']} | {ok} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hal.kernels.triton.compile_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", action="append", choices=ARCHS, help=f"repeatable (default: all of {ARCHS})")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable (default: all)")
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    parser.add_argument("--jobs", type=int, default=0, help="compiler processes (default: one per CPU)")
    parser.add_argument("--json", metavar="FILE", help="write every result here")
    parser.add_argument("--markdown", metavar="FILE", help="write the tile table here")
    parser.add_argument("--list", action="store_true", help="print the variants and compile nothing")
    parser.add_argument("--from-json", metavar="FILE", help="write --markdown from this record; compile nothing")
    parser.add_argument(
        "--worst-only", action="store_true", help="each tile with every feature on only (the test's set)"
    )
    args = parser.parse_args(argv)
    selected = variants(tuple(args.arch or ARCHS), tuple(args.dtype or DTYPES), args.worst_only)
    if args.kernel:
        selected = [v for v in selected if v.kernel in args.kernel]
    if args.list:
        print("\n".join(v.label for v in selected))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            record = json.load(f)
        with open(args.markdown or "/dev/stdout", "w") as f:
            f.write(markdown(record["results"], record["triton"]))
        return 0 if all(r["ok"] for r in record["results"]) else 1
    missing = nvidia_backend_missing()
    if missing:
        print(f"compile_check: cannot compile for NVIDIA targets here: {missing}", file=sys.stderr)
        return 2
    import triton

    start = time.perf_counter()

    def progress(r: Result) -> None:
        status = "ok" if r.ok else "FAIL " + "; ".join(r.problems)
        numbers = f"shared {r.shared} regs {r.registers} spills {r.spill_stores}"
        print(f"{r.seconds:6.1f}s {numbers}  {r.variant.label}  {status}", flush=True)

    results = run(selected, args.jobs, progress)
    wall = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    print(f"{len(results)} variants, {len(failed)} failed, {wall:.0f} s wall ({args.jobs or os.cpu_count()} processes)")
    if args.json:
        data = {
            "triton": triton.__version__,
            "spill_budget": SPILL_BUDGET,
            "shared_memory_limit": SHARED_MEMORY_LIMIT,
            "wall_seconds": round(wall, 1),
            "results": [r.to_dict() for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown([r.to_dict() for r in results], triton.__version__))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
