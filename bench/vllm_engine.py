"""vLLM's engine on hal against vLLM's own ``CPU_ATTN``, same model, one run; the per-step translation apart.

    python bench/vllm_engine.py [--out bench/results/vllm_engine.json] [--prompts 8] [--prompt-len 256]
        [--gen-requests 16] [--gen-tokens 64] [--dtype float32] [--repeats 3] [--rounds 2] [--translate-only]

Needs vLLM (docs/vllm.md: the ``vllm-engine`` env or ``/work/venvs/vllm``). For each backend a fresh engine
(``ci/vllm_engine.py``, its own process) serves two phases on a random Llama (``ci/vllm_model.py``: 4 layers,
hidden 256, 8/2 heads of dim 32): **prompt** (``--prompts`` prompts of ``--prompt-len`` tokens, one output
token each: prompt tokens per second) and **generation** (``--gen-requests`` short prompts decoding
``--gen-tokens`` tokens each, all in one batch: generated tokens per second), after an untimed warm-up (an
engine's first batch pays one-off costs: oneDNN primitives for new shapes, first-touch of the KV cache), each
phase ``--repeats`` times (median and best reported). The engines run ``--rounds`` times alternately (hal,
CPU_ATTN, hal, ...) with the load average recorded per engine, so a load change shows. Then, in this process, the
per-step translation alone (:class:`hal.integrations.vllm_steps.StepTranslator` plus hal's
``init_forward_metadata``: what hal adds per step, not per layer) on a decode step and a mixed step of the
generation phase's shape, median of many. JSON out with the machine (CPU features, load average): compare
ratios measured in one run, never figures from different machines or loads.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

import vllm_engine  # noqa: E402
import vllm_model  # noqa: E402

ENGINE_ARGS = {"block_size": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512, "enable_prefix_caching": False}


def _phases(args) -> tuple[list[dict], list[dict]]:
    """The prompt phase's and the generation phase's requests."""
    low = 8
    prompt = [
        {"prompt_token_ids": [low + (i * 7 + j) % 400 for j in range(args.prompt_len)], "max_tokens": 1}
        for i in range(args.prompts)
    ]
    gen = [
        {"prompt_token_ids": [low + (i * 13 + j) % 400 for j in range(16)], "max_tokens": args.gen_tokens}
        for i in range(args.gen_requests)
    ]
    return prompt, gen


def engine_throughput(model: str, attention: str, args, workdir: str) -> dict:
    """One engine serving the warm-up, then ``args.repeats`` x (prompt phase, generation phase)."""
    prompt, gen = _phases(args)
    warm = [dict(r, max_tokens=2) for r in prompt[:2]] + gen[:2]
    workload = [warm] + [prompt, gen] * args.repeats
    load = os.getloadavg()[0]
    run = vllm_engine.run_in_subprocess(
        model, attention, workload, workdir, {**ENGINE_ARGS, "dtype": args.dtype}, timeout=3000
    )
    prompt_s, gen_s = run["phase_s"][1::2], run["phase_s"][2::2]
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in prompt)
    generated = sum(r["max_tokens"] for r in gen)
    served = [x for x in run["log"].splitlines() if "serves vLLM's attention" in x]
    return {
        "attention": attention,
        "served_by": served[0].split("serves vLLM's attention", 1)[1].strip() if served else "vLLM's CPU_ATTN",
        "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
        "engine_start_s": round(run["start_s"], 2),
        "warm_up_s": round(run["phase_s"][0], 3),
        "prompt_s": [round(x, 3) for x in prompt_s],
        "prompt_tokens_per_s": round(prompt_tokens / statistics.median(prompt_s), 1),
        "prompt_tokens_per_s_best": round(prompt_tokens / min(prompt_s), 1),
        "generation_s": [round(x, 3) for x in gen_s],
        "generated_tokens_per_s": round(generated / statistics.median(gen_s), 1),
        "generated_tokens_per_s_best": round(generated / min(gen_s), 1),
    }


def translation_cost(batch: int, context: int, prefill: int, repeats: int = 300) -> dict:
    """Median microseconds of one step's translation + hal metadata, decode and mixed, for ``batch`` requests
    of ``context`` tokens (the mixed step: the same decodes plus one ``prefill``-token chunk)."""
    import torch

    import hal
    from hal.integrations.vllm_steps import StepTranslator, VllmKVPool

    block = ENGINE_ARGS["block_size"]
    blocks_per_req = -(-(context + prefill) // block)
    num_blocks = (batch + 1) * blocks_per_req + 1
    cache = torch.zeros(num_blocks, block, 2, 64).permute(0, 2, 1, 3)
    pool = VllmKVPool(block, torch.float32, "cpu", 32)
    pool.bind(0, cache)
    translator = StepTranslator(pool, block, batch + 1, blocks_per_req)
    layer = hal.AttentionLayer(layer_id=0, tp_q_head_num=8, tp_k_head_num=2, head_dim=32)
    config = hal.AttentionConfig.from_layers([layer], dtype=torch.float32, page_size=block)
    backend = hal.select(config, device="cpu").create()
    table = torch.arange(1, 1 + (batch + 1) * blocks_per_req, dtype=torch.int32).view(batch + 1, blocks_per_req)

    def metadata(chunk: int):
        q_lens = [1] * batch + ([chunk] if chunk else [])
        seq = [context] * batch + ([chunk] if chunk else [])
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        slots = [
            int(table[r, p // block]) * block + p % block
            for r, (q, s) in enumerate(zip(q_lens, seq))
            for p in range(s - q, s)
        ]
        qsl = torch.tensor(starts, dtype=torch.int32)
        return argparse.Namespace(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32),
            num_reqs=len(q_lens),
            num_actual_tokens=starts[-1],
            max_query_len=max(q_lens),
            max_seq_len=max(seq),
            block_table_tensor=table[: len(q_lens)],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            causal=True,
            positions=None,
        )

    out = {}
    for name, cm in (("decode", metadata(0)), ("mixed", metadata(prefill))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            step = translator.translate(cm)
            backend.init_forward_metadata(step)
            times.append(time.perf_counter_ns() - t0)
        out[f"{name}_step_us"] = round(statistics.median(times) / 1000, 1)
    out.update(batch=batch, context=context, prefill_chunk=prefill, hal_backend=type(backend).__name__)
    return out


def machine() -> dict:
    from hal.kernels import cpu as cpu_kernels

    features = cpu_kernels.cpu_features()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {
        "cpu": features.get("model") or platform.machine(),
        "cores": os.cpu_count(),
        "features": [f for f in wanted if f in features.get("flags", ())],
        "hal_cpu_isa": cpu_kernels.isa(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_engine.json"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-requests", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each phase per engine")
    parser.add_argument("--rounds", type=int, default=2, help="engines per backend, alternating")
    parser.add_argument("--translate-only", action="store_true", help="only the per-step translation cost")
    args = parser.parse_args(argv)
    result = {"machine": machine(), "args": vars(args)}
    if not args.translate_only:
        with tempfile.TemporaryDirectory() as work:
            model = vllm_model.build_model(os.path.join(work, "llama"), "llama", seed=0)
            runs = [engine_throughput(model, a, args, work) for _ in range(args.rounds) for a in ("hal", "CPU_ATTN")]
        result["engine"] = runs
        keys = ("prompt_tokens_per_s", "generated_tokens_per_s")
        # each hal engine over the CPU_ATTN engine that ran next to it, then the median of those rounds
        rounds = [{k: hal_run[k] / ref[k] for k in keys} for hal_run, ref in zip(runs[0::2], runs[1::2])]
        result["hal_over_cpu_attn"] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in keys}
        result["hal_over_cpu_attn_per_round"] = [{k: round(v, 3) for k, v in r.items()} for r in rounds]
    result["translation"] = translation_cost(args.gen_requests, 16 + args.gen_tokens, args.prompt_len)
    result["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
