"""SGLang's NPU KV pools served zero-copy (hal.integrations.sglang_pools), with stand-ins that mirror
SGLang 0.5.21's classes (python/sglang/srt/hardware_backend/npu/memory_pool_npu.py); no SGLang import."""

from __future__ import annotations

import pytest
import torch

from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, tolerance
from hal.devices.npu import AscendBackend
from hal.errors import UnsupportedError
from hal.integrations.sglang_pools import PagedBufferPool, SplitMLABufferPool, serve_pool
from hal.kernels.npu import emulation
from hal.registry import get_registry, probe_device


class NPUMHATokenToKVPool:
    """SGLang's allocation: one [layer, size // page_size + 1, page_size, H, D] tensor, per-layer 4-D slices
    (``use_fia``: ``[pages * page_size, 1, H, D]`` views of the same memory)."""

    def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, use_fia=False):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.head_num, self.head_dim, self.v_head_dim, self.layer_num = head_num, head_dim, head_dim, layer_num
        self.start_layer, self.device = 0, "cpu"
        shape = (layer_num, size // page_size + 1, page_size, head_num, head_dim)
        self._k, self._v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.k_buffer, self.v_buffer = self._k, self._v
        if use_fia:
            self.k_buffer = [self._k[i].view(-1, 1, head_num, head_dim) for i in range(layer_num)]
            self.v_buffer = [self._v[i].view(-1, 1, head_num, head_dim) for i in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.get_key_buffer(layer.layer_id).view(-1, self.head_num, self.head_dim)[loc] = cache_k
        self.get_value_buffer(layer.layer_id).view(-1, self.head_num, self.head_dim)[loc] = cache_v


class NPUMLATokenToKVPool:
    """SGLang's NPU MLA pool: the latent ``[layer, size // page_size + 1, page_size, 1, kv_lora_rank]`` (key buffer)
    and the rope part ``[..., qk_rope_head_dim]`` (value buffer) apart; ``set_kv_buffer(layer, loc, latent, rope)``,
    or the joined key split when the rope part is None."""

    def __init__(self, size, page_size, kv_lora_rank=64, qk_rope_head_dim=16, layer_num=1, dtype=torch.float32):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.kv_lora_rank, self.qk_rope_head_dim, self.layer_num, self.start_layer = (
            kv_lora_rank,
            qk_rope_head_dim,
            layer_num,
            0,
        )
        self.device, self.use_fia_nz = "cpu", False
        pages = size // page_size + 1
        self.k_buffer = torch.zeros(layer_num, pages, page_size, 1, kv_lora_rank, dtype=dtype)
        self.v_buffer = torch.zeros(layer_num, pages, page_size, 1, qk_rope_head_dim, dtype=dtype)

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        if cache_v is None:
            cache_k, cache_v = cache_k.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        self.get_key_buffer(layer.layer_id).view(-1, 1, self.kv_lora_rank)[loc] = cache_k.to(self.dtype)
        self.get_value_buffer(layer.layer_id).view(-1, 1, self.qk_rope_head_dim)[loc] = cache_v.to(self.dtype)


@pytest.mark.parametrize("use_fia", [False, True])
def test_npu_pool_buffers_are_hal_slots_views_of_the_same_memory(use_fia):
    pool = NPUMHATokenToKVPool(64, 16, torch.float32, 2, 8, 2, use_fia=use_fia)
    served = serve_pool(pool)
    assert isinstance(served, PagedBufferPool) and served.page_size == 16 and served.head_num == 2
    k = served.get_key_buffer(1)
    assert k.shape == (80, 2, 8) and k.data_ptr() == pool._k[1].data_ptr()  # pages + 1 = 5 pages of 16
    k[17] = 3.0
    assert (pool._k[1, 1, 1] == 3.0).all()  # slot 17 is token 1 of page 1 in SGLang's layout


def test_flat_pools_pass_through_and_the_mla_pool_is_served_split():
    class Flat:
        start_layer = 0

        def get_key_buffer(self, layer_id):
            return torch.zeros(4, 1, 8)

    flat = Flat()
    assert serve_pool(flat) is flat
    sgl = NPUMLATokenToKVPool(32, 16)
    served = serve_pool(sgl)
    assert isinstance(served, SplitMLABufferPool) and served.mla_split and served.kv_lora_rank == 64
    latent, rope = served.get_key_buffer(0), served.get_value_buffer(0)
    assert latent.shape == (48, 1, 64) and rope.shape == (48, 1, 16)
    assert latent.data_ptr() == sgl.k_buffer.data_ptr() and rope.data_ptr() == sgl.v_buffer.data_ptr()
    sgl.use_fia_nz = True
    with pytest.raises(UnsupportedError, match="NZ format"):
        serve_pool(sgl)


def _npu(monkeypatch):
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    return probe_device(get_registry(reload=True).get("npu"))


DEEPSEEK = dict(tp_q_head_num=16, tp_k_head_num=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.mark.parametrize(
    "mode, reqs",
    [
        (ForwardMode.DECODE, ((40, 1), (3, 1))),
        (ForwardMode.EXTEND, ((12, 4), (0, 5))),
        (ForwardMode.TARGET_VERIFY, ((20, 3), (7, 3))),
    ],
)
def test_ascend_serves_mla_in_place_on_sglangs_split_npu_pool(monkeypatch, mode, reqs):
    """FIA v2 reads SGLang's latent and rope buffers as they are; the write scatters both parts into them."""
    case = Case("sglang_npu_mla", mode, reqs, dtype=torch.bfloat16, page_size=16, **DEEPSEEK)
    built = build(case)
    fb, hal_pool = built.batch, built.batch.token_to_kv_pool
    sgl = NPUMLATokenToKVPool(hal_pool.num_slots - 16, 16, 512, 64, dtype=torch.bfloat16)
    served = serve_pool(sgl)
    served.get_key_buffer(0).copy_(hal_pool.k_buffer[0][..., :512])
    served.get_value_buffer(0).copy_(hal_pool.k_buffer[0][..., 512:])
    fb.token_to_kv_pool = served
    calls = []
    fia = emulation.torch_npu.npu_fused_infer_attention_score_v2
    monkeypatch.setattr(
        emulation.torch_npu,
        "npu_fused_infer_attention_score_v2",
        lambda *a, **kw: calls.append((a, kw)) or fia(*a, **kw),
    )
    backend = AscendBackend(_npu(monkeypatch))
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, built.k, None, built.layer, fb)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    ((args, kwargs),) = calls
    assert args[1].data_ptr() == sgl.k_buffer.data_ptr() and kwargs["key_rope"].data_ptr() == sgl.v_buffer.data_ptr()
    assert "mla_split" not in backend.route_of(fb, built.layer)
    loc, key = fb.out_cache_loc.long(), built.k.view(-1, 1, 576)
    torch.testing.assert_close(sgl.k_buffer[0].view(-1, 1, 512)[loc], key[..., :512])
    torch.testing.assert_close(sgl.v_buffer[0].view(-1, 1, 64)[loc], key[..., 512:])


def test_other_backends_refuse_the_split_pool_by_shape(monkeypatch):
    from hal.devices.cpu import PlainTorchBackend
    from hal.devices.cpu.capability import cpu_capability
    from hal.errors import InvalidBatchError

    built = build(
        Case(
            "sglang_npu_mla_torch", ForwardMode.DECODE, ((9, 1),), page_size=16, **{**DEEPSEEK, "dtype": torch.float32}
        )
    )
    fb = built.batch
    fb.token_to_kv_pool = serve_pool(NPUMLATokenToKVPool(fb.token_to_kv_pool.num_slots - 16, 16, 512, 64))
    backend = PlainTorchBackend(cpu_capability())
    backend.init_forward_metadata(fb)
    with pytest.raises(InvalidBatchError, match="KV pool"):
        backend.forward(built.q, built.k, built.v, built.layer, fb)


def test_ascend_backend_serves_a_batch_on_sglang_npu_pool_memory(monkeypatch):
    cap = _npu(monkeypatch)
    case = Case("sglang_npu_pool", ForwardMode.EXTEND, ((130, 5), (0, 20)), page_size=128, head_dim=128)
    built = build(case)
    fb = built.batch
    hal_pool = fb.token_to_kv_pool
    sgl = NPUMHATokenToKVPool(hal_pool.num_slots - 128, 128, case.dtype, case.tp_k_head_num, 128, 1)
    served = serve_pool(sgl)
    served.get_key_buffer(0).copy_(hal_pool.k_buffer[0])
    served.get_value_buffer(0).copy_(hal_pool.v_buffer[0])
    fb.token_to_kv_pool = served
    backend = AscendBackend(cap)
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, built.k, built.v, built.layer, fb)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    loc = fb.out_cache_loc.long()
    expected_k = built.k.view(-1, case.tp_k_head_num, 128)
    torch.testing.assert_close(sgl._k[0].view(-1, case.tp_k_head_num, 128)[loc], expected_k.to(case.dtype))
