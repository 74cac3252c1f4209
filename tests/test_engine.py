"""An engine's own batches and pools, served as they are: every native backend on this machine.

The engine here is plain objects with SGLang's field names holding the engine's tensors
(no hal class), as SGLang's ``ForwardBatch`` / ``MHATokenToKVPool`` / ``ReqToTokenPool``.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

import hal
from hal.batch import ForwardMode
from hal.conformance.cases import CASES, build
from hal.errors import ConfigError, InvalidBatchError
from hal.kernels import reference

TARGETS = [("cpu", "torch", 1)]
if os.environ.get("TRITON_INTERPRET") == "1":
    TARGETS.append(("cpu", "triton", 1))
if os.environ.get("HAL_NPU_EMULATION") == "1":
    TARGETS.append(("npu", "ascend", 16))


class EnginePool:
    """An engine's KV pool: its own per-layer tensors, SGLang's method names, nothing from hal."""

    def __init__(self, k_buffers, v_buffers, page_size, start_layer=0):
        self.k_buffer, self.v_buffer = k_buffers, v_buffers
        self.page_size, self.start_layer = page_size, start_layer
        self.dtype, self.device = k_buffers[0].dtype, str(k_buffers[0].device)
        self.head_num, self.head_dim = k_buffers[0].shape[1:]
        self.v_head_dim = v_buffers[0].shape[2]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id - self.start_layer][loc] = cache_k
        self.v_buffer[layer.layer_id - self.start_layer][loc] = cache_v


class EngineReqPool:
    def __init__(self, req_to_token):
        self.req_to_token = req_to_token


class EngineBatch:
    """SGLang's ForwardBatch field names, the engine's tensors."""


def _case(mode, page_size):
    base = next(c for c in CASES if c.mode == mode and c.page_size == 1 and c.logit_cap == 0)
    return dataclasses.replace(base, page_size=page_size)


def _engine_view(built):
    """The same step as an engine would hold it: its own pool objects over its own tensors, its own batch."""
    fb, pool = built.batch, built.batch.token_to_kv_pool
    layer_id = built.layer.layer_id
    engine_pool = EnginePool([pool.get_key_buffer(layer_id)], [pool.get_value_buffer(layer_id)], pool.page_size)
    batch = EngineBatch()
    for name in (
        "forward_mode",
        "batch_size",
        "req_pool_indices",
        "seq_lens",
        "seq_lens_cpu",
        "seq_lens_sum",
        "out_cache_loc",
        "positions",
        "extend_num_tokens",
        "extend_seq_lens",
        "extend_prefix_lens",
        "extend_start_loc",
        "extend_seq_lens_cpu",
        "extend_prefix_lens_cpu",
        "spec_info",
    ):
        setattr(batch, name, getattr(fb, name))
    batch.req_to_token_pool = EngineReqPool(fb.req_to_token_pool.req_to_token)
    batch.token_to_kv_pool = engine_pool
    return batch, engine_pool


def _backend(device, name, case, **options):
    return hal.select(case.config(), device=device, backend=name).create(**options)


@pytest.mark.parametrize("device, name, page", TARGETS)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
def test_an_engines_batch_and_pools_are_served_without_a_copy(device, name, page, mode):
    built = build(_case(mode, page))
    batch, engine_pool = _engine_view(built)
    k_ptr = engine_pool.k_buffer[0].data_ptr()
    backend = _backend(device, name, built.case, validate="full")
    backend.init_forward_metadata(batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, batch)
    tol = reference.tolerance(built.case.dtype)
    torch.testing.assert_close(out, built.expected, **tol)
    assert engine_pool.k_buffer[0].data_ptr() == k_ptr, "the engine's tensors were replaced"
    torch.testing.assert_close(engine_pool.k_buffer[0], built.expected_k, **tol)  # written in place
    torch.testing.assert_close(engine_pool.v_buffer[0], built.expected_v, **tol)


@pytest.mark.parametrize("device, name, page", TARGETS)
def test_direct_calls_take_2d_and_3d_inputs_checked_exactly(device, name, page):
    built = build(_case(ForwardMode.DECODE, page))
    layer, fb = built.layer, built.batch
    backend = _backend(device, name, built.case)
    backend.init_forward_metadata(fb)
    heads, dim = layer.tp_q_head_num, layer.head_dim
    flat = backend.forward_decode(built.q, built.k, built.v, layer, fb)
    shaped = backend.forward_decode(
        built.q.view(-1, heads, dim), built.k.view(-1, layer.tp_k_head_num, dim), built.v, layer, fb
    )
    torch.testing.assert_close(flat, built.expected, **reference.tolerance(built.case.dtype))
    torch.testing.assert_close(shaped, flat)
    pool = fb.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    wrong = built.q.view(-1, heads * 2, dim // 2)  # same element count, another split of heads
    with pytest.raises(InvalidBatchError, match=r"q\.shape"):
        backend.forward_decode(wrong, built.k, built.v, layer, fb)
    with pytest.raises(InvalidBatchError, match="k, v"):
        backend.forward_decode(built.q, None, None, layer, fb)  # None needs save_kv_cache=False
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer)), "cache was touched"


@pytest.mark.parametrize("device, name, page", TARGETS)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_k_and_v_may_be_none_when_the_cache_already_holds_them(device, name, page, mode):
    built = build(_case(mode, page))
    fb, pool = built.batch, built.batch.token_to_kv_pool
    pool.k_buffer[0].copy_(built.expected_k)  # the engine wrote the new tokens itself
    pool.v_buffer[0].copy_(built.expected_v)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    backend = _backend(device, name, built.case)
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, None, None, built.layer, fb, save_kv_cache=False)
    torch.testing.assert_close(out, built.expected, **reference.tolerance(built.case.dtype))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))


@pytest.mark.parametrize("device, name, page", TARGETS)
def test_nan_propagates_rather_than_being_zeroed(device, name, page):
    built = build(_case(ForwardMode.DECODE, page))
    fb = built.batch
    q = built.q.clone()
    q[0] = float("nan")  # request 0's query
    backend = _backend(device, name, built.case)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, built.k, built.v, built.layer, fb)
    assert out[0].isnan().all(), "NaN in q must reach the output"
    assert not out[1:].isnan().any(), "other requests are unaffected"
    slot = int(fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[1]), 0])
    fb.token_to_kv_pool.k_buffer[0][slot] = float("nan")  # a cached key of request 1
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, built.k, built.v, built.layer, fb)
    assert out[1].isnan().any() and not out[0].isnan().any()


@pytest.mark.parametrize("device, name, page", TARGETS)
def test_metadata_serves_any_view_of_the_step_and_refuses_a_stale_one(device, name, page):
    built = build(_case(ForwardMode.DECODE, page))
    backend = _backend(device, name, built.case)
    backend.init_forward_metadata(built.batch)
    view = copy.copy(built.batch)  # the graph runner's view of the same step
    del view._hal_metadata_step
    out = backend.forward(built.q, built.k, built.v, built.layer, view)
    torch.testing.assert_close(out, built.expected, **reference.tolerance(built.case.dtype))
    backend.init_forward_metadata(build(_case(ForwardMode.EXTEND, page)).batch)  # the next step
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)


def test_graph_padding_of_an_engine_is_served():
    """SGLang pads a replayed decode batch with row 0, slot 0 and the backend's fill value."""
    built = build(_case(ForwardMode.DECODE, 1))
    fb = built.batch
    backend = _backend("cpu", "torch", built.case)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    padded = hal.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=fb.batch_size + 2,
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(2, dtype=torch.int64)]),
        seq_lens=torch.cat([fb.seq_lens, torch.full((2,), fill, dtype=torch.int32)]),
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(2, dtype=torch.int64)]),
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        validate="full",
    )
    pad = lambda t: torch.cat([t, torch.zeros(2, t.shape[1])])  # noqa: E731
    backend.init_forward_metadata(padded)
    out = backend.forward(pad(built.q), pad(built.k), pad(built.v), built.layer, padded)
    torch.testing.assert_close(out[: fb.batch_size], built.expected, **reference.tolerance(built.case.dtype))


