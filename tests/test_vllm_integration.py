"""``hal.integrations.vllm``: hal's backends under vLLM's per-step objects.

The first tests need no vLLM (they run in every env): vLLM's KV cache layout read in place, the layer
descriptors, and the per-step translation driven by a stand-in of vLLM's ``CommonAttentionMetadata``
(the same fields, dtypes and conventions as vLLM 0.32's: ``vllm/v1/attention/backend.py``) over a
simulated engine (block allocator with a null block 0, chunked prefills, decodes first, prefix reuse,
padded requests), checked against dense attention computed here. The last ones need vLLM
(``tox -e vllm-engine``, or ``/work/venvs/vllm``) and check the classes vLLM reads and the opt-in
registration; ``tests/test_vllm_engine.py`` runs vLLM's real engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hal
from hal.batch import tables_for
from hal.conformance.vllm_standin import STEPS, SimulatedEngine, lbhnc_views, vllm_cache, vllm_cpu_cache
from hal.devices.cpu import PlainTorchBackend
from hal.errors import InvalidBatchError, KVCacheError, UnsupportedError
from hal.integrations.vllm_steps import (
    StepTranslator,
    VllmKVPool,
    hal_kv_cache_dtype,
    hal_kv_layout,
    head_major_views,
    kv_views,
    served_kv_layouts,
    step_mode,
    vllm_layer,
)
from hal.kernels.reference import quantize_kv
from hal.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT)


# ----------------------------------------------------------------------------- the KV cache, in place


def test_head_major_views_are_cpu_attns_own_pages_in_place():
    cache = vllm_cpu_cache(4, 2, 16, 8)
    k, v = head_major_views(cache, 8)
    want_k, want_v = lbhnc_views(cache)
    for got, want in ((k, want_k), (v, want_v)):
        assert got.shape == want.shape == (4, 2, 16, 8) and got.stride() == want.stride()
        assert got.data_ptr() == want.data_ptr()  # the very memory CPU_ATTN reads, no copy
    pool = VllmKVPool(16, torch.float32, "cpu", 8, kv_layout=HEAD_MAJOR)
    pool.bind(3, cache)
    layer = hal.AttentionLayer(layer_id=3, tp_q_head_num=4, tp_k_head_num=2, head_dim=8)
    pool.set_kv_buffer(layer, torch.tensor([37, -1]), torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    assert torch.equal(want_k[2, :, 5], torch.ones(2, 8)) and torch.equal(want_v[2, :, 5], torch.full((2, 8), 2.0))
    assert cache.sum() == 2 * 8 * 3  # slot 37 (block 2, token 5) only: the padding token wrote nothing
    assert pool.get_kv_pages(3)[0].data_ptr() == cache.data_ptr() and (pool.num_slots, pool.head_num) == (64, 2)
    with pytest.raises(KVCacheError, match="head_major pool"):
        pool.get_key_buffer(3)  # no token-major buffer: only a backend reading head-major pages reads it
    with pytest.raises(KVCacheError, match="LBHNC"):
        head_major_views(vllm_cache(4, 2, 16, 8), 8)  # token-major memory is not read as head-major
    stacked = torch.zeros(2, 4, 2, 16, 8)  # vLLM before 0.30: its CPU backend's get_kv_cache_shape
    k, v = head_major_views(stacked, 8)
    assert k.data_ptr() == stacked[0].data_ptr() and v.data_ptr() == stacked[1].data_ptr()


def test_layouts_offered_to_vllm_follow_hals_cpu_backend(monkeypatch):
    assert served_kv_layouts("cpu") == (HEAD_MAJOR, TOKEN_MAJOR)  # both read in place; vLLM's own the default
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "triton")  # reads token-major only
    assert served_kv_layouts("cpu") == (TOKEN_MAJOR,)
    monkeypatch.delenv("HAL_ATTENTION_BACKEND")
    monkeypatch.setenv("HAL_DEVICE", "no-such-device")
    assert served_kv_layouts("cpu") == (TOKEN_MAJOR,)  # the builder's selection names the device
    assert hal_kv_layout("LBHNC") == HEAD_MAJOR and hal_kv_layout("LBNHC") == TOKEN_MAJOR
    assert hal_kv_layout(None, HEAD_MAJOR) == HEAD_MAJOR
    with pytest.raises(UnsupportedError, match="BHLNC"):
        hal_kv_layout("BHLNC")


def test_kv_views_are_the_cache_itself():
    cache = vllm_cache(4, 2, 16, 8)
    k, v = kv_views(cache, 8)
    assert k.shape == v.shape == (64, 2, 8)
    k[37] = 1.0  # slot 37: block 2, token 5
    v[37] = 2.0
    assert torch.equal(cache[2, :, 5, :8], torch.ones(2, 8)) and torch.equal(
        cache[2, :, 5, 8:], torch.full((2, 8), 2.0)
    )
    assert cache.sum() == 2 * 8 * 3  # nothing else written
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


def test_kv_views_refuse_a_layout_that_needs_a_copy():
    head_major = torch.zeros(4, 2, 16, 16)  # vLLM's LBHNC (CPU_ATTN's): slots are not one stride apart
    with pytest.raises(KVCacheError, match="LBNHC"):
        kv_views(head_major, 8)
    with pytest.raises(KVCacheError, match="24"):
        kv_views(vllm_cache(4, 2, 16, 8), 12)


def test_fp8_cache_stored_as_bytes_is_read_as_fp8():
    cache = vllm_cache(2, 1, 16, 4, dtype=torch.uint8)
    k, _ = kv_views(cache, 4, dtype=torch.float8_e4m3fn)
    assert k.dtype == torch.float8_e4m3fn
    k[20] = torch.tensor(2.0).to(torch.float8_e4m3fn)
    assert cache[1, 0, 4, :4].tolist() == [torch.tensor(2.0).to(torch.float8_e4m3fn).view(torch.uint8).item()] * 4


def test_pool_write_goes_to_vllms_tensor_and_checks_block_size():
    cache = vllm_cache(3, 2, 16, 8)
    pool = VllmKVPool(16, torch.float32, "cpu", 8)
    pool.bind(5, cache)
    layer = hal.AttentionLayer(layer_id=5, tp_q_head_num=4, tp_k_head_num=2, head_dim=8)
    pool.set_kv_buffer(layer, torch.tensor([17]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 3.0))
    assert torch.equal(cache[1, :, 1, 8:], torch.full((2, 8), 3.0))
    with pytest.raises(KVCacheError, match="layer_id"):
        pool.get_key_buffer(4)
    with pytest.raises(KVCacheError, match="block size"):
        VllmKVPool(32, torch.float32, "cpu", 8).bind(0, cache)


# ----------------------------------------------------------------------------- layers and modes


def test_layer_descriptor_follows_vllms_conventions():
    layer = vllm_layer(3, 8, 2, 32, 0.125, sliding_window=4096, logits_soft_cap=50.0)
    assert (layer.sliding_window_size, layer.logit_cap, layer.scaling, layer.causal) == (4095, 50.0, 0.125, True)
    assert vllm_layer(0, 8, 2, 32, 0.1).sliding_window_size == -1
    assert not vllm_layer(0, 8, 2, 32, 0.1, causal=False).causal
    for kwargs, match in (
        ({"attn_type": "encoder_only"}, "encoder_only"),
        ({"attn_type": "encoder_decoder"}, "cross attention"),
        ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
    ):
        with pytest.raises(UnsupportedError, match=match):
            vllm_layer(0, 8, 2, 32, 0.1, **kwargs)


def test_step_mode():
    assert step_mode([1, 1, 1]) is hal.ForwardMode.DECODE
    assert step_mode([1, 1, 40, 7]) is hal.ForwardMode.MIXED
    assert step_mode([40, 7]) is hal.ForwardMode.EXTEND


# ----------------------------------------------------------------------------- steps, against dense attention


@pytest.mark.parametrize("kv_layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize(
    "window, cap, fp8", [(None, None, False), (24, 30.0, False), (None, None, True)], ids=["full", "window+cap", "fp8"]
)  # vLLM's sliding_window counts the query's own key
def test_translated_steps_equal_dense_attention(window, cap, fp8, kv_layout):
    engine = SimulatedEngine(fp8=fp8, kv_layout=kv_layout)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    layer = vllm_layer(
        7, engine.heads, engine.kv_heads, engine.head_dim, 0.2, sliding_window=window, logits_soft_cap=cap, **scales
    )
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    config = hal.AttentionConfig.from_layers(
        [layer], dtype=torch.float32, page_size=engine.block_size, kv_cache_dtype=kv_dtype, kv_layout=kv_layout
    )
    backend = hal.select(config, device="cpu").create(validate="full")
    pool = VllmKVPool(engine.block_size, kv_dtype, "cpu", engine.head_dim, kv_layout=kv_layout)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks)
    modes = []
    for i, schedule in enumerate(STEPS):
        padded = i == len(STEPS) - 1
        cm, q, k, v = engine.step(schedule, pad_reqs=2 if padded else 0, pad_tokens=3 if padded else 0)
        step = translator.translate(cm)
        modes.append(step.forward_mode.name)
        assert step.batch_size == len(schedule) and step.num_tokens == sum(n for _, n in schedule)
        pool.bind(layer.layer_id, engine.cache)
        backend.init_forward_metadata(step)
        n = step.num_tokens
        out = backend.forward(q[:n], k[:n], v[:n], layer, step)
        torch.testing.assert_close(out, engine.dense(schedule, layer), atol=2e-5, rtol=2e-5)
        if kv_layout == HEAD_MAJOR:  # vLLM's own tensor and block table, read as they are
            assert pool.get_kv_pages(layer.layer_id)[0].data_ptr() == engine.cache.data_ptr()
            assert fp8 or backend.forward_metadata.req_to_page is cm.block_table_tensor  # fp8: the plain plan
    assert modes == ["MIXED", "MIXED", "DECODE", "MIXED", "EXTEND"]
    # the keys went into vLLM's tensor where vLLM's slot mapping said
    k0 = engine.qkv[0][1][3]
    if kv_layout == HEAD_MAJOR:
        stored = lbhnc_views(engine.cache)[0][engine.blocks[0][0], :, 3]
    else:
        stored = engine.cache[engine.blocks[0][0], :, 3, : engine.head_dim]
    if fp8:
        k0 = quantize_kv(k0, kv_dtype, 0.5).view(torch.uint8)
    assert torch.equal(stored, k0)


def test_the_block_table_is_passed_as_it_is():
    """The step carries vLLM's block table itself (no token table of its own); a backend that reads tokens gets one
    derived for the step: its requests' rows, as wide as the longest sequence's blocks, not max_num_seqs x
    max_model_len."""
    engine = SimulatedEngine(block_size=16)
    pool = VllmKVPool(16, torch.float32, "cpu", engine.head_dim)
    translator = StepTranslator(pool, 16, engine.max_reqs, engine.max_blocks)
    assert not any(isinstance(v, torch.Tensor) and v.dim() == 2 for v in vars(translator).values())
    cm, *_ = engine.step([(0, 40), (1, 20)])
    step = translator.translate(cm)
    assert step.req_to_token_pool is None
    assert step.req_to_page_pool.req_to_page is cm.block_table_tensor and step.req_to_page_pool.page_size == 16
    assert step.req_pool_indices.tolist() == [0, 1]
    assert step.out_cache_loc.tolist() == cm.slot_mapping.tolist()
    assert (step.extend_prefix_lens_cpu, step.extend_seq_lens_cpu) == ([0, 0], [40, 20])
    reads_tokens = PlainTorchBackend.declaration()
    tables_for(reads_tokens, step)
    table = step.req_to_token_pool.req_to_token
    assert table.shape == (2, 48)  # 3 blocks of 16: the longest request's, not max_reqs x max_blocks * 16
    for row, req in ((0, 0), (1, 1)):
        want = [b * 16 + i for b in engine.blocks[req] for i in range(16)]
        n = min(len(want), 48)
        assert table[row, :n].tolist() == want[:n]
    step = translator.translate(engine.step([(0, 1)])[0])
    tables_for(dataclasses.replace(reads_tokens, reads_tables=frozenset({"page"})), step)  # nothing derived
    assert step.req_to_token_pool is None


def test_host_lengths_come_from_the_host():
    """The translation reads vLLM's host copies; with no host copy of seq_lens on the CPU device it reads the CPU
    tensor itself (no device sync exists there)."""
    engine = SimulatedEngine()
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks)
    cm, *_ = engine.step([(0, 5), (1, 9)])
    cm.seq_lens_cpu_upper_bound = None
    step = translator.translate(cm)
    assert step.seq_lens_cpu == [5, 9] and step.seq_lens_sum == 14
    cm.seq_lens_cpu_upper_bound = torch.tensor([5, 9 + 600], dtype=torch.int32)
    with pytest.raises(InvalidBatchError, match="max_model_len"):  # a bound past the block table: refused
        translator.translate(cm)


def _serve(translator, pool, backend, layer, engine, cm, q, k, v, schedule):
    step = translator.translate(cm)
    pool.bind(layer.layer_id, engine.cache)
    backend.init_forward_metadata(step)
    out = backend.forward(q[: step.num_tokens], k[: step.num_tokens], v[: step.num_tokens], layer, step)
    return step, out


def _cpu_backend(engine, layer):
    config = hal.AttentionConfig.from_layers([layer], dtype=torch.float32, page_size=engine.block_size)
    return hal.select(config, device="cpu").create(validate="full")


def test_speculative_decoding_reads_exact_lengths():
    """Under asynchronous speculative decoding vLLM's seq_lens_cpu_upper_bound assumes every draft was accepted
    (vllm/v1/attention/backend.py, CommonAttentionMetadata); with exact_seq_lens the lengths come from seq_lens.
    Verify rows (1 + drafts tokens) are served as causal extend rows behind the decodes."""
    engine = SimulatedEngine()
    layer = vllm_layer(0, engine.heads, engine.kv_heads, engine.head_dim, 0.2)
    backend = _cpu_backend(engine, layer)
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim)
    exact = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks, exact_seq_lens=True)
    bounded = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks)
    _serve(exact, pool, backend, layer, engine, *engine.step([(0, 20), (1, 9)]), [(0, 20), (1, 9)])
    schedule = [(1, 1), (0, 4)]  # a decode with no drafts, then a verify row: 1 token + 3 drafts
    cm, q, k, v = engine.step(schedule)
    cm.seq_lens_cpu_upper_bound = cm.seq_lens + 3  # the optimistic bound: 3 more drafts assumed accepted
    assert bounded.translate(cm).seq_lens_cpu == [13, 27]  # what a backend trusting the bound would attend to
    step, out = _serve(exact, pool, backend, layer, engine, cm, q, k, v, schedule)
    assert step.seq_lens_cpu == [10, 24] and step.forward_mode is hal.ForwardMode.MIXED
    torch.testing.assert_close(out, engine.dense(schedule, layer), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh's tests step runs it)")
def test_graph_decode_steps_replay_under_a_cuda_graph():
    """vLLM's full decode graph path as hal's builder serves it (GraphDecodeSteps refilled in place, hal's graph
    contract: out_graph before, in_graph recorded with the forward), under a real CUDA graph (hal's TorchGraph, the
    cuda device's): captured once over a padded batch of 4, replayed for other decode batches; each replay equals an
    eager forward of the same batch and dense attention. Needs no vLLM: the step comes from the stand-in metadata."""
    from hal.graph_capture import TorchGraph
    from hal.integrations.vllm_steps import GraphDecodeSteps

    cuda, size = torch.device("cuda"), 4
    engine = SimulatedEngine()
    engine.cache = engine.cache.to(cuda)  # strides kept: vLLM's LBNHC cache
    layer = vllm_layer(0, engine.heads, engine.kv_heads, engine.head_dim, 0.2)
    config = hal.AttentionConfig.from_layers(
        [layer],
        dtype=torch.float32,
        page_size=engine.block_size,
        max_context_len=engine.max_blocks * engine.block_size,
        max_batch_size=engine.max_reqs,
    )
    selection = hal.select(config, device="cuda")
    backend, eager_backend = selection.create(), selection.create()
    pool = VllmKVPool(engine.block_size, torch.float32, cuda, engine.head_dim)
    pool.bind(layer.layer_id, engine.cache)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks, cuda)
    backend.init_cuda_graph_state(size, size)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    steps = GraphDecodeSteps(pool, engine.block_size, size, engine.max_blocks, fill, cuda)

    def on_device(cm):
        moved = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions")
        return dataclasses.replace(cm, **{name: getattr(cm, name).to(cuda) for name in moved})

    def eager(cm, q, k, v):
        step = translator.translate(cm)
        eager_backend.init_forward_metadata(step)
        n = step.num_tokens
        return eager_backend.forward(q[:n].to(cuda), k[:n].to(cuda), v[:n].to(cuda), layer, step)

    def prefill(schedule):  # eagerly: the KV the decodes read
        cm, q, k, v = engine.step(schedule)
        eager(on_device(cm), q, k, v)

    prefill([(0, 20), (1, 9), (2, 5)])
    q_in, k_in, v_in = (
        torch.zeros(size, h, engine.head_dim, device=cuda) for h in (engine.heads,) + (engine.kv_heads,) * 2
    )
    out = torch.zeros(size, engine.heads, engine.head_dim, device=cuda)

    def load(schedule, capture=False):
        cm, q, k, v = engine.step(schedule, pad_reqs=size - len(schedule), pad_tokens=size - len(schedule))
        cm = on_device(cm)
        static = steps.fill(cm, translator.translate(cm))
        backend.init_forward_metadata_out_graph(static, in_capture=capture)
        for buffer, given in ((q_in, q), (k_in, k), (v_in, v)):
            buffer.copy_(given)
        return static, cm, q, k, v

    static, *_ = load([(0, 1), (1, 1)], capture=True)

    def forward():
        backend.init_forward_metadata_in_graph(static)
        return backend.forward(q_in, k_in, v_in, layer, static, out=out)

    graph = TorchGraph(torch.cuda, torch.cuda.CUDAGraph)
    graph.warmup(forward)
    graph.capture(forward)
    for schedule in ([(2, 1), (0, 1), (1, 1)], [(1, 1)], [(0, 1), (1, 1), (2, 1), (3, 1)]):
        if 3 in dict(schedule) and 3 not in engine.qkv:
            prefill([(3, 12)])  # a request joins between replays
        again, cm, q, k, v = load(schedule)
        assert again is static  # the captured step, refilled in place
        graph.replay()
        torch.cuda.synchronize()
        n = len(schedule)
        replayed = out[:n].reshape(n, -1).cpu()
        want = engine.dense(schedule, layer)
        torch.testing.assert_close(replayed, want, atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(replayed, eager(cm, q, k, v).reshape(n, -1).cpu(), atol=5e-3, rtol=5e-3)


def test_more_requests_than_max_num_seqs():
    """Chunked local attention (vllm/v1/attention/backends/utils.py make_local_attention_virtual_batches) makes a
    virtual request per attention chunk: more rows than max_num_seqs, served, not refused mid-serving."""
    engine = SimulatedEngine()
    layer = vllm_layer(0, engine.heads, engine.kv_heads, engine.head_dim, 0.2)
    backend = _cpu_backend(engine, layer)
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim)
    translator = StepTranslator(pool, engine.block_size, 1, engine.max_blocks)
    schedule = [(0, 3), (1, 17), (2, 40)]
    step, out = _serve(translator, pool, backend, layer, engine, *engine.step(schedule), schedule)
    assert step.req_pool_indices.tolist() == [0, 1, 2]
    torch.testing.assert_close(out, engine.dense(schedule, layer), atol=2e-5, rtol=2e-5)


def test_host_copies_are_awaited_where_vllm_copies_without_blocking(monkeypatch):
    """Shared-KV fast prefill fills query_start_loc_cpu with a non-blocking device-to-host copy
    (make_kv_sharing_fast_prefill_common_attn_metadata): off the CPU the translator synchronises before reading."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(device))
    engine = SimulatedEngine()
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim)
    cm, *_ = engine.step([(0, 5)])
    StepTranslator(pool, engine.block_size, 4, engine.max_blocks, wait_for_host_copies=True).translate(cm)
    assert calls == []  # the CPU's copies are synchronous
    StepTranslator(pool, engine.block_size, 4, engine.max_blocks, "meta", wait_for_host_copies=True).translate(cm)
    assert calls == [torch.device("meta")]


