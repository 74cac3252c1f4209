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
        forced = [
            model(torch.tensor([r.prompt + r.output[:-1]], device=device)).logits[0, len(r.prompt) - 1 :].float().cpu()
            for r in requests
        ]
    tolerance = LOGIT_TOLERANCE[dtype]
    diffs = [(torch.stack(r.logits) - f).abs().max().item() for r, f in zip(requests, forced)]
    max_diff = max(diffs, default=0.0)
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
            if gap > 2 * max_diff:  # hal's logits and HF's each err by <= max_diff: a larger gap cannot flip
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
        "logit_tolerance": tolerance,
        "reference_seconds": round(seconds, 3),
        "reference_tokens_per_s": round(generated / seconds, 1) if seconds else None,
    }
