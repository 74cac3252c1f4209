"""The documented contract of every torch_npu op hal calls: ONE table, read by the emulation, the routing and the docs.

Each :class:`Constraint` row names the op, a short key, the chip generations it applies to, the rule in words, the
upstream source that states it (repository@commit, path, section or line) and the test that proves the emulation
enforces it. The emulation (:mod:`hal.kernels.npu.emulation`) raises through :func:`violation` with the row's words
and source; ``hal info`` lists the rows of the emulated generation (:func:`limits_for`); ``docs/hardware-contracts.md``
is written from the same rows. Leaf module: imports nothing of hal.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALL_CHIPS",
    "Constraint",
    "CONSTRAINTS",
    "ACL_FORMAT_ND",
    "ACL_FORMAT_FRACTAL_NZ",
    "ATB_310P_MAX_BATCH",
    "FIA_DECODE_MAX_KV",
    "FIA_MAX_SEQ",
    "FIA_A5_MAX_HEAD_DIM",
    "INT32_MAX",
    "rule",
    "chips_of",
    "available",
    "violation",
    "limits_for",
    "markdown",
]

ALL_CHIPS = ("A2", "A3", "A5", "310P")
ACL_FORMAT_ND = 2  # torch_npu's ACL format ids (vllm_ascend/utils.py ACL_FORMAT_FRACTAL_NZ = 29)
ACL_FORMAT_FRACTAL_NZ = 29

# The numbers of the rows below, read by the emulation and by hal's routing (one place for each).
INT32_MAX = 2**31 - 1  # an int32 argument (ATB's host lengths, block tables, the slots the KV writes take)
FIA_DECODE_MAX_KV = 262144  # FIA / FIA v2 at Q_S = 1: KV_S <= 262144 (the "kv_len" rows)
FIA_MAX_SEQ = 20971520  # FIA at Q_S > 1: Q_S and KV_S <= 20M (the "kv_len" rows)
FIA_A5_MAX_HEAD_DIM = 512  # FIA TND on A5: any D vllm-ascend sends, <= 512 (the "tnd_head_dim_a5" row)
ATB_310P_MAX_BATCH = 2048  # ATB PagedAttention on 310P: 0 < batch (requests) <= 2048 (the "dtype_310p" row)

_OPP = "Ascend/op-plugin@517f2e7 "
_VA = "vllm-project/vllm-ascend@182b75e "
_PA_DOC = (
    _OPP + "op_plugin/python/atb/_atb_api_docs.py, _npu_paged_attention_v2 '规格约束' (ATB PagedAttentionOperation)"
)
_PA_PARAM = _OPP + "op_plugin/third_party/atb/inc/infer_op_params.h, struct PagedAttentionParam"
_RC_PARAM = _OPP + "op_plugin/third_party/atb/inc/infer_op_params.h, struct ReshapeAndCacheParam::KvCacheCfg"
_ATB_OUT = (
    _OPP
    + "op_plugin/python/atb/_atb_api_docs.py, _npu_paged_attention_v2 'out: ... shape为[num_tokens, num_head, "
    + "head_size_v]'; op_plugin/utils/custom_functions/atb/AtbCommon.cpp, ParamSetter::Output (no contiguous copy, "
    + "unlike Input) and AtTensor2AtbTensor ('at_tensor is not contiguous')"
)
_FIA = _OPP + "docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md"
_FIA2 = _OPP + "docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score_v2.md"
_SCATTER = _OPP + "docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_pa_kv_cache.md"
_ND_UPDATE = _OPP + "docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_nd_update_.md"
_VA_310P = (
    _VA
    + "vllm_ascend/_310p/attention/attention_v1.py get_kv_cache_shape; _310p/model_runner_310p.py "
    + ("_allocate_kv_cache_tensors (torch_npu.empty_with_format(..., acl_format=ACL_FORMAT_FRACTAL_NZ))")
)
_VA_A5 = _VA + "vllm_ascend/device/device_op.py A5DeviceAdaptor (inherits BaseDeviceAdaptor.reshape_and_cache)"
_VA_A5_FIA = (
    _VA
    + "vllm_ascend/device/device_op.py:967-995 (A5DeviceAdaptor.npu_fused_infer_attention_score: every head size to "
    + "FIA, no gate) and :74-90 (BaseDeviceAdaptor: D = 512 falls back on A2/A3 only, 'until A2/A3 FIA TND supports "
    + "Gemma4's 512-dim ... heads'); vllm_ascend/attention/utils.py:170-172 (using_paged_attention: never on A5)"
)


@dataclass(frozen=True)
class Constraint:
    """One documented rule of one op: the ``chips`` it applies to, the ``rule``, its ``source``, the ``test``."""

    op: str
    key: str
    chips: tuple[str, ...]
    rule: str
    source: str
    test: str


_PA = "_npu_paged_attention"
_SF = "_npu_paged_attention_splitfuse"
_MLA = "_npu_paged_attention_mla"
_RC = "_npu_reshape_and_cache"
_SISO = "_npu_reshape_and_cache_siso"
_FIA_OP = "npu_fused_infer_attention_score"
_FIA2_OP = "npu_fused_infer_attention_score_v2"
_SPA = "npu_scatter_pa_kv_cache"
_NDU = "npu_scatter_nd_update_"
_ATB_CHIPS = ("A2", "A3", "310P")
_V2_CHIPS = ("A2", "A3", "A5")
_T = "tests/test_npu_contracts.py::"

CONSTRAINTS: tuple[Constraint, ...] = (
    # --- availability per chip -------------------------------------------------------------------------------------
    *(
        Constraint(
            op,
            "chips",
            _ATB_CHIPS,
            "an ATB op: A2/A3/310P; vllm-ascend runs no ATB attention op on A5",
            _VA + "vllm_ascend/attention/utils.py using_paged_attention (never on A5); " + _PA_DOC,
            _T + "test_op_availability_per_chip",
        )
        for op in (_PA, _SF, _RC)
    ),
    Constraint(
        _MLA,
        "chips",
        ("A2", "A3"),
        "ATB PagedAttention with mlaVHeadSize: A2/A3 (SGLang's NPU MLA decode); 310P has no MLA path",
        _OPP + "op_plugin/ops/atb/PagedAttentionMlaAtb.cpp; " + _VA + "vllm_ascend/_310p (no MLA attention)",
        _T + "test_op_availability_per_chip",
    ),
    Constraint(
        _SISO,
        "chips",
        ("A2",),
        "ReshapeAndCache with kvCacheCfg = K_CACHE_V_BYPASS is supported on Atlas 800I A2 only "
        "('仅在Atlas 800I A2推理产品上支持设置为K_CACHE_V_BYPASS'); op-plugin tests it on Ascend910B only",
        _RC_PARAM
        + "; "
        + _OPP
        + "test/test_custom_ops/test_atb_reshape_and_cache_siso.py (@SupportedDevices(['Ascend910B']))",
        _T + "test_op_availability_per_chip",
    ),
    Constraint(
        _FIA_OP,
        "chips",
        ("A2", "A3", "A5"),
        "A2/A3 (the doc's product table); A5: vllm-ascend's A5DeviceAdaptor calls it; not 310P",
        _FIA
        + " '产品支持情况'; "
        + _VA
        + "vllm_ascend/device/device_op.py A5DeviceAdaptor.npu_fused_infer_attention_score",
        _T + "test_op_availability_per_chip",
    ),
    Constraint(
        _FIA2_OP,
        "chips",
        ("A2", "A3", "A5"),
        "A2/A3 (the doc's product table); A5: vllm-ascend calls it for sinks with no device gate; not 310P",
        _FIA2
        + " '产品支持情况'; "
        + _VA
        + "vllm_ascend/attention/attention_v1.py:1375-1400 (forward_fused_infer_attention, the path every A5 step "
        + "takes: npu_fused_infer_attention_score_v2 with learnable_sink, no device check)",
        _T + "test_op_availability_per_chip",
    ),
    Constraint(
        _SPA,
        "chips",
        ("A2", "A3", "A5"),
        "A2/A3 (the doc's product table); A5: vllm-ascend's A5DeviceAdaptor writes the KV with it",
        _SCATTER + " '产品支持情况'; " + _VA_A5,
        _T + "test_op_availability_per_chip",
    ),
    Constraint(
        _NDU,
        "chips",
        ("A2", "A3", "310P"),
        "A2/A3 and the Atlas inference series (310P: float32/float16/bool only)",
        _ND_UPDATE + " '产品支持情况', 'input'",
        _T + "test_op_availability_per_chip",
    ),
    # --- ATB PagedAttention (decode, splitfuse, MLA) ----------------------------------------------------------------
    Constraint(
        _PA,
        "block_size",
        _ATB_CHIPS,
        "block_size a multiple of 16 and <= 128 ('因硬件限制，block_size %16 == 0' and 'block_size <= 128')",
        _PA_DOC,
        _T + "test_paged_attention_block_size_limit",
    ),
    Constraint(
        _PA,
        "head_size",
        _ATB_CHIPS,
        "head_size in (0, 256], one head_size for K and V",
        _PA_DOC + "; " + _PA_PARAM,
        _T + "test_paged_attention_block_size_limit",
    ),
    Constraint(
        _PA,
        "head_x_block",
        ("310P",),
        "block_size * head_size <= 128 * 128 on the Atlas inference series (310P)",
        _PA_DOC + " ('以及Atlas 推理系列产品上 ... block_size * head_size ≤ 128 * 128')",
        _T + "test_310p_takes_nz_caches_only",
    ),
    Constraint(
        _SF,
        "head_x_block",
        _ATB_CHIPS,
        "parallel decoding (CALC_TYPE_SPEC, the splitfuse binding): block_size * head_size <= 128 * 128",
        _PA_DOC + " ('并行解码场景 ... block_size * head_size ≤ 128 * 128')",
        _T + "test_paged_attention_block_size_limit",
    ),
    Constraint(
        _MLA,
        "block_size",
        ("A2", "A3"),
        "head_size > 256 (MLA's 576) needs block_size <= 128, a multiple of 16",
        _PA_DOC + " ('当key_cache或value_cache的head_size > 256时，block_size小于等于128')",
        _T + "test_mla_decode_block_size_limit",
    ),
    *(
        Constraint(
            op,
            "out",
            chips,
            f"out: {shape} in query's dtype, contiguous (written in place as given; ATB refuses a non-contiguous "
            "output tensor)",
            _ATB_OUT + (f"; {_OPP}op_plugin/ops/atb/PagedAttentionMlaAtb.cpp (mla_vheadsize)" if op == _MLA else ""),
            _T + "test_atb_attention_out_contract",
        )
        for op, chips, shape in (
            (_PA, _ATB_CHIPS, "[num_tokens, num_heads, head_size]"),
            (_SF, _ATB_CHIPS, "[num_tokens, num_heads, head_size]"),
            (_MLA, ("A2", "A3"), "[num_tokens, num_heads, mla_vheadsize]"),
        )
    ),
    Constraint(
        _PA,
        "layout",
        _ATB_CHIPS,
        "key/value caches: A2/A3 ND [num_blocks, block_size, kv_heads, head_size]; 310P FRACTAL_NZ "
        "[num_blocks, head_size * num_heads / 16, block_size, 16] (head_size a multiple of 16)",
        _PA_DOC + " (key_cache/value_cache); " + _VA_310P,
        _T + "test_310p_takes_nz_caches_only",
    ),
    Constraint(
        _PA,
        "dtype_310p",
        ("310P",),
        "query, caches and mask float16 only, 0 < batch <= 2048 on the Atlas inference series (batch: requests, "
        "context_lens' length, not tokens; hal splits a larger batch into calls of <= 2048 requests)",
        _PA_DOC
        + " ('在Atlas 推理系列产品上 ：query、key_cache、value_cache、mask 四个入参只支持float16。0<batch<=2048')",
        _T + "test_310p_takes_nz_caches_only",
    ),
    Constraint(
        _SF,
        "mask_310p",
        ("310P",),
        "the splitfuse mask in FRACTAL_NZ [1, ceil16(max_seq_len) / 16, ceil16(num_tokens), 16]",
        _VA + "vllm_ascend/_310p/attention/attention_mask.py get_splitfuse_mask (nd_to_nz_spec, npu_format_cast "
        "ACL_FORMAT_FRACTAL_NZ); vllm_ascend/utils.py nd_to_nz_spec",
        _T + "test_310p_takes_nz_caches_only",
    ),
    Constraint(
        _PA,
        "context_lens",
        _ATB_CHIPS,
        "context_lens int32 [batch] host data; block_table int32 [batch, max_blocks] with ids in [0, num_blocks)",
        _PA_DOC + " ('block_tables中元素的值须在[0, num_blocks)之间')",
        "tests/test_npu_kernels.py::test_decode_rejects_bad_inputs",
    ),
    # --- KV writes ---------------------------------------------------------------------------------------------------
    Constraint(
        _RC,
        "slots",
        _ATB_CHIPS,
        "slot_indices int32 [num_tokens] in [0, num_blocks * block_size); a negative slot is skipped; "
        "no repeated slot; one dtype for key, value and both caches",
        _OPP + "op_plugin/ops/atb/ReshapeAndCachAtb.cpp; ATB ReshapeAndCache doc ('取值为负数时不进行任何搬运操作')",
        "tests/test_npu_kernels.py::test_reshape_and_cache_rejects_bad_inputs",
    ),
    Constraint(
        _RC,
        "layout",
        _ATB_CHIPS,
        "ND caches, or both caches FRACTAL_NZ [num_blocks, heads * head_size / 16, block_size, 16] "
        "(kvCacheCfg K_CACHE_V_CACHE_NZ, chosen by the caches' format); 310P caches are NZ",
        _OPP + "op_plugin/ops/atb/ReshapeAndCachAtb.cpp (get_npu_format == ACL_FORMAT_FRACTAL_NZ); " + _VA_310P,
        _T + "test_310p_takes_nz_caches_only",
    ),
    Constraint(
        _SPA,
        "slots",
        ("A2", "A3", "A5"),
        "slot_mapping int32/int64 in [0, num_blocks * block_size - 1] (no negative slot); repeated slots: "
        "'重复时不保证正确性'; cache_mode 'Norm' = ND caches; every tensor contiguous",
        _SCATTER + " '约束说明'",
        "tests/test_npu_kernels.py::test_write_kv_matches_reference_and_skips_negative_slots",
    ),
    Constraint(
        _NDU,
        "indices",
        ("A2", "A3", "310P"),
        "indices int32/int64, at least 2-D, no index out of bounds (no negative); updates shaped "
        "indices.shape[:-1] + input.shape[a:]; one dtype for input and updates",
        _ND_UPDATE + " '参数说明', '约束说明'",
        _T + "test_scatter_nd_update_contract",
    ),
    # --- FIA (v1) ----------------------------------------------------------------------------------------------------
    Constraint(
        _FIA_OP,
        "tnd_batch",
        ("A2", "A3", "A5"),
        "TND: actual_seq_lengths / actual_seq_lengths_kv required, their length is the batch, <= 4096",
        _FIA + " 'TND布局约束'",
        _T + "test_fia_tnd_batch_limit",
    ),
    Constraint(
        _FIA_OP,
        "tnd_head_dim",
        ("A2", "A3"),
        "TND without rope: Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with V_D 128 or 192",
        _FIA + " 'TND布局约束' (query D ≠ 512)",
        "tests/test_npu_kernels.py::test_unsupported_reasons",
    ),
    Constraint(
        _FIA_OP,
        "tnd_head_dim_a5",
        ("A5",),
        "A5, TND without rope: any D vllm-ascend sends (the doc lists no A5; its A5 adaptor gates no head size and "
        "runs D = 512 where A2/A3 fall back): D a multiple of 16 (16-byte aligned) and <= 512, K_D = V_D",
        _VA_A5_FIA + "; " + _FIA + " '各轴取值范围速查' (D ≤ 512, float16/bfloat16 16字节对齐)",
        _T + "test_a5_fia_takes_the_head_dims_vllm_ascend_sends",
    ),
    Constraint(
        _FIA_OP,
        "kv_len",
        ("A2", "A3", "A5"),
        "Q_S = 1 (every request one query token): KV_S <= 262144; Q_S > 1: Q_S and KV_S <= 20971520. hal sends a "
        "one-token request over more keys with a padding row (Q_S = 2), the way it sends a windowed decode",
        _FIA + " '各轴取值范围速查' (S (KV_S): Q_S > 1 ≤ 20971520, Q_S = 1 ≤ 262144) and 'Q_S = 1（Decode）专属约束' "
        "('S轴（KV）：≤ 262144')",
        _T + "test_fia_kv_length_limit",
    ),
    Constraint(
        _FIA_OP,
        "sparse_rows",
        ("A2", "A3", "A5"),
        "a TND call mixing one-token and longer requests under sparse_mode 4: the doc says only that Q_S = 1 ignores "
        "the band, not whether a one-token row of such a call is banded; the emulation takes the unsafe reading "
        "(such a row sees every key) and hal pads those rows to Q_S = 2, so either reading gives the band",
        _FIA
        + " ('Q_S = 1且不带rope输入时，sparse_mode参数无效'; pre_tokens/next_tokens 'Q_S=1时无效'; nothing per row)",
        _T + "test_fia_mixed_windowed_rows_are_banded_per_row",
    ),
    Constraint(
        _FIA_OP,
        "block_size",
        ("A2", "A3", "A5"),
        "page attention: Q_S > 1 block_size a multiple of 128 in [128, 512]; Q_S = 1 a multiple of 16, <= 512",
        _FIA + " PageAttention table (block_size)",
        "tests/test_npu_kernels.py::test_prefill_block_size_and_window_limits",
    ),
    Constraint(
        _FIA_OP,
        "sparse_q1",
        ("A2", "A3", "A5"),
        "Q_S = 1 without rope: sparse_mode, pre_tokens and next_tokens are ignored (a window needs Q_S > 1)",
        _FIA + " ('Q_S = 1且不带rope输入时，sparse_mode参数无效'; pre_tokens/next_tokens 'Q_S=1时无效')",
        _T + "test_fia_ignores_the_band_at_one_query_token",
    ),
    Constraint(
        _FIA_OP,
        "sparse_tnd",
        ("A2", "A3", "A5"),
        "TND takes sparse_mode 0 (no mask), 3 (rightDownCausal) or 4 (band: pre_tokens = window, next_tokens = 0), "
        "3/4 with the compressed 2048 x 2048 mask",
        _FIA + " sparse_mode table; " + _VA + "vllm_ascend/attention/attention_v1.py:939-943 (TND, sparse_mode=4)",
        "tests/test_npu_kernels.py::test_prefill_block_size_and_window_limits",
    ),
    # --- FIA v2 (rows A2/A3 by the doc; A5 runs it by vllm-ascend's code, the "chips" row) ---------------------------
    Constraint(
        _FIA2_OP,
        "tnd_batch",
        _V2_CHIPS,
        "TND: actual_seq_qlen / actual_seq_kvlen required, their length is the batch, <= 4096",
        _FIA2 + " 'MLA场景约束' (TND 综合限制)",
        _T + "test_fia_tnd_batch_limit",
    ),
    Constraint(
        _FIA2_OP,
        "mla",
        _V2_CHIPS,
        "query_rope/key_rope: latent D 512 (Q_N 1..128 a power of two, KV_N 1, sparse 0/3/4/9) or 128, rope D 64, "
        "page block_size a multiple of 16, <= 1024",
        _FIA2 + " 'MLA场景约束'",
        "tests/test_npu_kernels.py::test_fia_v2_refuses_what_its_doc_forbids",
    ),
    Constraint(
        _FIA2_OP,
        "mla_q16",
        _V2_CHIPS,
        "absorbed MLA in TND: at most 16 query tokens per request (vllm-ascend sends only decode / speculative "
        "steps and pads actual_seq_lengths_q to <= 16 per request)",
        _VA + "vllm_ascend/attention/mla_v1.py:255-257 and 348-365 ('npu_fused_infer_attention_score TND layout's "
        "limit of 16', FIA_SEQ_LEN_LIMIT = 16)",
        _T + "test_mla_tnd_query_limit",
    ),
    Constraint(
        _FIA2_OP,
        "sparse_q1",
        _V2_CHIPS,
        "Q_S = 1 without rope inputs: sparse_mode (and so a band) is ignored",
        _FIA2 + " sparse_mode ('Q_S为1且不带rope输入时该参数无效')",
        _T + "test_fia_ignores_the_band_at_one_query_token",
    ),
    Constraint(
        _FIA2_OP,
        "sink",
        _V2_CHIPS,
        "learnable_sink (Q_N,) bfloat16: TND only, value D <= 128, unquantised; so without rope D 64 or 128 "
        "(vllm-ascend serves gpt-oss, D = 64, so)",
        _FIA2
        + " 'learnable_sink约束' and TND 'query D ≠ 512' (MHA: 64/64/64, 128/128/128, 192/192/128); "
        + _VA
        + "vllm_ascend/attention/attention_v1.py:689-705",
        "tests/test_npu_kernels.py::test_paged_attention_sinks_adds_the_sink_to_every_denominator",
    ),
    Constraint(
        _FIA2_OP,
        "block_size",
        _V2_CHIPS,
        "TND without rope, page attention: block_size a multiple of 16, <= 1024",
        _FIA2 + " TND 'query D ≠ 512' ('page attention场景下仅支持blocksize为16对齐且小于等于1024')",
        "tests/test_npu_kernels.py::test_fia_v2_refuses_what_its_doc_forbids",
    ),
    Constraint(
        _FIA2_OP,
        "tnd_head_dim",
        _V2_CHIPS,
        "TND without rope: GQA and page attention take no V_D = 192 ('GQA和PA场景不支持V_D等于192'); MHA takes "
        "64/64/64, 128/128/128 or 192/192/128. hal calls it paged with K_D = V_D: D 64 or 128 (sinks); a paged "
        "192/192 layer goes to FIA v1, whose TND rule takes V_D 192",
        _FIA2 + " 'MLA场景约束', TND 'query D ≠ 512' (query_rope/key_rope为空时)",
        _T + "test_fia_v2_refuses_v_d_192_paged",
    ),
    Constraint(
        _FIA2_OP,
        "kv_len",
        _V2_CHIPS,
        "Q_S = 1: KV_S <= 262144 (S轴小于等于262144); hal pads a one-token request over more keys to Q_S = 2",
        _FIA2 + " 'Q_S=1（增量推理）约束' ('支持S轴小于等于262144')",
        _T + "test_fia_kv_length_limit",
    ),
)

_INDEX = {(c.op, c.key): c for c in CONSTRAINTS}


def rule(op: str, key: str) -> Constraint:
    """The row of ``op``'s constraint ``key`` (KeyError when the table has none: a bug in the caller)."""
    return _INDEX[(op, key)]


