"""vLLM's engine on hal against vLLM's own ``CPU_ATTN``, same model, one run; the per-step translation apart.

    python bench/vllm_engine.py [--out bench/results/vllm_engine.json] [--prompts 8] [--prompt-len 256]
        [--gen-requests 16] [--gen-tokens 64] [--dtype float32] [--repeats 3] [--rounds 2] [--translate-only]
        [--layers 4 --hidden 256 --heads 8 --kv-heads 2 --intermediate 512] [--gen-prompt-len 16]
        [--gen-prefilled] [--max-model-len N] [--max-num-seqs 16] [--max-num-batched-tokens 512]
        [--kv-cache-gib 1] [--hal-kv-layout LBNHC|LBHNC|head_major|amx_packed] [--translate-probe] [--no-step-times]

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
generation phase's shape, median of many, and the per-layer cost over the kernel (:func:`layer_overhead`: one
layer's forward through hal's vLLM impl against the kernel call it makes, alone, same shapes, alternating). JSON
out with the machine (CPU features, load average): compare ratios measured in one run, never figures from
different machines or loads.

An attention-heavy model: ``--heads 16 --kv-heads 4 --hidden 2048`` (head dim 128) with few ``--layers`` and a
small ``--intermediate``, ``--gen-prompt-len`` contexts of thousands of tokens and ``--gen-prefilled`` (the
generation phase's prompts are prefilled once, untimed, and found in vLLM's prefix cache, so the generation phase
times decode steps; each prompt phase then gets new prompts). ``--translate-probe``: the per-step translation of
one step (64 decodes of 2k tokens) under engines of growing ``max_num_seqs x max_model_len`` (:func:`translate_probe`:
its time and the bytes torch allocates for it, which must not grow with them).

Inside the engines (``--step-times``, the default): :mod:`bench.vllm_step_probe` times every step the engine runs,
the attention impl's forward of each layer (hal's ``HalAttentionImpl`` or vLLM's ``CPU_ATTN`` impl: kernel and
Python around it), CPU_ATTN's separate KV write and the metadata builder (the per-step translation), and
:func:`step_summary` gives each engine's decode and prefill steps as 10th percentile and median. On a shared
2-core host the phase times mostly measure the other users: every OpenMP region waits for its slower thread, so a
busy core stretches a step's every op, some steps 10x; and decode attention is memory-bound, so others' memory
traffic moves it 3x between runs minutes apart. The 10th percentiles of each engine's steps, and their
CPU_ATTN/hal ratios per round (``hal_over_cpu_attn_steps_p10_per_round``), are the figures that hold; for prefill,
whose chunks read 0 to 4k tokens of prefix, :func:`matched_step_ratios` compares steps of equal work
(``hal_over_cpu_attn_steps_matched_per_round``).
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


def _phases(args, repeat: int = 0) -> tuple[list[dict], list[dict]]:
    """The prompt phase's and the generation phase's requests. With ``--gen-prefilled`` (the prefix cache on) each
    repeat's prompt phase starts its prompts with its own token, and the generation prompts with another, so no
    timed prompt finds another's blocks in the cache."""
    low = 8
    prompt = [[low + (i * 7 + j) % 400 for j in range(args.prompt_len)] for i in range(args.prompts)]
    gen = [[low + (i * 13 + j) % 400 for j in range(args.gen_prompt_len)] for i in range(args.gen_requests)]
    if args.gen_prefilled:
        prompt = [[low + 400 + repeat % 90] + p[1:] for p in prompt]
        gen = [[vllm_model.VOCAB - 1] + p[1:] for p in gen]
    return (
        [{"prompt_token_ids": p, "max_tokens": 1} for p in prompt],
        [{"prompt_token_ids": p, "max_tokens": args.gen_tokens} for p in gen],
    )


def engine_args(args) -> dict:
    """The engine arguments of this run (the defaults: :data:`ENGINE_ARGS`)."""
    given = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.gen_prefilled,
    }
    if args.max_model_len:
        given["max_model_len"] = args.max_model_len
    return {**ENGINE_ARGS, **given}