def test_kv_cache_dtype_names():
    assert hal_kv_cache_dtype("fp8") == "fp8_e4m3" and hal_kv_cache_dtype("auto") is None
    assert hal_kv_cache_dtype("fp8_e5m2", torch.float8_e4m3fnuz) == "fp8_e5m2"
    for name in ("fp8", "fp8_e4m3"):  # ROCm MI300's fp8 caches hold e4m3fnuz bytes: not hal's fp8_e4m3
        with pytest.raises(UnsupportedError, match="e4m3fnuz"):
            hal_kv_cache_dtype(name, torch.float8_e4m3fnuz)
    with pytest.raises(UnsupportedError, match="kv_cache_dtype"):
        hal_kv_cache_dtype("int8_per_token_head")


def test_no_vllm_module_is_imported_by_the_translation():
    done = _python(
        "import sys; sys.modules['vllm'] = None\n"
        "import hal.integrations.vllm_steps\n"
        "from hal.errors import MissingDependencyError\n"
        "try:\n"
        "    import hal.integrations.vllm\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "needs vLLM" in done.stdout and "docs/vllm.md" in done.stdout


# ----------------------------------------------------------------------------- with vLLM installed

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (tox -e vllm-engine)")


@needs_vllm
def test_backend_declarations():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheLayout

    from hal.integrations.vllm import HalAttentionBackend, HalCpuAttentionBackend

    assert HalAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)
    # on the CPU, vLLM's native layout first (CPU_ATTN's: the default), then token-major (VLLM_KV_CACHE_LAYOUT=LBNHC):
    # hal's compiled CPU backend reads both in place
    assert HalCpuAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
    assert HalCpuAttentionBackend.get_kv_cache_shape(5, 16, 2, 64) == (2, 5, 2, 16, 64)
    assert HalAttentionBackend.get_kv_cache_shape(5, 16, 2, 64) == (2, 5, 16, 2, 64)
    for cls in (HalAttentionBackend, HalCpuAttentionBackend):
        assert AttentionBackendEnum[cls.get_name()] is not None  # vLLM looks every layer's backend up so
        assert cls.supports_sink() and cls.supports_sliding_window() and not cls.is_mla()
        assert 128 in cls.get_supported_kernel_block_sizes()
        assert not cls.supports_device_cpu_query_lens_mismatch()  # steps are planned from query_start_loc_cpu
    assert HalCpuAttentionBackend.get_name() == "CPU_ATTN"
    assert not HalCpuAttentionBackend.supports_kv_connector() and HalAttentionBackend.supports_kv_connector()


