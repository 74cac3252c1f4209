"""``hal demo``: a Llama, DeepSeek (MLA) or gpt-oss (sinks) model served with continuous batching through hal.

``serve`` (the default) runs the serving loop of :mod:`hal.demo.engine` over
:mod:`hal.demo.model`, optionally checked against HF transformers
(:mod:`hal.demo.reference`) and tensor parallel (:mod:`hal.demo.tp`);
``--check-steps`` runs :mod:`hal.demo.steps`, the synthetic step-by-step comparison of
every forward mode with ``hal.kernels.reference``.
"""

from __future__ import annotations

import argparse

from hal.demo.model import DTYPES

__all__ = ["add_arguments", "run_demo", "DTYPES"]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}") from exc
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama",
        help="llama (default), deepseek (MLA over a latent KV cache, MoE) or gpt-oss (sinks, alternating windows, MoE)",
    )
    from .kv_quant import KV_DTYPE_NAMES

    p.add_argument(
        "--kv-dtype",
        default="auto",
        help=f"KV cache dtype: {', '.join(KV_DTYPE_NAMES)} (auto: the model dtype; the others are scaled per layer "
        "and the report gives their agreement with the unquantised run; fp8, the old spelling of fp8_e4m3, is "
        "deprecated)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1, npu... (default: the best available)")
    p.add_argument("--backend", help="force an attention backend (default: the device's first that fits)")
    p.add_argument("--requests", type=int, default=32, help="requests in the queue (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the longest output; each request draws its own")
    p.add_argument("--prompt-range", type=_range, default=(8, 64), metavar="MIN:MAX", help="prompt lengths")
    p.add_argument("--prompt-lens", type=_int_list, help="explicit prompt lengths, one request each (N1,N2,...)")
    p.add_argument("--dtype", default="fp32", help=f"the model dtype: {' or '.join(DTYPES)} (default fp32)")
    p.add_argument("--check", action="store_true", help="compare every token with transformers' generate")
    p.add_argument("--check-steps", action="store_true", help="the synthetic step-by-step reference check instead")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torch.distributed)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--context-len", type=int, default=512, help="max tokens of one request (prompt + output)")
    p.add_argument("--kv-pages", type=int, help="pages in the KV pool (default: max-running full contexts)")
    p.add_argument("--max-running", type=int, default=16, help="the largest batch of running requests")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens per step (chunked prefill)")
    p.add_argument(
        "--graph",
        choices=["auto", "on", "off"],
        default="auto",
        help="replay decode steps through hal.graph.GraphRunner: auto = where the device captures real graphs "
        "(CUDA, NPU); on = also the CPU's checked eager graph (it checks the contract, it does not speed up)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads of torch (default: 1 when other work keeps the cores busy, else torch's default)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--intermediate", type=int, help="MLP width (default 2 * hidden)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run_demo(args: argparse.Namespace, argv: list[str]) -> int:
    if args.check_steps:
        from .steps import run_steps

        return run_steps(args.device, as_json=args.json, page_size=args.page_size)
    from .serve import serve

    return serve(args, argv)
