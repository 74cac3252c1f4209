"""STAND-IN for sgl_kernel's CPU build: not sgl_kernel. hal's SGLang test envs only.

PyPI's sgl-kernel wheels are CUDA builds; SGLang's CPU engine imports its CPU ops. The ops
SGLang 0.5.21's CPU engine calls for a dense Llama-family model with ``--attention-backend hal``
or ``torch_native`` are written here in plain torch, each naming the SGLang file that calls it;
importing any other name works, calling it raises ``RuntimeError`` (see
ci/sglang_stubs/_hal_sglang_stub.py). No ``torch.ops.sgl_kernel`` op is registered, so SGLang's
``cpu_has_amx_support()`` stays False and its ``intel_amx`` paths stay off.
"""

import torch
from _hal_sglang_stub import stub_package

stub_package(__name__, globals(), "0.3.21+hal.importstub")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = `` request i's run of
    ``out_cache_loc`` (the runs are consecutive, in request order). In place; returns None.

    Called by sglang/srt/mem_cache/allocation.py (``assign_req_to_token_pool_func``, every
    prefill and decode allocation on the CPU); the same as its Triton kernel
    ``assign_req_to_token_pool``. ``req_to_token`` is ``[pool_size, pool_len]`` int32.
    """
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(req_to_token.dtype)
        taken += end - start
