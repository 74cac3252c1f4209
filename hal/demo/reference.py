"""``hal demo --check``: the same weights in the family's transformers model (``LlamaForCausalLM``,
``DeepseekV3ForCausalLM``, ``GptOssForCausalLM``), the same requests.

HF's greedy ``generate`` runs every request on its own (its reference speed). Every
token hal generated must be the token ``generate`` gave. Where they part, the step is a
*near-tie* when HF's logit for hal's token is within twice the measured logit error of
HF's best (hal's logits and HF's each err by at most that much, so either token is the
argmax up to rounding); from there on the request is compared
teacher-forced: HF's logits on hal's tokens, which must pick hal's token (or tie with
it) at every later step. Logits are compared everywhere against a stated tolerance:
HF's teacher-forced forward over the prompt and hal's tokens gives its logits at every
step hal sampled.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .model import ModelShape

__all__ = ["LOGIT_TOLERANCE", "check_against_hf"]

# Largest |hal - HF| logit difference accepted, per dtype (logits here are O(1)-O(10)).
LOGIT_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.5}


def hf_model(family, shape: ModelShape, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """``family``'s transformers model of ``shape`` with ``weights`` (all of its state dict, strictly)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)  # HF initialises weights before they are replaced: keep the global RNG out of it
    model = getattr(transformers, family.hf_class)(family.hf_config(shape))
    model.load_state_dict(weights, strict=True)
    model.generation_config.do_sample = False
    return model.to(device=device, dtype=dtype).eval()


def check_against_hf(
    family,
    shape: ModelShape,
    weights: dict[str, torch.Tensor],
    requests: list,
    dtype: torch.dtype,
    device: torch.device,
) -> dict:
    """Compare the finished ``requests`` (with recorded logits) with ``family``'s HF model; returns the report's
    fields."""
    model = hf_model(family, shape, weights, dtype, device)

    def generate(prompt: list[int], new: int) -> list[int]:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        return out[0, len(prompt) :].tolist()

    with torch.inference_mode():
        generate(requests[0].prompt[:8], 2)  # warm-up, as hal's serving loop is timed after its own setup
        start = time.perf_counter()
        reference = [generate(r.prompt, r.max_new_tokens) for r in requests]
        seconds = time.perf_counter() - start
        forced, hf_routes = [], []
        for r in requests:
            with record_routes(model) as log:
                logits = model(torch.tensor([r.prompt + r.output[:-1]], device=device)).logits[0].float().cpu()
            forced.append(logits[len(r.prompt) - 1 :])
            hf_routes.append(
                [(scores[len(r.prompt) - 1 :].cpu(), chosen[len(r.prompt) - 1 :].cpu()) for scores, chosen in log]
            )
    tolerance = LOGIT_TOLERANCE[dtype]
    step_diffs = [(torch.stack(r.logits) - f).abs().amax(-1).tolist() for r, f in zip(requests, forced)]
    routing = routing_near_ties(family.route, requests, hf_routes, step_diffs, tolerance)
    tied = {(t["request"], t["step"]) for t in routing.get("routing_near_ties", [])}
    max_all = max((d for diffs in step_diffs for d in diffs), default=0.0)
    max_diff = max(
        (d for r, diffs in zip(requests, step_diffs) for i, d in enumerate(diffs) if (r.rid, i) not in tied),
        default=0.0,
    )
    near_ties, mismatches, identical = [], [], 0
    for r, ref, f in zip(requests, reference, forced):
        split = next((i for i, (a, b) in enumerate(zip(r.output, ref)) if a != b), None)
        if split is None:
            identical += 1
            continue
        for step in range(split, len(r.output)):
            token = r.output[step]
            best = f[step].max().item()
            gap = best - f[step, token].item()  # 0 when HF's teacher-forced logits pick hal's token
            routed_tie = (r.rid, step) in tied  # a token chosen on the other side of an MoE routing tie
            if gap > 2 * max_diff and not routed_tie:  # hal's and HF's logits each err by <= max_diff: cannot flip
                mismatches.append(
                    {"request": r.rid, "step": step, "hal": token, "hf": int(f[step].argmax()), "gap": gap}
                )
                break
            if step == split or gap > 0:
                top2 = f[step].topk(2).values
                near_ties.append(
                    {
                        "request": r.rid,
                        "step": step,
                        "hal": token,
                        "hf": ref[step] if step == split else int(f[step].argmax()),
                        "top2_gap": (top2[0] - top2[1]).item(),
                        **({"after_routing_tie": True} if routed_tie else {}),
                    }
                )
    generated = sum(len(r) for r in reference)
    return {
        "matches_reference": not mismatches and max_diff <= tolerance,
        "identical_requests": identical,
        "compared_requests": len(requests),
        "near_ties": near_ties,
        "mismatches": mismatches,
        "max_logit_diff": max_diff,
        "max_logit_diff_all_steps": max_all,
        "logit_tolerance": tolerance,
        **routing,
        "reference_seconds": round(seconds, 3),
        "reference_tokens_per_s": round(generated / seconds, 1) if seconds else None,
    }


