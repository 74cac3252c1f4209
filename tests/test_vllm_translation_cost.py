"""The per-step translation of vLLM's metadata allocates nothing sized by the engine's maxima.

hal's vLLM builder (``hal.integrations.vllm.HalMetadataBuilder``) creates its backend for ``max_num_seqs`` x
``max_model_len`` and translates every step (:class:`hal.integrations.vllm_steps.StepTranslator`, then the backend's
``init_forward_metadata``). vLLM's block table is ``[max_num_seqs, max_model_len / block_size]``; hal reads the
step's rows of it in place. Here the same step (16 decodes of 2k tokens) is translated under a small engine and a
large one (1024 sequences of 128k tokens, block size 16: a 32 MiB block table) with torch's CPU allocations counted
(the profiler's memory events): no timing. Needs no vLLM (a stand-in of its ``CommonAttentionMetadata``).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hal
from hal.integrations import vllm_steps
from hal.integrations.vllm_steps import StepTranslator, VllmKVPool, vllm_layer

BLOCK = 16
DECODES, CONTEXT = 16, 2048
STEP_BOUND = 1 << 20  # bytes: a token table of the step itself (16 x 2048 int64) is 256 KiB
# the KV layouts vLLM may allocate for hal's CPU backend (token-major before hal read vLLM's native one)
LAYOUTS = vllm_steps.served_kv_layouts("cpu") if hasattr(vllm_steps, "served_kv_layouts") else ("token_major",)


def allocated_bytes(fn) -> int:
    """Bytes torch's CPU allocator hands out while ``fn()`` runs (each op's own net allocation, and those outside
    any op)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def engine(max_num_seqs: int, max_model_len: int, layout: str):
    """hal's side of one KV cache group as vLLM's builder makes it over a cache in ``layout``, and a decode step's
    metadata over vLLM's block table of those maxima: ``(backend, translator, cm, table, setup_bytes)``."""
    blocks_per_req = CONTEXT // BLOCK
    layer = vllm_layer(0, 2, 1, 32, 32**-0.5)
    placed = {} if layout == "token_major" else {"kv_layout": layout}
    config = hal.AttentionConfig.from_layers(
        [layer],
        dtype=torch.float32,
        page_size=BLOCK,
        max_context_len=max_model_len,
        max_batch_size=max_num_seqs,
        **placed,
    )
    made = {}

    def create():
        made["backend"] = hal.select(config, device="cpu").create()
        made["translator"] = StepTranslator(made["pool"], BLOCK, max_num_seqs, max_model_len // BLOCK)

    blocks = DECODES * blocks_per_req + 1
    if layout == "token_major":  # vLLM's LBNHC cache: memory [blocks, block, kv_heads, 2 * head_dim]
        cache = torch.zeros(blocks, BLOCK, 1, 64).permute(0, 2, 1, 3)
    else:  # LBHNC, vLLM's CPU layout: [blocks, kv_heads, block, 2 * head_dim] dense
        cache = torch.zeros(blocks, 1, BLOCK, 64)
    made["pool"] = VllmKVPool(BLOCK, torch.float32, "cpu", 32, **placed)
    made["pool"].bind(0, cache)
    setup_bytes = allocated_bytes(create)
    table = torch.zeros(max(max_num_seqs, DECODES), max_model_len // BLOCK, dtype=torch.int32)
    table[:DECODES, :blocks_per_req] = torch.arange(1, 1 + DECODES * blocks_per_req).view(DECODES, blocks_per_req)
    starts = torch.arange(DECODES + 1, dtype=torch.int32)
    seq_lens = torch.full((DECODES,), CONTEXT, dtype=torch.int32)
    slots = (table[:DECODES, blocks_per_req - 1].long() * BLOCK + (CONTEXT - 1) % BLOCK).contiguous()
    cm = types.SimpleNamespace(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=DECODES,
        num_actual_tokens=DECODES,
        max_query_len=1,
        max_seq_len=CONTEXT,
        block_table_tensor=table[:DECODES],
        slot_mapping=slots,
        causal=True,
        positions=None,
    )
    return made["backend"], made["translator"], cm, table, setup_bytes


def translate(backend, translator, cm):
    step = translator.translate(cm)
    backend.init_forward_metadata(step)
    return step


@pytest.fixture(scope="module", params=LAYOUTS)
def small_and_large(request):
    return engine(16, 2048, request.param), engine(1024, 131072, request.param)


def test_translation_reads_the_block_table_in_place(small_and_large):
    _, (backend, translator, cm, table, _) = small_and_large
    step = translate(backend, translator, cm)
    assert step.req_to_token_pool is None
    assert step.req_to_page_pool.req_to_page.data_ptr() == table.data_ptr()
    assert step.req_pool_indices.tolist() == list(range(DECODES))


def test_step_allocates_nothing_sized_by_the_engine_maxima(small_and_large):
    (small, large) = small_and_large
    measured = []
    for backend, translator, cm, *_ in (small, large):
        translate(backend, translator, cm)  # first step: anything cached once
        measured.append(allocated_bytes(lambda b=backend, t=translator, c=cm: translate(b, t, c)))
    table_bytes = large[3].numel() * large[3].element_size()
    assert table_bytes == 1024 * (131072 // BLOCK) * 4  # 32 MiB: what a proportional allocation would be near
    assert measured[1] <= STEP_BOUND, measured
    assert measured[1] <= measured[0] + 4096, f"the step allocates more under the larger engine: {measured}"


def test_backend_and_translator_allocate_nothing_sized_by_the_engine_maxima(small_and_large):
    _, (*_, setup_bytes) = small_and_large
    assert setup_bytes <= STEP_BOUND, setup_bytes


def test_the_count_sees_an_allocation_sized_by_the_maxima(small_and_large):
    """The measure's negative case: a translation that expanded vLLM's whole block table into a token table (as
    hal's integration once did per step) is counted, and fails the bound."""
    _, (backend, translator, cm, table, _) = small_and_large

    def expanding():
        translate(backend, translator, cm)
        (table[:, :, None] * BLOCK + torch.arange(BLOCK, dtype=torch.int32)).view(table.shape[0], -1)

    counted = allocated_bytes(expanding)
    assert counted >= table.shape[0] * table.shape[1] * BLOCK * 4
    assert counted > STEP_BOUND


# ----------------------------------------------------------------------------- the engine's step times
# bench/vllm_engine.py --step-times reports the translation and each layer's attention as measured inside the engine
# (bench/vllm_step_probe): the probe's wrappers and the summary are checked here on stand-in classes (no timing).

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str, path: pathlib.Path, monkeypatch, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "path", list(sys.path))  # bench/vllm_engine.py puts ci/ on it
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def probe(tmp_path, monkeypatch):
    log = tmp_path / "steps.jsonl"
    module = _load(
        "step_probe", ROOT / "bench" / "vllm_step_probe" / "sitecustomize.py", monkeypatch, HAL_BENCH_STEP_LOG=str(log)
    )
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_PatchAfterImport"])
    return module, log


class _Impl:
    def forward(self):
        return "attended"


class _Builder:
    def build(self):
        return "metadata"


class _Runner:
    def __init__(self, impl, builder, layers):
        self.impl, self.builder, self.layers = impl, builder, layers

    def execute_model(self, scheduler_output):
        self.builder.build()
        for _ in range(self.layers):
            self.impl.forward()
        return "stepped"


def test_probe_records_each_step_with_its_attention_calls_and_translation(probe):
    module, log = probe
    module._timed(_Impl, "forward", "attention_s", "attention_calls")
    module._timed(_Builder, "build", "build_s")
    module._steps(_Runner)
    runner = _Runner(_Impl(), _Builder(), layers=3)
    cached = types.SimpleNamespace(req_ids=["a", "b"], num_computed_tokens=[40, 7])
    decode = types.SimpleNamespace(
        total_num_scheduled_tokens=2, num_scheduled_tokens={"a": 1, "b": 1}, scheduled_cached_reqs=cached
    )
    new_request = types.SimpleNamespace(req_id="c", num_computed_tokens=16)  # 16 tokens found in the prefix cache
    prefill = types.SimpleNamespace(
        total_num_scheduled_tokens=9,
        num_scheduled_tokens={"a": 1, "c": 8},
        scheduled_new_reqs=[new_request],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=["a"], num_computed_tokens=[41]),
    )
    idle = types.SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    assert [runner.execute_model(s) for s in (decode, prefill, idle)] == ["stepped"] * 3
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["tokens"], r["decode_only"], r["attention_calls"]) for r in records] == [(2, True, 3), (9, False, 3)]
    assert [r["keys"] for r in records] == [41 + 8, 42 + 24]  # tokens read: computed before the step + scheduled
    for r in records:  # the wrapped calls happen inside the step: their times are parts of its wall time
        assert 0 < r["attention_s"] + r["build_s"] <= r["wall_s"]
        assert r["kv_write_s"] == 0