@needs_vllm
def test_registration_is_opt_in():
    """Without HAL_VLLM vLLM's CPU backend stays its own; with it, CPU_ATTN resolves to hal and MLA keeps vLLM's."""
    code = (
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "from hal.integrations.vllm_plugin import vllm_plugin\n"
        "vllm_plugin()\n"
        "print(E.CPU_ATTN.get_path()); print(E.CUSTOM.get_path()); print(E.CPU_MLA.get_path())\n"
    )
    off = _python(code, HAL_VLLM="0")
    assert off.returncode == 0, off.stderr
    lines = off.stdout.splitlines()
    assert lines[0] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert lines[1] == "hal.integrations.vllm.HalAttentionBackend"
    on = _python(code, HAL_VLLM="1")
    assert on.returncode == 0, on.stderr
    lines = on.stdout.splitlines()
    assert lines[0] == "hal.integrations.vllm.HalCpuAttentionBackend"
    assert lines[2] == off.stdout.splitlines()[2] and lines[2].startswith("vllm.")  # hal steps aside for MLA


@needs_vllm
def test_custom_owned_by_another_plugin_is_said_loudly(caplog):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from hal.integrations.vllm import register

    custom = AttentionBackendEnum.CUSTOM
    before = custom.get_path() if custom.is_overridden() else None
    register_backend(custom, "other_plugin.Backend")
    try:
        with caplog.at_level("WARNING", logger="vllm.hal"):
            served = register(cpu=False)
        assert served == [] and custom.get_path() == "other_plugin.Backend"
        assert "other_plugin.Backend" in caplog.text and "CUSTOM" in caplog.text
    finally:
        custom.clear_override()
        if before is not None:
            register_backend(custom, before)


