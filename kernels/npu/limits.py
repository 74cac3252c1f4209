"""Why the real Ascend ops cannot serve a layer: each op's documented limits as reasons, for routing and validation.
The rules with their sources are the rows of :mod:`hal.kernels.npu.contracts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .contracts import FIA_A5_MAX_HEAD_DIM, FIA_DECODE_MAX_KV

__all__ = [
    "FIA_TND_HEAD_DIMS",
    "FIA_DECODE_MAX_KV",
    "fia_head_dim_reason",
    "PA_MAX_BLOCK_SIZE",
    "PA_MLA_DIMS",
    "MLA_LATENT_DIMS",
    "MLA_ROPE_DIM",
    "MLA_TREE_LATENT_DIM",
    "MLA_TND_MAX_QUERY",
    "SINK_MAX_VALUE_DIM",
    "unsupported_reasons",
    "sink_unsupported_reasons",
    "mla_unsupported_reasons",
]

# FIA with input_layout TND, per its doc at op-plugin 517f2e7 (docs/zh/custom_APIs/torch_npu/
# torch_npu-npu_fused_infer_attention_score.md, "TND布局约束"): query D = 512 only with query_rope/key_rope (MLA,
# KV_N = 1); D != 512 without rope needs Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with V_D = 128 or 192. hal passes
# no rope and one head size for K and V, so 128 or 192 on A2/A3. A5 (which the doc does not list) takes what
# vllm-ascend sends there: a multiple of 16, <= 512 (contracts: "tnd_head_dim_a5").
FIA_TND_HEAD_DIMS = (128, 192)
# FIA v2 with query_rope / key_rope (doc at op-plugin 517f2e7, "MLA场景约束"): the latent D is 512 (KV_N = 1, Q_N a
# power of two <= 128, sparse 0/3/4/9) or 128, the rope part 64, page block_size a multiple of 16 <= 1024.
MLA_LATENT_DIMS = (512, 128)
MLA_ROPE_DIM = 64
MLA_TREE_LATENT_DIM = 512  # sparse_mode 9 (treeMask) is documented for D = 512
# _npu_paged_attention_mla at the only shape upstream calls and tests it with (op-plugin
# test/test_custom_ops/test_atb_paged_attention_mla.py; SGLang's forward_decode with DeepSeek): 512 + 64, one KV head.
PA_MLA_DIMS = (512, 64)
PA_MAX_BLOCK_SIZE = 128  # ATB PagedAttention: "因硬件限制，block_size <= 128" (contracts: _npu_paged_attention)
MLA_TND_MAX_QUERY = 16  # absorbed MLA in TND (contracts: npu_fused_infer_attention_score_v2 "mla_q16")
SINK_MAX_VALUE_DIM = 128  # FIA v2 "learnable_sink约束": value D <= 128


def fia_head_dim_reason(head_dim: int, chip: str | None) -> str:
    """Why FIA (v1, TND, no rope) cannot take ``head_dim`` on ``chip`` (None: A2/A3), ``""`` when it can."""
    if chip == "A5":
        if head_dim % 16 or not 0 < head_dim <= FIA_A5_MAX_HEAD_DIM:
            return (
                f"head_dim {head_dim}: on A5 FIA TND takes what vllm-ascend sends there, a multiple of 16 "
                f"<= {FIA_A5_MAX_HEAD_DIM} (contracts: tnd_head_dim_a5)"
            )
        return ""
    if head_dim not in FIA_TND_HEAD_DIMS:
        return (
            f"head_dim {head_dim}: input_layout TND takes head dim 128 or 192 without rope (512 only with MLA's "
            "query_rope/key_rope; op-plugin doc, TND constraints)"
        )
    return ""


def unsupported_reasons(
    head_dim: int,
    v_head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    logit_cap: float,
    sliding_window: int,
    custom_mask: bool,
    causal: bool,
    *,
    kv_heads: int | None = None,
    q_heads: int | None = None,
    paths: Sequence[str] = ("decode", "extend", "mixed"),
    chip: str | None = None,
    max_kv_len: int | None = None,
) -> list[str]:
    """Why the real Ascend ops cannot serve a config on ``chip`` (None: A2/A3): ``[]`` when all of ``paths`` can.
    ``max_kv_len``: the longest context the layer reads (None: unknown); past FIA's Q_S = 1 limit (262144 keys) a
    ``fia_decode`` goes with a padding row per request (Q_S = 2), so the page-size rule of Q_S > 1 applies to it.

    Paths: ``decode`` = ``_npu_paged_attention``, ``extend`` = ``npu_fused_infer_attention_score``
    (TND, paged, query lengths > 1 allowed), ``fia_decode`` = the same op with one query token per request
    (its page-size rule is the doc's Q_S = 1 column), ``mixed`` = ``_npu_paged_attention_splitfuse``.
    Each reason names the op and the documented limit. float32 is reported (the real ops take float16/bfloat16) although
    the CPU emulation computes it.
    """
    reasons: list[str] = []
    half = (torch.float16, torch.bfloat16)
    atb_paths = [p for p in paths if p in ("decode", "mixed")]
    for path in atb_paths:
        name = "_npu_paged_attention" if path == "decode" else "_npu_paged_attention_splitfuse"
        # ATB PagedAttentionOperation constraints: _ATB_PA_DOC and _ATB_PA_IO_DOC.
        if dtype not in half:
            reasons.append(f"{name} ({path}): dtype {dtype} unsupported (ATB PagedAttention takes float16/bfloat16)")
        if v_head_dim != head_dim:
            reasons.append(
                f"{name} ({path}): v_head_dim {v_head_dim} != head_dim {head_dim} (one head_size for K and V caches)"
            )
        if not 0 < head_dim <= 256:
            reasons.append(f"{name} ({path}): head_dim {head_dim} outside (0, 256]")
        if block_size % 16 or block_size > PA_MAX_BLOCK_SIZE:
            reasons.append(
                f"{name} ({path}): page size {block_size}: ATB PagedAttention takes a multiple of 16, <= "
                f"{PA_MAX_BLOCK_SIZE} (op-plugin _atb_api_docs.py, '因硬件限制，block_size <= 128')"
            )
        if head_dim * block_size > 128 * 128 and (path == "mixed" or chip == "310P"):
            reasons.append(f"{name} ({path}): head_dim * page size = {head_dim * block_size} > 128 * 128")
        if chip == "310P" and head_dim % 16:
            reasons.append(
                f"{name} ({path}) on 310P: FRACTAL_NZ caches need head_dim a multiple of 16, not {head_dim} "
                "(op-plugin _atb_api_docs.py, Atlas 推理系列产品)"
            )
        if chip == "310P" and dtype == torch.bfloat16:
            reasons.append(
                f"{name} ({path}) on 310P: float16 only, not {dtype} (op-plugin _atb_api_docs.py, Atlas 推理系列产品)"
            )
        if logit_cap > 0:
            reasons.append(f"{name} ({path}): no logit soft-cap input (PagedAttentionParam has none)")
        if path == "decode" and sliding_window >= 0:
            reasons.append(f"{name} (decode): no mask or window input (torch_npu fixes maskType=UNDEFINED)")
        if kv_heads and q_heads and q_heads % kv_heads:
            reasons.append(f"{name} ({path}): q_heads {q_heads} not a multiple of kv_heads {kv_heads}")
        if path == "mixed" and head_dim == 192 and block_size % 128:
            # vllm-ascend warns that splitfuse at head dim 192 may crash unless the page size is a
            # multiple of 128; vllm-ascend never sends 192 there (A2/A3 take FIA), so hal does not either.
            reasons.append(
                f"{name} (mixed): head_dim 192 with page size {block_size} (not a multiple of 128) may crash "
                "(vllm-ascend's warning); use a page size of 128/256/512 so FIA serves it"
            )
    for path in [p for p in paths if p in ("extend", "fia_decode")]:
        name = "npu_fused_infer_attention_score"
        # FIA constraints: _FIA_DOC ("约束说明": TND, page attention, Q_S > 1).
        if dtype not in half:
            reasons.append(f"{name} ({path}): dtype {dtype} unsupported (query takes float16/bfloat16)")
        if v_head_dim != head_dim:
            reasons.append(
                f"{name} ({path}): v_head_dim {v_head_dim} != head_dim {head_dim} "
                "(paged key and value shapes must match)"
            )
        why = fia_head_dim_reason(head_dim, chip)
        if why:
            reasons.append(f"{name} ({path}): {why}")
        # A windowed decode, or one over more than 262144 keys, goes with a padding row per request (Q_S = 2: the
        # band is ignored at Q_S = 1, and Q_S = 1 takes KV_S <= 262144), so the Q_S > 1 page rule applies.
        padded = path == "fia_decode" and (sliding_window >= 0 or (max_kv_len or 0) > FIA_DECODE_MAX_KV)
        if (path == "extend" or padded) and (block_size % 128 or not 128 <= block_size <= 512):
            long = (
                f" (a decode over up to {max_kv_len} keys runs at Q_S = 2)"
                if (max_kv_len or 0) > FIA_DECODE_MAX_KV
                else ""
            )
            reasons.append(
                f"{name} ({path}): page size {block_size} must be a multiple of 128 in [128, 512] "
                f"(page attention, Q_S > 1){long}"
            )
        if path == "fia_decode" and (block_size % 16 or not 0 < block_size <= 512):
            reasons.append(
                f"{name} ({path}): page size {block_size} must be a multiple of 16 (TND) in (0, 512] "
                "(page attention, Q_S = 1)"
            )
        if logit_cap > 0:
            reasons.append(f"{name} ({path}): no logit soft-cap input")
        if custom_mask:
            reasons.append(
                f"{name} ({path}): custom mask unsupported "
                "(TND takes sparse_mode 0 without a mask or 3 with the causal mask)"
            )
        if kv_heads and q_heads and (q_heads % kv_heads or q_heads // kv_heads > 64):
            reasons.append(f"{name} ({path}): q_heads / kv_heads = {q_heads}/{kv_heads} must be an integer <= 64")
        if kv_heads and kv_heads * head_dim > 65535:
            reasons.append(
                f"{name} ({path}): kv_heads * head_dim = {kv_heads * head_dim} > 65535 "
                "in the (blocks, block_size, H) layout"
            )
    # ``causal`` needs no reason: decode sees every key, FIA has sparse_mode 0, splitfuse a zero mask.
    del causal
    return reasons


def sink_unsupported_reasons(
    head_dim: int,
    v_head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    logit_cap: float,
    causal: bool,
    *,
    kv_heads: int,
    q_heads: int,
    decode: bool = False,
) -> list[str]:
    """Why FIA v2 with ``learnable_sink`` (TND, paged, no rope) cannot serve a layer: the doc's TND rules without rope
    (head dim 64 or 128, one for K and V: no V_D = 192 in page attention; page size a multiple of 16, <= 1024;
    KV_N * D <= 65535) and the sink's own (value D <= 128). gpt-oss (head 64) is served so by vllm-ascend
    (``attention_v1.py``)."""
    del causal
    where = f"npu_fused_infer_attention_score_v2 ({'fia_decode' if decode else 'extend'})"
    reasons = []
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"{where}: dtype {dtype} unsupported (query takes float16/bfloat16)")
    if v_head_dim != head_dim:
        reasons.append(
            f"{where}: v_head_dim {v_head_dim} != head_dim {head_dim} (paged key and value shapes must match)"
        )
    if head_dim not in (64, 128):
        reasons.append(
            f"{where}: head_dim {head_dim}: paged TND without rope takes 64 or 128 with V_D = K_D ('GQA和PA场景不支持"
            "V_D等于192'; op-plugin FIA v2 doc)"
        )
    if v_head_dim > SINK_MAX_VALUE_DIM:
        reasons.append(f"{where}: learnable_sink needs value D <= {SINK_MAX_VALUE_DIM}, not {v_head_dim}")
    if block_size % 16 or block_size > 1024:
        reasons.append(f"{where}: page size {block_size} must be a multiple of 16, <= 1024 (page attention, TND)")
    if logit_cap > 0:
        reasons.append(f"{where}: no logit soft-cap input")
    if kv_heads and q_heads and (q_heads % kv_heads or q_heads // kv_heads > 64):
        reasons.append(f"{where}: q_heads / kv_heads = {q_heads}/{kv_heads} must be an integer <= 64")
    if kv_heads and kv_heads * head_dim > 65535:
        reasons.append(
            f"{where}: kv_heads * head_dim = {kv_heads * head_dim} > 65535 in the (blocks, block_size, H) layout"
        )
    return reasons


def mla_unsupported_reasons(
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    q_heads: int,
    kv_heads: int,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    paths: Sequence[str] = ("mla_decode", "mla_fia"),
) -> list[str]:
    """Why the real ops cannot serve an MLA layer's ``paths``: ``mla_decode`` = ``_npu_paged_attention_mla``,
    ``mla_fia`` = FIA v2 with query_rope / key_rope, ``mla_tree`` = the same with a tree mask (verify)."""
    reasons: list[str] = []
    half = dtype in (torch.float16, torch.bfloat16)
    for path in paths:
        name = "_npu_paged_attention_mla" if path == "mla_decode" else "npu_fused_infer_attention_score_v2"
        where = f"{name} ({path})"
        if not half:
            reasons.append(f"{where}: dtype {dtype} unsupported (float16/bfloat16)")
        if kv_heads != 1:
            reasons.append(f"{where}: {kv_heads} latent KV heads (MLA caches have one)")
        if logit_cap > 0:
            reasons.append(f"{where}: no logit soft-cap input")
        if path == "mla_decode":
            if (kv_lora_rank, qk_rope_head_dim) != PA_MLA_DIMS:
                reasons.append(
                    f"{where}: latent {kv_lora_rank} + rope {qk_rope_head_dim}: upstream calls and tests it only at "
                    f"{PA_MLA_DIMS[0]} + {PA_MLA_DIMS[1]} (DeepSeek)"
                )
            if block_size % 16 or block_size > PA_MAX_BLOCK_SIZE:
                reasons.append(
                    f"{where}: page size {block_size}: head_size {kv_lora_rank + qk_rope_head_dim} > 256 needs a "
                    f"multiple of 16, <= {PA_MAX_BLOCK_SIZE} (op-plugin _atb_api_docs.py: '当key_cache或value_cache的"
                    "head_size > 256时，block_size小于等于128')"
                )
            if sliding_window >= 0:
                reasons.append(f"{where}: no mask or window input")
            continue
        if kv_lora_rank not in MLA_LATENT_DIMS or qk_rope_head_dim != MLA_ROPE_DIM:
            reasons.append(
                f"{where}: latent {kv_lora_rank} + rope {qk_rope_head_dim}: with query_rope/key_rope the latent D is "
                f"{' or '.join(map(str, MLA_LATENT_DIMS))} and the rope D {MLA_ROPE_DIM} (op-plugin FIA v2 doc, MLA)"
            )
        if block_size % 16 or block_size > 1024:
            reasons.append(f"{where}: page size {block_size} must be a multiple of 16, <= 1024 (MLA page attention)")
        if kv_lora_rank == 512 and q_heads > 128:
            reasons.append(f"{where}: {q_heads} query heads > 128 (D = 512)")
        if path == "mla_tree":
            if kv_lora_rank != MLA_TREE_LATENT_DIM:
                reasons.append(f"{where}: the verify tree mask (sparse_mode 9) needs latent D = {MLA_TREE_LATENT_DIM}")
            if sliding_window >= 0:
                reasons.append(f"{where}: a tree mask (sparse_mode 9) cannot carry a sliding window")
    return reasons
