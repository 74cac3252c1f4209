"""What the peer harnesses (``sglang_peer.py``, ``vllm_peer.py``) share: the float64 oracle, the timer, the
shape options and the two ways a harness runs (:func:`run`): on its own, timing every workload and printing one
JSON report, or as ``hal bench``'s server (``--serve``), timing one call at a time when asked so that hal's calls
and the peer's alternate.

A harness supplies ``prepare(mode, dtype_name)`` -> ``{variant: (step, facts)}``: its timed calls on that
workload (``step()`` writes the step's K/V and attends, as the engine's layer does) and what it checked
(:func:`first_call`). Imports torch only, so it runs in any peer's venv (the harnesses put ``bench/`` on
``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def expected(q, k_all, v_all, prefix: int, new: int, heads) -> torch.Tensor:
    """float64 causal GQA attention of the step's queries over every request's keys.

    ``q``: ``[B * new, Hq * D]``; ``k_all`` / ``v_all``: ``[B, prefix + new, Hkv, D]``; returns ``[B * new, Hq * D]``.
    """
    q_heads, kv_heads, dim = heads
    batch, total = k_all.shape[:2]
    group = q_heads // kv_heads  # query heads per KV head, served by it without copying K/V per query head
    qd = q.double().view(batch, new, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, n, D]
    qd = qd.reshape(batch, kv_heads, group * new, dim)
    k = k_all.double().transpose(1, 2)  # [B, Hkv, L, D]
    v = v_all.double().transpose(1, 2)
    scores = qd @ k.transpose(-1, -2) * dim**-0.5  # [B, Hkv, G * n, L]
    visible = (torch.arange(total)[None, :] <= torch.arange(prefix, total)[:, None]).repeat(group, 1)
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v  # [B, Hkv, G * n, D]
    out = out.view(batch, kv_heads, group, new, dim).permute(0, 3, 1, 2, 4)  # [B, n, Hkv, G, D]
    return out.reshape(batch * new, q_heads * dim)


def time_ms(fn, warmup: int, repeats: int) -> dict:
    """Wall-clock milliseconds of ``fn()``: median, min, max over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeats": repeats}


def check(out: torch.Tensor, q, k_all, v_all, prefix: int, new: int, heads) -> dict:
    """``{"max_abs_err", "correct"}`` of a peer's output against :func:`expected` (the conformance tolerance)."""
    err = (out.double() - expected(q, k_all, v_all, prefix, new, heads)).abs().max().item()
    return {"max_abs_err": err, "correct": err <= (1e-4 if out.dtype == torch.float32 else 3e-2)}


def first_call(step, q, k_all, v_all, prefix: int, new: int, heads) -> dict:
    """``step()`` run once: its milliseconds (``first_ms``) and :func:`check` of its output."""
    start = time.perf_counter()
    out = step()
    first_ms = 1e3 * (time.perf_counter() - start)
    return {"first_ms": first_ms, **check(out, q, k_all, v_all, prefix, new, heads)}


def shapes(args, mode: str, shape: dict | None = None) -> tuple[int, int, int]:
    """(requests, prefix, new tokens) of ``mode``: ``shape`` (``{"batch", "prefix", "new"}``) where given, else
    from the shape options."""
    if shape is not None:
        return int(shape["batch"]), int(shape["prefix"]), int(shape["new"])
    return {
        "decode": (args.decode_batch, args.decode_ctx - 1, 1),
        "extend": (args.extend_batch, args.extend_prefix, args.extend_new),
    }[mode]


def run(args, meta: dict, prepare: Callable[[str, str], dict], tag: str) -> int:
    """The harness's main: :func:`serve` with ``--serve``, else every ``--modes`` x ``--dtypes`` workload timed
    and one JSON object printed, ``{"meta", mode: {dtype: {variant: facts + timing}}}``; exit 1 if any
    variant's output was wrong."""
    if args.serve:
        return serve(meta, prepare)
    report, ok = {"meta": meta}, True
    for mode in filter(None, args.modes.split(",")):
        report[mode] = {}
        for name in filter(None, args.dtypes.split(",")):
            print(f"[{tag} peer] {mode} {name}", file=sys.stderr, flush=True)
            variants = prepare(mode, name)
            report[mode][name] = {
                v: {**facts, **time_ms(step, args.warmup, args.repeats)} for v, (step, facts) in variants.items()
            }
            ok &= all(facts["correct"] for _, facts in variants.values())
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


def serve(meta: dict, prepare: Callable[[str, str], dict]) -> int:
    """Serve ``hal bench``: one JSON request per line on stdin, one JSON answer per line on stdout.

    The first answer is ``{"meta": meta}``. Requests:

    * ``{"prepare": [mode, dtype]}`` or ``{"prepare": [mode, dtype, {"batch", "prefix", "new"}]}`` ->
      ``{"variants": {name: facts}}``: that workload built at the harness's shape for the mode (:func:`shapes`) or
      the one given (the last one dropped: one workload's pools at a time) and each variant run once and checked
      (:func:`first_call`);
    * ``{"call": name}`` -> ``{"ms": t}``: one call of that variant of the prepared workload, timed here;
    * a request that fails -> ``{"error": message}``. End of input ends the process.

    Anything the engine prints (to Python's or the C library's stdout) goes to stderr: stdout carries answers only.
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    print(json.dumps({"meta": meta}), file=answers)
    variants: dict = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if "prepare" in request:
                variants = {}  # the last workload's pools freed before the next one is built
                variants = prepare(*request["prepare"])
                answer = {"variants": {name: facts for name, (_, facts) in variants.items()}}
            elif "call" in request:
                step = variants[request["call"]][0]
                start = time.perf_counter()
                step()
                answer = {"ms": 1e3 * (time.perf_counter() - start)}
            else:
                answer = {"error": f"unknown request {sorted(request)}: expected prepare or call"}
        except Exception as exc:  # answered, so hal bench reports it and goes on
            answer = {"error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"}
        print(json.dumps(answer), file=answers)
    return 0


def shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every harness takes from ``hal bench``: threads, timing, dtypes, modes and the shapes."""
    ap.add_argument("--json", action="store_true", help="(the output is always JSON; kept for hal bench)")
    ap.add_argument("--serve", action="store_true", help="serve hal bench call by call (see peer_common.serve)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default="decode,extend")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=2048)
    ap.add_argument("--extend-batch", type=int, default=4)
    ap.add_argument("--extend-prefix", type=int, default=512)
    ap.add_argument("--extend-new", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