@needs_vllm
def test_impl_refuses_at_construction():
    from hal.integrations.vllm import HalAttentionImpl

    with pytest.raises(UnsupportedError, match="ALiBi"):
        HalAttentionImpl(8, 32, 0.1, 2, alibi_slopes=[0.1] * 8)
    with pytest.raises(UnsupportedError, match="kv_cache_dtype"):
        HalAttentionImpl(8, 32, 0.1, 2, kv_cache_dtype="int8_per_token_head")
    with pytest.raises(UnsupportedError, match="block_m"):
        HalAttentionImpl(8, 32, 0.1, 2, block_m=64)
    impl = HalAttentionImpl(8, 32, 0.1, 2, sliding_window=16, logits_soft_cap=20.0)
    assert math.isclose(impl.hal_layer(3, None).logit_cap, 20.0) and impl.hal_layer(3, None).sliding_window_size == 15


def _vllm_config(layers: dict, *, cache_dtype="auto", block_size=16, kv_cache_layout=None, **parallel):
    """A stand-in of vLLM's VllmConfig with the fields hal's metadata builder and impls read."""
    from types import SimpleNamespace

    return SimpleNamespace(
        device_config=SimpleNamespace(device=torch.device("cpu")),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype=torch.float32, max_model_len=128),
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype,
            kv_sharing_fast_prefill=False,
            block_size=block_size,
            kv_cache_layout=kv_cache_layout,  # the layout vLLM resolved (None: before 0.30)
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=parallel.get("dcp", 1), prefill_context_parallel_size=parallel.get("pcp", 1)
        ),
        speculative_config=parallel.get("speculative_config"),
        kv_transfer_config=parallel.get("kv_transfer_config"),
        num_speculative_tokens=parallel.get("num_speculative_tokens", 0),
    )