def test_probe_is_inert_without_a_log(monkeypatch):
    monkeypatch.delenv("HAL_BENCH_STEP_LOG", raising=False)
    before = list(sys.meta_path)
    module = _load("step_probe_off", ROOT / "bench" / "vllm_step_probe" / "sitecustomize.py", monkeypatch)
    assert module.LOG is None and sys.meta_path == before


def _record(decode: bool, wall: float, attention: float, calls=2, build=0.001, kv=0.0, tokens=None, keys=None):
    return {
        "tokens": tokens or (8 if decode else 512),
        **({} if keys is None else {"keys": keys}),
        "decode_only": decode,
        "wall_s": wall,
        "attention_s": attention,
        "attention_calls": calls,
        "build_s": build,
        "kv_write_s": kv,
        "load": 1.0,
    }


def test_step_summary_splits_decode_from_prefill_and_ratios_read_as_throughput(monkeypatch):
    bench = _load("bench_vllm_engine", ROOT / "bench" / "vllm_engine.py", monkeypatch)
    warm_up = [_record(True, 0.001, 0.0001, tokens=2)] * 5  # another batch size: left out of the decode figures
    decodes = [_record(True, 0.010 + i * 0.001, 0.004) for i in range(10)]
    hal_steps = bench.step_summary(warm_up + decodes + [_record(False, 0.100, 0.040)])
    assert hal_steps["decode"]["tokens"] == 8
    assert hal_steps["decode"]["n"] == 10 and hal_steps["prefill"]["n"] == 1
    assert hal_steps["decode"]["wall_ms"][0] == pytest.approx(11.0)  # the 10th percentile of 10..19 ms
    assert hal_steps["decode"]["attention_per_layer_ms"][0] == pytest.approx(2.0)
    assert hal_steps["decode"]["rest_ms"][0] == pytest.approx(11.0 - 4.0 - 1.0)
    slower = bench.step_summary([_record(True, 0.022, 0.008, kv=0.001)] * 10 + [_record(False, 0.100, 0.040)])
    ratios = bench.step_ratios(hal_steps, slower)
    assert ratios["decode"]["wall_ms"] == pytest.approx(2.0)  # CPU_ATTN twice hal's time: hal 2x the throughput
    assert bench.step_ratios(slower, hal_steps)["decode"]["wall_ms"] == pytest.approx(0.5)
    assert ratios["prefill"] == {"wall_ms": 1.0, "attention_per_layer_ms": 1.0}