@contextmanager
def record_routes(model):
    """While inside, each MoE layer of HF's ``model`` appends ``(scores [T, experts] float32, chosen [T, k])``,
    the scores its top-k chose by (DeepSeek: biased sigmoid scores; gpt-oss: router logits), to the yielded list."""
    log, undo = [], []
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "route_tokens_to_experts"):  # DeepseekV3MoE

            def route(router_logits, mlp=mlp, original=mlp.route_tokens_to_experts):
                chosen, weights = original(router_logits)
                log.append((router_logits.sigmoid() + mlp.gate.e_score_correction_bias, chosen))
                return chosen, weights

            mlp.route_tokens_to_experts = route
            undo.append(lambda mlp=mlp: delattr(mlp, "route_tokens_to_experts"))
        elif hasattr(mlp, "router"):  # GptOssMLP: the router returns (logits, scores, indices)
            handle = mlp.router.register_forward_hook(lambda _m, _i, out: log.append((out[0].float(), out[2])))
            undo.append(handle.remove)
    try:
        yield log
    finally:
        for fn in undo:
            fn()


def routing_near_ties(route, requests: list, hf_routes: list, step_diffs: list, tolerance: float) -> dict:
    """The steps whose logit error exceeds ``tolerance`` because an MoE layer routed the sampled token to other
    experts than HF did, on a tie. At the first layer where the choices part: ``route`` (the family's routing,
    scores -> experts) gives each side's choice from its own scores (both route by HF's rule), and hal's
    scores differ from HF's by at most twice the largest difference measured where both routed alike (so the
    inputs agree as closely as anywhere: the choice fell on a boundary, where rounding decides).

    Such a step is a discrete flip, as a token near-tie is: it is reported and left out of the logit gate.
    Returns the report's fields (none for models without MoE)."""
    if route is None:
        return {}
    route_err, flips = 0.0, []
    for r, hf, diffs in zip(requests, hf_routes, step_diffs):
        for step, ours in enumerate(r.routes):
            for layer, ((scores, chosen), (hf_scores, hf_chosen)) in enumerate(zip(ours or [], hf)):
                if set(chosen.tolist()) != set(hf_chosen[step].tolist()):
                    if diffs[step] > tolerance:
                        flips.append(
                            (r.rid, step, layer, scores, chosen, hf_scores[step], hf_chosen[step], diffs[step])
                        )
                    break
                route_err = max(route_err, (scores - hf_scores[step]).abs().max().item())
    ties = []
    for rid, step, layer, scores, chosen, hf_scores, hf_chosen, diff in flips:
        same_rule = all(
            set(route(x[None])[0].tolist()) == set(c.tolist()) for x, c in ((hf_scores, hf_chosen), (scores, chosen))
        )
        score_diff = (scores - hf_scores).abs().max().item()
        if same_rule and score_diff <= 2 * route_err:
            ties.append(
                {
                    "request": rid,
                    "step": step,
                    "moe_layer": layer,
                    "hal_experts": sorted(chosen.tolist()),
                    "hf_experts": sorted(hf_chosen.tolist()),
                    "score_diff": score_diff,
                    "logit_diff": diff,
                }
            )
    return {"routing_near_ties": ties, "max_routing_score_diff": route_err}