def _attention_layer(name: str, kv_cache_dtype: str, cache: torch.Tensor, backend=None):
    """vLLM's Attention module as the builder reads it (impl, name, backend class, bound cache, fp8 scales)."""
    from vllm.model_executor.layers.attention import Attention

    from hal.integrations.vllm import HalAttentionBackend, HalAttentionImpl

    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    layer.impl = HalAttentionImpl(4, 32, 0.2, 2, kv_cache_dtype=kv_cache_dtype)
    layer.layer_name, layer.attn_backend, layer.kv_cache, layer.head_size_v = (
        name,
        backend or HalAttentionBackend,
        cache,
        32,
    )
    layer._k_scale_float = layer._v_scale_float = 1.0
    return layer


@needs_vllm
def test_builder_reads_each_layers_cache_dtype():
    """kv_cache_dtype_skip_layers: vLLM gives a skipped layer an "auto" (model dtype) cache while the engine-wide
    cache_dtype is fp8; the builder reads the layer's own dtype, and serves its fp32 cache as fp32."""
    from types import SimpleNamespace

    from hal.errors import ConfigError
    from hal.integrations.vllm import HalMetadataBuilder

    engine = SimulatedEngine()
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    layers = {names[0]: _attention_layer(names[0], "auto", engine.cache)}
    spec = SimpleNamespace(block_size=engine.block_size)
    builder = HalMetadataBuilder(spec, names[:1], _vllm_config(layers, cache_dtype="fp8"), torch.device("cpu"))
    assert builder.pool.dtype == torch.float32
    schedule = [(0, 20), (1, 9)]
    cm, q, k, v = engine.step(schedule)
    metadata = builder.build(0, cm)
    layer = layers[names[0]]
    out = torch.zeros(q.shape[0], engine.heads, engine.head_dim)
    layer.impl.forward(layer, q, k, v, engine.cache, metadata, out)
    want = engine.dense(schedule, metadata.layers[names[0]])
    torch.testing.assert_close(out.reshape(len(want), -1), want, atol=2e-5, rtol=2e-5)
    layers[names[1]] = _attention_layer(names[1], "fp8", engine.cache)
    with pytest.raises(ConfigError, match="one cache dtype per group"):
        HalMetadataBuilder(spec, names, _vllm_config(layers, cache_dtype="fp8"), torch.device("cpu"))


