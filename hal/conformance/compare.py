"""Comparisons: a backend's result against a built case's expectation, in the porter's terms.

:func:`check_cache` tells a missing KV write from a wrong one and both from a write outside
``out_cache_loc``; :func:`check_output` names the requests, positions and heads that differ,
reference against got; :func:`describe` is a case in one line.
"""

from __future__ import annotations

import torch

from hal.conformance.builder import Built
from hal.conformance.case import Case
from hal.errors import ranges
from hal.kernels.reference import tolerance
from hal.kv_cache import kv_rows
from hal.kv_layouts import TOKEN_MAJOR, pool_kv_layout

__all__ = ["check_cache", "check_output", "describe", "tolerance"]


def _fmt(t: torch.Tensor, n: int = 4) -> str:
    vals = [f"{x:.4g}" for x in t.flatten()[:n].tolist()]
    return "[" + ", ".join(vals) + (", ...]" if t.numel() > n else "]")


def _differs(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per slot: whether any element differs (NaN equals NaN)."""
    diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    return diff.flatten(1).any(1)


def _slot_rows(pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V as token-major rows ``[num_slots, heads, dim]``: a token-major pool's own buffers, any
    other layout's pages read slot by slot (:func:`hal.kv_cache.kv_rows`)."""
    if pool_kv_layout(pool) == TOKEN_MAJOR:
        return pool.k_buffer, pool.v_buffer
    slots = torch.arange(pool.num_slots, device=pool.k_buffer[0].device)
    rows = [kv_rows(pool, pool.start_layer + i, slots) for i in range(pool.layer_num)]
    return [k for k, _ in rows], [v for _, v in rows]


def check_cache(
    built: Built, pool=None, layers: list[int] | None = None, skip_padding_page: bool = False
) -> str | None:
    """None when every layer's K and V buffers equal the expectation, else what differs and how.

    It tells a missing KV write (a slot of ``out_cache_loc`` still holds its old value)
    from a wrong one, and both from a write outside ``out_cache_loc``.
    """
    pool = pool if pool is not None else built.batch.token_to_kv_pool
    loc = built.batch.out_cache_loc.cpu().long().tolist()
    slot_token = {s: i for i, s in enumerate(loc)}
    first = pool.page_size if skip_padding_page else 0
    problems = []
    got_k, got_v = _slot_rows(pool)
    for name, got_list, want_list, init_list in (
        ("K", got_k, built.expected_pool_k, built.initial_pool_k),
        ("V", got_v, built.expected_pool_v, built.initial_pool_v),
    ):
        for index, (got, want, init) in enumerate(zip(got_list, want_list, init_list)):
            lid = index + built.case.start_layer  # the model's layer id
            if layers is not None and lid not in layers:
                continue
            bad = _differs(got[first:].cpu(), want[first:].cpu()).nonzero().flatten().add(first).tolist()
            if not bad:
                continue
            ours = [s for s in bad if s in slot_token]
            missing = [s for s in ours if not bool(_differs(got[s : s + 1].cpu(), init[s : s + 1].cpu()).any())]
            wrong = [s for s in ours if s not in missing]
            outside = [s for s in bad if s not in slot_token]

            def where(slots):
                toks = [slot_token[s] for s in slots[:6]]
                return ", ".join(
                    f"slot {s} (request {built.token_origin[t][0]} position {built.token_origin[t][1]})"
                    for s, t in zip(slots, toks)
                ) + (" ..." if len(slots) > 6 else "")

            if missing:
                problems.append(
                    f"{name} cache of layer {lid}: the new tokens were not written at {len(missing)} slot(s) of "
                    f"out_cache_loc: {where(missing)} (a missing KV write, or a write to another layer)"
                )
            if wrong:
                s = wrong[0]
                problems.append(
                    f"{name} cache of layer {lid}: wrong values written at {len(wrong)} slot(s) of out_cache_loc: "
                    f"{where(wrong)}; slot {s}: expected {_fmt(want[s].float())} got {_fmt(got[s].float())}"
                )
            if outside:
                problems.append(
                    f"{name} cache of layer {lid}: {len(outside)} slot(s) outside out_cache_loc changed: "
                    f"{ranges(outside)[:200]} (only the batch's new tokens may be written; "
                    f"save_kv_cache=False writes nothing)"
                )
    if not problems:
        return None
    return "KV cache differs from the expected writes (checked before the output):\n  " + "\n  ".join(problems)


def check_output(built: Built, out: torch.Tensor, expected: torch.Tensor | None = None, rows=None) -> str | None:
    """None when ``out`` matches the reference within the dtype's tolerance, else where and how it differs.

    ``rows``: the requests ``out``'s rows belong to, when it covers a subset (a graph replay).
    """
    expected = built.expected if expected is None else expected
    layer, case = built.layer, built.case
    if tuple(out.shape) != tuple(expected.shape):
        return f"output shape {tuple(out.shape)} != expected {tuple(expected.shape)} ([tokens, q_heads * v_head_dim])"
    if out.dtype != built.q.dtype:
        return f"output dtype {out.dtype} != q dtype {built.q.dtype}"
    tol = tolerance(case.dtype, case.kv_cache_dtype)
    got, want = out.detach().double().cpu(), expected.double().cpu()
    close = torch.isclose(got, want, equal_nan=True, **tol)
    if bool(close.all()):
        return None
    tokens = got.shape[0]
    heads, dv = layer.tp_q_head_num, layer.v_head_dim
    bad = ~close.view(tokens, heads, dv)
    bad_th = bad.any(-1)
    origin = [built.token_origin[i] for i in rows] if rows is not None else built.token_origin
    per_request: dict[int, list[int]] = {}
    for t in bad_th.any(1).nonzero().flatten().tolist():
        r, pos = origin[t]
        per_request.setdefault(r, []).append(pos)
    bad_heads = bad_th.any(0).nonzero().flatten().tolist()
    lines = [
        f"attention output differs from the float64 reference in {int(bad.sum())} of {bad.numel()} elements "
        f"(atol {tol['atol']}, rtol {tol['rtol']}); the KV cache was right",
        "  requests (prefix, new) -> query positions that differ: "
        + "; ".join(
            f"request {r} {case.requests[r] if r < len(case.requests) else ''}: positions {ranges(p)}"
            for r, p in sorted(per_request.items())
        ),
        f"  q heads that differ: {ranges(bad_heads)} of {heads} (kv head of q head h: h // {layer.group_size})",
    ]
    for t, h in bad_th.nonzero().tolist()[:4]:
        r, pos = origin[t]
        lines.append(
            f"  request {r} position {pos} head {h}: reference {_fmt(want[t].view(heads, dv)[h])} "
            f"got {_fmt(got[t].view(heads, dv)[h])}"
        )
    return "\n".join(lines)


def describe(case: Case) -> str:
    """One line about a case, for failure messages."""
    window = f" window {case.sliding_window_size}" if case.sliding_window_size >= 0 else ""
    cap = f" cap {case.logit_cap}" if case.logit_cap else ""
    layers = f" layer {case.layer_id} of {case.layer_num}" if case.layer_num > 1 else ""
    if case.start_layer:
        layers = (
            f" layer {case.layer_id} of a pool of layers {case.start_layer}..{case.start_layer + case.layer_num - 1}"
        )
    slots = " slots scattered (not at i % page_size)" if case.slots != "aligned" else ""
    threads = f" at {case.threads} thread(s)" if case.threads is not None else ""
    layers += f" MLA latent {case.kv_lora_rank} + rope {case.qk_rope_head_dim}" if case.kv_lora_rank else ""
    layers += " sinks" if case.sinks else ""
    if case.kv_cache_dtype is not None:
        layers += (
            f" {str(case.kv_cache_dtype).removeprefix('torch.')} cache (k_scale {case.k_scale}, v_scale {case.v_scale})"
        )
    return (
        f"{case.id}: {case.mode.name} {case.dtype_name} page {case.page_size}, heads {case.tp_q_head_num}/"
        f"{case.tp_k_head_num}, head_dim {case.head_dim}/{case.v_head_dim or case.head_dim}{window}{cap}"
        f"{' non-causal' if case.attn_type != 'decoder' else ''}{layers}{slots}{threads}, requests (prefix, new) "
        f"{case.requests}"
    )
