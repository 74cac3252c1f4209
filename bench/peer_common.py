"""What the peer harnesses (``sglang_peer.py``, ``vllm_peer.py``) share: the float64 oracle and the timer.

Imports torch only, so it runs in any peer's venv (the harnesses put ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


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


def shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every harness takes from ``hal bench``: threads, timing, dtypes, modes and the shapes."""
    ap.add_argument("--json", action="store_true", help="(the output is always JSON; kept for hal bench)")
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
