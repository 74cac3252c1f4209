"""Which Ascend op serves each step of a layer on each chip generation, and why not (issue 23: split from
ascend_backend.py). The ops' limits: :mod:`hal.kernels.npu.limits`; their sources: :mod:`hal.kernels.npu.contracts`.
"""

from __future__ import annotations

import torch

from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.kernels import npu as npu_ops

from .emulated_ops import _op_dtype
from .graph_tasks import GRAPH_UPDATE_API

__all__ = ["AscendRouting", "MLA_GENERATIONS", "MLA_OFF"]

# Latent MLA per generation. hal's MLA pool is one [slots, 1, kv_lora_rank + rope] cache; the ops that read or write
# that layout (_npu_paged_attention_mla, _npu_reshape_and_cache_siso) are ATB ops (A2/A3).
MLA_GENERATIONS = ("A2", "A3")
MLA_OFF = {
    "A5": "no ATB ops (vllm-ascend runs none there), so nothing writes or reads hal's one latent ++ rope cache; "
    "FIA v2 alone would need the latent and rope parts in two caches",
    "310P": "no MLA op (vllm-ascend's 310P attention has no MLA path; FIA v2 is not run there)",
    None: "unknown generation",
}


def _mha_kv_write(generation: str | None) -> str:
    """The KV write op of an MHA layer: ``npu_scatter_pa_kv_cache`` (vllm-ascend's ``BaseDeviceAdaptor`` on A2/A3, and
    its ``A5DeviceAdaptor``, which inherits it); on 310P ``npu_scatter_nd_update_`` into hal's ND pool, which the
    attention ops then read as FRACTAL_NZ pages (``_nz_caches``). vllm-ascend's 310P runner allocates its caches NZ and
    writes them with ``_npu_reshape_and_cache``; hal's pool contract is ND, so the write is the ND one (doc:
    op-plugin ``torch_npu-npu_scatter_nd_update_.md``, Atlas inference series: float16)."""
    return "npu_scatter_nd_update_" if generation == "310P" else "npu_scatter_pa_kv_cache"


# The write of hal's one latent ++ rope MLA cache: ATB's K_CACHE_V_BYPASS is documented for A2 only
# (infer_op_params.h ReshapeAndCacheParam: '仅在Atlas 800I A2推理产品上支持设置为K_CACHE_V_BYPASS'; op-plugin tests
# _npu_reshape_and_cache_siso on Ascend910B only); A3 writes the cache rows with npu_scatter_nd_update_, as SGLang's NPU
# MLA pool does (one call per buffer).
_MLA_KV_WRITE = {"A2": "_npu_reshape_and_cache_siso", "A3": "npu_scatter_nd_update_"}


def _fp8_reason(generation: str | None) -> str:
    """Why an fp8 KV cache is off on ``generation`` (A2/A3/310P: no fp8 dtype; upstream quantises to int8)."""
    if generation == "A5":
        return (
            "fp8 KV cache on A5: vllm-ascend's fp8 (float8_e4m3fn) cache runs FIA with the query quantised too "
            "(query_quant_mode 3, dequant_scale_query/key/value, vllm_ascend/attention/mla_v1.py at 182b75e), not "
            "hal's bf16 queries over a per-layer scaled cache; not implemented in hal's Ascend backend"
        )
    return (
        f"fp8 KV cache on {generation}: the chip has no fp8 dtype; upstream's quantised KV cache there is int8 "
        "(vllm-ascend's fa_quant 'C8' path: int8 caches with FIA dequant scales, vllm_ascend/attention/mla_v1.py "
        "at 182b75e), which hal's kv_cache_dtype (fp8_e4m3 / fp8_e5m2) does not name"
    )


