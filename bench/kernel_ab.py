#!/usr/bin/env python
"""Two versions of the compiled CPU kernels' source timed against each other in one process.

    git show HEAD:kernels/cpu/attention.cpp > /tmp/before.cpp
    python bench/kernel_ab.py /tmp/before.cpp kernels/cpu/attention.cpp --workload decode --dtype bf16 --page-size 16
    python bench/kernel_ab.py kernels/cpu/attention.cpp kernels/cpu/attention.cpp --isa avx512_bf16 --after-isa avx512

A kernel change worth a few percent is lost in the drift of a shared host between two runs (10-30% on the
machines hal is measured on, minute to minute). Here both sources are built side by side (each under an ISA tag
of its own, so their ops coexist) and called in turns on the same inputs, the order swapped every round, so both
see the same host; the medians and their ratio are what to read. The outputs of the two are compared too: a
change meant to be a pure speed-up shows 0 (or rounding) there. ``--after-isa`` builds the second source for
another kernel path, so two paths of one source can be compared on this CPU. ``--flush-mb N`` reads N MB before
each call, so the call's K/V come from memory (without it a call follows one over the same rows).
``--hot-slots N`` lays every request's keys over the pool's first N slots (pages kept whole), so they stay in
cache: the kernel's arithmetic alone, to set beside its time from memory. ``--kv-layout head_major`` reads the same
keys from head-major pages (vLLM's CPU layout) through a block table, ``amx_packed`` from AMX-packed pages (vLLM's
AMX layout, pages of a multiple of 32: the AMX paths read them by tiles), ``--after-kv-layout`` for ``after`` alone:
``python bench/kernel_ab.py SRC SRC --after-kv-layout head_major --page-size 16`` times one source on both pools;
``python bench/kernel_ab.py SRC SRC --kv-layout head_major --after-kv-layout amx_packed --page-size 128`` the
packed pages against head-major ones.

Shapes are ``hal bench``'s defaults: decode 32 requests x 2048 keys, extend 4 x (512 cached + 512 new), 32
query heads over 8 KV heads of 128 dims; ``--page-size 1`` scatters each request's slots over the pool, a larger
page keeps slots in page order with the pages scattered. The kernel entry is the one hal's CPU forward calls
(``paged_attention``, float32 queries, bf16-exact for a bf16 pool, output reused). Prints one JSON object.
Both builds are cached under ``$TMPDIR/hal-kernel-ab`` by their source and flags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hal.kernels import cpu as cpu_kernels
from hal.kv_cache import pool_buffer
from hal.kv_layouts import KV_LAYOUTS

HEADS = (32, 8, 128)  # query heads, KV heads, head dim: hal bench's
SHAPES = {"decode": (32, 2047, 1), "extend": (4, 512, 512)}  # requests, cached keys, new tokens
QUICK_SHAPES = {"decode": (8, 511, 1), "extend": (2, 128, 128)}
LAYOUTS = ("token_major", "head_major", "amx_packed")  # the pools a side reads (hal.kernels.cpu.KV_LAYOUTS)


def build(source: Path, isa: str):
    """``source`` compiled for path ``isa`` as a module of its own (ops ``hal::paged_attention_ab<digest>``)."""
    from torch.utils.cpp_extension import load

    flags = [f for f in cpu_kernels.build_key(isa)["flags"] if not f.startswith("-DHAL_ISA=")]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    name = f"ab{digest}"
    where = Path(tempfile.gettempdir()) / "hal-kernel-ab" / name
    where.mkdir(parents=True, exist_ok=True)
    return load(
        name=f"hal_kernel_ab_{name}",
        sources=[str(source)],
        extra_cflags=[*flags, f"-DHAL_ISA={name}"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
        verbose=False,
    )


def slot_table(requests: int, context: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[requests, context]``: each request's slots, distinct over the pool. Page 1: a random permutation
    of the slots; page P: of the pages, slots in order inside each (P consecutive slots)."""
    pages_per = -(-context // page_size)
    pages = torch.randperm(requests * pages_per, generator=gen).view(requests, pages_per, 1)
    slots = pages * page_size + torch.arange(page_size).view(1, 1, page_size)
    return slots.view(requests, -1)[:, :context].to(torch.int32).contiguous()


def head_major(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """The keys (or values) of token-major ``pool`` ``[slots, kv_heads, dim]`` as head-major pages ``[pages,
    kv_heads, page_size, dim]`` (vLLM's CPU layout: each page's rows of one head together), in a pool buffer."""
    slots, kv_heads, dim = pool.shape
    pages = pool_buffer((slots // page_size, kv_heads, page_size, dim), pool.dtype, torch.device("cpu"))
    pages.copy_(pool.view(slots // page_size, page_size, kv_heads, dim).transpose(1, 2))
    return pages


def amx_packed(pool: torch.Tensor, page_size: int, value: bool) -> torch.Tensor:
    """The keys (``value`` False) or values of token-major ``pool`` as AMX-packed pages ``[pages, kv_heads,
    page_size, dim]`` in a pool buffer, written by the layout's reference writer a few pages at a time."""
    slots, kv_heads, dim = pool.shape
    pages = pool_buffer((slots // page_size, kv_heads, page_size, dim), pool.dtype, torch.device("cpu"))
    write = KV_LAYOUTS["amx_packed"].writer(value)
    step = max(1, (1 << 20) // (page_size * kv_heads * dim))  # pages per write: index tensors of ~8 MB
    for p0 in range(0, pages.shape[0], step):
        part = pages[p0 : p0 + step]
        n = part.shape[0] * page_size
        write(part, torch.arange(n), pool[p0 * page_size : p0 * page_size + n])
    return pages


def as_layout(args: tuple, layout: str, page_size: int) -> tuple:
    """:func:`inputs`' arguments for a pool of ``layout``: as they are (token-major, read through req_to_token), or
    head-major or AMX-packed pages read through the block table req_to_page (the same keys, so the outputs
    compare)."""
    if layout == "token_major":
        return args
    q, k, v, table, *rest = args
    pages = (table[:, ::page_size].long() // page_size).to(torch.int32).contiguous()
    if layout == "amx_packed":
        return (q, amx_packed(k, page_size, False), amx_packed(v, page_size, True), pages, *rest)
    return (q, head_major(k, page_size), head_major(v, page_size), pages, *rest)


def inputs(workload: str, dtype: torch.dtype, page_size: int, quick: bool, seed: int = 0, hot_slots: int = 0) -> tuple:
    """The kernel's arguments for ``workload``: ``paged_attention``'s, in its order (the output last but the
    layer's scalars), over a token-major pool. ``hot_slots`` (a multiple of ``page_size``; 0: off): every
    request's slots taken modulo it, so all keys lie in the first ``hot_slots`` slots, whole pages still in page
    order."""
    requests, cached, new = (QUICK_SHAPES if quick else SHAPES)[workload]
    q_heads, kv_heads, dim = HEADS
    gen = torch.Generator().manual_seed(seed)
    context = cached + new
    table = slot_table(requests, context, page_size, gen)
    if hot_slots:
        table = (table % hot_slots).contiguous()
    slots = requests * -(-context // page_size) * page_size
    # hal's own pool buffers (transparent huge pages where the host grants them), as hal bench and a server read
    k = pool_buffer((slots, kv_heads, dim), dtype, torch.device("cpu"))
    v = pool_buffer((slots, kv_heads, dim), dtype, torch.device("cpu"))
    k.copy_(torch.randn(slots, kv_heads, dim, generator=gen))
    v.copy_(torch.randn(slots, kv_heads, dim, generator=gen))
    q = torch.randn(requests * new, q_heads, dim, generator=gen).to(dtype).float()
    rows = torch.arange(requests)
    kv_lens = torch.full((requests,), context)
    q_lens = torch.full((requests,), new)
    q_start = torch.cumsum(q_lens, 0) - q_lens
    out = torch.empty(requests * new, q_heads, dim)
    no_mask, no_start = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.int64)
    return (q, k, v, table, rows, kv_lens, q_lens, q_start, no_mask, no_start, cpu_kernels._NO_SINKS, out)


def run(
    before: Path,
    after: Path,
    workload: str,
    dtype: str,
    page_size: int,
    rounds: int,
    isa: str,
    quick: bool,
    after_isa: str | None = None,
    flush_mb: int = 0,
    hot_slots: int = 0,
    kv_layout: str = "token_major",
    after_kv_layout: str | None = None,
):
    """Both builds (``after`` for ``after_isa`` where given, else both for ``isa``) timed in turns, each call after a
    read of ``flush_mb`` MB (0: none) so that its K/V come from memory: the report as a dict. ``kv_layout`` (and
    ``after_kv_layout`` for ``after``): the pool each reads, ``token_major`` through req_to_token or
    ``head_major`` pages through req_to_page (a source that reads them: this one)."""
    for source in (before, after):
        if not source.is_file():
            raise SystemExit(f"kernel_ab: {source} is not a file")
    if rounds < 2:
        raise SystemExit(f"kernel_ab: --rounds {rounds}: expected at least 2")
    if hot_slots < 0 or hot_slots % page_size:
        raise SystemExit(f"kernel_ab: --hot-slots {hot_slots}: expected 0 (off) or a multiple of the page size")
    if hot_slots and flush_mb:
        raise SystemExit("kernel_ab: --hot-slots keeps the keys in cache, --flush-mb evicts them: one or the other")
    after_isa = after_isa or isa
    after_kv_layout = after_kv_layout or kv_layout
    for layout in (kv_layout, after_kv_layout):
        if layout not in LAYOUTS:
            raise SystemExit(f"kernel_ab: --kv-layout {layout}: expected one of {', '.join(LAYOUTS)}")
        why = KV_LAYOUTS[layout].unsupported(HEADS[1], HEADS[2], page_size)
        if why:
            raise SystemExit(f"kernel_ab: --kv-layout {layout} --page-size {page_size}: {why}")
    modules = [build(before, isa), build(after, after_isa)]
    args = inputs(
        workload, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype], page_size, quick, hot_slots=hot_slots
    )
    layouts = (kv_layout, after_kv_layout)
    sides = [as_layout(args[:-1], layout, page_size) for layout in layouts]
    # the flags only where a side reads pages (or packed ones): a source from before them takes no such argument
    extra = [
        {"by_page": True, **({"amx_packed": True} if layout == "amx_packed" else {})} if layout != "token_major" else {}
        for layout in layouts
    ]
    outs = [args[-1], args[-1].clone()]
    scale = HEADS[2] ** -0.5

    flush = torch.ones(flush_mb << 18) if flush_mb else None  # float32: 2^18 per MB

    def call(i: int) -> float:
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        modules[i].paged_attention(*sides[i], outs[i], scale, 0.0, -1, True, cpu_kernels.TILE_ROWS, **extra[i])
        return time.perf_counter() - start

    for i in (0, 1, 0, 1):  # warm-up
        call(i)
    times: list[list[float]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append(call(i))
    medians = [statistics.median(t) for t in times]
    return {
        "workload": workload,
        "dtype": dtype,
        "page_size": page_size,
        "isa": isa,
        "after_isa": after_isa,
        "flush_mb": flush_mb,
        "hot_slots": hot_slots,
        "kv_layout": kv_layout,
        "after_kv_layout": after_kv_layout,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "before": {"source": str(before), "median_ms": 1e3 * medians[0], "min_ms": 1e3 * min(times[0])},
        "after": {"source": str(after), "median_ms": 1e3 * medians[1], "min_ms": 1e3 * min(times[1])},
        "speedup": medians[0] / medians[1],
        "max_abs_diff": (outs[0] - outs[1]).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the source to compare against (e.g. the committed one)")
    parser.add_argument("after", type=Path, help="the changed source")
    parser.add_argument("--workload", choices=sorted(SHAPES), default="decode")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30, help="calls of each version, in turns")
    parser.add_argument("--isa", default=None, help="kernel path to build both for (default: this CPU's best)")
    parser.add_argument("--after-isa", default=None, help="kernel path to build `after` for (default: --isa's)")
    parser.add_argument(
        "--flush-mb", type=int, default=0, help="MB read before each call, so K/V come from memory (e.g. 512)"
    )
    parser.add_argument(
        "--hot-slots", type=int, default=0, help="every request's keys over the first N slots: in cache (e.g. 256)"
    )
    parser.add_argument(
        "--kv-layout",
        choices=LAYOUTS,
        default="token_major",
        help="the pool both read: token-major slots through req_to_token, or head-major or AMX-packed pages through "
        "req_to_page",
    )
    parser.add_argument("--after-kv-layout", choices=LAYOUTS, default=None, help="the pool `after` reads")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error(f"--page-size {args.page_size}: expected a positive page size")
    if args.flush_mb < 0:
        parser.error(f"--flush-mb {args.flush_mb}: expected 0 (no flush) or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = cpu_kernels.isa() if args.isa is None else cpu_kernels._isa(args.isa)
    after_isa = None if args.after_isa is None else cpu_kernels._isa(args.after_isa)
    report = run(
        args.before,
        args.after,
        args.workload,
        args.dtype,
        args.page_size,
        args.rounds,
        isa,
        args.quick,
        after_isa,
        args.flush_mb,
        args.hot_slots,
        args.kv_layout,
        args.after_kv_layout,
    )
    report["cpu"] = cpu_kernels.cpu_features()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
