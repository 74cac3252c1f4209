"""``hal demo --kv-dtype fp8_e4m3``: per-layer scales for a scaled (fp8) KV cache; agreement with an unquantised one.

Scales are calibrated, not guessed: the unquantised run records each layer's largest
``|k|`` and ``|v|`` over its first scheduler step (the first prompts' prefill, the data a
server sees before it must fix its scales) and ``k_scale = max|k| / finfo(fp8).max`` (so
that step's keys use the full fp8 range; a later key beyond it saturates, as the row's
``quantize`` in ``hal.kv_dtypes`` defines). The fp8 run then serves the same requests. Every scaled row
of the KV-dtype table is a ``--kv-dtype`` choice.

Agreement is measured where it means something: the token match rate is over every
generated token (position by position); logits are compared at the steps where both runs
had the same context (every step up to and including each request's first differing token).
"""

from __future__ import annotations

from hal.errors import ConfigError
from hal.kv_dtypes import DEPRECATED_NAMES, KV_DTYPE_TABLE, kv_cache_dtype_setting, kv_dtype

__all__ = ["KV_DTYPE_NAMES", "kv_cache_dtype", "calibrated_scales", "agreement"]

# --kv-dtype choices -> hal's KV cache dtype name: auto (the model dtype) and the table's scaled rows.
KV_DTYPE_NAMES = {"auto": None, **{row.name: row.name for row in KV_DTYPE_TABLE if row.scaled}}


def kv_cache_dtype(name: str) -> str | None:
    """hal's name of the KV cache dtype ``--kv-dtype name`` asks for (None: the model dtype); an old spelling
    (``fp8``) warns and names the row."""
    if name not in KV_DTYPE_NAMES and name not in DEPRECATED_NAMES:
        raise ConfigError(f"--kv-dtype = {name!r}: expected one of {list(KV_DTYPE_NAMES)} (auto: the model dtype)")
    row = kv_cache_dtype_setting(name, ConfigError, "--kv-dtype")
    return None if row is None else row.name


def calibrated_scales(amax: dict[int, list[float]], layer_num: int, kv_dtype_name: str) -> list[tuple[float, float]]:
    """Each layer's ``(k_scale, v_scale)``: the recorded ``max |k|``, ``max |v|`` over the fp8 dtype's largest
    finite value (a layer that stored only zeros keeps 1.0)."""
    limit = kv_dtype(kv_dtype_name).max
    missing = [i for i in range(layer_num) if i not in amax]
    if missing:
        raise ConfigError(f"fp8 calibration saw no keys for layers {missing}: expected every layer in the first step")
    return [tuple(m / limit if m > 0 else 1.0 for m in amax[i]) for i in range(layer_num)]


def agreement(baseline: list, quantised: list) -> dict:
    """Compare two runs of the same requests (each with recorded logits), ``quantised`` against ``baseline``."""
    total = matched = identical = steps = 0
    max_err, err_sum, err_count = 0.0, 0.0, 0
    first_divergence = []
    for a, b in zip(baseline, quantised):
        same = [x == y for x, y in zip(a.output, b.output)]
        total += len(same)
        matched += sum(same)
        split = same.index(False) if False in same else None
        identical += split is None
        if split is not None:
            first_divergence.append(
                {"request": a.rid, "step": split, "baseline": a.output[split], "fp8": b.output[split]}
            )
        last = len(same) if split is None else split + 1  # the same context up to and including the split
        for la, lb in zip(a.logits[:last], b.logits[:last]):
            err = (la - lb).abs()
            max_err = max(max_err, err.max().item())
            err_sum += err.sum().item()
            err_count += err.numel()
        steps += last
    return {
        "token_match_rate": round(matched / total, 4) if total else None,
        "matched_tokens": matched,
        "generated_tokens": total,
        "identical_requests": identical,
        "compared_requests": len(baseline),
        "logit_compared_steps": steps,
        "max_logit_err": max_err,
        "mean_logit_err": err_sum / err_count if err_count else None,
        "first_divergences": first_divergence,
    }
