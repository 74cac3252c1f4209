"""SGLang's NPU KV pools served zero-copy (hal.integrations.sglang_pools), with stand-ins that mirror
SGLang 0.5.21's classes (python/sglang/srt/hardware_backend/npu/memory_pool_npu.py); no SGLang import."""

from __future__ import annotations

import pytest
import torch

from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, tolerance
from hal.devices.npu import AscendBackend
from hal.errors import UnsupportedError
from hal.integrations.sglang_pools import PagedBufferPool, serve_pool
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
    def __init__(self, size, page_size, kv_lora_rank=64, qk_rope_head_dim=16):
        self.page_size, self.dtype, self.kv_lora_rank, self.start_layer = page_size, torch.float32, kv_lora_rank, 0
        self.k_buffer = torch.zeros(1, size // page_size + 1, page_size, 1, kv_lora_rank)
        self.v_buffer = torch.zeros(1, size // page_size + 1, page_size, 1, qk_rope_head_dim)

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]


@pytest.mark.parametrize("use_fia", [False, True])
def test_npu_pool_buffers_are_hal_slots_views_of_the_same_memory(use_fia):
    pool = NPUMHATokenToKVPool(64, 16, torch.float32, 2, 8, 2, use_fia=use_fia)
    served = serve_pool(pool)
    assert isinstance(served, PagedBufferPool) and served.page_size == 16 and served.head_num == 2
    k = served.get_key_buffer(1)
    assert k.shape == (80, 2, 8) and k.data_ptr() == pool._k[1].data_ptr()  # pages + 1 = 5 pages of 16
    k[17] = 3.0
    assert (pool._k[1, 1, 1] == 3.0).all()  # slot 17 is token 1 of page 1 in SGLang's layout


def test_flat_pools_pass_through_and_split_mla_buffers_are_refused():
    class Flat:
        start_layer = 0

        def get_key_buffer(self, layer_id):
            return torch.zeros(4, 1, 8)

    flat = Flat()
    assert serve_pool(flat) is flat
    with pytest.raises(UnsupportedError, match="two separate buffers"):
        serve_pool(NPUMLATokenToKVPool(32, 16))


def test_ascend_backend_serves_a_batch_on_sglang_npu_pool_memory(monkeypatch):
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    cap = probe_device(get_registry(reload=True).get("npu"))
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