@needs_vllm
def test_builder_reads_exact_lengths_under_speculative_decoding():
    """vLLM's builder contract under drafts (EAGLE / MTP / draft models schedule asynchronously on GPUs, where
    seq_lens_cpu_upper_bound counts every draft as accepted: vllm/v1/attention/backend.py CommonAttentionMetadata):
    with num_speculative_tokens > 0 hal's builder reads seq_lens from the device, as vLLM's FlashInfer builder does
    (vllm/v1/attention/backends/flashinfer.py, build: seq_lens.cpu() when _num_speculative_tokens > 0). Verify rows
    (1 + drafts tokens, behind the decodes: reorder_batch_threshold 1) are causal extend rows, exact for vLLM 0.32's
    chain drafts. Without drafts the builder trusts the bound, which is then exact."""
    from types import SimpleNamespace

    from hal.integrations.vllm import HalMetadataBuilder

    engine = SimulatedEngine()
    name = "model.layers.0.self_attn.attn"
    layers = {name: _attention_layer(name, "auto", engine.cache)}
    spec = SimpleNamespace(block_size=engine.block_size)
    drafting = HalMetadataBuilder(spec, [name], _vllm_config(layers, num_speculative_tokens=3), "cpu")
    trusting = HalMetadataBuilder(spec, [name], _vllm_config(layers), "cpu")
    layer = layers[name]

    def forward(builder, cm, q, k, v):
        metadata = builder.build(0, cm)
        out = torch.zeros(q.shape[0], engine.heads, engine.head_dim)
        layer.impl.forward(layer, q, k, v, engine.cache, metadata, out)
        return metadata.step, out.reshape(q.shape[0], -1)

    forward(drafting, *engine.step([(0, 20), (1, 9)]))
    schedule = [(1, 1), (0, 4)]  # a decode whose drafts were all rejected, then a verify row: 1 token + 3 drafts
    cm, q, k, v = engine.step(schedule)
    cm.seq_lens_cpu_upper_bound = cm.seq_lens + 3  # the asynchronous scheduler's bound: 3 more tokens accepted
    assert trusting.build(0, cm).step.seq_lens_cpu == [13, 27]  # what a builder reading the bound would attend to
    step, out = forward(drafting, cm, q, k, v)
    assert step.seq_lens_cpu == [10, 24] and step.extend_prefix_lens_cpu == [9, 20]
    assert step.forward_mode is hal.ForwardMode.MIXED and step.extend_seq_lens_cpu == [1, 4]
    torch.testing.assert_close(out, engine.dense(schedule, layer.impl.hal_layer(0, layer)), atol=2e-5, rtol=2e-5)


def _workspace_engine(monkeypatch, need: int):
    """A backend that keeps a FlashInfer-like workspace of ``need`` bytes (the class the CPU device selects, given a
    ``workspace_bytes``), the integration's per-process buffers emptied, and a stand-in of the vLLM config vLLM makes
    current while it builds the model (``set_current_vllm_config``)."""
    import vllm.config

    import hal.integrations.vllm as integration

    layer = vllm_layer(0, 4, 2, 32, 0.2)
    selection = hal.select(hal.AttentionConfig.from_layers([layer], dtype=torch.float32, page_size=16), device="cpu")
    for cls in {selection.prefill_backend, selection.decode_backend}:
        monkeypatch.setattr(cls, "workspace_bytes", need, raising=False)
    monkeypatch.setattr(integration, "_WORKSPACES", {})
    monkeypatch.setattr(integration, "_WORKSPACE_CONFIGS", set())
    engine_config = _vllm_config({})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine_config)
    return integration, engine_config


@needs_vllm
def test_workspace_is_allocated_while_vllm_builds_the_model_and_shared(monkeypatch, caplog):
    """One workspace per device, allocated when vLLM makes the impls (model construction, inside the window its memory
    profile measures: vllm/v1/worker/gpu_worker.py determine_available_memory), before any builder (made after the
    profile by both GPU runners' initialize_kv_cache); every builder uses it, and it is the buffer vLLM's V2 runner
    takes from the first builder and hands to the rest (vllm/v1/worker/gpu/attn_utils.py init_attn_backend). Asking a
    builder for it allocates nothing. A builder whose backend needs a workspace no impl reserved allocates one after
    the profile, and says so."""
    import logging
    from types import SimpleNamespace

    from hal.integrations.vllm import HalMetadataBuilder

    need = 1 << 20
    integration, engine_config = _workspace_engine(monkeypatch, need)
    engine = SimulatedEngine()
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    layers = {name: _attention_layer(name, "auto", engine.cache) for name in names}  # vLLM builds the model
    cpu = torch.device("cpu")
    assert list(integration._WORKSPACES) == [cpu] and integration._WORKSPACES[cpu].numel() == need
    reserved = integration._WORKSPACES[cpu]
    engine_config.compilation_config.static_forward_context = layers
    spec = SimpleNamespace(block_size=engine.block_size)
    with caplog.at_level(logging.WARNING, logger="vllm.hal"):
        builders = [HalMetadataBuilder(spec, [name], engine_config, cpu) for name in names]  # one group per layer
    assert "after vLLM's memory profile" not in caplog.text
    shared = builders[0]._get_workspace_buffer()  # vLLM's V2 runner: the first builder's buffer, to the others
    for builder in builders[1:]:
        builder.set_workspace_buffer(shared)
    assert shared is reserved
    assert all(b.workspace is reserved and b.hal_backend._workspace is reserved for b in builders)
    assert integration._WORKSPACES == {cpu: reserved}  # nothing else allocated
    builders[1].set_workspace_buffer(torch.zeros(need - 1, dtype=torch.uint8))  # too small for hal's backend: kept
    assert builders[1].workspace is reserved and builders[1].hal_backend._workspace is reserved
    cm, q, k, v = engine.step([(0, 9), (1, 3)])  # and the builders still serve steps
    builders[0].build(0, cm)

    monkeypatch.setattr(integration, "_WORKSPACES", {})  # no impl reserved one (e.g. a group's own selection)
    with caplog.at_level(logging.WARNING, logger="vllm.hal"):
        late = HalMetadataBuilder(spec, names[:1], engine_config, cpu)
    assert "1 MiB attention workspace on cpu after vLLM's memory profile" in caplog.text
    assert late.workspace is integration._WORKSPACES[cpu] and late.workspace is not reserved


@needs_vllm
def test_workspace_is_reserved_once_per_layer_config(monkeypatch):
    """One selection per distinct layer config and device while the model is built (not one per layer); none at all
    outside an engine; none where the selected backend keeps no workspace."""
    import hal.integrations.vllm as integration
    from hal.integrations.vllm import HalAttentionImpl

    _workspace_engine(monkeypatch, 0)
    calls = []
    select = hal.select
    monkeypatch.setattr(hal, "select", lambda config, **kw: calls.append(config) or select(config, **kw))
    for _ in range(3):
        HalAttentionImpl(4, 32, 0.2, 2)
    HalAttentionImpl(4, 32, 0.2, 2, sliding_window=8)
    assert len(calls) == 2 and integration._WORKSPACES == {}  # two configs; the backend keeps no workspace
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    HalAttentionImpl(8, 64, 0.2, 2)
    assert len(calls) == 2