def chips_of(op: str) -> tuple[str, ...]:
    """The generations ``op`` exists on (its ``chips`` row)."""
    return rule(op, "chips").chips


def available(op: str, chip: str | None) -> bool:
    """Whether ``op`` may be called on ``chip`` (an unknown chip: never)."""
    return chip in chips_of(op)


def violation(op: str, key: str, what: str) -> ValueError:
    """The error a call that breaks ``op``'s rule ``key`` raises: ``what`` was passed, the rule, its source."""
    row = rule(op, key)
    return ValueError(f"{op}: {what}: the op's contract says {row.rule} [{row.source}]")


def limits_for(chip: str, ops: tuple[str, ...] | None = None) -> list[str]:
    """``op: rule`` lines of every row that applies on ``chip`` (the ops hal calls there, or ``ops``)."""
    wanted = (
        ops if ops is not None else tuple(op for op in dict.fromkeys(c.op for c in CONSTRAINTS) if available(op, chip))
    )
    return [f"{c.op}: {c.rule}" for c in CONSTRAINTS if c.op in wanted and c.key != "chips" and chip in c.chips]


def markdown() -> str:
    """The table as the Markdown rows of ``docs/hardware-contracts.md`` (a test keeps the doc equal to this)."""
    lines = ["| op | chips | constraint | source | test |", "|---|---|---|---|---|"]
    for c in CONSTRAINTS:
        cells = [f"`{c.op}`", "/".join(c.chips), c.rule, c.source, f"`{c.test}`"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"
