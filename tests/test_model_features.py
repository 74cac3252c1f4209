"""MLA, attention sinks and fp8 KV caches (issue 19): the layer/config checks, the pools, the reference's
semantics against hand computations, the base class's declarations and the CPU backends' routes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import hal
from hal.backend import fused_forward_disabled
from hal.batch import ForwardMode
from hal.conformance.cases import Case, build
from hal.devices.cpu import CompiledBackend, PlainTorchBackend
from hal.devices.cpu.capability import cpu_capability
from hal.devices.cpu.torch_backend import TorchMetadata
from hal.kernels import reference
from hal.layer import AttentionLayer

MLA = {
    "layer_id": 0,
    "tp_q_head_num": 8,
    "tp_k_head_num": 1,
    "head_dim": 80,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
}


# ----------------------------------------------------------------------------- layer and config


@pytest.mark.parametrize(
    "bad",
    [
        {"tp_k_head_num": 2, "tp_q_head_num": 8},
        {"head_dim": 64},
        {"v_head_dim": 80},
        {"kv_lora_rank": -1},
        {"kv_lora_rank": 0},  # a rope part without a latent
        {"k_scale": 0.0},
        {"k_scale": float("nan")},
        {"k_scale": 0.5, "v_scale": 0.25},  # MLA stores the value once, as the key
    ],
)
def test_bad_mla_or_scale_fields_are_config_errors(bad):
    with pytest.raises(hal.ConfigError):
        AttentionLayer(**{**MLA, **bad})


def test_mla_layer_defaults_and_config_carries_the_new_fields():
    layer = AttentionLayer(**MLA, k_scale=0.5)
    assert layer.is_mla and layer.v_head_dim == 64 and layer.v_scale == 0.5
    config = hal.AttentionConfig.from_layers([layer], attention_sinks=True, kv_cache_dtype="fp8_e4m3")
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.v_head_dim) == (64, 16, 64)
    assert config.attention_sinks and config.kv_cache_torch_dtype == torch.float8_e4m3fn
    assert hal.AttentionConfig(kv_cache_dtype=torch.float8_e5m2).kv_cache_dtype == "fp8_e5m2"
    assert hal.AttentionConfig(kv_cache_dtype="auto").kv_cache_dtype_name == "bf16"
    for bad in ("int8", ["fp8"], torch.int8):
        with pytest.raises(hal.ConfigError, match="kv_cache_dtype"):
            hal.AttentionConfig(kv_cache_dtype=bad)
    with pytest.raises(hal.ConfigError, match="tp_k_head_num"):
        hal.AttentionConfig(tp_k_head_num=2, head_dim=80, kv_lora_rank=64, qk_rope_head_dim=16)


# ----------------------------------------------------------------------------- pools


def test_mla_pool_value_is_a_view_and_writes_store_the_key_only():
    pool = hal.MLAKVPool(3, 4, 2, kv_lora_rank=8, qk_rope_head_dim=4, start_layer=3)
    key, value = pool.get_kv_buffer(4)
    assert value.data_ptr() == key.data_ptr() and value.shape == (16, 1, 8) and key.shape == (16, 1, 12)
    layer = AttentionLayer(4, 2, 1, 12, kv_lora_rank=8, qk_rope_head_dim=4)
    loc, k = torch.tensor([5, 9]), torch.randn(2, 1, 12)
    pool.set_kv_buffer(layer, loc, k, torch.full((2, 1, 8), 7.0))  # the value argument is not written
    assert torch.equal(key[loc], k) and torch.equal(value[loc], k[..., :8])
    pool.set_mla_kv_buffer(layer, torch.tensor([6]), k[:1, :, :8], k[:1, :, 8:])
    assert torch.equal(key[6], k[0])
    wrapped = hal.MLAKVPool.from_buffers(pool.kv_buffer, kv_lora_rank=8, page_size=4, start_layer=3)
    assert wrapped.get_value_buffer(4).data_ptr() == key.data_ptr() and wrapped.qk_rope_head_dim == 4
    before = key.clone()
    with pytest.raises(hal.KVCacheError, match="cache_k"):
        pool.set_kv_buffer(layer, loc, torch.randn(2, 1, 8))
    with pytest.raises(hal.KVCacheError, match="cache_k_rope"):
        pool.set_mla_kv_buffer(layer, loc, k[..., :8], k[..., :3])
    assert torch.equal(key, before)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_quantises_with_the_layer_scales_and_saturates(dtype):
    pool = hal.PagedKVPool(2, 1, 1, 1, 4, dtype=dtype)
    layer = AttentionLayer(0, 1, 1, 4, k_scale=0.5, v_scale=4.0)
    big = torch.finfo(dtype).max
    k = torch.tensor([[[0.25, -1.0, big, -3 * big]]])
    v = torch.tensor([[[1.0, 8.0, -2.0, 0.0]]])
    pool.set_kv_buffer(layer, torch.tensor([1]), k, v)
    stored_k, stored_v = pool.k_buffer[0][1].float(), pool.v_buffer[0][1].float()
    assert stored_k.flatten().tolist() == [0.5, -2.0, big, -big]  # k / 0.5, clamped to the fp8 range
    assert stored_v.flatten().tolist() == [0.25, 2.0, -0.5, 0.0]
    assert torch.equal(reference.dequantize_kv(pool.v_buffer[0][1], 4.0), v[0])
    pool.set_kv_buffer(layer, torch.tensor([1]), k, v, k_scale=1.0, v_scale=torch.tensor(2.0))  # SGLang's arguments
    assert pool.v_buffer[0][1].float().flatten().tolist() == [0.5, 4.0, -1.0, 0.0]


# ----------------------------------------------------------------------------- the reference's semantics


def test_reference_sinks_are_one_more_term_of_the_denominator():
    gen = torch.Generator().manual_seed(3)
    q, keys, values = (torch.randn(n, 2, 4, generator=gen, dtype=torch.float64) for n in (1, 3, 3))
    sinks = torch.tensor([0.7, -1.5], dtype=torch.float64)
    rt = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    out = reference.paged_attention(
        q, keys, values, rt, torch.tensor([0]), torch.tensor([3]), torch.tensor([1]),
        scale=0.5, sinks=sinks, acc_dtype=torch.float64,
    )  # fmt: skip
    for h in range(2):
        scores = [0.5 * float(q[0, h] @ keys[j, h]) for j in range(3)]
        denominator = sum(math.exp(s) for s in scores) + math.exp(float(sinks[h]))
        want = sum(math.exp(s) / denominator * values[j, h] for j, s in enumerate(scores))
        torch.testing.assert_close(out[0, h], want)


def test_reference_row_without_keys_is_zero_with_sinks():
    q, kv = torch.randn(1, 1, 4), torch.randn(2, 1, 4)
    out = reference.paged_attention(
        q, kv, kv, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0]), torch.tensor([2]),
        torch.tensor([1]), scale=1.0, custom_mask=torch.zeros(2, dtype=torch.bool), sinks=torch.tensor([2.0]),
    )  # fmt: skip
    assert torch.equal(out, torch.zeros(1, 1, 4))


# ----------------------------------------------------------------------------- the base class and the CPU backends


class NoSinks(PlainTorchBackend):
    name = "no_sinks"
    supports_sinks = False
    kv_cache_dtypes = frozenset({"fp32", "bf16"})


def test_declarations_give_reasons():
    config = hal.AttentionConfig(dtype="fp32", attention_sinks=True, kv_cache_dtype="fp8_e5m2")
    reasons = NoSinks.unsupported_reasons(config, cpu_capability())
    assert "attention sinks not supported" in reasons
    assert any("kv_cache_dtype fp8_e5m2 not supported" in r for r in reasons)
    assert PlainTorchBackend.unsupported_reasons(config, cpu_capability()) == []


def test_undeclared_sinks_or_fp8_pool_are_unsupported_and_write_nothing():
    built = build(Case("s", ForwardMode.DECODE, ((3, 1), (5, 1)), sinks=True))
    backend = NoSinks(cpu_capability())
    backend.init_forward_metadata(built.batch)
    with pytest.raises(hal.UnsupportedError, match="sinks"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch, sinks=built.sinks)
    torch_backend = PlainTorchBackend(cpu_capability())
    torch_backend.init_forward_metadata(built.batch)
    with pytest.raises(hal.InvalidBatchError, match="sinks"):
        torch_backend.forward(built.q, built.k, built.v, built.layer, built.batch, sinks=built.sinks[:2])
    assert torch.equal(built.batch.token_to_kv_pool.k_buffer[0], built.initial_pool_k[0])
    fp8 = build(Case("f", ForwardMode.DECODE, ((3, 1),), kv_cache_dtype=torch.float8_e5m2, k_scale=0.3))
    backend.init_forward_metadata(fp8.batch)
    with pytest.raises(hal.UnsupportedError, match="fp8_e5m2"):
        backend.forward(fp8.q, fp8.k, fp8.v, fp8.layer, fp8.batch)


@pytest.mark.parametrize("backend_cls", [PlainTorchBackend, CompiledBackend])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_mla_value_may_be_none(backend_cls, mode):
    requests = ((4, 1), (9, 1)) if mode.is_decode() else ((4, 3), (0, 5))
    built = build(Case("m", mode, requests, tp_q_head_num=4, tp_k_head_num=1, head_dim=80, kv_lora_rank=64,
                       qk_rope_head_dim=16))  # fmt: skip
    backend = backend_cls(cpu_capability())
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, None, built.layer, built.batch)
    assert torch.equal(built.batch.token_to_kv_pool.k_buffer[0], built.expected_pool_k[0])
    torch.testing.assert_close(out, built.expected.float(), **reference.tolerance(torch.float32))


def test_compiled_backend_runs_sinks_and_mla_in_the_kernels_and_fp8_on_the_plain_path():
    backend = CompiledBackend(cpu_capability(), hal.AttentionConfig(dtype="fp32", attention_sinks=True))
    if backend.kernels is None:
        pytest.skip("the compiled CPU kernels are not built here")
    sinks = build(Case("s", ForwardMode.DECODE, ((3, 1), (40, 1)), sinks=True))
    for config in (backend.config, None):  # announced by the config, or not: the kernels take sinks= either way
        kernels = CompiledBackend(cpu_capability(), config)
        kernels.init_forward_metadata(sinks.batch)
        assert not isinstance(kernels.forward_metadata, TorchMetadata)
        assert kernels.route_of(sinks.batch, sinks.layer) == ["rows/one_head"]
        with fused_forward_disabled():  # the checked prologue, then paged_attention
            checked = kernels.forward(sinks.q, sinks.k, sinks.v, sinks.layer, sinks.batch, sinks=sinks.sinks)
        fused = kernels.forward(sinks.q, sinks.k, sinks.v, sinks.layer, sinks.batch, sinks=sinks.sinks)
        for out in (checked, fused):  # write_and_attend (the fused forward) with sinks
            torch.testing.assert_close(out, sinks.expected.float(), **reference.tolerance(torch.float32))
    fp8 = build(Case("f", ForwardMode.DECODE, ((3, 1),), kv_cache_dtype=torch.float8_e4m3fn))
    unconfigured = CompiledBackend(cpu_capability())
    unconfigured.init_forward_metadata(fp8.batch)
    assert isinstance(unconfigured.forward_metadata, TorchMetadata)
    mla = build(Case("m", ForwardMode.DECODE, ((3, 1),), tp_k_head_num=1, head_dim=80, kv_lora_rank=64,
                     qk_rope_head_dim=16))  # fmt: skip
    unconfigured.init_forward_metadata(mla.batch)
    assert not isinstance(unconfigured.forward_metadata, TorchMetadata)  # MLA runs in the kernels
    assert any("fp8 KV caches run the plain torch path" in note for note in CompiledBackend.notes(cpu_capability()))


def test_fp8_tolerance_is_the_query_dtypes_against_the_same_cache():
    assert reference.tolerance(torch.bfloat16, torch.float8_e4m3fn) == reference.tolerance(torch.bfloat16)
    assert reference.tolerance(torch.float32, torch.float8_e4m3fn)["atol"] <= 1e-2


def test_indexer_metadata_is_none():
    built = build(replace(Case("d", ForwardMode.DECODE, ((3, 1),))))
    assert PlainTorchBackend(cpu_capability()).get_indexer_metadata(0, built.batch) is None
