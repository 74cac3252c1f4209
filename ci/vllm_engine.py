"""Run vLLM's ``LLM`` on the CPU over a workload, with hal or with vLLM's own ``CPU_ATTN``; JSON out.

    HAL_VLLM=1 python ci/vllm_engine.py MODEL --spec SPEC.json --out OUT.json     # hal (HAL_VLLM=0: CPU_ATTN)

``SPEC.json`` holds ``workload``, a list of phases, each a list of requests
``{"prompt_token_ids": [...], "max_tokens": n}`` (``"prompt_logprobs": true``: also each prompt token's
log-probability given the tokens before it), and ``engine_args`` over :data:`ENGINE_ARGS`. A phase is
one ``LLM.generate`` call (all its requests queued at once: with ``max_num_seqs`` below their number,
requests join running batches as others finish); phases run in order on one engine (a later phase finds an
earlier one's prompts in the prefix cache). Greedy, EOS ignored, special tokens kept. ``OUT.json``: per
request the token ids, cached prompt tokens and text; the engine's start and run times.

:func:`run_in_subprocess` picks the backend by environment (:func:`attention_env`: ``hal`` sets
``HAL_VLLM=1``, so hal's plugin serves ``CPU_ATTN``; ``CPU_ATTN`` sets ``HAL_VLLM=0``). :data:`ENV` pins
vLLM's CPU runtime to this machine's two cores and a 1 GiB KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# vLLM's CPU platform on a small shared machine: no core pinning, both cores, a bounded KV cache.
ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}
# Small blocks (several per request) and chunks (long prompts prefill in pieces), few sequences at once.
ENGINE_ARGS = {
    "dtype": "float32",
    "block_size": 32,
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
}


def attention_env(attention: str) -> dict[str, str]:
    """The environment that makes ``attention`` serve vLLM's CPU engine (``hal`` or ``CPU_ATTN``)."""
    if attention not in ("hal", "CPU_ATTN"):
        raise ValueError(f"attention {attention!r}: expected hal or CPU_ATTN")
    return {**ENV, "HAL_VLLM": "1" if attention == "hal" else "0"}


def run(model: str, workload: list[list[dict]], engine_args: dict | None = None) -> dict:
    """Serve ``workload`` with vLLM's ``LLM`` in this process (the environment decides the backend)."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model, **{**ENGINE_ARGS, **(engine_args or {})})
    started = time.perf_counter()
    results, phases = [], []
    for phase in workload:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in phase]
        params = [
            SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                skip_special_tokens=False,
                prompt_logprobs=0 if r.get("prompt_logprobs") else None,
            )
            for r in phase
        ]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        phases.append(time.perf_counter() - t0)
        for out in outputs:
            results.append(
                {
                    "output_ids": list(out.outputs[0].token_ids),
                    "text": out.outputs[0].text,
                    "cached_tokens": out.num_cached_tokens or 0,
                    "prompt_tokens": len(out.prompt_token_ids),
                    **({"prompt_logprobs": _prompt_logprobs(out)} if out.prompt_logprobs is not None else {}),
                }
            )
    return {"results": results, "start_s": started - start, "phase_s": phases}


def _prompt_logprobs(out) -> list[float]:
    """The log-probability the model gave each prompt token after the tokens before it (teacher-forced: one
    kernel's rounding cannot compound into different tokens), from the second token on."""
    ids = out.prompt_token_ids
    return [float(out.prompt_logprobs[i][ids[i]].logprob) for i in range(1, len(ids))]


def run_in_subprocess(
    model: str,
    attention: str,
    workload: list[list[dict]],
    workdir: str,
    engine_args: dict | None = None,
    env: dict | None = None,
    timeout: float = 1500,
) -> dict:
    """:func:`run` in a fresh Python (vLLM's CPU engine spawns its own processes) with ``attention``'s environment
        plus ``env``; returns its JSON with ``log`` (the engine's output). Raises ``RuntimeError`` on failure (its
    ``log`` attribute: the engine's output)."""
    tag = f"{attention}-{abs(hash((model, json.dumps(env or {}, sort_keys=True)))) % 10**8}"
    spec, out = os.path.join(workdir, f"{tag}-workload.json"), os.path.join(workdir, f"{tag}-out.json")
    with open(spec, "w") as f:
        json.dump({"workload": workload, "engine_args": engine_args or {}}, f)
    full_env = {k: v for k, v in os.environ.items() if k != "HAL_VLLM"} | attention_env(attention) | (env or {})
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), model, "--spec", spec, "--out", out],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = done.stdout + done.stderr
    if done.returncode != 0 and not _aborted_after_results(done.returncode, log, out):
        error = RuntimeError(f"vLLM engine ({attention}) failed with {done.returncode}:\n{log[-6000:]}")
        error.log = log  # the whole engine output: a refusal raised in a worker is far from the tail
        raise error
    with open(out) as f:
        result = json.load(f)
    result["log"] = log
    if done.returncode != 0:
        result["exit"] = f"aborted at interpreter exit ({done.returncode}) after writing its results"
    return result


def _aborted_after_results(returncode: int, log: str, out: str) -> bool:
    """Whether the engine's Python aborted in its teardown, after :func:`main` wrote every result: vLLM 0.32's CPU
    engine now and then ends in ``std::terminate`` ("terminate called without an active exception", SIGABRT) once
    the engine has shut down, with CPU_ATTN as with hal. Any other failure, or results not all written, is one."""
    if returncode != -6 or "terminate called without an active exception" not in log[-2000:]:
        return False
    try:
        with open(out) as f:
            return "results" in json.load(f)
    except (OSError, ValueError):
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--spec", required=True, help="JSON: {workload: [[request...]...], engine_args: {...}}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(args.model, spec["workload"], spec.get("engine_args"))
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
