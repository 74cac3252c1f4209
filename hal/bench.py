"""``hal bench``: decode and extend speed, as ratios to this machine's own limits, in one run.

Each workload is timed per backend (``init_forward_metadata`` + ``forward`` of one
layer, KV write included, as a serving step runs it) and reported as medians and as:

* ``fraction_of_read_bw``: bytes of K+V attended per second over this machine's read
  bandwidth (``x.sum()`` over 1 GiB on the CPU; on a GPU, ``copy_bw`` too: a 1 GiB
  device-to-device copy, bytes read + written);
* ``fraction_of_matmul``: useful attention FLOPs per second over a square matmul's rate
  in the same dtype;
* ``speedup_vs_reference``: against ``hal.kernels.reference`` (decode only; the oracle
  loops over requests), and against SGLang's ``TorchNativeAttnBackend`` when
  ``--peer-python`` names an interpreter with the peer installed (run in the same bench).

Emulated devices and interpreted Triton are never timed: their numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, to_device
from hal.kernels.reference import batch_attention, tolerance
from hal.registry import device_backends, get_registry
from hal.selection import select

PEER_SCRIPT = Path(__file__).resolve().parents[1] / ".." / "shared" / "peer" / "sglang_torch_native_bench.py"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeats": repeats}


def _bandwidth(device: torch.device, n: int) -> dict:
    x = torch.ones(n, dtype=torch.float32, device=device)
    limits = {"read_GBps": 4 * n / _time(lambda: x.sum(), device, 5, 1)["median_ms"] / 1e6}
    if device.type != "cpu":
        y = torch.empty_like(x)
        limits["copy_GBps"] = 2 * 4 * n / _time(lambda: y.copy_(x), device, 5, 1)["median_ms"] / 1e6
    return limits


def machine_limits(device: torch.device, quick: bool) -> dict:
    """Read (and on GPUs copy) bandwidth and square-matmul rates measured now, on ``device``."""
    limits = _bandwidth(device, (1 << 26) if quick else (1 << 28))  # fp32 elements: 256 MiB or 1 GiB
    size = 1024 if quick or device.type == "cpu" else 8192
    limits["matmul_TFLOPs"] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(size, size, device=device).to(dtype)
        ms = _time(lambda a=a: a @ a, device, 5, 1)["median_ms"]
        limits["matmul_TFLOPs"][name] = 2 * size**3 / ms / 1e9
    return limits


def workloads(quick: bool) -> list[Case]:
    heads = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
    if quick:
        decode, extend = tuple((511, 1) for _ in range(8)), tuple((128, 128) for _ in range(2))
    else:  # the SGLang peer's shapes
        decode, extend = tuple((2047, 1) for _ in range(32)), tuple((512, 512) for _ in range(4))
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        cases.append(Case(f"decode_{tag}", ForwardMode.DECODE, decode, dtype=dtype, **heads))
        cases.append(Case(f"extend_{tag}", ForwardMode.EXTEND, extend, dtype=dtype, **heads))
    return cases


def _work(case: Case) -> tuple[int, int]:
    """(bytes of K+V attended, useful FLOPs) of one forward of ``case``."""
    elem = torch.finfo(case.dtype).bits // 8
    kv_tokens = sum(p + n for p, n in case.requests)
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in case.requests)  # causal (query, key) pairs
    return kv_tokens * case.tp_k_head_num * case.head_dim * 2 * elem, 4 * case.tp_q_head_num * case.head_dim * pairs


def _measure(backend, built, device, repeats: int, warmup: int) -> dict:
    fb = built.batch

    def step():
        backend.init_forward_metadata(fb)
        return backend.forward(built.q, built.k, built.v, built.layer, fb)

    out = step()
    timing = _time(step, device, repeats, warmup)
    err = (out.float() - built.expected.float()).abs().max().item()
    correct = torch.allclose(out.float(), built.expected.float(), **tolerance(built.case.dtype))
    return {**timing, "max_abs_err": err, "correct": correct}


def _peer(python: str, quick: bool, threads: int) -> dict:
    if not PEER_SCRIPT.is_file():
        return {"error": f"the peer script is not at {PEER_SCRIPT} (a checkout beside ../shared/peer is needed)"}
    args = [python, str(PEER_SCRIPT), "--json", "--skip-dense", "--threads", str(threads)]
    if quick:
        args += [
            "--decode-batch",
            "8",
            "--decode-ctx",
            "512",
            "--extend-batch",
            "2",
            "--extend-prefix",
            "128",
            "--extend-new",
            "128",
        ]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout)


def run_bench(
    device: str | None,
    backends: list[str],
    quick: bool = False,
    as_json: bool = False,
    peer_python: str | None = None,
    repeats: int = 7,
) -> int:
    selection = select(device=device)
    dev_name, cap = selection.device, selection.capability
    dev = get_registry().get(dev_name)
    torch_device = cap.torch_device
    if cap.emulated:
        print(f"hal bench: {dev_name} is emulated here; an emulation never reports performance", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    report = {
        "meta": {
            "device": dev_name,
            "name": cap.name,
            "arch": cap.arch,
            "torch": torch.__version__,
            "threads": threads,
            "quick": quick,
            "repeats": repeats,
            "loadavg": os.getloadavg(),
        },
        "machine": machine_limits(torch_device, quick),
        "workloads": [],
    }
    limits = report["machine"]
    classes = [c for c in device_backends(dev)[0] if not backends or c.name in backends]
    peer = _peer(peer_python, quick, threads) if peer_python else None
    for case in workloads(quick):
        built = build(case)
        if torch_device.type != "cpu":
            built = to_device(built, torch_device)
        kv_bytes, flops = _work(case)
        row = {
            "name": case.name,
            "dtype": case.config().dtype_name,
            "requests": len(case.requests),
            "kv_bytes": kv_bytes,
            "flops": flops,
            "results": {},
            "skipped": {},
        }
        for cls in classes:
            reasons = cls.validate(case.config(), cap) + (
                ["Triton runs interpreted here"] if cap.triton_interpreted and cls.name == "triton" else []
            )
            if reasons:
                row["skipped"][cls.name] = reasons
                continue
            result = _measure(cls(cap), built, torch_device, repeats, 2)
            seconds = result["median_ms"] / 1e3
            result["kv_GBps"] = kv_bytes / seconds / 1e9
            result["fraction_of_read_bw"] = result["kv_GBps"] / limits["read_GBps"]
            if "copy_GBps" in limits:
                result["fraction_of_copy_bw"] = result["kv_GBps"] / limits["copy_GBps"]
            result["GFLOPs"] = flops / seconds / 1e9
            matmul = limits["matmul_TFLOPs"].get("bf16" if case.dtype == torch.bfloat16 else "fp32")
            result["fraction_of_matmul"] = result["GFLOPs"] / (matmul * 1e3)
            row["results"][cls.name] = result
        if case.mode.is_decode() and torch_device.type == "cpu":
            buffers = built.batch.token_to_kv_pool.get_kv_buffer(0)
            ref = _time(
                lambda built=built, buffers=buffers: batch_attention(built.q, *buffers, built.layer, built.batch),
                torch_device,
                3,
                1,
            )
            row["reference"] = ref
            for result in row["results"].values():
                result["speedup_vs_reference"] = ref["median_ms"] / result["median_ms"]
        if peer and "error" not in peer:
            mode, dtype = case.name.split("_")
            peer_row = peer.get(mode, {}).get(dtype, {}).get("torch_native_backend")
            if peer_row:
                row["sglang_torch_native"] = peer_row
                for result in row["results"].values():
                    result["speedup_vs_sglang"] = peer_row["median_ms"] / result["median_ms"]
        report["workloads"].append(row)
    if peer and "error" in peer:
        report["peer_error"] = peer["error"]
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"hal bench on {dev_name} ({cap.name}), {threads} threads; read {limits['read_GBps']:.1f} GB/s, "
            f"matmul fp32 {limits['matmul_TFLOPs']['fp32']:.2f} / bf16 {limits['matmul_TFLOPs']['bf16']:.2f} TFLOP/s"
        )
        for row in report["workloads"]:
            for name, r in row["results"].items():
                extra = f"  x{r['speedup_vs_reference']:.1f} vs reference" if "speedup_vs_reference" in r else ""
                extra += f"  x{r['speedup_vs_sglang']:.2f} vs sglang" if "speedup_vs_sglang" in r else ""
                print(
                    f"{row['name']:<12}{name:<12}{r['median_ms']:>9.2f} ms  {r['kv_GBps']:>7.2f} GB/s "
                    f"({100 * r['fraction_of_read_bw']:.0f}% of read bw)  {r['GFLOPs']:>8.1f} GFLOP/s "
                    f"({100 * r['fraction_of_matmul']:.0f}% of matmul){extra}" + ("" if r["correct"] else "  WRONG")
                )
            for name, reasons in row["skipped"].items():
                print(f"{row['name']:<12}{name:<12}skipped: {'; '.join(reasons)}")
    return 0 if all(r["correct"] for w in report["workloads"] for r in w["results"].values()) else 1
