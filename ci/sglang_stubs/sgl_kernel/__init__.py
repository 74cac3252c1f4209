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
    for row, start, end, flat in _runs(req_pool_indices, start_offset, end_offset):
        req_to_token[row, start:end] = out_cache_loc[flat].to(req_to_token.dtype)


def _runs(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor):
    """Per request ``i`` in order: ``(row, start, end, flat)``, ``flat`` the slice of its run in a flat list of
    every request's ``end - start`` entries, one request after another."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        yield row, start, end, slice(taken, taken + end - start)
        taken += end - start


# ----------------------------------------------------------------------------- speculative decoding (NGRAM)
# SGLang's CPU engine calls these for speculative decoding and KV moves (the ``_is_cpu`` branches of
# sglang/kernels/ops/speculative/*.py and kvcache/cache_move.py). Plain-torch stand-ins written from the
# contracts SGLang documents for its device versions of the same ops (its Triton kernels, the JIT kernel
# ``VerifyTreeGreedy``); a host loop per request is fine for the small test loads.


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer ``i`` (its address ``data_ptrs[i]``, ``strides[i]`` bytes a slot), copy slot
    ``src_loc[j]`` onto slot ``tgt_loc[j]``, in order (a slot may be both). Called by
    sglang/kernels/ops/kvcache/cache_move.py ``copy_all_layer_kv_cache_func`` (the pool's warm-up at start and
    the accepted drafts' KV moved into place after a speculative verify), as its Triton kernel
    ``copy_all_layer_kv_cache_tiled`` does on other devices."""
    import ctypes

    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``out_cache_loc`` = request 0's ``req_to_token[row, start:end]``, then request 1's, ... (in place).

    Called by sglang/kernels/ops/speculative/cache_locs.py ``assign_extend_cache_locs_func`` (the verify step's
    KV slots: each request's ``draft_token_num`` slots after its verified prefix)."""
    for row, start, end, flat in _runs(req_pool_indices, start_offset, end_offset):
        out_cache_loc[flat] = req_to_token[row, start:end].to(out_cache_loc.dtype)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification, in place: per request, walk the draft tree from its root; at each depth take the
    first child (then its siblings) whose draft token equals the target's prediction at the last accepted node.

    ``candidates`` / ``retrive_*``: ``[bs, draft_tokens]`` (``retrive_index`` holds flat node ids into
    ``target_predict`` / ``predicts``; ``retrive_next_token``: first child, ``retrive_next_sibling``: next sibling,
    -1 for none); ``accept_index``: ``[bs, spec_steps]``, the accepted nodes' flat ids, root first;
    ``accept_token_num``: ``[bs]``, drafts accepted; ``predicts`` (flat node ids, as ``target_predict``): the
    target's token after each accepted node. Called by sglang/kernels/ops/speculative/spec_tree.py
    ``verify_tree_greedy_func`` (EAGLE and NGRAM)."""
    steps, flat = accept_index.shape[1], predicts.view(-1)
    cands, index = candidates.tolist(), retrive_index.tolist()
    first_child, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.flatten().tolist()
    for b in range(candidates.shape[0]):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            node = first_child[b][node]
            while node != -1 and cands[b][node] != target[last]:
                node = sibling[b][node]
            if node == -1:
                break
            flat[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = index[b][node]
            last = index[b][node]
        accept_token_num[b] = accepted
        flat[last] = target[last]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The accepted tokens' KV slots, packed in order (in place): the ``k``-th entry of ``accept_index`` (flat)
    that is not -1, ``j``, gives ``accept_out_cache_loc[k] = out_cache_loc[j]``. Called by
    sglang/kernels/ops/speculative/eagle.py ``fill_accept_out_cache_loc_func`` (after a verify), as its Triton
    kernel ``fill_accept_out_cache_loc`` does on other devices."""
    index = accept_index.flatten()
    index = index[index != -1].long()
    accept_out_cache_loc[: index.numel()] = out_cache_loc[index].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """``bonus_tokens[b]`` = request ``b``'s last accepted token, ``accept_tokens.flatten()[accept_stride * b +
    accept_lens[b] - 1]`` (``accept_lens`` counts the bonus token), in place. Called by
    sglang/kernels/ops/speculative/eagle.py ``fill_bonus_tokens_func``, as its Triton kernel ``fill_bonus_tokens``."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    flat = accept_tokens.flatten()[rows * accept_stride + accept_lens.long() - 1]
    bonus_tokens[: rows.numel()] = flat.to(bonus_tokens.dtype)
