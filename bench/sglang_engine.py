"""Serving numbers from SGLang's real engine on the CPU: ``--attention-backend hal`` against ``torch_native``.

    python bench/sglang_engine.py --json bench/results/sglang-engine-cpu.json     # a few minutes on 2 cores

A benchmark, not a test. Builds a random-weight Llama-architecture model big enough that attention
matters at these lengths (``--layers`` 4, hidden 256, 4 query / 2 KV heads of 64, fp32: at 1000 to
2000 tokens of context attention is about as many flops per token as the rest of the model;
``ci/sglang_model.py``), then for each backend in the same run starts ``sglang.Engine(device="cpu",
attention_backend=BACKEND, dtype=float32)`` (``ci/sglang_engine.py``) and serves one load: ``--requests``
distinct random prompts of ``--min-prompt`` .. ``--max-prompt`` tokens (no shared prefixes, so every
prompt token is prefilled), ``--output`` greedy tokens each, arriving ``--interval`` s apart (0: all at
once), streamed. Records, per backend, SGLang's serving-benchmark quantities over the load's wall time
(first request sent to last token received): prompt and generated tokens per second, time to first
token (mean / median / p90), end-to-end latency, engine start-up; and the CPU (model name, cores, its
features as hal's kernels see them, torch threads, load average before and after). The order of the
backends alternates with ``--rounds`` > 1 so a drifting machine load is not credited to one backend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ci"))

import sglang_engine  # noqa: E402
import sglang_model  # noqa: E402


def requests_for(args) -> list[dict]:
    rng = random.Random(args.seed)
    low = len(sglang_model.SPECIALS)
    out = []
    for i in range(args.requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        out.append(
            {
                "input_ids": [rng.randrange(low, args.vocab) for _ in range(n)],
                "max_new_tokens": args.output,
                "delay_s": i * args.interval,
            }
        )
    return out


def summarize(run: dict) -> dict:
    results = run["results"]
    start = min(r["sent_s"] for r in results)
    end = max(r["sent_s"] + r["latency_s"] for r in results)
    duration = end - start
    prompt = sum(r["prompt_tokens"] for r in results)
    generated = sum(len(r["output_ids"]) for r in results)
    ttft = sorted(r["ttft_s"] for r in results)
    latency = sorted(r["latency_s"] for r in results)
    return {
        "backend": run["backend"],
        "duration_s": duration,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "prompt_tokens_per_s": prompt / duration,
        "generated_tokens_per_s": generated / duration,
        "ttft_s": {
            "mean": statistics.fmean(ttft),
            "median": statistics.median(ttft),
            "p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        },
        "latency_s": {"mean": statistics.fmean(latency), "median": statistics.median(latency)},
        "startup_s": run["startup_s"],
        "cached_tokens": sum(r["cached_tokens"] for r in results),
    }


def machine() -> dict:
    import torch

    from hal.kernels import cpu as cpu_kernels

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "cpu_features": cpu_kernels.cpu_features(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here (e.g. bench/results/sglang-engine-cpu.json)")
    parser.add_argument("--backends", default="hal,torch_native")
    parser.add_argument("--rounds", type=int, default=1, help="runs per backend, order alternating")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=1000)
    parser.add_argument("--max-prompt", type=int, default=2000)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between arrivals")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunked-prefill-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import sglang

    backends = [b for b in args.backends.split(",") if b]
    requests = requests_for(args)
    work = tempfile.mkdtemp(prefix="hal-sglang-bench-")
    model = sglang_model.build_model(
        os.path.join(work, "model"),
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_positions=max(4096, args.max_prompt + args.output + 16),
        seed=args.seed,
    )
    extra = {
        "chunked_prefill_size": args.chunked_prefill_size,
        "max_total_tokens": sum(len(r["input_ids"]) + r["max_new_tokens"] for r in requests) + 1024,
        "disable_radix_cache": True,
    }
    report = {
        "what": "sglang.Engine on the CPU serving one load per backend (bench/sglang_engine.py)",
        "sglang": sglang.__version__,
        "machine": machine(),
        "load": {k: v for k, v in vars(args).items() if k not in ("json", "backends", "rounds")},
        "engine_args": sglang_engine.engine_kwargs("<backend>", extra),
        "loadavg_at_start": os.getloadavg(),
        "runs": [],
    }
    outputs = {}
    for round_ in range(args.rounds):
        for backend in backends if round_ % 2 == 0 else backends[::-1]:
            print(f"[bench] round {round_}: {backend} ...", file=sys.stderr, flush=True)
            loadavg = os.getloadavg()
            run = sglang_engine.run_in_subprocess(str(model), backend, requests, work, extra)
            row = {**summarize(run), "round": round_, "loadavg_before": loadavg}
            report["runs"].append(row)
            outputs.setdefault(backend, [r["output_ids"] for r in run["results"]])
            print(
                f"[bench] {backend}: {row['prompt_tokens_per_s']:.0f} prompt tok/s, "
                f"{row['generated_tokens_per_s']:.1f} generated tok/s, TTFT median {row['ttft_s']['median']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    report["loadavg_at_end"] = os.getloadavg()
    first = outputs.get(backends[0])
    report["same_tokens_as_" + backends[0]] = {b: o == first for b, o in outputs.items()}
    text = json.dumps(report, indent=1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