def test_matched_ratios_compare_prefill_chunks_of_equal_work(monkeypatch):
    bench = _load("bench_vllm_engine", ROOT / "bench" / "vllm_engine.py", monkeypatch)
    # two chunks per prefix, over 0 / 512 / 1024 tokens of prefix; the longer the prefix, the dearer the chunk
    hal = [_record(False, 0.1 + k / 1e4, 0.01 * (1 + k / 512), keys=512 + k) for k in (0, 512, 1024) for _ in "ab"]
    # CPU_ATTN: 2x hal's time on the long chunks, level on the first; its KV write apart (counted in)
    ref = [_record(False, 0.2, 0.02 * (1 + k / 512) - 0.002, kv=0.002, keys=512 + k) for k in (512, 1024)]
    ref += [_record(False, 0.1, 0.009, kv=0.001, keys=512), _record(False, 0.5, 0.5, keys=512)]  # the 2nd: load
    matched = bench.matched_step_ratios(bench.step_summary(hal), bench.step_summary(ref))
    assert matched["prefill"]["steps_matched"] == 3
    assert matched["prefill"]["attention_with_kv_write_per_layer"] == pytest.approx(2.0)  # median of 1, 2, 2
    # a step kind or a step work only one engine ran is left out, not guessed
    assert (
        bench.matched_step_ratios(bench.step_summary(hal), bench.step_summary(ref[:2]))["prefill"]["steps_matched"] == 2
    )
    assert bench.matched_step_ratios(bench.step_summary(hal[:1]), bench.step_summary(ref[:2])) == {}
