"""Batches the conformance suite runs, and a builder that makes them on any device.

A :class:`Case` names a forward mode, the requests (cached prefix, new tokens) and the
layer's shape and features. :func:`build` lays the requests out in a KV pool filled
with noise, pages shuffled so that nothing works by accident, and returns everything a
forward needs plus what the reference says it must produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.capability import resolve_device
from hal.config import AttentionConfig
from hal.kernels import reference
from hal.kernels.reference import tolerance
from hal.kv_cache import PagedKVPool, ReqToTokenPool
from hal.layer import AttentionLayer

__all__ = ["Case", "Built", "CASES", "GRAPH_CASES", "build", "tolerance"]


@dataclass(frozen=True)
class Case:
    """One conformance batch. ``requests``: ``(cached prefix, new tokens)`` per request."""

    name: str
    mode: ForwardMode
    requests: tuple[tuple[int, int], ...]
    tp_q_head_num: int = 4
    tp_k_head_num: int = 2
    head_dim: int = 64  # FlashInfer compiles 64/128/256 only
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.float32
    page_size: int = 1
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    attn_type: str = "decoder"
    q_scale: float = 1.0  # larger queries make the logit cap matter
    blind_row: bool = False  # TARGET_VERIFY: each request's first draft token sees no key (outputs zeros)
    seed: int = 0

    def layer(self, layer_id: int = 0) -> AttentionLayer:
        return AttentionLayer(
            layer_id=layer_id,
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            logit_cap=self.logit_cap,
            sliding_window_size=self.sliding_window_size,
            attn_type=self.attn_type,
        )

    def config(self, graph: bool = False) -> AttentionConfig:
        return AttentionConfig(
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
            sliding_window_size=self.sliding_window_size,
            logit_cap=self.logit_cap,
            non_causal=self.attn_type != "decoder",
            custom_mask=self.mode.is_target_verify(),
            graph=graph,
        )


@dataclass
class Built:
    """A built case: the batch, its inputs, and the expected output and cache."""

    case: Case
    layer: AttentionLayer
    batch: ForwardBatch
    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]
    v: torch.Tensor  # [T, Hkv * Dv]
    expected: torch.Tensor  # [T, Hq * Dv], from the reference
    expected_k: torch.Tensor  # the layer's key buffer after a correct forward
    expected_v: torch.Tensor
    extra: dict = field(default_factory=dict)


def _verify_mask(prefix: int, draft: int, gen: torch.Generator, blind_row: bool) -> torch.Tensor:
    """A random draft tree: every draft token sees the prefix, itself and a random subset of earlier drafts."""
    tree = torch.rand(draft, draft, generator=gen) < 0.5
    tree = torch.tril(tree, diagonal=-1) | torch.eye(draft, dtype=torch.bool)
    mask = torch.cat([torch.ones(draft, prefix, dtype=torch.bool), tree], dim=1)
    if blind_row:
        mask[0] = False
    return mask.flatten()


def build(case: Case, device: torch.device | str = "cpu", layer_num: int = 1) -> Built:
    """Lay out ``case`` on ``device``: pools full of noise, shuffled pages, the batch and its expectation."""
    gen = torch.Generator().manual_seed(case.seed)
    layer = case.layer()
    ps, mode = case.page_size, case.mode
    verify = mode.is_target_verify()
    totals = [p + n for p, n in case.requests]
    pages_per_req = [-(-t // ps) for t in totals]
    num_pages = sum(pages_per_req) + 2
    kv_pool = PagedKVPool(num_pages, ps, layer_num, case.tp_k_head_num, case.head_dim, case.v_head_dim, case.dtype)
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))  # noise everywhere: reading a wrong slot shows
    bs = len(case.requests)
    req_pool = ReqToTokenPool(bs + 3, max(totals) + 5)
    rows = torch.randperm(bs + 3, generator=gen)[:bs] + 1  # row 0 is the padding row
    pages = (torch.randperm(num_pages, generator=gen) + 1)[: sum(pages_per_req)].tolist()
    loc, masks = [], []
    for r, ((prefix, new), total) in enumerate(zip(case.requests, totals)):
        own, pages = pages[: pages_per_req[r]], pages[pages_per_req[r] :]
        slots = torch.tensor([own[i // ps] * ps + i % ps for i in range(total)])
        req_pool.write(int(rows[r]), 0, slots)
        loc.append(slots[prefix:])
        if verify:
            masks.append(_verify_mask(prefix, new, gen, case.blind_row))
    kw: dict = {}
    prefix_lens = torch.tensor([p for p, _ in case.requests])
    new_lens = torch.tensor([n for _, n in case.requests])
    if mode.is_decode():
        assert all(n == 1 for _, n in case.requests), "decode requests bring one token"
        seq_lens = prefix_lens + 1
    elif verify:
        assert len(set(new_lens.tolist())) == 1, "verify requests bring the same number of draft tokens"
        seq_lens = prefix_lens
        kw["spec_info"] = SpecInfo(int(new_lens[0]), torch.cat(masks))
    else:
        seq_lens = prefix_lens + new_lens
        kw.update(
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=new_lens,
            extend_prefix_lens_cpu=prefix_lens.tolist(),
            extend_seq_lens_cpu=new_lens.tolist(),
        )
    fb = ForwardBatch(
        seq_lens_cpu=seq_lens.clone(),
        validate="full",
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=rows.to(torch.int64),
        seq_lens=seq_lens.to(torch.int32),
        out_cache_loc=torch.cat(loc).to(torch.int64),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        **kw,
    )
    tokens = fb.num_tokens
    q = (torch.randn(tokens, case.tp_q_head_num * case.head_dim, generator=gen) * case.q_scale).to(case.dtype)
    k = torch.randn(tokens, case.tp_k_head_num * case.head_dim, generator=gen).to(case.dtype)
    v = torch.randn(tokens, case.tp_k_head_num * layer.v_head_dim, generator=gen).to(case.dtype)

    expected_k, expected_v = kv_pool.k_buffer[0].clone(), kv_pool.v_buffer[0].clone()
    reference.write_kv(
        expected_k,
        expected_v,
        fb.out_cache_loc,
        k.view(tokens, case.tp_k_head_num, -1),
        v.view(tokens, case.tp_k_head_num, -1),
    )
    expected = reference.batch_attention(q, expected_k, expected_v, layer, fb)
    built = Built(case, layer, fb, q, k, v, expected, expected_k, expected_v)
    return to_device(built, torch.device(device)) if torch.device(device).type != "cpu" else built


def to_device(built: Built, device: torch.device) -> Built:
    """Move a CPU-built case to ``device`` (pools, batch tensors, inputs)."""
    fb = built.batch
    kv, rt = fb.token_to_kv_pool, fb.req_to_token_pool
    kv.device = rt.device = resolve_device(device)
    kv.k_buffer = [b.to(device) for b in kv.k_buffer]
    kv.v_buffer = [b.to(device) for b in kv.v_buffer]
    rt.req_to_token = rt.req_to_token.to(device)
    moved = {
        name: getattr(fb, name).to(device)
        for name in (
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "extend_prefix_lens",
            "extend_seq_lens",
            "extend_start_loc",
            "positions",
        )
        if getattr(fb, name) is not None
    }
    spec = fb.spec_info and SpecInfo(fb.spec_info.draft_token_num, fb.spec_info.custom_mask.to(device))
    fb = ForwardBatch(
        forward_mode=fb.forward_mode,
        batch_size=fb.batch_size,
        req_to_token_pool=rt,
        token_to_kv_pool=kv,
        spec_info=spec,
        seq_lens_cpu=fb.seq_lens_cpu,
        extend_seq_lens_cpu=fb.extend_seq_lens_cpu,
        extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu,
        validate="full",
        **{**{k: v for k, v in moved.items() if k not in ("extend_start_loc",)}},
    )
    return replace(
        built,
        batch=fb,
        q=built.q.to(device),
        k=built.k.to(device),
        v=built.v.to(device),
        expected=built.expected.to(device),
        expected_k=built.expected_k.to(device),
        expected_v=built.expected_v.to(device),
    )


D, E, M, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
_DECODE = ((0, 1), (5, 1), (17, 1), (33, 1))
_EXTEND = ((9, 5), (0, 3), (20, 11))
_MIXED = ((12, 1), (0, 9), (7, 6), (30, 1))
_VERIFY = ((10, 4), (3, 4), (25, 4))

CASES: tuple[Case, ...] = (
    Case("decode", D, _DECODE),
    Case("decode_bf16", D, _DECODE, dtype=torch.bfloat16),
    Case("decode_page16", D, _DECODE, page_size=16),
    Case("decode_page16_bf16", D, _DECODE, page_size=16, dtype=torch.bfloat16),
    Case("decode_mqa", D, _DECODE, tp_q_head_num=4, tp_k_head_num=1),
    Case("decode_mha", D, _DECODE, tp_q_head_num=2, tp_k_head_num=2),
    Case("decode_gqa8", D, _DECODE, tp_q_head_num=8, tp_k_head_num=2),
    Case("decode_head_dim_80", D, _DECODE, head_dim=80),
    Case("decode_sliding_window", D, _DECODE, sliding_window_size=8),
    Case("decode_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0),
    Case("extend_no_prefix", E, ((0, 7), (0, 12), (0, 1))),
    Case("extend_prefix", E, _EXTEND),
    Case("extend_prefix_bf16", E, _EXTEND, dtype=torch.bfloat16),
    Case("extend_prefix_page16", E, _EXTEND, page_size=16),
    Case("extend_page4", E, _EXTEND, page_size=4),
    Case("extend_mqa", E, _EXTEND, tp_k_head_num=1),
    Case("extend_sliding_window", E, _EXTEND, sliding_window_size=6),
    Case("extend_logit_cap", E, _EXTEND, logit_cap=5.0, q_scale=8.0),
    Case("extend_non_causal", E, ((0, 7), (0, 12)), attn_type="encoder_only"),
    Case("extend_v_head_dim", E, _EXTEND, v_head_dim=32),
    Case("mixed", M, _MIXED),
    Case("mixed_page16", M, _MIXED, page_size=16),
    Case("mixed_bf16", M, _MIXED, dtype=torch.bfloat16),
    Case("draft_extend", ForwardMode.DRAFT_EXTEND, ((6, 3), (11, 3))),
    Case("verify", V, _VERIFY),
    Case("verify_page16_bf16", V, _VERIFY, page_size=16, dtype=torch.bfloat16),
    Case("verify_sliding_window", V, _VERIFY, sliding_window_size=7),
    # fp16: accelerators only (hal never runs fp16 on a CPU)
    Case("decode_fp16", D, _DECODE, dtype=torch.float16),
    Case("extend_prefix_fp16", E, _EXTEND, dtype=torch.float16, page_size=16),
    Case("mixed_fp16", M, _MIXED, dtype=torch.float16),
    Case("verify_fp16", V, _VERIFY, dtype=torch.float16),
    # 128-token pages (Ascend's default block size): requests cross page boundaries
    Case("decode_page128", D, ((0, 1), (130, 1), (260, 1), (5, 1)), page_size=128),
    Case("decode_page128_bf16", D, ((0, 1), (130, 1), (260, 1), (5, 1)), page_size=128, dtype=torch.bfloat16),
    Case("extend_prefix_page128", E, ((130, 5), (0, 20), (200, 12)), page_size=128),
    Case("extend_prefix_page128_bf16", E, ((130, 5), (0, 20), (200, 12)), page_size=128, dtype=torch.bfloat16),
    Case("mixed_page128", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128),
    Case("mixed_page128_bf16", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128, dtype=torch.bfloat16),
    Case("verify_page128", V, ((130, 4), (3, 4)), page_size=128),
    # the same features at the page sizes paged-only kernels (Ascend: multiples of 16) take
    Case("decode_mqa_page16", D, _DECODE, tp_k_head_num=1, page_size=16),
    Case("decode_gqa8_page128", D, ((0, 1), (130, 1), (260, 1)), tp_q_head_num=8, page_size=128),
    Case("decode_sliding_window_page16", D, _DECODE, sliding_window_size=8, page_size=16),
    Case("extend_no_prefix_page128", E, ((0, 7), (0, 140), (0, 1)), page_size=128),
    Case("extend_sliding_window_page128", E, ((130, 5), (0, 20), (200, 12)), sliding_window_size=6, page_size=128),
    Case("extend_non_causal_page16", E, ((0, 7), (0, 12)), attn_type="encoder_only", page_size=16),
    Case("extend_non_causal_page128", E, ((0, 7), (0, 130)), attn_type="encoder_only", page_size=128),
    Case("draft_extend_page128", ForwardMode.DRAFT_EXTEND, ((130, 3), (11, 3)), page_size=128),
    Case("mixed_page16_bf16", M, _MIXED, page_size=16, dtype=torch.bfloat16),
    Case("verify_sliding_window_page16", V, _VERIFY, sliding_window_size=7, page_size=16),
    Case("verify_blind_row_page16", V, _VERIFY, page_size=16, blind_row=True),
)

GRAPH_CASES: tuple[Case, ...] = (
    Case("graph_decode", D, ((3, 1), (20, 1), (9, 1))),
    Case("graph_decode_page128", D, ((3, 1), (200, 1)), page_size=128),
    Case("graph_decode_fp16", D, ((3, 1), (20, 1), (9, 1)), dtype=torch.float16),
    Case("graph_decode_page16_window", D, ((3, 1), (20, 1), (9, 1)), page_size=16, sliding_window_size=6),
    Case(
        "graph_decode_page16_bf16",
        D,
        ((3, 1), (20, 1), (9, 1), (40, 1), (1, 1)),
        page_size=16,
        dtype=torch.bfloat16,
    ),
    # TARGET_VERIFY at a fixed draft count (SGLang captures verify under speculative decoding)
    Case("graph_verify", ForwardMode.TARGET_VERIFY, ((3, 4), (20, 4), (9, 4))),
    Case(
        "graph_verify_page16_bf16",
        ForwardMode.TARGET_VERIFY,
        ((3, 3), (40, 3), (17, 3)),
        page_size=16,
        dtype=torch.bfloat16,
    ),
    Case(
        "graph_verify_page128_window",
        ForwardMode.TARGET_VERIFY,
        ((130, 4), (3, 4)),
        page_size=128,
        sliding_window_size=5,
    ),
)
