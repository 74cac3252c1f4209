"""Peers ``hal bench`` times beside hal in the same process and run: what a CPU user would otherwise pick.

* ``sdpa_gathered``: per request, its K/V gathered from the pool through ``req_to_token``
  and ``torch.nn.functional.scaled_dot_product_attention`` (GQA, an offset causal mask for
  extends); the pattern of SGLang's ``torch_native`` backend, on PyTorch's fused CPU kernel.
* ``flex_attention``: ``torch.nn.attention.flex_attention`` compiled by ``torch.compile``
  for the CPU, reading the pool in place (K/V as ``[1, Hkv, slots, D]``, one batch entry per
  request) under a paged block mask: a key is visible when its slot belongs to the request
  at a position up to the query's (KV blocks of ``max(page_size, 16)`` slots, so whole pages
  are skipped). Its compile time (first call) and block-mask build time are reported apart
  from the step time.

Each peer writes the step's new K/V into the pool and returns ``[T, Hq * Dv]`` like a
backend's ``forward``; its output is checked against the reference like hal's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hal.batch import host_lens

__all__ = ["PEERS", "DEFAULT_PEERS", "peer_step"]


def _write_kv(built) -> None:
    fb, layer = built.batch, built.layer
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    loc = fb.out_cache_loc.long()
    k_buffer[loc] = built.k.view(-1, layer.tp_k_head_num, layer.head_dim).to(k_buffer.dtype)
    v_buffer[loc] = built.v.view(-1, layer.tp_v_head_num, layer.v_head_dim).to(v_buffer.dtype)


def _inputs(built):
    """``(layer, k_buffer, v_buffer, req_to_token, requests, q [T, Hq, D])``; ``requests``: per request its
    ``(req_to_token row, keys, query tokens, first query row)``, from the host mirrors."""
    fb, layer = built.batch, built.layer
    if layer.logit_cap or layer.sliding_window_size >= 0 or not layer.causal or fb.forward_mode.is_target_verify():
        raise NotImplementedError("the peers serve plain causal attention (no cap, window or custom mask)")
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    lens = host_lens(fb)
    requests, start = [], 0
    for row, kv, n in zip(fb.req_pool_indices.tolist(), lens.kv, lens.query):
        requests.append((row, kv, n, start))
        start += n
    q = built.q.view(-1, layer.tp_q_head_num, layer.head_dim)
    return layer, k_buffer, v_buffer, fb.req_to_token_pool.req_to_token, requests, q


def _sdpa_gathered(built) -> tuple[Callable[[], torch.Tensor], dict]:
    layer, k_buffer, v_buffer, r2t, requests, q = _inputs(built)
    hq, dv = layer.tp_q_head_num, layer.v_head_dim

    def step() -> torch.Tensor:
        _write_kv(built)
        out = q.new_empty(q.shape[0], hq, dv)
        for row, kv, n, start in requests:
            slots = r2t[row, :kv].long()
            k = k_buffer[slots].transpose(0, 1)  # [Hkv, kv, D]
            v = v_buffer[slots].transpose(0, 1)
            mask = None if n == 1 else torch.ones(n, kv, dtype=torch.bool).tril(kv - n)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1), k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True
            )
            out[start : start + n] = o.transpose(0, 1)
        return out.view(q.shape[0], hq * dv)

    return step, {}


def _flex_attention(built) -> tuple[Callable[[], torch.Tensor], dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    layer, k_buffer, v_buffer, r2t, requests, q = _inputs(built)
    hq, d, dv = layer.tp_q_head_num, layer.head_dim, layer.v_head_dim
    slots_total, batch = k_buffer.shape[0], len(requests)
    q_max = max(n for _, _, n, _ in requests)
    start = time.perf_counter()
    # the paged block mask: which request owns each slot, at which position
    slot_req = torch.full((slots_total,), -1, dtype=torch.int32)
    slot_pos = torch.zeros(slots_total, dtype=torch.int32)
    first_pos = torch.zeros(batch, dtype=torch.int32)
    rows_of_q = []  # (request, query index) -> row of q
    for b, (row, kv, n, q_start) in enumerate(requests):
        slots = r2t[row, :kv].long()
        slot_req[slots] = b
        slot_pos[slots] = torch.arange(kv, dtype=torch.int32)
        first_pos[b] = kv - n
        rows_of_q += [(b, i, q_start + i) for i in range(n)]

    def mask_mod(b, h, q_idx, kv_idx):
        return (slot_req[kv_idx] == b) & (slot_pos[kv_idx] <= first_pos[b] + q_idx)

    block = max(built.case.page_size, 16)
    block_mask = create_block_mask(mask_mod, batch, None, q_max, slots_total, device="cpu", BLOCK_SIZE=(128, block))
    mask_seconds = time.perf_counter() - start
    padded = built.q.new_zeros(batch, hq, q_max, d)
    index_b = torch.tensor([b for b, _, _ in rows_of_q])
    index_i = torch.tensor([i for _, i, _ in rows_of_q])
    index_t = torch.tensor([t for _, _, t in rows_of_q])
    k = k_buffer.permute(1, 0, 2).unsqueeze(0).expand(batch, -1, -1, -1)  # [B, Hkv, slots, D], the pool in place
    v = v_buffer.permute(1, 0, 2).unsqueeze(0).expand(batch, -1, -1, -1)
    torch._dynamo.reset()  # a cold compile per workload, timed; no recompile limit ever falls back to eager
    compiled = torch.compile(flex_attention, dynamic=False)

    def step() -> torch.Tensor:
        _write_kv(built)
        padded[index_b, :, index_i] = q[index_t]
        o = compiled(padded, k, v, block_mask=block_mask, scale=layer.scaling, enable_gqa=True)
        out = q.new_empty(q.shape[0], hq, dv)
        out[index_t] = o[index_b, :, index_i]
        return out.view(q.shape[0], hq * dv)

    start = time.perf_counter()
    step()  # compiles
    return step, {"compile_s": round(time.perf_counter() - start, 3), "block_mask_ms": round(1e3 * mask_seconds, 3)}


# name -> builder: built case -> (step, facts reported apart from the timing)
PEERS: dict[str, Callable] = {"sdpa_gathered": _sdpa_gathered, "flex_attention": _flex_attention}
# What a default run times: flex_attention is opt-in (--peer flex_attention): its cold compile per workload
# takes minutes on 2 cores, and its compile time is reported apart from its step time when it runs.
DEFAULT_PEERS = ("sdpa_gathered",)


def peer_step(name: str, built) -> tuple[Callable[[], torch.Tensor], dict]:
    """The timed step of peer ``name`` on ``built`` and what its preparation cost (compile, block mask)."""
    return PEERS[name](built)
