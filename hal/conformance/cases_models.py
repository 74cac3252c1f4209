"""Conformance cases of the models beyond Llama's shape: MLA (DeepSeek), attention sinks (gpt-oss), fp8 KV caches.

Each feature runs in every forward mode (DECODE, EXTEND after a cached prefix, MIXED,
TARGET_VERIFY, DRAFT_EXTEND) and under graph capture, alone and with what the models
combine it with: sinks with sliding windows (gpt-oss alternates windowed and full layers),
MLA over an fp8 cache (DeepSeek-V3 served in fp8), bf16 queries over an fp8 cache. MLA
runs at small test dims (latent 64 + rope 16) and at DeepSeek-V3's (512 + 64, 16 heads).

fp8 scales are not powers of two and differ between K and V, so a scale applied twice,
to one side only or not at all shows; the oracle reads the same fp8 entries the backend
wrote, so the tolerances stay the query dtype's (``hal.kernels.reference.tolerance``).
"""

from __future__ import annotations

import torch

from hal.batch import ForwardMode
from hal.conformance.cases import Case

__all__ = ["MODEL_CASES", "MODEL_GRAPH_CASES"]

D, E, M, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
X = ForwardMode.DRAFT_EXTEND
F8, F5 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16

_DECODE = ((0, 1), (5, 1), (17, 1), (33, 1))
_EXTEND = ((9, 5), (0, 3), (20, 11))
_MIXED = ((12, 1), (0, 9), (7, 6), (30, 1))
_VERIFY = ((10, 4), (3, 4), (25, 4))
_DRAFT = ((6, 3), (11, 3))

# MLA at test dims: 8 query heads over one latent head of 64 + a rope part of 16
_MLA = {"tp_q_head_num": 8, "tp_k_head_num": 1, "head_dim": 80, "kv_lora_rank": 64, "qk_rope_head_dim": 16}
# DeepSeek-V3 per worker at TP 8: 16 heads, latent 512 + rope 64, scaling (128 + 64) ** -0.5
_DEEPSEEK = {
    "tp_q_head_num": 16,
    "tp_k_head_num": 1,
    "head_dim": 576,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "scaling": 192**-0.5,
}
_DEEPSEEK12 = {**_DEEPSEEK, "tp_q_head_num": 12}  # 12 heads at D = 576: Ascend's MLA ops take 2^n heads
# a latent of 128 + rope 64 (FIA's other MLA head size)
_LATENT128 = {"tp_q_head_num": 8, "tp_k_head_num": 1, "head_dim": 192, "kv_lora_rank": 128, "qk_rope_head_dim": 64}
_FP8 = {"kv_cache_dtype": F8, "k_scale": 0.37, "v_scale": 1.9}


def _mla(name: str, mode: ForwardMode, requests, **kw) -> Case:
    return Case(f"mla_{name}", mode, requests, **{**_MLA, **kw})


def _sinks(name: str, mode: ForwardMode, requests, **kw) -> Case:
    return Case(f"sinks_{name}", mode, requests, sinks=True, **kw)


def _fp8(name: str, mode: ForwardMode, requests, **kw) -> Case:
    return Case(f"fp8_{name}", mode, requests, **{**_FP8, **kw})