@needs_vllm
def test_unserved_features_are_refused_at_start():
    from types import SimpleNamespace

    from hal.integrations.vllm import refuse_unserved_features

    base = _vllm_config({})
    refuse_unserved_features(base, "CPU_ATTN")
    nixl = SimpleNamespace(is_kv_transfer_instance=True, kv_connector="NixlConnector")
    for config, name, match in (
        (_vllm_config({}, dcp=2), "CUSTOM", "decode context parallelism"),
        (_vllm_config({}, pcp=2), "CUSTOM", "prefill context parallelism"),
        (
            _vllm_config({}, speculative_config=SimpleNamespace(enable_adaptive_verification=True)),
            "CUSTOM",
            "adaptive_verification",
        ),
        (_vllm_config({}, kv_transfer_config=nixl), "CPU_ATTN", "pack_kv_cache"),
    ):
        with pytest.raises(UnsupportedError, match=match):
            refuse_unserved_features(config, name)
    refuse_unserved_features(_vllm_config({}, kv_transfer_config=nixl), "CUSTOM")  # hal's own name: no rewrite


@needs_vllm
def test_encoder_only_layers_keep_vllms_cpu_attn(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.attention.backends import cpu_attn

    from hal.integrations.vllm import HalAttentionBackend, HalCpuAttentionBackend, HalCpuAttentionImpl

    engine_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: engine_config)  # read by vLLM's CPU impl
    args = (8, 32, 0.1, 2, None, None, "auto", None)
    assert isinstance(HalCpuAttentionBackend.get_impl_cls()(*args, "encoder_only"), cpu_attn.CPUAttentionBackendImpl)
    assert (
        type(HalCpuAttentionBackend.get_impl_cls()(*args, attn_type="encoder_only")) is cpu_attn.CPUAttentionBackendImpl
    )
    assert type(HalCpuAttentionBackend.get_impl_cls()(*args, "decoder")) is HalCpuAttentionImpl
    with pytest.raises(UnsupportedError, match="cross attention"):  # its cache would be in hal's layout: refused
        HalCpuAttentionBackend.get_impl_cls()(*args, "encoder_decoder")
    with pytest.raises(UnsupportedError, match="encoder_only"):  # CUSTOM: no CPU_ATTN to step aside to
        HalAttentionBackend.get_impl_cls()(*args, "encoder_only")


def _graph_config(layers: dict, max_capture_size: int = 4, kv_cache_layout=None):
    """``_vllm_config`` with vLLM's full decode graphs on (FULL_AND_PIECEWISE, capture sizes up to the given one)."""
    from vllm.config import CUDAGraphMode

    config = _vllm_config(layers, kv_cache_layout=kv_cache_layout)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = max_capture_size
    return config


def _graph_layers(engine: SimulatedEngine, backend=None) -> dict:
    """Two hal layers over the engine's cache, named out of model order (the builder still records in_graph with
    layer 0, the first to run)."""
    names = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn"]
    return {name: _attention_layer(name, "auto", engine.cache, backend) for name in names}


def _forward_layers(layers: dict, q, k, v, cache, metadata, out: torch.Tensor) -> torch.Tensor:
    """Every layer's forward in model order, layer i into ``out[i]`` (``[layers, T, heads, head_dim]``)."""
    for i, name in enumerate(sorted(layers)):
        layers[name].impl.forward(layers[name], q, k, v, cache, metadata, out[i])
    return out


