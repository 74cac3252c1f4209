"""What ``hal bench`` asks the CPU device for (:meth:`CpuDevice.bench_facts`): the machine's record and ceilings.

The bench core names no device: it records what the device says (``meta``: the CPU's features, the
kernel path that serves and how it was loaded, the results file name), samples the ceilings the device
measures (``ceilings``: this kernel path's float32 FMA, bf16-dot and AMX peaks, beside the bench's own read
bandwidth and torch matmul rates), and runs what the device says is meaningful here (in-process peers,
the reference's timing, the matmul size, no device-to-device copy).
"""

from __future__ import annotations

import re

from hal.kernels import cpu as cpu_kernels

__all__ = ["bench_facts", "cpu_meta"]


def cpu_meta() -> dict:
    """The CPU's features, the compiled kernels' path and first-use record, the name of its results file."""
    ok, why = cpu_kernels.status()
    features = cpu_kernels.cpu_features()
    kind = re.sub(r"[^a-z0-9]+", "-", features["model"].lower()).strip("-") or "unknown"
    meta = {
        "cpu_features": features,
        # bench/results/ keeps one file per CPU kind, named by its model and vector features
        "result_name": f"cpu-{kind}-{'-'.join(f.replace('_', '') for f in features['flags']) or 'scalar'}.json",
        "kernels": {"available": ok, "reason": why, "isa": cpu_kernels.isa(), "runnable": cpu_kernels.runnable_isas()},
    }
    if ok:
        try:
            cpu_kernels.load()  # first-use build cost, reported and kept out of the timings
        except cpu_kernels.KernelBuildError as exc:
            meta["kernels"].update(available=False, reason=str(exc))
            ok = False
    meta["kernels"]["first_use"] = cpu_kernels.build_record()
    first = meta["kernels"]["first_use"] or {}
    meta["summary"] = f"CPU features: {' '.join(features['flags'])}; compiled kernels: " + (
        f"{first.get('build_info')}, first use {first.get('seconds')} s" if ok else f"off ({meta['kernels']['reason']})"
    )
    return meta


def _ceilings() -> dict:
    """This kernel path's arithmetic peaks now (GFLOP/s), or {} where the kernels do not run."""
    try:
        found = cpu_kernels.ceilings()
    except (cpu_kernels.KernelBuildError, RuntimeError):
        return {}
    names = ("fma", "bf16_dot", "amx_bf16")
    return {name: found[f"{name}_GFLOPs"] for name in names if found.get(f"{name}_GFLOPs")}


def bench_facts() -> dict:
    """The CPU's answers to ``hal bench`` (see :func:`hal.commands.bench.device_facts` for the keys)."""
    meta = cpu_meta()
    isa = meta["kernels"]["isa"]
    bf16_dot = "avx512_bf16" in isa or isa == "amx"
    # the ceiling each dtype's kernels can reach on this path: bf16 is dotted as bf16 only where it has them,
    # and bf16 extend tiles run on AMX where the path has it (decode rows stay on the vector units; a mixed
    # batch's flops are its extends')
    ceiling_for_dtype = {"fp32": "fma", "bf16": "bf16_dot" if bf16_dot else "fma"}
    if isa == "amx":
        ceiling_for_dtype.update(extend_bf16="amx_bf16", mixed_bf16="amx_bf16")
    return {
        "meta": meta,
        "ceilings": _ceilings if meta["kernels"]["available"] else None,
        "ceiling_for_dtype": ceiling_for_dtype,
        "in_process_peers": True,
        "time_reference": True,
        "matmul_size": 1024,
        "copy_bw": False,
    }