MODEL_CASES: tuple[Case, ...] = (
    # MLA: the latent and rope part written as one key, the value read through the latent view
    _mla("decode", D, _DECODE),
    _mla("decode_bf16", D, _DECODE, dtype=BF16),
    _mla("decode_page16", D, ((15, 1), (31, 1), (0, 1), (40, 1)), page_size=16),
    _mla("extend_prefix", E, _EXTEND),
    _mla("extend_prefix_bf16_page16", E, _EXTEND, dtype=BF16, page_size=16),
    _mla("mixed", M, _MIXED),
    _mla("verify", V, _VERIFY),
    _mla("draft_extend", X, _DRAFT),
    _mla("decode_window", D, _DECODE, sliding_window_size=8),
    _mla("decode_fp8", D, _DECODE, dtype=BF16, kv_cache_dtype=F8, k_scale=0.45),
    _mla("extend_prefix_fp8", E, _EXTEND, kv_cache_dtype=F8, k_scale=0.45),
    Case("mla_deepseek_decode_bf16", D, ((40, 1), (3, 1), (17, 1)), dtype=BF16, **_DEEPSEEK),
    Case("mla_deepseek_extend_prefix_bf16", E, ((12, 4), (0, 5)), dtype=BF16, page_size=16, **_DEEPSEEK),
    Case("mla_deepseek_verify_fp8", V, ((20, 3), (7, 3)), dtype=BF16, kv_cache_dtype=F8, k_scale=0.45, **_DEEPSEEK),
    # paged bf16 at DeepSeek's dims reach every route of the Ascend MLA path (its ops take only these dims)
    Case("mla_deepseek_mixed_bf16", M, ((12, 1), (0, 5), (7, 3)), dtype=BF16, page_size=16, **_DEEPSEEK),
    Case("mla_deepseek_verify_bf16", V, ((20, 3), (7, 3)), dtype=BF16, page_size=16, **_DEEPSEEK),
    Case(
        "mla_deepseek_decode_window_bf16",
        D,
        ((40, 1), (3, 1)),
        dtype=BF16,
        page_size=16,
        sliding_window_size=8,
        **_DEEPSEEK,
    ),
    Case("mla_latent128_decode_bf16", D, ((30, 1), (5, 1)), dtype=BF16, page_size=16, **_LATENT128),
    # MLA on non-causal windowed layers: the window bounds the past only
    _mla("extend_non_causal_window", E, ((0, 12), (0, 20)), attn_type="encoder_only", sliding_window_size=5),
    _mla("mixed_non_causal_window", M, _MIXED, attn_type="encoder_only", sliding_window_size=4),
    Case(
        "mla_deepseek_extend_non_causal_window_bf16",
        E,
        ((0, 9), (0, 14)),
        dtype=BF16,
        page_size=16,
        attn_type="encoder_only",
        sliding_window_size=5,
        **_DEEPSEEK,
    ),
    # MLA head counts that are not a power of two: an op that takes 2^n heads only must pad and cut back
    _mla("decode_12_heads", D, _DECODE, tp_q_head_num=12),
    _mla("extend_prefix_12_heads", E, _EXTEND, tp_q_head_num=12),
    _mla("verify_12_heads_bf16", V, _VERIFY, tp_q_head_num=12, dtype=BF16),
    Case("mla_deepseek_decode_12_heads_bf16", D, ((40, 1), (3, 1), (17, 1)), dtype=BF16, page_size=16, **_DEEPSEEK12),
    Case("mla_deepseek_extend_prefix_12_heads_bf16", E, ((12, 4), (0, 5)), dtype=BF16, page_size=16, **_DEEPSEEK12),
    # attention sinks: one more logit per head in every softmax denominator, with and without windows
    _sinks("decode", D, _DECODE),
    _sinks("decode_window", D, _DECODE, sliding_window_size=8),
    _sinks("decode_bf16_page16", D, _DECODE, dtype=BF16, page_size=16),
    _sinks("decode_mqa", D, _DECODE, tp_q_head_num=6, tp_k_head_num=1),
    _sinks("extend_prefix", E, _EXTEND),
    _sinks("extend_window", E, _EXTEND, sliding_window_size=6),
    _sinks("extend_bf16", E, _EXTEND, dtype=BF16),
    _sinks("mixed_window", M, _MIXED, sliding_window_size=5),
    _sinks("mixed_gqa", M, _MIXED, tp_q_head_num=8, tp_k_head_num=2),
    _sinks("verify", V, _VERIFY),
    _sinks("verify_window_blind_row", V, _VERIFY, sliding_window_size=7, blind_row=True),
    _sinks("draft_extend_window", X, _DRAFT, sliding_window_size=4),
    _sinks("decode_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0),
    # head dim 128 on 128-token pages: FIA v2's learnable_sink takes these (the Ascend sinks path)
    _sinks("decode_d128_bf16_page128", D, _DECODE, head_dim=128, dtype=BF16, page_size=128),
    _sinks("extend_window_d128_page128", E, _EXTEND, head_dim=128, page_size=128, sliding_window_size=6),
    _sinks("mixed_gqa_d128_page128", M, _MIXED, head_dim=128, page_size=128, tp_q_head_num=8, tp_k_head_num=2),
    # non-causal windowed layers: the window bounds the past only, every later key stays visible (a band that
    # also hides later keys shows here)
    _sinks("extend_non_causal_window", E, ((0, 12), (0, 20)), attn_type="encoder_only", sliding_window_size=5),
    _sinks("mixed_non_causal_window_bf16", M, _MIXED, attn_type="encoder_only", sliding_window_size=4, dtype=BF16),
    _sinks(
        "extend_non_causal_window_d128_page128",
        E,
        ((0, 30), (0, 140)),
        attn_type="encoder_only",
        sliding_window_size=7,
        head_dim=128,
        page_size=128,
        dtype=BF16,
    ),
    # gpt-oss's windowed layer served from an fp8 cache
    _sinks("extend_window_fp8_bf16", E, _EXTEND, sliding_window_size=6, dtype=BF16, **_FP8),
    # fp8 KV cache: the write quantises with the layer's scales, the read dequantises; bf16 and fp32 queries
    _fp8("decode", D, _DECODE),
    _fp8("decode_bf16", D, _DECODE, dtype=BF16),
    _fp8("decode_e5m2_bf16", D, _DECODE, dtype=BF16, kv_cache_dtype=F5),
    _fp8("decode_page16_bf16", D, ((15, 1), (31, 1), (0, 1), (40, 1)), dtype=BF16, page_size=16),
    _fp8("extend_prefix", E, _EXTEND),
    _fp8("extend_prefix_bf16", E, _EXTEND, dtype=BF16),
    _fp8("extend_e5m2", E, _EXTEND, kv_cache_dtype=F5),
    _fp8("mixed_bf16", M, _MIXED, dtype=BF16),
    _fp8("mixed_window", M, _MIXED, sliding_window_size=5),
    _fp8("verify_bf16", V, _VERIFY, dtype=BF16),
    _fp8("draft_extend", X, _DRAFT),
    _fp8("decode_gqa_saturating", D, _DECODE, tp_q_head_num=8, q_scale=2.0, k_scale=0.004, v_scale=0.003),
)

MODEL_GRAPH_CASES: tuple[Case, ...] = (
    _mla("graph_decode", D, ((3, 1), (20, 1), (9, 1))),
    _mla("graph_verify_bf16", V, ((3, 3), (40, 3), (17, 3)), dtype=BF16, page_size=16),
    _mla("graph_decode_12_heads", D, ((3, 1), (20, 1), (9, 1)), tp_q_head_num=12),
    Case("mla_deepseek_graph_decode_bf16", D, ((3, 1), (20, 1), (9, 1)), dtype=BF16, page_size=16, **_DEEPSEEK),
    _sinks("graph_decode_window", D, ((3, 1), (20, 1), (9, 1), (31, 1)), sliding_window_size=6, layer_num=2),
    _sinks("graph_verify", V, ((3, 4), (20, 4), (9, 4))),
    _fp8("graph_decode_bf16", D, ((3, 1), (20, 1), (9, 1), (40, 1)), dtype=BF16, page_size=16),
    _fp8("graph_verify", V, ((3, 4), (20, 4), (9, 4))),
)