class AscendRouting:
    """Mixin of :class:`~hal.devices.npu.ascend_backend.AscendBackend`: its class-level routing and validation."""

    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        if capability.type != "npu":
            return [f"the ascend backend runs on the npu device only, not {capability.type}"]
        generation = npu_ops.generation_of_arch(capability.arch)
        if generation is None:
            return [capability.reasons.get("generation", f"unknown Ascend generation (arch {capability.arch!r})")]
        if "atb" in capability.reasons and generation != "A5":  # A2/A3 fall back to ATB ops, 310P runs only them
            return [capability.reasons["atb"]]
        return []

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        generation = npu_ops.generation_of_arch(capability.arch)
        if generation == "310P":
            route = "310P: _npu_paged_attention (decode), _npu_paged_attention_splitfuse (everything else), both over "
            route += "a FRACTAL_NZ copy of the batch's pages (npu_format_cast) and an NZ mask; npu_scatter_nd_update_ "
            route += "(KV write into hal's ND pool)"
        else:
            route = (
                f"{generation}: npu_fused_infer_attention_score (TND, paged) for decode, extend and mixed batches "
                f"it serves (head_dim {' or '.join(map(str, npu_ops.FIA_TND_HEAD_DIMS))}, no window or custom "
                "mask; op-plugin's FIA doc), npu_scatter_pa_kv_cache for the KV write"
            )
            route += (
                "; nothing else (A5 has no ATB ops)"
                if generation == "A5"
                else "; _npu_paged_attention for captured decode graphs and decodes FIA cannot serve, "
                "_npu_paged_attention_splitfuse for windows, verify masks and extends FIA cannot serve"
            )
        if generation in MLA_GENERATIONS:
            route += (
                "; MLA: _npu_reshape_and_cache_siso (KV write), _npu_paged_attention_mla (decode), "
                "npu_fused_infer_attention_score_v2 with query_rope/key_rope over a split copy (other steps)"
            )
        else:
            route += f"; no MLA ({MLA_OFF.get(generation, 'unknown generation')})"
        if generation in ("A2", "A3"):  # FIA v2's product table lists A2/A3 only
            route += "; attention sinks: npu_fused_infer_attention_score_v2 with learnable_sink"
        limits = [f"limit {line}" for line in npu_ops.contracts.limits_for(generation)] if generation else []
        return [*super().notes(capability), route + " (routes() and extend_route() say why)", *limits]

    @staticmethod
    def _reasons(config: AttentionConfig, capability: DeviceCapability, path: str, window: int = -1) -> list[str]:
        return npu_ops.unsupported_reasons(
            config.head_dim,
            config.v_head_dim,
            config.page_size,
            _op_dtype(config.dtype, capability),
            config.logit_cap,
            window,
            config.custom_mask and path == "mixed",
            not config.non_causal,
            kv_heads=config.tp_k_head_num,
            q_heads=config.tp_q_head_num,
            paths=(path,),
            chip=npu_ops.generation_of_arch(capability.arch),
        )

    @classmethod
    def routes(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """``step:op`` for every step of ``config`` an op serves here (``hal check`` reports the unreached ones).
        A captured decode's ``_npu_paged_attention`` needs a real NPU: the emulation replays eagerly."""
        steps = cls.step_routes(config, capability)
        if capability.emulated:
            steps.pop("graph_decode", None)
        relayout = ["relayout"] if config.page_size > 1 else []  # the scratch copy of slots off their page offsets
        split = ["mla_split"] if config.kv_lora_rank and "npu_fused_infer_attention_score_v2" in steps.values() else []
        return [f"{step}:{op}" for step, op in steps.items() if op] + relayout + split

    @classmethod
    def step_routes(cls, config: AttentionConfig, capability: DeviceCapability) -> dict[str, str]:
        """The op each kind of step of ``config`` runs on this generation (``""``: none can)."""
        if config.kv_lora_rank:
            return cls._mla_step_routes(config, capability)
        if config.attention_sinks:
            return cls._sink_step_routes(config, capability)
        generation = npu_ops.generation_of_arch(capability.arch)
        window = config.sliding_window_size
        fia = generation in ("A2", "A3", "A5")
        atb = generation in ("A2", "A3", "310P")
        pa, sf, fia_op = "_npu_paged_attention", "_npu_paged_attention_splitfuse", "npu_fused_infer_attention_score"

        def pick(fia_path: str, atb_path: str, atb_op: str, window: int) -> str:
            if fia and not cls._reasons(config, capability, fia_path, window):
                return fia_op
            return atb_op if atb and not cls._reasons(config, capability, atb_path, window) else ""

        decode = pick("fia_decode", "decode", pa, -1) if window < 0 else pick("fia_decode", "mixed", sf, window)
        routes = {
            "kv_write": _mha_kv_write(generation),
            "decode": decode,
            "extend": pick("extend", "mixed", sf, window),
            "mixed": pick("extend", "mixed", sf, window),
        }
        if config.custom_mask:
            routes["target_verify"] = sf if atb and not cls._reasons(config, capability, "mixed", window) else ""
        if config.graph and window < 0:  # a captured decode runs the one op with an in-graph length update
            routes["graph_decode"] = pa if atb and not cls._reasons(config, capability, "decode") else ""
        return routes

    @classmethod
    def _mla_reasons(cls, config: AttentionConfig, capability: DeviceCapability, path: str) -> list[str]:
        """Why the op of MLA ``path`` (``mla_decode`` / ``mla_fia`` / ``mla_tree``) cannot serve ``config`` here."""
        generation = npu_ops.generation_of_arch(capability.arch)
        if generation not in MLA_GENERATIONS:
            return [f"MLA on {generation}: {MLA_OFF[generation]}"]
        return npu_ops.mla_unsupported_reasons(
            config.kv_lora_rank,
            config.qk_rope_head_dim,
            config.page_size,
            _op_dtype(config.dtype, capability),
            q_heads=config.tp_q_head_num,
            kv_heads=config.tp_k_head_num,
            logit_cap=config.logit_cap,
            sliding_window=config.sliding_window_size,
            paths=(path,),
        )

    @classmethod
    def _mla_step_routes(cls, config: AttentionConfig, capability: DeviceCapability) -> dict[str, str]:
        """MLA over hal's one latent ++ rope cache: the KV write and decode take the ATB ops that read that layout;
        the other steps take FIA v2, which needs the latent and rope parts apart (``mla_split`` copies them)."""
        fia = "npu_fused_infer_attention_score_v2"

        def pick(path: str, op: str) -> str:
            return "" if cls._mla_reasons(config, capability, path) else op

        decode = pick("mla_decode", "_npu_paged_attention_mla") or pick("mla_fia", fia)
        write = _MLA_KV_WRITE.get(npu_ops.generation_of_arch(capability.arch), "")
        routes = {
            "kv_write": pick("mla_decode", write) or pick("mla_fia", write),
            "decode": decode,
            "extend": pick("mla_fia", fia),
            "mixed": pick("mla_fia", fia),
        }
        if config.custom_mask:
            routes["target_verify"] = pick("mla_tree", fia)
        return routes

    @classmethod
    def _sink_reasons(cls, config: AttentionConfig, capability: DeviceCapability, step: str) -> list[str]:
        """Why FIA v2 with ``learnable_sink`` cannot serve ``step`` of ``config`` here."""
        generation = npu_ops.generation_of_arch(capability.arch)
        if generation == "310P":
            return ["attention sinks on 310P: no FIA (vllm-ascend runs only the ATB ops there), no op takes a sink"]
        if generation == "A5":
            return [
                "attention sinks on A5: npu_fused_infer_attention_score_v2 (the one op with learnable_sink) lists "
                "A2/A3 only in its product table (op-plugin docs/zh/custom_APIs/torch_npu/"
                "torch_npu-npu_fused_infer_attention_score_v2.md, '产品支持情况')"
            ]
        if step == "target_verify":
            return [
                "npu_fused_infer_attention_score_v2 (target_verify): learnable_sink with hal's verify mask: TND takes "
                "no custom mask without MLA's rope inputs (its tree mask, sparse_mode 9, is MLA-only)"
            ]
        return npu_ops.sink_unsupported_reasons(
            config.head_dim,
            config.v_head_dim,
            config.page_size,
            _op_dtype(config.dtype, capability),
            config.logit_cap,
            not config.non_causal,
            kv_heads=config.tp_k_head_num,
            q_heads=config.tp_q_head_num,
            decode=step == "decode",
        )

    @classmethod
    def _sink_step_routes(cls, config: AttentionConfig, capability: DeviceCapability) -> dict[str, str]:
        """Layers with attention sinks: every attention step is FIA v2 with ``learnable_sink`` (windows as band
        mode 4); the KV write is the MHA one."""
        generation = npu_ops.generation_of_arch(capability.arch)
        steps = ["decode", "extend", "mixed"] + (["target_verify"] if config.custom_mask else [])
        routes = {"kv_write": _mha_kv_write(generation)}
        fia = "npu_fused_infer_attention_score_v2"
        return routes | {step: "" if cls._sink_reasons(config, capability, step) else fia for step in steps}

    @classmethod
    def extend_route(cls, config: AttentionConfig, capability: DeviceCapability) -> tuple[str, list[str]]:
        """``(op, reasons)``: the op EXTEND batches of ``config`` run, and why FIA does not serve them."""
        reasons = cls._reasons(config, capability, "extend", config.sliding_window_size)
        return cls.step_routes(config, capability)["extend"], reasons

    @classmethod
    def unsupported_reasons(cls, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        reasons = super().unsupported_reasons(config, capability)
        generation = npu_ops.generation_of_arch(capability.arch)
        window = config.sliding_window_size
        if config.kv_cache_dtype_name != config.dtype_name and config.kv_cache_dtype_name.startswith("fp8"):
            reasons.append(_fp8_reason(generation))
        for step, op in cls.step_routes(config, capability).items():
            if op:
                continue
            if config.attention_sinks and not config.kv_lora_rank:
                reasons += [f"{step}: {why}" for why in cls._sink_reasons(config, capability, step)]
                continue
            if config.kv_lora_rank:
                both = ("mla_decode", "mla_fia")
                paths = {"decode": both, "kv_write": both, "target_verify": ("mla_tree",)}.get(step, ("mla_fia",))
                reasons += [f"{step}: {why}" for path in paths for why in cls._mla_reasons(config, capability, path)]
                continue
            why = []
            if generation in ("A2", "A3", "A5") and step != "target_verify" and step != "graph_decode":
                why += cls._reasons(
                    config, capability, "fia_decode" if step == "decode" and window < 0 else "extend", window
                )
            if generation != "A5":
                atb_path = "decode" if step in ("decode", "graph_decode") and window < 0 else "mixed"
                why += cls._reasons(config, capability, atb_path, -1 if atb_path == "decode" else window)
            else:
                why.append(f"{step}: A5 has no ATB ops (vllm-ascend never runs _npu_paged_attention/splitfuse there)")
            reasons += why or [f"{step}: no Ascend op serves it on {generation}"]
        if config.kv_lora_rank:
            reasons += cls._mla_graph_reasons(config, capability)
            if config.attention_sinks:
                reasons.append("attention sinks with MLA: learnable_sink needs value D <= 128 and no rope inputs")
        elif config.attention_sinks and config.graph and capability.available and not capability.emulated:
            reasons.append(
                "graph capture of attention sinks on a real NPU: no in-graph update of FIA v2's host lengths"
            )
        if config.graph and capability.available and not capability.emulated:
            npu = getattr(torch, "npu", None)
            missing = [name for name in GRAPH_UPDATE_API if not hasattr(npu, name)]
            if missing:
                reasons.append(
                    f"graph capture needs torch_npu's graph task update API (torch.npu.{', '.join(missing)} "
                    "missing): the ops take host lengths that every replay must update"
                )
            if config.sliding_window_size >= 0:
                reasons.append(
                    "graph capture of sliding-window decode (_npu_paged_attention_splitfuse) on a real NPU: "
                    "no documented in-graph update of its host lengths; only _npu_paged_attention has one"
                )
            if config.custom_mask:
                reasons.append(
                    "graph capture of TARGET_VERIFY (_npu_paged_attention_splitfuse with the verify mask) on a "
                    "real NPU: no documented in-graph update of its host lengths; capture decode only there"
                )
        return list(dict.fromkeys(reasons))

    @staticmethod
    def _mla_graph_reasons(config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        reasons = []
        if not capability.emulated and capability.available:
            module, _ = npu_ops.load_torch_npu()
            missing = [name for name in npu_ops.MLA_OP_NAMES if module is not None and not hasattr(module, name)]
            if missing:
                reasons.append(f"MLA: torch_npu lacks {', '.join(missing)}")
            if config.graph:
                reasons.append(
                    "graph capture of MLA on a real NPU: _npu_paged_attention_mla cannot be captured (SGLang asserts "
                    "it) and hal has no in-graph update of FIA v2's host lengths"
                )
        if config.graph and config.custom_mask:
            reasons.append(
                "graph capture of MLA TARGET_VERIFY: its FIA tree mask is gathered from the verify mask per step "
                "with host-built indices; hal captures MLA decode only"
            )
        return reasons
