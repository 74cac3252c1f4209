"""``hal demo``: serve a Llama, DeepSeek or gpt-oss model with continuous batching through hal."""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import time
from dataclasses import asdict

import torch

from hal.config import AttentionConfig
from hal.errors import ConfigError, expect
from hal.kv_dtypes import kv_dtype as kv_dtype_row

from . import tp as tp_mod
from .core import make_graph, make_pools, select_backend
from .engine import Engine, ModelGraphRunner, Request
from .families import Family, family
from .kv_quant import agreement, calibrated_scales, kv_cache_dtype
from .model import DTYPES, ModelShape

__all__ = ["serve", "make_requests", "build"]


def make_requests(args) -> list[Request]:
    """The demo's request queue: seeded prompts of varied lengths and varied output lengths."""
    rng = random.Random(args.seed)
    if args.prompt_lens:
        lens = args.prompt_lens
    else:
        lo, hi = args.prompt_range
        lens = [rng.randint(lo, hi) for _ in range(args.requests)]
    m = args.max_new_tokens
    return [
        Request(
            rid=i,
            prompt=[rng.randrange(args.vocab) for _ in range(n)],
            max_new_tokens=rng.randint(max(1, m // 4), m),
        )
        for i, n in enumerate(lens)
    ]


def _shape(args) -> ModelShape:
    return ModelShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate or 2 * args.hidden,
        max_position=max(args.context_len, 2048),
    )


def build(
    args,
    shape: ModelShape,
    rank: tp_mod.RankInfo,
    record_logits: bool,
    kv_dtype: str | None = None,
    kv_scales: list[tuple[float, float]] | None = None,
):
    """Select the backend, build the model on this rank's slice, the pools, the graph runner and the engine
    (``kv_dtype``: the KV cache's dtype name, None: the model dtype; ``kv_scales``: each layer's fp8 scales)."""
    fam = family(args.model)
    dtype = DTYPES[args.dtype]
    config = _attention_config(args, shape, kv_dtype, kv_scales)
    selection = select_backend(config, args.device, args.backend, rank.local_rank if rank.world > 1 else None)
    validate = "full" if args.check else None
    backend = selection.create(validate=validate)
    device = selection.capability.torch_device
    tp = {"tp_rank": rank.rank, "tp_size": rank.world} if rank.world > 1 else {}
    model = fam.model(shape, fam.random_weights(shape, args.seed), backend, dtype, device, kv_scales=kv_scales, **tp)
    pages_per_req = -(-args.context_len // args.page_size)
    req_pool, kv_pool = make_pools(
        selection, config, num_pages=args.kv_pages or args.max_running * pages_per_req, max_requests=args.max_running
    )
    runner = None
    graph = selection.capability.graph
    if graph and (args.graph == "on" or (args.graph == "auto" and graph != "eager_guard")):
        sizes = [1 << i for i in range(args.max_running.bit_length()) if 1 << i < args.max_running]
        runner = ModelGraphRunner(
            model, req_pool, kv_pool, lambda: make_graph(selection), capture_bs=[*sizes, args.max_running]
        )
        with torch.inference_mode():
            runner.capture()
    engine = Engine(
        model,
        req_pool,
        kv_pool,
        max_running=args.max_running,
        chunk_tokens=args.chunk,
        graph_runner=runner,
        validate=validate,
        record_logits=record_logits,
    )
    return selection, engine


class Progress:
    """A status line on stderr: redrawn in place on a terminal, else a line every few seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()
        self.start, self.last = time.perf_counter(), time.perf_counter()

    def __call__(self, engine: Engine) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < (0.1 if self.tty else 5.0):
            return
        self.last = now
        generated = sum(len(r.output) for r in engine.finished + engine.running)
        line = (
            f"step {len(engine.stats):5d}  running {len(engine.running):3d}  waiting {len(engine.waiting):3d}  "
            f"done {len(engine.finished):3d}/{self.total}  {generated / (now - self.start):8.1f} tok/s"
        )
        print(
            f"\r{line}" if self.tty else f"hal demo: {line}", end="" if self.tty else "\n", file=sys.stderr, flush=True
        )

    def close(self) -> None:
        if self.enabled and self.tty:
            print("\r" + " " * 78 + "\r", end="", file=sys.stderr, flush=True)


def keep_freed_memory() -> None:
    """Stop glibc handing freed activation buffers back to the OS (and faulting them in again on the next
    step): fresh pages run at a few GB/s here and halved the CPU's step time. No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve large blocks from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep the heap's free top
    except (OSError, AttributeError):
        pass


def choose_threads(requested: int | None, world: int = 1) -> tuple[int, str]:
    """torch's intra-op threads for a CPU run, and why. A parallel op waits for its slowest thread: when other
    processes keep the cores busy (load average >= cores), one thread per process measured 10-20x faster
    here than two, for hal and HF alike; on idle cores torch's default stands."""
    if requested is not None:
        expect(requested >= 1, ConfigError, "--threads", requested, "an int >= 1")
        return requested, "--threads"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if world > 1:
        return max(1, cores // world), f"{cores} cores shared by {world} ranks"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores > 1 and load >= cores - 0.5:
        return 1, f"load average {load:.1f} on {cores} cores: other work keeps them busy"
    return torch.get_num_threads(), f"torch's default ({cores} cores, load average {load:.1f})"


def serve(args, argv: list[str]) -> int:
    fam = family(args.model)
    kv_dtype = kv_cache_dtype(args.kv_dtype)
    shape = _shape(args)
    shape.check_tp(args.tp)
    expect(fam.tp or args.tp == 1, ConfigError, "--tp", args.tp, "1: tensor parallelism is implemented for llama only")
    expect(
        not (args.check and kv_dtype),
        ConfigError,
        "--check",
        f"with --kv-dtype {args.kv_dtype}",
        "an unquantised cache (--kv-dtype auto): an fp8 run reports its agreement with the unquantised run instead",
    )
    expect(args.page_size >= 1, ConfigError, "--page-size", args.page_size, "a positive power of two")
    for name in ("requests", "max_new_tokens", "max_running", "chunk", "context_len"):
        value = getattr(args, name)
        expect(value >= 1, ConfigError, "--" + name.replace("_", "-"), value, "an int >= 1")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype = {args.dtype!r}: expected one of {sorted(DTYPES)} (never fp16 on a CPU)")
    keep_freed_memory()
    rank = tp_mod.rank_info(args.tp)
    if rank is None:
        if args.tp > 1:
            # Selection errors (unknown device or backend) are reported once, here, before any rank starts.
            select_backend(_attention_config(args, shape, kv_dtype), args.device, args.backend)
            return tp_mod.launch(args.tp, argv)
        rank = tp_mod.RankInfo()
    else:
        config = _attention_config(args, shape, kv_dtype)
        tp_mod.init_group(rank, select_backend(config, args.device, args.backend, rank.local_rank).capability)
    try:
        return _serve_rank(args, shape, rank, fam, kv_dtype)
    finally:
        if rank.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _attention_config(args, shape: ModelShape, kv_dtype: str | None = None, kv_scales=None) -> AttentionConfig:
    """What one rank's attention asks of a backend: its layers (heads, MLA, windows, fp8 scales), sinks, the
    KV cache dtype, the pool's page size, and the context and batch the engine plans for."""
    fam = family(args.model)
    return AttentionConfig.from_layers(
        fam.model.layer_descriptors(shape, args.tp, kv_scales),
        dtype=DTYPES[args.dtype],
        page_size=args.page_size,
        graph=args.graph == "on",
        max_context_len=args.context_len,
        max_batch_size=args.max_running,
        attention_sinks=fam.sinks,
        kv_cache_dtype=kv_dtype,
    )


def _run(args, shape: ModelShape, rank: tp_mod.RankInfo, record_logits: bool, kv_dtype=None, kv_scales=None):
    """Build an engine and serve the demo's requests through it: ``(selection, engine, seconds, threads)``.
    With ``kv_scales == {}`` the model records each layer's max ``|k|`` / ``|v|`` over the first step into it."""
    selection, engine = build(args, shape, rank, record_logits, kv_dtype, kv_scales or None)
    threads = choose_threads(args.threads, rank.world)
    if selection.capability.on_host:
        torch.set_num_threads(threads[0])
    else:
        threads = torch.get_num_threads(), "host threads (the model runs on the device)"
    for req in make_requests(args):
        if not engine.submit(req) and rank.is_main and not kv_dtype:
            print(f"hal demo: request {req.rid} rejected: {req.error}", file=sys.stderr)
    progress = Progress(len(engine.waiting), rank.is_main)
    start = time.perf_counter()
    with torch.inference_mode():
        if kv_scales == {}:
            engine.model.kv_amax = kv_scales
            engine.step()
            engine.model.kv_amax = None
        engine.run(progress)
    seconds = time.perf_counter() - start
    progress.close()
    return selection, engine, seconds, threads


def _calibrate(args, shape: ModelShape, rank: tp_mod.RankInfo, kv_dtype: str):
    """The unquantised run (its logits recorded) and the fp8 scales calibrated on its first step."""
    amax: dict[int, list[float]] = {}
    _, engine, seconds, _ = _run(args, shape, rank, True, None, amax)
    if rank.world > 1:  # every rank's slice of the heads: one scale per layer over all of them
        table = torch.tensor([amax[i] for i in range(shape.layers)], dtype=torch.float64)
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
        amax = {i: row for i, row in enumerate(table.tolist())}
    first = engine.stats[0]
    return engine, calibrated_scales(amax, shape.layers, kv_dtype), first.prefill_tokens, seconds


def _serve_rank(args, shape: ModelShape, rank: tp_mod.RankInfo, fam: Family, kv_dtype: str | None) -> int:
    scales = None
    if kv_dtype:
        baseline, scales, calibration_tokens, baseline_seconds = _calibrate(args, shape, rank, kv_dtype)
    record = bool(args.check or kv_dtype) and rank.is_main
    selection, engine, seconds, (threads, threads_why) = _run(args, shape, rank, record, kv_dtype, scales)
    if not rank.is_main:
        return 0
    served = sorted(engine.finished, key=lambda r: r.rid)
    generated = sum(len(r.output) for r in served)
    report = {
        "model_family": fam.name,
        "model_description": fam.describe(shape),
        "device": selection.device_name,
        "torch_device": str(selection.capability.torch_device),
        "device_name": selection.capability.name,
        "emulated": selection.capability.emulated,
        "backend": selection.backend,
        "selection_trace": selection.trace,
        "dtype": args.dtype,
        "kv_cache_dtype": kv_dtype or args.dtype,
        "tp": rank.world,
        "threads": threads,
        "threads_why": threads_why,
        "page_size": args.page_size,
        "model": asdict(shape),
        "requests": len(served),
        "rejected": [{"request": r.rid, "error": r.error} for r in engine.rejected],
        "prompt_tokens": sum(len(r.prompt) for r in served),
        "generated_tokens": generated,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1) if seconds else None,
        **engine.summary(),
        "outputs": {str(r.rid): r.output for r in served},
        "matches_reference": None,
    }
    code = 2 if engine.rejected else 0
    if kv_dtype:
        report["kv_scales"] = {
            "method": f"calibrated: max |k|, |v| per layer over the unquantised run's first step "
            f"({calibration_tokens} prompt tokens) / {kv_dtype_row(kv_dtype).max:g}",
            "k_scale": [k for k, _ in scales],
            "v_scale": [v for _, v in scales],
        }
        base = sorted(baseline.finished, key=lambda r: r.rid)
        base_generated = sum(len(r.output) for r in base)
        report["kv_agreement"] = {
            "baseline": f"the same requests with a {args.dtype} KV cache",
            "baseline_tokens_per_s": round(base_generated / baseline_seconds, 1) if baseline_seconds else None,
            **agreement(base, served),
        }
    if args.check and served:
        from .reference import check_against_hf

        weights = fam.random_weights(shape, args.seed)
        report.update(
            check_against_hf(fam, shape, weights, served, DTYPES[args.dtype], selection.capability.torch_device)
        )
        ref = report["reference_tokens_per_s"]
        report["speedup"] = round(report["tokens_per_s"] / ref, 2) if ref else None
        if not report["matches_reference"]:
            code = 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return code


def print_table(r: dict) -> None:
    emulated = " (emulated)" if r["emulated"] else ""
    rows = [
        (
            "model",
            f"{r['model_description']}, {r['dtype']} (KV cache {r['kv_cache_dtype']}), seeded random weights",
        ),
        (
            "device",
            f"{r['device']}{emulated} ({r['torch_device']}, {r['device_name']}), tp {r['tp']}, "
            f"{r['threads']} thread(s): {r['threads_why']}",
        ),
        ("backend", f"{r['backend']}, page size {r['page_size']}"),
        *(("  why", step) for step in r["selection_trace"]),
        ("requests", f"{r['requests']} served, {len(r['rejected'])} rejected"),
        ("tokens", f"{r['prompt_tokens']} prompt, {r['generated_tokens']} generated in {r['seconds']} s"),
        (
            "speed",
            f"{r['tokens_per_s']} generated tokens/s end to end; prefill {r['prefill_tokens_per_s']} tokens/s, "
            f"decode {r['decode_tokens_per_s']} tokens/s (steps of that kind only)",
        ),
        ("batches", f"sizes {r['batch_sizes']} (mean {r['mean_batch_size']})"),
        (
            "steps",
            ", ".join(f"{k} {v}" for k, v in sorted(r["steps_by_mode"].items()))
            + f" ({r['graph_steps']} decode steps replayed through a graph)",
        ),
    ]
    for rej in r["rejected"]:
        rows.append(("rejected", f"request {rej['request']}: {rej['error']}"))
    if "kv_agreement" in r:
        a, s = r["kv_agreement"], r["kv_scales"]
        rows += [
            ("kv scales", s["method"]),
            ("  k_scale", ", ".join(f"{x:.3g}" for x in s["k_scale"])),
            ("  v_scale", ", ".join(f"{x:.3g}" for x in s["v_scale"])),
            (
                "agreement",
                f"{r['kv_cache_dtype']} vs {a['baseline']}: {a['matched_tokens']}/{a['generated_tokens']} generated "
                f"tokens match ({a['token_match_rate']:.1%}), {a['identical_requests']}/{a['compared_requests']} "
                "requests identical",
            ),
            (
                "  logits",
                f"max |fp8 - baseline| {a['max_logit_err']:.3g}, mean {a['mean_logit_err']:.3g} over the "
                f"{a['logit_compared_steps']} steps with the same context in both runs",
            ),
        ]
    if r["matches_reference"] is not None:
        verdict = "PASS" if r["matches_reference"] else "FAIL"
        rows += [
            (
                "check",
                f"{verdict}: {r['identical_requests']}/{r['compared_requests']} requests token-identical to "
                f"transformers generate, {len(r['near_ties'])} near-ties, {len(r['mismatches'])} mismatches",
            ),
            ("logits", f"max |hal - HF| {r['max_logit_diff']:.2e} (tolerance {r['logit_tolerance']:.0e})"),
            (
                "reference",
                f"HF generate {r['reference_tokens_per_s']} tokens/s: hal is {r['speedup']}x faster",
            ),
        ]
        for tie in r["near_ties"]:
            rows.append(("near-tie", json.dumps(tie)))
        for bad in r["mismatches"]:
            rows.append(("MISMATCH", json.dumps(bad)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
