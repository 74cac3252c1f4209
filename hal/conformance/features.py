"""Features a backend can declare off, and what a deployment requires of them (``hal check --require``).

:func:`declared_off` asks the backend's own ``unsupported_reasons`` about a config it serves with one
feature added; a feature that brings new reasons is declared off. :func:`case_features`
says which of them a conformance case needs, so that ``hal check`` counts the cases each
declared-off feature skipped. No pytest here: ``hal``'s argument parser reads these names.
"""

from __future__ import annotations

from hal.kv_dtypes import COMPUTE_DTYPES

# Features a backend can declare off, each as what it adds to a config it serves (see declared_off).
FEATURES = {
    "graph": {"graph": True},
    "graph_verify": {"graph": True, "custom_mask": True},
    "custom_mask": {"custom_mask": True},
    "sliding_window": {"sliding_window_size": 8},
    "logit_cap": {"logit_cap": 30.0},
    "non_causal": {"non_causal": True},
    "mla": {"v_head_dim": 64},
    "sinks": {"attention_sinks": True},
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
    **{name: {"dtype": name} for name in COMPUTE_DTYPES},  # fp32, bf16, fp16
}
# What an SGLang serving path needs: graphs for DECODE and TARGET_VERIFY, custom mask (every mode), bf16.
PROFILES = {"serving": ("graph", "graph_verify", "custom_mask", "bf16")}


def _probe_config(backend, capability, **changes):
    import torch

    from hal.config import AttentionConfig

    declared = backend.declaration()
    pages = sorted(declared.page_sizes) if declared.page_sizes else [16]
    head_dims = sorted(declared.head_dims) if declared.head_dims else [128]
    fields = {
        "tp_q_head_num": 8,
        "tp_k_head_num": 2,
        "head_dim": 128 if 128 in head_dims else head_dims[0],
        "page_size": 128 if 128 in pages else pages[0],
        "dtype": torch.bfloat16,
    }
    dtype = changes.pop("dtype", None)
    if dtype is None:  # a dtype the backend serves (the narrowest), so that only the feature asked about adds reasons
        for candidate in sorted(COMPUTE_DTYPES.values(), key=lambda d: d.itemsize):
            if not backend.unsupported_reasons(AttentionConfig(**{**fields, "dtype": candidate}), capability):
                fields["dtype"] = candidate
                break
    else:
        fields["dtype"] = COMPUTE_DTYPES[dtype]
    if "v_head_dim" in changes:
        changes["v_head_dim"] = fields["head_dim"] // 2
    return AttentionConfig(**{**fields, **changes})


def declared_off(backend, capability) -> dict[str, str]:
    """``{feature: why}`` for every feature of :data:`FEATURES` the backend declares off on ``capability``:
    the reasons its ``unsupported_reasons`` gives for a config with that feature that it does not give without it."""
    base = set(backend.unsupported_reasons(_probe_config(backend, capability), capability))
    off = {}
    for feature, changes in FEATURES.items():
        reasons = backend.unsupported_reasons(_probe_config(backend, capability, **changes), capability)
        extra = [r for r in reasons if r not in base]
        if extra:
            off[feature] = "; ".join(extra)
    if base:
        off["any"] = "; ".join(sorted(base))
    return off


def kv_dtypes_off(backend, capability) -> dict[str, str]:
    """``{name: why}`` for each KV-cache dtype the backend declares (``kv_cache_dtypes``) but refuses on
    ``capability``: the reasons its ``unsupported_reasons`` gives for a config it serves with that KV cache (a
    compute dtype's as the model dtype too), those it does not give without it first. A declared name that is no
    KV-cache dtype is not refused here: no case can use it, which ``hal check`` reports."""
    from hal.kv_dtypes import KV_STORAGE_DTYPES

    base = set(backend.unsupported_reasons(_probe_config(backend, capability), capability))
    off = {}
    for name in sorted(backend.declaration().kv_cache_dtypes & set(KV_STORAGE_DTYPES)):
        changes = {"dtype": name} if name in COMPUTE_DTYPES else {"kv_cache_dtype": name}
        reasons = backend.unsupported_reasons(_probe_config(backend, capability, **changes), capability)
        if reasons:
            off[name] = "; ".join([r for r in reasons if r not in base] or reasons)
    return off


def case_features(case, kind: str) -> set[str]:
    """The features of :data:`FEATURES` a conformance case needs (``kind``: forward or graph)."""
    needs = {case.dtype_name}
    verify = case.mode.name == "TARGET_VERIFY"
    needs |= {"custom_mask"} if verify else set()
    needs |= {"graph_verify" if verify else "graph"} if kind == "graph" else set()
    needs |= {"sliding_window"} if case.sliding_window_size >= 0 else set()
    needs |= {"logit_cap"} if case.logit_cap > 0 else set()
    needs |= {"non_causal"} if case.attn_type != "decoder" else set()
    needs |= {"mla"} if case.v_head_dim not in (None, case.head_dim) or case.kv_lora_rank else set()
    needs |= {"sinks"} if case.sinks else set()
    needs |= {"fp8_kv"} if case.kv_cache_dtype is not None else set()
    return needs


def required_features(require: list[str] | tuple = (), profile: str | None = None) -> list[str]:
    """The features ``--require`` and ``--profile`` name; a ``ConfigError`` for an unknown one."""
    from hal.errors import ConfigError

    if profile is not None and profile not in PROFILES:
        raise ConfigError(f"--profile {profile!r}: expected one of {sorted(PROFILES)}")
    wanted = [f.strip() for item in require for f in item.split(",") if f.strip()]
    wanted += [f for f in PROFILES.get(profile, ()) if f not in wanted]
    unknown = [f for f in wanted if f not in FEATURES]
    if unknown:
        raise ConfigError(f"--require {','.join(unknown)}: expected features among {list(FEATURES)}")
    return wanted