def engine_throughput(model: str, attention: str, args, workdir: str) -> dict:
    """One engine serving the warm-up, then ``args.repeats`` x (prompt phase, generation phase); with
    ``--gen-prefilled`` the generation prompts are prefilled (one token each) after the warm-up, untimed."""
    prompt, gen = _phases(args, args.repeats)  # the warm-up's prompts: no timed repeat's
    warm = [dict(r, max_tokens=2) for r in prompt[:2]] + gen[:2]
    workload = [warm] + ([[dict(r, max_tokens=1) for r in gen]] if args.gen_prefilled else [])
    first = len(workload)
    for repeat in range(args.repeats):
        workload += [_phases(args, repeat)[0], gen]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)} if args.kv_cache_gib else {}
    if attention == "hal" and args.hal_kv_layout:
        env["VLLM_KV_CACHE_LAYOUT"] = VLLM_ALLOCATION.get(args.hal_kv_layout, args.hal_kv_layout)
        if args.hal_kv_layout in VLLM_ALLOCATION:  # what hal keeps in vLLM's head-major cache
            env["HAL_KV_LAYOUT"] = args.hal_kv_layout
    step_log = None
    if args.step_times:
        step_log = os.path.join(workdir, f"{attention}-{time.perf_counter_ns()}-steps.jsonl")
        path = [str(STEP_PROBE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(HAL_BENCH_STEP_LOG=step_log, PYTHONPATH=os.pathsep.join(path))
    load = os.getloadavg()[0]
    run = vllm_engine.run_in_subprocess(model, attention, workload, workdir, engine_args(args), env=env, timeout=3000)
    prompt_s, gen_s = run["phase_s"][first::2], run["phase_s"][first + 1 :: 2]
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in prompt)
    generated = sum(r["max_tokens"] for r in gen)
    served = [x for x in run["log"].splitlines() if "serves vLLM's attention" in x]
    notes = [x.split("hal backend", 1)[1].strip() for x in run["log"].splitlines() if "hal backend " in x]
    layouts = [x.split("Using", 1)[1].strip() for x in run["log"].splitlines() if "KV cache layout" in x]
    return {
        "attention": attention,
        "served_by": served[0].split("serves vLLM's attention", 1)[1].strip() if served else "vLLM's CPU_ATTN",
        "hal_backend_notes": list(dict.fromkeys(notes)),
        "kv_cache_layout": layouts[0] if layouts else None,
        "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
        "engine_start_s": round(run["start_s"], 2),
        "warm_up_s": round(run["phase_s"][0], 3),
        **({"gen_prefill_s": round(run["phase_s"][1], 3)} if args.gen_prefilled else {}),
        "prompt_s": [round(x, 3) for x in prompt_s],
        "prompt_tokens_per_s": round(prompt_tokens / statistics.median(prompt_s), 1),
        "prompt_tokens_per_s_best": round(prompt_tokens / min(prompt_s), 1),
        "generation_s": [round(x, 3) for x in gen_s],
        "generated_tokens_per_s": round(generated / statistics.median(gen_s), 1),
        "generated_tokens_per_s_best": round(generated / min(gen_s), 1),
        **({"steps": step_summary(_read_steps(step_log))} if step_log else {}),
    }


STEP_PROBE = ROOT / "bench" / "vllm_step_probe"  # its sitecustomize times the engine's steps (--step-times)


def _read_steps(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_summary(records: list[dict]) -> dict:
    """The engine's steps (:mod:`bench.vllm_step_probe`'s records) by kind: ``decode`` (every request one token)
    and ``prefill`` (any other), each kind's steps of its most frequent token count only (the generation phase's
    full batch; the prefill chunks filling the step's token budget: warm-up and stragglers left out), with ``n``,
    ``tokens`` and, as ``[p10, median]`` in milliseconds: the step's wall time, one layer's attention (the impl's
    forward: kernel and Python around it), the per-step translation (the metadata builder), vLLM's separate KV write
    (CPU_ATTN only) and the rest of the step (the model around attention). The 10th percentile is the robust figure
    on a shared host: load only ever adds time, and it lands on some steps, not all."""
    fields = {
        "wall_ms": lambda r: r["wall_s"],
        "attention_per_layer_ms": lambda r: r["attention_s"] / max(r["attention_calls"], 1),
        "translation_ms": lambda r: r["build_s"],
        "kv_write_ms": lambda r: r["kv_write_s"],
        "rest_ms": lambda r: r["wall_s"] - r["attention_s"] - r["build_s"] - r["kv_write_s"],
    }
    kinds = {}
    for kind, decode_only in (("decode", True), ("prefill", False)):
        of_kind = [r for r in records if r["decode_only"] == decode_only]
        if not of_kind:
            continue
        tokens = statistics.mode(r["tokens"] for r in of_kind)
        steps = [r for r in of_kind if r["tokens"] == tokens]
        kinds[kind] = {
            "n": len(steps),
            "tokens": tokens,
            **{
                name: [round(_quantile([f(r) for r in steps], q) * 1e3, 3) for q in (0.1, 0.5)]
                for name, f in fields.items()
            },
            "load_average_1min_median": round(statistics.median(r["load"] for r in steps), 2),
        }
        by_keys: dict[int, list[dict]] = {}
        for r in steps:
            if "keys" in r:
                by_keys.setdefault(r["keys"], []).append(r)
        if by_keys:  # per step work (KV tokens read): the fastest of its steps, attention with its KV write
            kinds[kind]["by_keys_min_ms"] = {
                str(keys): [
                    round(min(_attention_with_write(r) for r in of_keys) * 1e3, 3),
                    round(min(r["wall_s"] for r in of_keys) * 1e3, 3),
                ]
                for keys, of_keys in sorted(by_keys.items())
            }
    return kinds


def _attention_with_write(record: dict) -> float:
    """One layer's attention in a step with vLLM's separate KV write counted in (hal's forward writes the KV
    itself; CPU_ATTN's ``do_kv_cache_update`` does it apart), in seconds."""
    return (record["attention_s"] + record["kv_write_s"]) / max(record["attention_calls"], 1)


def matched_step_ratios(hal_steps: dict, reference_steps: dict) -> dict:
    """CPU_ATTN's time over hal's (above 1: hal faster), per step kind, on steps of equal work: for each number of
    KV tokens read that both engines' steps of the kind share, the fastest step of each (attention per layer with
    its KV write, and the whole step), then the median ratio over those. A prefill phase mixes chunks over 0 to 4k
    tokens of prefix, so its 10th percentile compares the cheapest chunks only; this compares every chunk."""
    out = {}
    for kind in hal_steps.keys() & reference_steps.keys():
        mine = hal_steps[kind].get("by_keys_min_ms", {})
        theirs = reference_steps[kind].get("by_keys_min_ms", {})
        shared = [k for k in mine if k in theirs and min(mine[k]) > 0]
        if not shared:
            continue
        out[kind] = {
            "steps_matched": len(shared),
            "attention_with_kv_write_per_layer": round(statistics.median(theirs[k][0] / mine[k][0] for k in shared), 3),
            "wall_ms": round(statistics.median(theirs[k][1] / mine[k][1] for k in shared), 3),
        }
    return out


def step_ratios(hal_steps: dict, reference_steps: dict) -> dict:
    """CPU_ATTN's time over hal's (above 1: hal faster), per step kind, on the 10th percentiles of
    :func:`step_summary`: the whole step and one layer's attention."""
    out = {}
    for kind in hal_steps.keys() & reference_steps.keys():
        out[kind] = {
            name: round(reference_steps[kind][name][0] / hal_steps[kind][name][0], 3)
            for name in ("wall_ms", "attention_per_layer_ms")
            if hal_steps[kind][name][0] > 0
        }
    return out


def _step_metadata(table, block: int, context: int, decodes: int, chunk: int = 0):
    """A stand-in of vLLM's ``CommonAttentionMetadata``: ``decodes`` one-token rows of ``context`` tokens, then one
    ``chunk``-token prefill (none when 0); request ``r`` reads row ``r`` of ``table`` (vLLM's block table, int32)."""
    import torch

    q_lens = [1] * decodes + ([chunk] if chunk else [])
    seq = [context] * decodes + ([chunk] if chunk else [])
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    rows = table[: len(q_lens)].tolist()
    slots = [
        rows[r][p // block] * block + p % block for r, (q, s) in enumerate(zip(q_lens, seq)) for p in range(s - q, s)
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


HAL_LAYOUTS = {"LBNHC": "token_major", "LBHNC": "head_major"}  # vLLM's names -> hal's (hal.kv_layouts)
# hal's names of what it may keep in vLLM's head-major (LBHNC) allocation -> that allocation
VLLM_ALLOCATION = {"head_major": "LBHNC", "amx_packed": "LBHNC"}


def served_kv_layout() -> str:
    """The KV layout vLLM allocates for hal's CPU backend (hal's name, :mod:`hal.kv_layouts`)."""
    from hal.integrations import vllm_steps

    served = getattr(vllm_steps, "served_kv_layouts", None)
    return served("cpu")[0] if served else "token_major"


def _hal_group(heads, kv_heads, head_dim, dtype, num_blocks, max_num_seqs, max_model_len, block=None, layout=None):
    """hal's side of one KV cache group as ``HalMetadataBuilder`` makes it (the backend chosen and created for
    ``max_num_seqs`` x ``max_model_len``, the pool over a cache of ``num_blocks`` blocks in the layout vLLM
    allocates for hal (``layout``, default :func:`served_kv_layout`) with layer 0 bound, the step translator):
    ``(backend, translator, layer, cache)``."""
    import torch

    import hal
    from hal.integrations.vllm_steps import StepTranslator, VllmKVPool, vllm_layer

    block = block or ENGINE_ARGS["block_size"]
    layout = layout or served_kv_layout()
    layer = vllm_layer(0, heads, kv_heads, head_dim, head_dim**-0.5)
    placed = {} if layout == "token_major" else {"kv_layout": layout}
    config = hal.AttentionConfig.from_layers(
        [layer], dtype=dtype, page_size=block, max_context_len=max_model_len, max_batch_size=max_num_seqs, **placed
    )
    backend = hal.select(config, device="cpu").create()
    if layout == "token_major":  # LBNHC: memory [blocks, block, kv_heads, 2 * head_dim]
        cache = torch.zeros(num_blocks, block, kv_heads, 2 * head_dim, dtype=dtype).permute(0, 2, 1, 3)
    else:  # LBHNC, vLLM's CPU layout: [blocks, kv_heads, block, 2 * head_dim] dense (a block's keys, then values)
        cache = torch.zeros(num_blocks, kv_heads, block, 2 * head_dim, dtype=dtype)
    pool = VllmKVPool(block, dtype, "cpu", head_dim, **placed)
    pool.bind(0, cache)
    translator = StepTranslator(pool, block, max_num_seqs, -(-max_model_len // block))
    return backend, translator, layer, cache


def _block_table(rows: int, max_blocks: int, used_rows: int, blocks_per_req: int):
    """vLLM's block table ``[rows, max_blocks]`` int32: request ``r < used_rows`` holds blocks
    ``1 + r * blocks_per_req ...`` (block 0: vLLM's null block)."""
    import torch

    table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    used = torch.arange(1, 1 + used_rows * blocks_per_req, dtype=torch.int32).view(used_rows, blocks_per_req)
    table[:used_rows, :blocks_per_req] = used
    return table


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return round(statistics.median(times) / 1000, 1)


def allocated_bytes(fn) -> tuple[int, int]:
    """Bytes torch's CPU allocator hands out while ``fn()`` runs, and how many allocations: each op's own net
    allocation (its outputs, and what it keeps) plus allocations outside any op, freed later or not."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return sum(sizes), len(sizes)


def translation_cost(batch: int, context: int, prefill: int, repeats: int = 300) -> dict:
    """Median microseconds of one step's translation + hal metadata, decode and mixed, for ``batch`` requests
    of ``context`` tokens (the mixed step: the same decodes plus one ``prefill``-token chunk)."""
    import torch

    block = ENGINE_ARGS["block_size"]
    blocks_per_req = -(-(context + prefill) // block)
    num_blocks = (batch + 1) * blocks_per_req + 1
    backend, translator, _, _ = _hal_group(8, 2, 32, torch.float32, num_blocks, batch + 1, blocks_per_req * block)
    table = _block_table(batch + 1, blocks_per_req, batch + 1, blocks_per_req)
    out = {}
    for name, cm in (
        ("decode", _step_metadata(table, block, context, batch)),
        ("mixed", _step_metadata(table, block, context, batch, prefill)),
    ):
        out[f"{name}_step_us"] = _median_us(
            lambda cm=cm: backend.init_forward_metadata(translator.translate(cm)), repeats
        )
    out.update(batch=batch, context=context, prefill_chunk=prefill, hal_backend=type(backend).__name__)
    return out


PROBE_SIZES = ((16, 2048), (256, 32768), (1024, 131072))  # (max_num_seqs, max_model_len)


def translate_probe(decodes: int = 64, context: int = 2048, repeats: int = 300, sizes=PROBE_SIZES) -> list[dict]:
    """The same step (``decodes`` decode rows of ``context`` tokens) translated under engines of each
    ``(max_num_seqs, max_model_len)`` of ``sizes``: :func:`probe_translation` at each, its ``repeats`` timed."""
    results = []
    for max_num_seqs, max_model_len in sizes:
        result, step = probe_translation(max_num_seqs, max_model_len, decodes, context)
        results.append({**result, "step_us": _median_us(step, repeats)})
    return results


def probe_translation(max_num_seqs: int, max_model_len: int, decodes: int = 64, context: int = 2048):
    """One step of ``decodes`` decode rows of ``context`` tokens, as an engine of ``max_num_seqs`` x
    ``max_model_len`` hands it to hal: vLLM's block table ``[max(max_num_seqs, decodes), max_model_len / block]``
    int32 (the step's rows a slice of it), hal's backend created for those maxima. Returns (the bytes torch
    allocated creating the backend and translator beyond the KV cache, for one step's translation +
    ``init_forward_metadata`` and how many allocations, and the block table's bytes; the step as a function)."""
    import torch

    block = ENGINE_ARGS["block_size"]
    blocks_per_req = -(-context // block)
    created = {}

    def create():
        created["group"] = _hal_group(
            8, 2, 32, torch.float32, decodes * blocks_per_req + 1, max_num_seqs, max_model_len
        )

    setup_bytes, _ = allocated_bytes(create)
    backend, translator, _, cache = created["group"]
    table = _block_table(max(max_num_seqs, decodes), -(-max_model_len // block), decodes, blocks_per_req)
    cm = _step_metadata(table, block, context, decodes)

    def step():
        backend.init_forward_metadata(translator.translate(cm))

    step()
    step_bytes, step_allocations = allocated_bytes(step)
    result = {
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "block_table_bytes": table.numel() * table.element_size(),
        "step_allocated_bytes": step_bytes,
        "step_allocations": step_allocations,
        "setup_allocated_bytes_beyond_kv_cache": setup_bytes - cache.numel() * cache.element_size(),
    }
    return result, step


def layer_overhead(args, repeats: int = 200) -> dict:
    """One layer's forward through hal's vLLM impl (``HalAttentionImpl.forward``: bind, slicing, hal's prologue,
    the kernel, the output in vLLM's buffer; hal's backend ``forward`` where vLLM is not installed) against the
    kernel call it makes, alone, on the same inputs; alternating, median microseconds of ``repeats``. The model's
    attention shape and dtype; a decode step of ``--gen-requests`` rows of the generation phase's context, a
    mixed one (those decodes and a prefill chunk filling the step's token budget) and a decode of one block per
    row (a kernel of microseconds: the Python around it shows). Medians, and minimums (``overhead_us_of_mins``:
    the robust figure where the kernel's own time swings with the host's load)."""
    import torch

    from hal.kernels import cpu as cpu_kernels

    heads, kv_heads = args.heads, args.kv_heads
    head_dim = args.hidden // heads
    dtype = getattr(torch, args.dtype)
    block = ENGINE_ARGS["block_size"]
    batch, context = args.gen_requests, args.gen_prompt_len + args.gen_tokens // 2
    chunk = max(1, min(args.prompt_len, args.max_num_batched_tokens - batch))
    blocks_per_req = -(-max(context, chunk) // block)
    num_blocks = (batch + 1) * blocks_per_req + 1
    max_model_len = args.max_model_len or blocks_per_req * block
    layout = HAL_LAYOUTS.get(args.hal_kv_layout, args.hal_kv_layout) or served_kv_layout()
    backend, translator, layer, cache = _hal_group(
        heads, kv_heads, head_dim, dtype, num_blocks, args.max_num_seqs, max_model_len, layout=layout
    )
    torch.manual_seed(0)
    cache.normal_()
    table = _block_table(max(args.max_num_seqs, batch + 1), -(-max_model_len // block), batch + 1, blocks_per_req)
    try:
        from hal.integrations.vllm import HalAttentionImpl

        impl = HalAttentionImpl(heads, head_dim, head_dim**-0.5, kv_heads)
        impl.kv_layout = layout  # as the group's builder sets it
        through = "HalAttentionImpl.forward"
    except ImportError:
        impl = None
        through = "hal backend forward (no vLLM here)"
    out = {
        "through": through,
        "heads": [heads, kv_heads, head_dim],
        "dtype": args.dtype,
        "kv_layout": layout,
    }
    out["load_average_1min"] = [round(os.getloadavg()[0], 2)]
    for name, cm in (
        ("decode", _step_metadata(table, block, context, batch)),
        ("mixed", _step_metadata(table, block, context, batch, chunk)),
        ("decode_one_block", _step_metadata(table, block, block, batch)),  # a small kernel: the Python cost shows
    ):
        step = translator.translate(cm)
        backend.init_forward_metadata(step)
        n = step.num_tokens
        q = torch.randn(n, heads, head_dim, dtype=dtype)
        k, v = torch.randn(n, kv_heads, head_dim, dtype=dtype), torch.randn(n, kv_heads, head_dim, dtype=dtype)
        output = torch.empty(n, heads, head_dim, dtype=dtype)
        forward = _layer_forward(impl, backend, layer, step, cache, q, k, v, output)
        kernel = _captured_kernel_call(cpu_kernels, forward)
        forward_us, kernel_us = [], []
        for _ in range(repeats):
            for fn, times in ((forward, forward_us), (kernel, kernel_us)):
                if fn is None:
                    continue
                t0 = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - t0)
        forward_med = statistics.median(forward_us) / 1000
        entry = {
            "rows": step.batch_size,
            "tokens": n,
            "context": int(cm.max_seq_len),
            "forward_us": round(forward_med, 1),
            "forward_us_min": round(min(forward_us) / 1000, 1),
        }
        if kernel is not None:
            kernel_med = statistics.median(kernel_us) / 1000
            entry.update(
                kernel=kernel.name,
                kernel_us=round(kernel_med, 1),
                kernel_us_min=round(min(kernel_us) / 1000, 1),
                overhead_us=round(forward_med - kernel_med, 1),
                overhead_us_of_mins=round((min(forward_us) - min(kernel_us)) / 1000, 1),
                overhead_per_pair_us_median=round(
                    statistics.median(f - k for f, k in zip(forward_us, kernel_us)) / 1000, 1
                ),
            )
        else:
            entry["kernel"] = "none captured (hal's forward took a path calling no hal.kernels.cpu entry)"
        out[name] = entry
    out["load_average_1min"].append(round(os.getloadavg()[0], 2))
    return out


def _layer_forward(impl, backend, layer, step, cache, q, k, v, output):
    """One layer's forward of ``step`` as vLLM calls it (``impl``: hal's vLLM impl, or None: hal's backend)."""
    if impl is None:

        def forward():
            step.token_to_kv_pool.bind(layer.layer_id, cache)
            backend.forward(q, k, v, layer, step, save_kv_cache=True, out=output)

        return forward
    from hal.integrations.vllm import HalAttentionMetadata

    vllm_module = argparse.Namespace(layer_name=f"model.layers.{layer.layer_id}.self_attn.attn")
    metadata = HalAttentionMetadata(step, backend, {vllm_module.layer_name: layer}, step.num_tokens)

    def forward():
        impl.forward(vllm_module, q, k, v, cache, metadata, output)

    return forward


def _captured_kernel_call(module, forward):
    """The first call ``forward()`` makes to ``module``'s ``write_and_attend`` or ``paged_attention`` (the compiled
    kernels' entries), as a function repeating it with the same arguments; None when it makes none."""
    names = ("write_and_attend", "paged_attention")
    originals = {name: getattr(module, name) for name in names}
    calls = []

    def recorder(name):
        def record(*a, **kw):
            calls.append((name, a, kw))
            return originals[name](*a, **kw)

        return record

    for name in names:
        setattr(module, name, recorder(name))
    try:
        forward()
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
    if not calls:
        return None
    name, a, kw = calls[0]
    fn = originals[name]

    def kernel():
        fn(*a, **kw)

    kernel.name = f"hal.kernels.cpu.{name}"
    return kernel


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
    parser.add_argument("--translate-only", action="store_true", help="only the in-process measurements")
    parser.add_argument("--translate-probe", action="store_true", help="the translation under growing engine maxima")
    parser.add_argument(
        "--step-times",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each engine step, its attention and its translation inside the engine (bench/vllm_step_probe)",
    )
    for key, default in vllm_model.SHAPES.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=default, help="the model's")
    parser.add_argument("--intermediate", type=int, default=None, help="the model's MLP width (default 2 * hidden)")
    parser.add_argument("--gen-prompt-len", type=int, default=16, help="the generation requests' prompt tokens")
    parser.add_argument(
        "--gen-prefilled", action="store_true", help="prefill the generation prompts untimed (prefix cache on)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's 4096 positions")
    parser.add_argument("--max-num-seqs", type=int, default=ENGINE_ARGS["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_ARGS["max_num_batched_tokens"])
    parser.add_argument("--kv-cache-gib", type=int, default=None, help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    parser.add_argument(
        "--hal-kv-layout",
        choices=["LBNHC", "LBHNC", *VLLM_ALLOCATION],
        default=None,
        help="VLLM_KV_CACHE_LAYOUT for hal's engines only (default: vLLM's choice, hal's preferred layout); "
        "head_major / amx_packed: LBHNC holding that layout (HAL_KV_LAYOUT; default there: amx_packed on the amx "
        "path for bf16, else head_major)",
    )
    args = parser.parse_args(argv)
    result = {"machine": machine(), "args": vars(args)}
    if not args.translate_only:
        with tempfile.TemporaryDirectory() as work:
            shape = {key: getattr(args, key) for key in vllm_model.SHAPES}
            shape.update(intermediate=args.intermediate, max_positions=args.max_model_len)
            model = vllm_model.build_model(os.path.join(work, "llama"), "llama", seed=0, **shape)
            runs = [engine_throughput(model, a, args, work) for _ in range(args.rounds) for a in ("hal", "CPU_ATTN")]
        result["engine"] = runs
        keys = ("prompt_tokens_per_s", "generated_tokens_per_s")
        # each hal engine over the CPU_ATTN engine that ran next to it, then the median of those rounds
        rounds = [{k: hal_run[k] / ref[k] for k in keys} for hal_run, ref in zip(runs[0::2], runs[1::2])]
        result["hal_over_cpu_attn"] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in keys}
        result["hal_over_cpu_attn_per_round"] = [{k: round(v, 3) for k, v in r.items()} for r in rounds]
        if args.step_times:
            pairs = list(zip(runs[0::2], runs[1::2]))
            result["hal_over_cpu_attn_steps_p10_per_round"] = [step_ratios(h["steps"], r["steps"]) for h, r in pairs]
            result["hal_over_cpu_attn_steps_matched_per_round"] = [
                matched_step_ratios(h["steps"], r["steps"]) for h, r in pairs
            ]
        _write(result, args.out)  # the engines' figures kept should an in-process measurement fail
    result["translation"] = translation_cost(args.gen_requests, args.gen_prompt_len + args.gen_tokens, args.prompt_len)
    result["layer_overhead"] = layer_overhead(args)
    if args.translate_probe:
        result["translate_probe"] = translate_probe()
    result["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(_write(result, args.out))


def _write(result: dict, out: str | None) -> str:
    text = json.dumps(result, indent=2)
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