@needs_vllm
@pytest.mark.parametrize("kernels", ["1", "0"], ids=["compiled", "plain-torch"])
@pytest.mark.parametrize("kv_layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_full_decode_graphs_replay_vllms_capture_sequence(kv_layout, kernels, monkeypatch):
    """vLLM's full-graph sequence: build_for_cudagraph_capture, every layer's forward captured (hal's EagerGraph:
    fails on host syncs, data-dependent shapes and tensors read at other addresses than captured), then builds of
    other decode batches padded to the captured size and replays; each replay equals an eager forward of the same
    batch (a builder without graphs) and dense attention. Mixed steps in between run eagerly."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from hal.graph import EagerGraph
    from hal.integrations.vllm import HalAttentionBackend, HalCpuAttentionBackend, HalMetadataBuilder

    monkeypatch.setenv("HAL_CPU_KERNELS", kernels)
    engine = SimulatedEngine(kv_layout=kv_layout)
    layers = _graph_layers(engine, HalCpuAttentionBackend if kv_layout == HEAD_MAJOR else HalAttentionBackend)
    names, spec, size = list(layers), SimpleNamespace(block_size=engine.block_size), 4
    vllm_layout = "LBHNC" if kv_layout == HEAD_MAJOR else "LBNHC"  # the layout vLLM allocated the cache in
    config = _graph_config(layers, size, vllm_layout)
    assert HalMetadataBuilder.get_cudagraph_support(config, spec) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    builder = HalMetadataBuilder(spec, names, config, torch.device("cpu"))
    eager = HalMetadataBuilder(spec, names, _vllm_config(layers, kv_cache_layout=vllm_layout), torch.device("cpu"))
    assert builder.graph_steps is not None and eager.graph_steps is None
    assert builder.pool.kv_layout == kv_layout and (builder.hal_backend.kernels is None) == (kernels == "0")
    shape = (len(layers), size, engine.heads, engine.head_dim)

    def eager_forward(chosen, cm, q, k, v):
        metadata = chosen.build(0, cm)
        assert metadata.in_graph_layer is None  # the step's metadata was prepared whole
        return _forward_layers(layers, q, k, v, engine.cache, metadata, torch.zeros(shape[0], *q.shape))

    eager_forward(eager, *engine.step([(0, 20), (1, 9), (2, 5)]))  # prefills: the KV the decodes read
    graph = EagerGraph()
    static = builder.graph_steps.static_step(size)
    q_in, k_in, v_in = (
        torch.zeros(size, heads, engine.head_dim) for heads in (engine.heads, engine.kv_heads, engine.kv_heads)
    )
    out = torch.zeros(shape)

    def build(cm, q, k, v, capture=False):
        with graph.outside(static):  # what the build makes on the host counts as host data in the graph
            metadata = builder.build_for_cudagraph_capture(cm) if capture else builder.build(0, cm)
        for t, given in ((q_in, q), (k_in, k), (v_in, v)):
            t.copy_(given)
        assert metadata.step is static and metadata.in_graph_layer == "model.layers.0.self_attn.attn"
        return metadata

    schedule = [(0, 1), (1, 1)]
    cm, q, k, v = engine.step(schedule, pad_reqs=2, pad_tokens=2)
    current = {"metadata": build(cm, q, k, v, capture=True)}
    step = lambda: _forward_layers(layers, q_in, k_in, v_in, engine.cache, current["metadata"], out)  # noqa: E731
    graph.warmup(step)  # vLLM's warm-up runs of the size before its capture (scratch buffers sized there)
    captured = graph.capture(step)
    want = engine.dense(schedule, builder.layers[names[0]]).reshape(2, engine.heads, -1)
    torch.testing.assert_close(captured[:, :2], torch.stack([want, want]), atol=2e-5, rtol=2e-5)

    def addresses() -> list[int]:
        tensors = (static.seq_lens, static.out_cache_loc, static.req_pool_indices, static.req_to_page_pool.req_to_page)
        return [t.data_ptr() for t in tensors]

    captured_addresses = addresses()
    for schedule in ([(2, 1), (0, 1), (1, 1)], [(1, 1)], None, [(0, 1), (1, 1), (2, 1), (3, 1)], [(3, 1)]):
        if schedule is None:  # a prefill between replays runs eagerly, through the graph builder too
            eager_forward(builder, *engine.step([(0, 1), (3, 12)]))
            continue
        n = len(schedule)
        cm, q, k, v = engine.step(schedule, pad_reqs=size - n, pad_tokens=size - n)
        current["metadata"] = build(cm, q, k, v)
        assert addresses() == captured_addresses  # refilled in place
        graph.replay()  # the guard: no host sync, the captured shapes, constants and addresses
        replayed = captured[:, :n].clone()
        eager_out = eager_forward(eager, cm, q, k, v)  # the same batch (its KV written again to the same slots)
        torch.testing.assert_close(replayed, eager_out[:, :n], atol=2e-5, rtol=2e-5)
        want = engine.dense(schedule, builder.layers[names[0]]).reshape(n, engine.heads, -1)
        torch.testing.assert_close(replayed[0], want, atol=2e-5, rtol=2e-5)
        assert replayed.abs().sum() > 0
    # every size's static step reads one table sized for the largest (no table per captured size), its first N rows
    steps = [builder.graph_steps.static_step(n) for n in range(1, size + 1)]
    assert {s.req_to_page_pool.req_to_page.data_ptr() for s in steps} == {builder.graph_steps.table.data_ptr()}
    assert [s.req_pool_indices.shape[0] for s in steps] == list(range(1, size + 1))


@needs_vllm
def test_eager_steps_are_not_replayable():
    """Without vLLM's full graphs the builder translates each step afresh: a graph captured over one build would
    replay that build's tensors, and hal's eager graph guard refuses the replay after another build."""
    from types import SimpleNamespace

    from hal.errors import GraphCaptureError
    from hal.graph import EagerGraph
    from hal.integrations.vllm import HalMetadataBuilder

    engine = SimulatedEngine()
    name = "model.layers.0.self_attn.attn"
    layers = {name: _attention_layer(name, "auto", engine.cache)}
    builder = HalMetadataBuilder(SimpleNamespace(block_size=engine.block_size), [name], _vllm_config(layers), "cpu")
    assert builder.graph_steps is None
    layer = layers[name]
    engine.step([(0, 20), (1, 9)])
    builder.build(0, engine.step([(0, 1), (1, 1)])[0])  # the caches bound
    cm, q, k, v = engine.step([(0, 1), (1, 1)])
    current = {"metadata": builder.build_for_cudagraph_capture(cm)}
    out = torch.zeros(2, engine.heads, engine.head_dim)
    graph = EagerGraph()
    graph.capture(lambda: layer.impl.forward(layer, q, k, v, engine.cache, current["metadata"], out))
    current["metadata"] = builder.build(0, engine.step([(0, 1), (1, 1)])[0])
    with pytest.raises(GraphCaptureError):
        graph.replay()


@needs_vllm
def test_graph_support_follows_the_selected_backend(monkeypatch):
    """UNIFORM_SINGLE_TOKEN_DECODE only where the selected decode backend declares graphs and its device has a
    capture mechanism; NEVER otherwise, and then the builder keeps no static steps."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from hal.integrations.vllm import HalMetadataBuilder, graph_support

    engine = SimulatedEngine()
    layers = _graph_layers(engine)
    config, spec = _graph_config(layers), SimpleNamespace(block_size=engine.block_size)
    selection = HalMetadataBuilder(spec, list(layers), config, "cpu").selection
    assert selection.capability.graph and graph_support(selection) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert (
        graph_support(dataclasses.replace(selection, capability=dataclasses.replace(selection.capability, graph=None)))
        is AttentionCGSupport.NEVER
    )
    monkeypatch.setattr(selection.decode_backend, "supports_graph", False, raising=False)  # a class attribute: input
    assert HalMetadataBuilder.get_cudagraph_support(config, spec) is AttentionCGSupport.NEVER
    assert HalMetadataBuilder(spec, list(layers), config, "cpu").graph_steps is None
    assert HalMetadataBuilder.get_cudagraph_support(_vllm_config({}), spec) is AttentionCGSupport.NEVER  # no hal layer
    config.compilation_config.cudagraph_capture_sizes = []  # vLLM's CPU platform: no graph is ever captured
    monkeypatch.undo()
    assert HalMetadataBuilder(spec, list(layers), config, "cpu").graph_steps is None
