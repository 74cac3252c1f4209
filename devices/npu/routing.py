"""Which Ascend op serves each step of a layer on each chip generation, and why not.

Plain functions of a model's config, or of one layer and its step, and of the chip; nothing here reads a backend.
Two views of one table:

* per model, for selection and ``hal check``: :func:`step_routes` (step -> op), :func:`routes`,
  :func:`extend_route`, :func:`notes`, :func:`unavailable_reasons` and :func:`unsupported_reasons`, which
  :class:`~hal.devices.npu.ascend_backend.AscendBackend`'s classmethods of the same names answer with;
* per layer, at run time: :func:`attention_route`, :func:`sink_route` and :func:`mla_route` give the
  :class:`Route` one step of a layer takes on the :class:`~hal.devices.npu.metadata.StepFacts` its plan recorded,
  :func:`kv_write_op` the op of its KV write.

The ops' limits: :mod:`hal.kernels.npu.limits`; their sources: :mod:`hal.kernels.npu.contracts`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.deprecation import moved_names
from hal.kernels import npu as npu_ops
from hal.kv_layouts import FRACTAL_NZ, kv_layout
from hal.layer import AttentionLayer

from .emulated_ops import _op_dtype
from .graph_tasks import GRAPH_UPDATE_API
from .metadata import MaskKey, StepFacts

__all__ = [
    "FIA",
    "FIA_V2",
    "MLA_DECODE",
    "MLA_GENERATIONS",
    "MLA_OFF",
    "PAGED",
    "SPLITFUSE",
    "Route",
    "attention_route",
    "extend_route",
    "kv_write_op",
    "mha_reasons",
    "mla_reasons",
    "mla_route",
    "notes",
    "routes",
    "sink_reasons",
    "sink_route",
    "step_of",
    "step_routes",
    "unavailable_reasons",
    "unsupported_reasons",
]

# The attention ops a route names.
PAGED = "_npu_paged_attention"
SPLITFUSE = "_npu_paged_attention_splitfuse"
FIA = "npu_fused_infer_attention_score"
FIA_V2 = "npu_fused_infer_attention_score_v2"
MLA_DECODE = "_npu_paged_attention_mla"

# Latent MLA per generation. hal's MLA pool is one [slots, 1, kv_lora_rank + rope] cache; the ops that read or write
# that layout (_npu_paged_attention_mla, _npu_reshape_and_cache_siso) are ATB ops (A2/A3).
MLA_GENERATIONS = ("A2", "A3")
MLA_OFF = {
    "A5": "no ATB ops (vllm-ascend runs none there), so nothing writes or reads hal's one latent ++ rope cache; "
    "FIA v2 alone would need the latent and rope parts in two caches",
    "310P": "no MLA op (vllm-ascend's 310P attention has no MLA path; FIA v2 is not run there)",
    None: "unknown generation",
}

# The write of hal's one latent ++ rope MLA cache: ATB's K_CACHE_V_BYPASS is documented for A2 only
# (infer_op_params.h ReshapeAndCacheParam: '仅在Atlas 800I A2推理产品上支持设置为K_CACHE_V_BYPASS'; op-plugin tests
# _npu_reshape_and_cache_siso on Ascend910B only); A3 writes the cache rows with npu_scatter_nd_update_, as SGLang's NPU
# MLA pool does (one call per buffer).
_MLA_KV_WRITE = {"A2": "_npu_reshape_and_cache_siso", "A3": "npu_scatter_nd_update_"}


@dataclass(frozen=True)
class Route:
    """The op one step of one layer runs, or why it cannot (:func:`attention_route`, :func:`sink_route`,
    :func:`mla_route`). At most one of ``refused`` and ``uncapturable`` is set."""

    op: str = ""  # the torch_npu op; "" when refused
    mask: MaskKey | None = None  # splitfuse's mask variant, or ("tree", -1): FIA v2's tree mask (MLA verify)
    decode: bool = False  # one query token per request (FIA and FIA v2 take query lengths of 1)
    captured: bool = False  # _npu_paged_attention captured in a graph task group, its lengths updated per replay
    refused: str = ""  # why no op runs this step of the layer (an UnsupportedError's message)
    uncapturable: bool = False  # ``op`` would run inside an NPUGraph capture, which would freeze its host lengths


def step_of(mode) -> str:
    """The step a forward mode runs: ``decode``, ``mixed``, ``target_verify`` or ``extend`` (DRAFT_EXTEND too)."""
    if mode.is_decode():
        return "decode"
    if mode.is_mixed():
        return "mixed"
    return "target_verify" if mode.is_target_verify() else "extend"


# ----------------------------------------------------------------------------- per layer, at run time


@functools.lru_cache(maxsize=1024)
def attention_route(facts: StepFacts, layer: AttentionLayer, step: str, capturing: bool) -> Route:
    """The op of ``step`` (``decode`` / ``extend`` / ``mixed`` / ``target_verify``) of the MHA ``layer`` without
    sinks: FIA (TND, paged) where it serves the layer (a decode's window as band mode 4; never inside a capture),
    else the ATB ops: ``_npu_paged_attention`` for a decode without a window (``captured`` inside a capture),
    splitfuse with its mask for the rest (hal's custom mask for TARGET_VERIFY)."""
    window = layer.sliding_window_size
    if step == "decode":
        if _fia_serves(facts, layer, "fia_decode") and not capturing:
            return Route(FIA, decode=True)
        if window >= 0:  # _npu_paged_attention has no mask: splitfuse with a windowed one
            return _splitfuse(facts, layer, ("causal", window), capturing)
        if facts.generation == "A5":
            why = "; ".join(_fia_reasons(facts, layer, "fia_decode"))
            return Route(
                refused=f"ascend: decode of layer {layer.layer_id} on A5: FIA cannot serve it ({why}), and A5 has no "
                "ATB op"
            )
        return Route(PAGED, captured=capturing)  # captured: vllm-ascend's full-decode graph op
    if step == "target_verify":
        return _splitfuse(facts, layer, ("custom", window), capturing)
    if _fia_serves(facts, layer, "extend"):
        return Route(FIA, uncapturable=capturing)
    return _splitfuse(facts, layer, ("causal" if layer.causal else "full", window), capturing)


def _splitfuse(facts: StepFacts, layer: AttentionLayer, mask: MaskKey, capturing: bool) -> Route:
    if capturing:
        return Route(SPLITFUSE, mask=mask, uncapturable=True)
    if facts.generation == "A5":
        return Route(
            refused=f"ascend: layer {layer.layer_id} needs {SPLITFUSE} ({mask[0]} mask, window {mask[1]}), which A5 "
            "does not have (vllm-ascend runs no ATB attention op there)"
        )
    return Route(SPLITFUSE, mask=mask)


def _fia_serves(facts: StepFacts, layer: AttentionLayer, path: str) -> bool:
    """Whether FIA (TND, paged) can run the layer's ``path`` (``extend`` / ``fia_decode``); never on 310P, which
    runs the ATB ops."""
    return facts.generation != "310P" and not _fia_reasons(facts, layer, path)


def _fia_reasons(facts: StepFacts, layer: AttentionLayer, path: str) -> list[str]:
    """Why FIA cannot run the layer's ``path`` on the step's chip (a decode over more than FIA's Q_S = 1 keys runs
    at Q_S = 2: ``facts.long_kv``)."""
    return npu_ops.unsupported_reasons(
        layer.head_dim,
        layer.v_head_dim,
        facts.page_size,
        facts.op_dtype,
        layer.logit_cap,
        layer.sliding_window_size,
        False,
        layer.causal,
        kv_heads=layer.tp_k_head_num,
        q_heads=layer.tp_q_head_num,
        paths=(path,),
        chip=facts.generation,
        max_kv_len=npu_ops.contracts.FIA_DECODE_MAX_KV + 1 if facts.long_kv else None,
    )


@functools.lru_cache(maxsize=1024)
def sink_route(facts: StepFacts, layer: AttentionLayer, step: str, capturing: bool) -> Route:
    """The op of ``step`` of ``layer`` with attention sinks: FIA v2 with ``learnable_sink`` (a decode: one query token
    per request), or why not."""
    config = AttentionConfig.from_layers([layer], dtype=facts.dtype, page_size=facts.page_size)
    why = sink_reasons(config, facts.generation, facts.op_dtype, step)
    if why:
        return Route(refused=f"ascend: attention sinks, layer {layer.layer_id}: " + "; ".join(why))
    return Route(FIA_V2, decode=step == "decode", uncapturable=capturing)


@functools.lru_cache(maxsize=1024)
def mla_route(facts: StepFacts, layer: AttentionLayer, step: str, joined: bool, sinks: bool, capturing: bool) -> Route:
    """The op of ``step`` of the latent MLA ``layer``. Over hal's ``joined`` latent ++ rope cache a decode without
    a window is ``_npu_paged_attention_mla`` on it in place; every other step, and every step of a split pool, is
    FIA v2 with ``query_rope`` / ``key_rope`` (TARGET_VERIFY: with its tree mask). No MLA op takes a sink."""
    if sinks:
        return Route(
            refused=f"ascend: MLA layer {layer.layer_id} with sinks=: no Ascend MLA op takes a sink "
            "(FIA v2's learnable_sink needs value D <= 128 and no rope inputs)"
        )
    config = AttentionConfig.from_layers([layer], dtype=facts.dtype, page_size=facts.page_size)
    if joined and step == "decode" and not mla_reasons(config, facts.generation, facts.op_dtype, "mla_decode"):
        return Route(MLA_DECODE, uncapturable=capturing)
    verify = step == "target_verify"
    why = mla_reasons(config, facts.generation, facts.op_dtype, "mla_tree" if verify else "mla_fia")
    if why:
        return Route(refused=f"ascend: MLA layer {layer.layer_id}, {step}: " + "; ".join(why))
    return Route(FIA_V2, mask=("tree", -1) if verify else None, decode=step == "decode", uncapturable=capturing)


def kv_write_op(generation: str | None, layout: str | None, *, mla: bool = False, split_mla: bool = False) -> str:
    """The KV write op of a layer into a pool of ``layout``: ``_npu_reshape_and_cache_siso`` for MLA into hal's joined
    cache on A2, ``_npu_reshape_and_cache`` into a FRACTAL_NZ pool, ``npu_scatter_nd_update_`` for the rest of MLA
    (A3, SGLang's split pool), else the MHA write (:func:`_mha_kv_write`)."""
    if mla and not split_mla and generation == "A2":
        return _MLA_KV_WRITE["A2"]
    if layout == FRACTAL_NZ:
        return "_npu_reshape_and_cache"
    return "npu_scatter_nd_update_" if mla else _mha_kv_write(generation, layout)


def _mha_kv_write(generation: str | None, layout: str | None = None) -> str:
    """The KV write op of an MHA layer: ``npu_scatter_pa_kv_cache`` (vllm-ascend's ``BaseDeviceAdaptor`` on A2/A3, and
    its ``A5DeviceAdaptor``, which inherits it). On 310P into a ``fractal_nz`` pool ``_npu_reshape_and_cache``, as
    vllm-ascend's 310P runner writes its NZ caches; into a token-major (ND) pool ``npu_scatter_nd_update_``, which
    the attention ops then read as FRACTAL_NZ copies (doc: op-plugin ``torch_npu-npu_scatter_nd_update_.md``, Atlas
    inference series: float16)."""
    if generation != "310P":
        return "npu_scatter_pa_kv_cache"
    return "_npu_reshape_and_cache" if layout == FRACTAL_NZ else "npu_scatter_nd_update_"


# ----------------------------------------------------------------------------- why an op cannot serve


def mha_reasons(
    config: AttentionConfig, generation: str | None, op_dtype: torch.dtype, path: str, window: int = -1
) -> list[str]:
    """Why the MHA op of ``path`` (``fia_decode`` / ``extend``: FIA; ``decode`` / ``mixed``: ATB) cannot serve
    ``config`` with ``window`` on ``generation``, its limits read at ``op_dtype``."""
    return npu_ops.unsupported_reasons(
        config.head_dim,
        config.v_head_dim,
        config.page_size,
        op_dtype,
        config.logit_cap,
        window,
        config.custom_mask and path == "mixed",
        not config.non_causal,
        kv_heads=config.tp_k_head_num,
        q_heads=config.tp_q_head_num,
        paths=(path,),
        chip=generation,
        max_kv_len=config.max_context_len,
    )


def mla_reasons(config: AttentionConfig, generation: str | None, op_dtype: torch.dtype, path: str) -> list[str]:
    """Why the op of MLA ``path`` (``mla_decode`` / ``mla_fia`` / ``mla_tree``) cannot serve ``config``."""
    if generation not in MLA_GENERATIONS:
        return [f"MLA on {generation}: {MLA_OFF[generation]}"]
    return npu_ops.mla_unsupported_reasons(
        config.kv_lora_rank,
        config.qk_rope_head_dim,
        config.page_size,
        op_dtype,
        q_heads=config.tp_q_head_num,
        kv_heads=config.tp_k_head_num,
        logit_cap=config.logit_cap,
        sliding_window=config.sliding_window_size,
        paths=(path,),
    )


def sink_reasons(config: AttentionConfig, generation: str | None, op_dtype: torch.dtype, step: str) -> list[str]:
    """Why FIA v2 with ``learnable_sink`` cannot serve ``step`` of ``config``."""
    if generation == "310P":
        return ["attention sinks on 310P: no FIA (vllm-ascend runs only the ATB ops there), no op takes a sink"]
    if step == "target_verify":
        return [
            "npu_fused_infer_attention_score_v2 (target_verify): learnable_sink with hal's verify mask: TND takes "
            "no custom mask without MLA's rope inputs (its tree mask, sparse_mode 9, is MLA-only)"
        ]
    return npu_ops.sink_unsupported_reasons(
        config.head_dim,
        config.v_head_dim,
        config.page_size,
        op_dtype,
        config.logit_cap,
        not config.non_causal,
        kv_heads=config.tp_k_head_num,
        q_heads=config.tp_q_head_num,
        decode=step == "decode",
    )


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


def _kv_layout_reasons(config: AttentionConfig, generation: str | None) -> list[str]:
    """Why a ``fractal_nz`` pool (``config.kv_layout``) cannot be read in place on ``generation``."""
    if config.kv_layout != FRACTAL_NZ:
        return []
    if generation != "310P":
        return [f"kv_layout {FRACTAL_NZ} on {generation}: only 310P's ATB ops read FRACTAL_NZ caches (ND here)"]
    if config.kv_lora_rank:
        return [f"kv_layout {FRACTAL_NZ} with MLA: hal's latent cache is token-major"]
    why = [kv_layout(FRACTAL_NZ).unsupported(config.tp_k_head_num, dim) for dim in (config.head_dim, config.v_head_dim)]
    return [f"kv_layout {w}" for w in dict.fromkeys(why) if w]


# ----------------------------------------------------------------------------- per model


def unavailable_reasons(capability: DeviceCapability) -> list[str]:
    """Why the ascend backend cannot run on ``capability`` at all (``[]``: it can)."""
    if capability.type != "npu":
        return [f"the ascend backend runs on the npu device only, not {capability.type}"]
    generation = npu_ops.generation_of_arch(capability.arch)
    if generation is None:
        return [capability.reasons.get("generation", f"unknown Ascend generation (arch {capability.arch!r})")]
    if "atb" in capability.reasons and generation != "A5":  # A2/A3 fall back to ATB ops, 310P runs only them
        return [capability.reasons["atb"]]
    return []


def notes(capability: DeviceCapability) -> list[str]:
    """The routes of ``capability``'s generation in one line, then one ``limit ...`` line per op limit."""
    generation = npu_ops.generation_of_arch(capability.arch)
    if generation == "310P":
        route = f"310P: {PAGED} (decode), {SPLITFUSE} (everything else), both over "
        route += "a fractal_nz pool's pages in place (_npu_reshape_and_cache writes them), or over a FRACTAL_NZ "
        route += "copy of a token-major pool's pages (npu_format_cast per layer; npu_scatter_nd_update_ writes "
        route += "them), and an NZ mask"
    else:
        route = (
            f"{generation}: {FIA} (TND, paged) for decode, extend and mixed batches it serves (head_dim "
            + ("a multiple of 16 <= 512, as vllm-ascend sends there" if generation == "A5" else "128 or 192")
            + "; no custom mask; op-plugin's FIA doc), npu_scatter_pa_kv_cache for the KV write"
        )
        route += (
            "; nothing else (A5 has no ATB ops)"
            if generation == "A5"
            else f"; {PAGED} for captured decode graphs and decodes FIA cannot serve, "
            f"{SPLITFUSE} for windows, verify masks and extends FIA cannot serve"
        )
    if generation in MLA_GENERATIONS:
        route += (
            f"; MLA: _npu_reshape_and_cache_siso (KV write), {MLA_DECODE} (decode), "
            f"{FIA_V2} with query_rope/key_rope over a split copy (other steps)"
        )
    else:
        route += f"; no MLA ({MLA_OFF.get(generation, 'unknown generation')})"
    if generation in ("A2", "A3", "A5"):  # FIA v2: A2/A3 by its doc, A5 by vllm-ascend's code (contracts)
        route += f"; attention sinks: {FIA_V2} with learnable_sink"
    limits = [f"limit {line}" for line in npu_ops.contracts.limits_for(generation)] if generation else []
    return [route + " (routes() and extend_route() say why)", *limits]


def routes(config: AttentionConfig, capability: DeviceCapability) -> list[str]:
    """``step:op`` for every step of ``config`` an op serves here (``hal check`` reports the unreached ones).
    A captured decode's ``_npu_paged_attention`` needs a real NPU: the emulation replays eagerly."""
    steps = step_routes(config, capability)
    if capability.emulated:
        steps.pop("graph_decode", None)
    relayout = ["relayout"] if config.page_size > 1 else []  # the scratch copy of slots off their page offsets
    split = ["mla_split"] if config.kv_lora_rank and FIA_V2 in steps.values() else []
    return [f"{step}:{op}" for step, op in steps.items() if op] + relayout + split


def step_routes(config: AttentionConfig, capability: DeviceCapability) -> dict[str, str]:
    """The op each kind of step of ``config`` runs on ``capability``'s generation (``""``: none can)."""
    generation = npu_ops.generation_of_arch(capability.arch)
    op_dtype = _op_dtype(config.dtype, capability)
    if config.kv_lora_rank:
        return _mla_step_routes(config, generation, op_dtype)
    if config.attention_sinks:
        return _sink_step_routes(config, generation, op_dtype)
    window = config.sliding_window_size
    fia = generation in ("A2", "A3", "A5")
    atb = generation in ("A2", "A3", "310P")

    def serves(path: str, window: int = -1) -> bool:
        return not mha_reasons(config, generation, op_dtype, path, window)

    def pick(fia_path: str, atb_path: str, atb_op: str, window: int) -> str:
        if fia and serves(fia_path, window):
            return FIA
        return atb_op if atb and serves(atb_path, window) else ""

    decode = pick("fia_decode", "decode", PAGED, -1) if window < 0 else pick("fia_decode", "mixed", SPLITFUSE, window)
    found = {
        "kv_write": _mha_kv_write(generation, config.kv_layout),
        "decode": decode,
        "extend": pick("extend", "mixed", SPLITFUSE, window),
        "mixed": pick("extend", "mixed", SPLITFUSE, window),
    }
    if config.custom_mask:
        found["target_verify"] = SPLITFUSE if atb and serves("mixed", window) else ""
    if config.graph and window < 0:  # a captured decode runs the one op with an in-graph length update
        found["graph_decode"] = PAGED if atb and serves("decode") else ""
    return found


def _mla_step_routes(config: AttentionConfig, generation: str | None, op_dtype: torch.dtype) -> dict[str, str]:
    """MLA over hal's one latent ++ rope cache: the KV write and decode take the ATB ops that read that layout;
    the other steps take FIA v2, which needs the latent and rope parts apart (``mla_split`` copies them)."""

    def pick(path: str, op: str) -> str:
        return "" if mla_reasons(config, generation, op_dtype, path) else op

    write = _MLA_KV_WRITE.get(generation, "")
    found = {
        "kv_write": pick("mla_decode", write) or pick("mla_fia", write),
        "decode": pick("mla_decode", MLA_DECODE) or pick("mla_fia", FIA_V2),
        "extend": pick("mla_fia", FIA_V2),
        "mixed": pick("mla_fia", FIA_V2),
    }
    if config.custom_mask:
        found["target_verify"] = pick("mla_tree", FIA_V2)
    return found


def _sink_step_routes(config: AttentionConfig, generation: str | None, op_dtype: torch.dtype) -> dict[str, str]:
    """Layers with attention sinks: every attention step is FIA v2 with ``learnable_sink`` (windows as band
    mode 4); the KV write is the MHA one."""
    steps = ["decode", "extend", "mixed"] + (["target_verify"] if config.custom_mask else [])
    found = {"kv_write": _mha_kv_write(generation, config.kv_layout)}
    return found | {step: "" if sink_reasons(config, generation, op_dtype, step) else FIA_V2 for step in steps}


def extend_route(config: AttentionConfig, capability: DeviceCapability) -> tuple[str, list[str]]:
    """``(op, reasons)``: the op EXTEND batches of ``config`` run, and why FIA does not serve them."""
    generation = npu_ops.generation_of_arch(capability.arch)
    reasons = mha_reasons(config, generation, _op_dtype(config.dtype, capability), "extend", config.sliding_window_size)
    return step_routes(config, capability)["extend"], reasons


def unsupported_reasons(config: AttentionConfig, capability: DeviceCapability) -> list[str]:
    """Why the Ascend ops cannot serve ``config`` on ``capability``: the KV layout, the KV dtype, every step no op
    serves, and graph capture on a real NPU (the backend adds the declared limits)."""
    generation = npu_ops.generation_of_arch(capability.arch)
    op_dtype = _op_dtype(config.dtype, capability)
    reasons = _kv_layout_reasons(config, generation)
    window = config.sliding_window_size
    if config.kv_cache_dtype_name != config.dtype_name and config.kv_cache_dtype_name.startswith("fp8"):
        reasons.append(_fp8_reason(generation))
    for step, op in step_routes(config, capability).items():
        if op:
            continue
        if config.attention_sinks and not config.kv_lora_rank:
            reasons += [f"{step}: {why}" for why in sink_reasons(config, generation, op_dtype, step)]
            continue
        if config.kv_lora_rank:
            both = ("mla_decode", "mla_fia")
            paths = {"decode": both, "kv_write": both, "target_verify": ("mla_tree",)}.get(step, ("mla_fia",))
            reasons += [f"{step}: {why}" for path in paths for why in mla_reasons(config, generation, op_dtype, path)]
            continue
        why = []
        if generation in ("A2", "A3", "A5") and step != "target_verify" and step != "graph_decode":
            fia_path = "fia_decode" if step == "decode" and window < 0 else "extend"
            why += mha_reasons(config, generation, op_dtype, fia_path, window)
        if generation != "A5":
            atb_path = "decode" if step in ("decode", "graph_decode") and window < 0 else "mixed"
            why += mha_reasons(config, generation, op_dtype, atb_path, -1 if atb_path == "decode" else window)
        else:
            why.append(f"{step}: A5 has no ATB ops (vllm-ascend never runs _npu_paged_attention/splitfuse there)")
        reasons += why or [f"{step}: no Ascend op serves it on {generation}"]
    if config.kv_lora_rank:
        reasons += _mla_graph_reasons(config, capability)
        if config.attention_sinks:
            reasons.append("attention sinks with MLA: learnable_sink needs value D <= 128 and no rope inputs")
    elif config.attention_sinks and config.graph and capability.available and not capability.emulated:
        reasons.append("graph capture of attention sinks on a real NPU: no in-graph update of FIA v2's host lengths")
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
                f"graph capture of sliding-window decode ({SPLITFUSE}) on a real NPU: "
                f"no documented in-graph update of its host lengths; only {PAGED} has one"
            )
        if config.custom_mask:
            reasons.append(
                f"graph capture of TARGET_VERIFY ({SPLITFUSE} with the verify mask) on a "
                "real NPU: no documented in-graph update of its host lengths; capture decode only there"
            )
    return reasons


def _mla_graph_reasons(config: AttentionConfig, capability: DeviceCapability) -> list[str]:
    reasons = []
    if not capability.emulated and capability.available:
        module, _ = npu_ops.load_torch_npu()
        missing = [name for name in npu_ops.MLA_OP_NAMES if module is not None and not hasattr(module, name)]
        if missing:
            reasons.append(f"MLA: torch_npu lacks {', '.join(missing)}")
        if config.graph:
            reasons.append(
                f"graph capture of MLA on a real NPU: {MLA_DECODE} cannot be captured (SGLang asserts "
                "it) and hal has no in-graph update of FIA v2's host lengths"
            )
    if config.graph and config.custom_mask:
        reasons.append(
            "graph capture of MLA TARGET_VERIFY: its FIA tree mask is gathered from the verify mask per step "
            "with host-built indices; hal captures MLA decode only"
        )
    return reasons


# ``AscendRouting``, once the routing mixin of ``AscendBackend``: deprecated since hal 0.4.0 (goes in 0.5.0); it
# answers with ``AscendBackend``, whose classmethods answer with this module's functions.
__getattr__ = moved_names(__name__, {"AscendRouting": "hal.devices.npu.ascend_backend:AscendBackend"}, since="0.4.0")