def test_pipeline_stage_pools_index_by_global_layer_id():
    built = build(_case(ForwardMode.DECODE, 1))
    pool = built.batch.token_to_kv_pool
    stage = hal.PagedKVPool.from_buffers(pool.k_buffer, pool.v_buffer, page_size=1, start_layer=12)
    fb = copy.copy(built.batch)
    fb.token_to_kv_pool = stage
    layer = built.case.layer(layer_id=12)
    backend = _backend("cpu", "torch", built.case)
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, built.k, built.v, layer, fb)
    torch.testing.assert_close(out, built.expected, **reference.tolerance(built.case.dtype))
    with pytest.raises(hal.KVCacheError, match="layer_id"):
        backend.forward(built.q, built.k, built.v, built.case.layer(layer_id=0), fb)


def test_selection_takes_arguments_and_passes_the_model_on():
    layers = [hal.AttentionLayer(i, 4, 2, 64, sliding_window_size=8 if i % 2 else -1) for i in range(4)]
    config = hal.AttentionConfig.from_layers(layers, dtype=torch.float32, max_context_len=4096, max_batch_size=64)
    assert config.sliding_window_size == 8 and config.layer_num == 4
    selection = hal.select(config, device="cpu:0", backend="torch")
    backend = selection.create(validate="full")
    assert backend.config is config and backend.validation == "full" and backend.device == torch.device("cpu")
    with pytest.raises(ConfigError, match="options"):
        selection.create(workspace_mb=7)
    with pytest.raises(ConfigError, match="layers"):
        hal.AttentionConfig(tp_q_head_num=4, tp_k_head_num=2, head_dim=64, layers=(hal.AttentionLayer(0, 8, 2, 64),))
    hybrid = hal.select(config, prefill_backend="torch", decode_backend="torch").create()
    assert hybrid.config is config


def test_step_costs_read_nothing_from_the_device():
    from hal.commands.step_bench import run_step_workload

    data = run_step_workload("cpu", "torch", batch_sizes=(4,), context=64, repeats=1)
    assert data["results"][0]["host_reads"]["outside_out_graph"] == 0, data["results"][0]["host_reads"]
    assert data["forward_us"] > 0
