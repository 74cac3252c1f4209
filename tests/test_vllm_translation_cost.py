"""The per-step translation of vLLM's metadata allocates nothing sized by the engine's maxima.

hal's vLLM builder (``hal.integrations.vllm.HalMetadataBuilder``) creates its backend for ``max_num_seqs`` x
``max_model_len`` and translates every step (:class:`hal.integrations.vllm_steps.StepTranslator`, then the backend's
``init_forward_metadata``). vLLM's block table is ``[max_num_seqs, max_model_len / block_size]``; hal reads the
step's rows of it in place. Here the same step (16 decodes of 2k tokens) is translated under a small engine and a
large one (1024 sequences of 128k tokens, block size 16: a 32 MiB block table) with torch's CPU allocations counted
(the profiler's memory events): no timing. Needs no vLLM (a stand-in of its ``CommonAttentionMetadata``).
"""

from __future__ import annotations

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
