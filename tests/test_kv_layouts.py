"""KV layouts are declared, not assumed: the layout table (``hal.kv_layouts``), pools in every layout, backends'
``kv_layouts`` and selection's refusals, plugins that declare nothing (token-major), 310P's FRACTAL_NZ pools read
in place, and vLLM's cache forms read by ``kv_views``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import hal
from hal.conformance.cases import Case, build, tolerance
from hal.declaration import BackendDeclaration
from hal.devices.cpu import CompiledBackend, PlainTorchBackend
from hal.errors import ConfigError, KVCacheError, NoBackendError, PluginError, UnsupportedError
from hal.integrations.vllm_steps import VllmKVPool, kv_views, vllm_block_size
from hal.kernels.npu import emulation, load_torch_npu
from hal.kernels.reference.kv_layouts import read_head_major
from hal.kv_cache import PagedKVPool, kv_pages, kv_rows, pool_geometry
from hal.kv_layouts import AMX_PACKED, FRACTAL_NZ, HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR, pool_kv_layout
from hal.modes import ForwardMode
from hal.registry import get_registry, probe_device, register_device
from hal.selection import select

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "hal-device-example" / "src"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR, FRACTAL_NZ)


def _filled(layout: str, dtype=torch.float32, seed=0) -> tuple[PagedKVPool, torch.Tensor, torch.Tensor]:
    """A 2-layer pool of ``layout`` (3 pages of 4 slots + the padding page, 2 heads of dim 16) whose layer 1 holds
    known rows at every slot but the padding page, written with a padding token (-1) among them."""
    gen = torch.Generator().manual_seed(seed)
    pool = PagedKVPool(3, 4, 2, 2, 16, dtype=dtype, kv_layout=layout)
    k, v = torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    loc = torch.cat([torch.arange(4, 16), torch.tensor([-1])])
    pool.set_kv_buffer(1, loc, torch.cat([k, k[:1] + 7]), torch.cat([v, v[:1] + 7]))
    return pool, k, v


# ----------------------------------------------------------------------------- the table


def test_table_names_each_layout_as_the_engines_do():
    assert [(r.name, r.flashinfer, r.vllm, r.ascend) for r in KV_LAYOUTS.values()] == [
        (TOKEN_MAJOR, "NHD", "LBNHC", "ND"),
        (HEAD_MAJOR, "HND", "LBHNC", None),
        (FRACTAL_NZ, None, None, "FRACTAL_NZ"),
        (AMX_PACKED, None, None, None),
    ]
    assert KV_LAYOUTS[HEAD_MAJOR].shape(5, 4, 2, 16) == (5, 2, 4, 16)
    assert KV_LAYOUTS[FRACTAL_NZ].shape(5, 4, 2, 16) == (5, 2, 4, 16)
    assert KV_LAYOUTS[TOKEN_MAJOR].shape(5, 4, 2, 16) == (20, 2, 16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rows_element_offset_is_where_the_pool_put_the_value(layout):
    pool, k, _ = _filled(layout)
    memory = pool.k_buffer[1].contiguous().view(-1)
    row = KV_LAYOUTS[layout]
    for slot, head, d in ((4, 0, 0), (5, 1, 3), (9, 0, 15), (15, 1, 9), (12, 1, 0)):
        at = row.element_offset(slot // 4, slot % 4, head, d, page_size=4, heads=2, dim=16)
        assert memory[at] == k[slot - 4, head, d]
    assert tuple(pool.k_buffer[1].shape) == row.shape(4, 4, 2, 16)


def _amx_filled(dtype=torch.float32, seed=0) -> tuple[PagedKVPool, torch.Tensor, torch.Tensor]:
    """``_filled``'s pool for AMX-packed pages, which hold 32 slots of dims of 32: 3 pages of 32 slots + the
    padding page, 2 heads of dim 64 (V of 32), layer 1 written at every slot but the padding page's, and a -1."""
    gen = torch.Generator().manual_seed(seed)
    pool = PagedKVPool(3, 32, 2, 2, 64, 32, dtype=dtype, kv_layout=AMX_PACKED)
    k, v = torch.randn(96, 2, 64, generator=gen), torch.randn(96, 2, 32, generator=gen)
    loc = torch.cat([torch.arange(32, 128).flip(0), torch.tensor([-1])])
    pool.set_kv_buffer(1, loc, torch.cat([k.flip(0), k[:1] + 7]), torch.cat([v.flip(0), v[:1] + 7]))
    return pool, k, v


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float8_e4m3fn))
def test_amx_packed_pages_hold_each_value_where_the_tiles_read_it(dtype):
    pool, k, v = _amx_filled(dtype)
    want_k, want_v = k.to(dtype), v.to(dtype)
    got_k, got_v = kv_rows(pool, 1, torch.arange(32, 128))
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert not kv_rows(pool, 1, torch.arange(32))[0].float().any()  # the -1 wrote nothing
    row = KV_LAYOUTS[AMX_PACKED]
    k_mem, v_mem = (
        t[1].contiguous().view(-1).view(torch.uint8).view(-1, dtype.itemsize) for t in (pool.k_buffer, pool.v_buffer)
    )
    for slot, head, d in ((32, 0, 0), (49, 1, 37), (127, 0, 63), (70, 1, 30)):
        at = row.element_offset(slot // 32, slot % 32, head, d, page_size=32, heads=2, dim=64)
        assert torch.equal(k_mem[at], want_k[slot - 32, head, d : d + 1].view(torch.uint8))
        at = row.element_offset(slot // 32, slot % 32, head, d % 32, page_size=32, heads=2, dim=32, value=True)
        assert torch.equal(v_mem[at], want_v[slot - 32, head, d % 32 : d % 32 + 1].view(torch.uint8))
    # a K tile (keys 16..31 of page 2 x dims 32..63 of head 1) is B = K^T in pairs, as AMX loads it
    slab = pool.k_buffer[1][2, 1].reshape(-1)
    tile = slab[(1 * 64 // 32 + 1) * 512 :][:512].view(16, 16, 2)
    assert torch.equal(tile.permute(1, 0, 2).reshape(16, 32), want_k[64 + 16 - 32 : 64 + 32 - 32, 1, 32:64])
    # a V tile (keys 0..31 x dims 16..31 of head 0 of page 1) is B = V in key pairs
    slab = pool.v_buffer[1][1, 0].reshape(-1)
    tile = slab[1 * 32 * 16 :][:512].view(16, 16, 2)
    assert torch.equal(tile.permute(0, 2, 1).reshape(32, 16), want_v[0:32, 0, 16:32])


def test_amx_packed_pages_refuse_pages_and_dims_their_tiles_cannot_hold():
    with pytest.raises(KVCacheError, match="multiple of 32, not 16"):
        PagedKVPool(3, 16, 1, 2, 64, dtype=torch.bfloat16, kv_layout=AMX_PACKED)
    with pytest.raises(KVCacheError, match="dim a multiple of 32, not 48"):
        PagedKVPool(3, 32, 1, 2, 64, 48, dtype=torch.bfloat16, kv_layout=AMX_PACKED)


# ----------------------------------------------------------------------------- pools


@pytest.mark.parametrize("layout", (HEAD_MAJOR, FRACTAL_NZ))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float8_e4m3fn))
def test_each_layouts_pool_reads_back_what_a_token_major_pool_does(layout, dtype):
    token, _, _ = _filled(TOKEN_MAJOR, dtype)
    other, _, _ = _filled(layout, dtype)
    assert pool_kv_layout(other) == layout and pool_kv_layout(token) == TOKEN_MAJOR
    every = torch.arange(16)
    for got, want in zip(kv_rows(other, 1, every), kv_rows(token, 1, every)):
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert pool_geometry(other, 1) == pool_geometry(token, 1) == (16, 2, 16, 16)
    assert not kv_rows(other, 0, every)[0].float().any()  # layer 0 untouched
    assert not kv_rows(other, 1, torch.arange(4))[0].float().any()  # the padding page too (-1 wrote nothing)


def test_the_reference_reader_gathers_a_requests_keys_from_head_major_pages():
    token, _, _ = _filled(TOKEN_MAJOR)
    head_major, _, _ = _filled(HEAD_MAJOR)
    req_to_token = torch.tensor([[0, 0, 0, 0], [13, 6, 11, 4]], dtype=torch.int32)
    slots = req_to_token[1, :3]
    keys = read_head_major(kv_pages(head_major, 1)[0], slots)
    assert torch.equal(keys, token.get_key_buffer(1)[slots.long()])
    assert not torch.equal(keys, token.get_key_buffer(1)[slots.long().flip(0)])


def test_a_layout_pool_has_no_token_major_buffer_and_says_where_to_read():
    pool, _, _ = _filled(HEAD_MAJOR)
    with pytest.raises(KVCacheError, match="head_major pool.*get_kv_pages"):
        pool.get_key_buffer(1)
    with pytest.raises(KVCacheError, match="head_major"):
        pool.get_kv_buffer(1)
    k, v = pool.get_kv_pages(1)
    assert k.shape == v.shape == (4, 2, 4, 16) and k.data_ptr() == pool.k_buffer[1].data_ptr()
    token, _, _ = _filled(TOKEN_MAJOR)
    assert kv_pages(token, 1)[0].shape == (4, 4, 2, 16)  # token-major: the NHD view of the same memory
    assert kv_pages(token, 1)[0].data_ptr() == token.get_key_buffer(1).data_ptr()
    with pytest.raises(KVCacheError, match="kv_layout"):
        PagedKVPool(3, 4, 1, 2, 8, kv_layout=FRACTAL_NZ)  # NZ lanes of 16
    with pytest.raises(KVCacheError, match="one of"):
        PagedKVPool(3, 4, 1, 2, 16, kv_layout="NHD")


# ----------------------------------------------------------------------------- declarations and selection


def test_a_backend_declaring_only_token_major_refuses_a_head_major_pool_config_with_the_reason(monkeypatch):
    config = hal.AttentionConfig(dtype=torch.float32, head_dim=16, tp_q_head_num=4, tp_k_head_num=2, page_size=4)
    cap = probe_device(get_registry().devices["cpu"])
    assert PlainTorchBackend.declaration().kv_layouts == (TOKEN_MAJOR,)
    assert PlainTorchBackend.unsupported_reasons(config, cap) == []
    reasons = PlainTorchBackend.unsupported_reasons(
        hal.AttentionConfig(**{**_fields(config), "kv_layout": HEAD_MAJOR}), cap
    )
    assert reasons == ["kv_layout head_major not read in place (reads ['token_major'])"]
    head_major = hal.AttentionConfig(**{**_fields(config), "kv_layout": HEAD_MAJOR})
    assert select(head_major, device="cpu").backend == "torch"  # the compiled backend reads head-major pages
    monkeypatch.setattr(CompiledBackend, "kv_layouts", (TOKEN_MAJOR,))
    with pytest.raises(NoBackendError, match="kv_layout head_major not read in place"):
        select(head_major, device="cpu")
    with pytest.raises(ConfigError, match="kv_layout"):
        hal.AttentionConfig(kv_layout="HND")


def _fields(config: hal.AttentionConfig) -> dict:
    return {
        name: getattr(config, name) for name in ("dtype", "head_dim", "tp_q_head_num", "tp_k_head_num", "page_size")
    }


def test_a_declaration_names_known_layouts_in_preferred_order():
    class Plugin(hal.AttentionBackend):
        name = "p"
        kv_layouts = None  # as a class written before 0.4 reads through getattr: 0.3's token-major pools

    assert BackendDeclaration.of(Plugin).kv_layouts == (TOKEN_MAJOR,)
    for bad, why in (("head_major", "sequence"), (("NHD",), "names of"), ((), "one or more")):
        Plugin.kv_layouts = bad
        with pytest.raises(PluginError, match=why):
            BackendDeclaration.of(Plugin)
    Plugin.kv_layouts = [HEAD_MAJOR, TOKEN_MAJOR]
    assert BackendDeclaration.of(Plugin).kv_layouts == (HEAD_MAJOR, TOKEN_MAJOR)


@pytest.fixture
def toy(restore_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    for name in [m for m in sys.modules if m == "hal_toy" or m.startswith("hal_toy.")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("hal_toy")
    register_device(module.device)
    return module


def test_a_plugin_written_for_0_3_gets_token_major_pools_and_still_runs(toy):
    case = Case("toy_decode", ForwardMode.DECODE, ((5, 1), (17, 1)), page_size=16, dtype=torch.float32)
    built = build(case)
    config = hal.AttentionConfig(
        tp_q_head_num=case.tp_q_head_num,
        tp_k_head_num=case.tp_k_head_num,
        head_dim=case.head_dim,
        dtype=torch.float32,
        page_size=16,
    )
    selection = select(config, device="toy")
    assert "kv_layouts" not in vars(selection.decode_backend)  # the example declares no layout
    assert selection.kv_layout == TOKEN_MAJOR
    own = built.batch.token_to_kv_pool
    pool = selection.create_kv_pool(own.num_pages)
    assert pool_kv_layout(pool) == TOKEN_MAJOR and pool.get_key_buffer(0).shape == own.get_key_buffer(0).shape
    for mine, theirs in zip(pool.k_buffer + pool.v_buffer, own.k_buffer + own.v_buffer):
        mine.copy_(theirs)
    built.batch.token_to_kv_pool = pool
    backend = selection.create()
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


# ----------------------------------------------------------------------------- Ascend 310P: FRACTAL_NZ in place

needs_emulation = pytest.mark.skipif(load_torch_npu()[0] is not None, reason="a real NPU: the emulation is not used")


def _npu(monkeypatch, generation: str):
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", generation)
    return probe_device(get_registry(reload=True).get("npu"))


@needs_emulation
def test_310p_prefers_nz_pools_and_other_generations_refuse_them(monkeypatch):
    _npu(monkeypatch, "1")
    config = hal.AttentionConfig(dtype=torch.float16, head_dim=128, tp_q_head_num=4, tp_k_head_num=2, page_size=128)
    assert select(config, device="npu").kv_layout == TOKEN_MAJOR  # an A2: its ops read ND pages
    nz = hal.AttentionConfig(**{**_fields(config), "kv_layout": FRACTAL_NZ})
    with pytest.raises(NoBackendError, match="only 310P's ATB ops read FRACTAL_NZ"):
        select(nz, device="npu")
    _npu(monkeypatch, "310P")
    selection = select(config, device="npu")
    assert selection.kv_layout == FRACTAL_NZ
    pool = selection.create_kv_pool(2)
    k, v = pool.get_kv_pages(0)
    assert k.shape == v.shape == (3, 2 * 128 // 16, 128, 16)
    assert emulation.get_npu_format(k) == emulation.get_npu_format(v) == 29  # cast once, when allocated


@needs_emulation
@pytest.mark.parametrize(
    "mode, requests", [(ForwardMode.DECODE, ((0, 1), (130, 1), (5, 1))), (ForwardMode.EXTEND, ((130, 5), (0, 20)))]
)
def test_310p_reads_nz_pools_in_place_with_no_per_layer_cast(monkeypatch, mode, requests):
    cap = _npu(monkeypatch, "310P")
    built = build(Case("nz", mode, requests, page_size=128, dtype=torch.float32))
    own = built.batch.token_to_kv_pool
    config = hal.AttentionConfig(
        tp_q_head_num=built.case.tp_q_head_num,
        tp_k_head_num=own.head_num,
        head_dim=own.head_dim,
        dtype=torch.float32,
        page_size=128,
    )
    selection = select(config, device="npu")
    pool = selection.create_kv_pool(own.num_pages)
    every = torch.arange(own.num_slots)
    pool.set_kv_buffer(0, every, own.get_key_buffer(0), own.get_value_buffer(0))  # the same contents, NZ
    built.batch.token_to_kv_pool = pool
    calls: dict[str, list] = {"npu_format_cast": [], "_npu_reshape_and_cache": [], "npu_scatter_nd_update_": []}
    for name, seen in calls.items():
        op = getattr(emulation.torch_npu, name)
        monkeypatch.setattr(
            emulation.torch_npu, name, lambda *a, _op=op, _seen=seen, **kw: _seen.append(a or kw) or _op(*a, **kw)
        )
    backend = selection.create()
    assert cap.arch and backend.generation == "310P"
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(built.case.dtype))
    cast = [c.get("x") if isinstance(c, dict) else c[0] for c in calls["npu_format_cast"]]
    # no cache copy cast per layer (a token-major pool costs two here); extend casts its NZ mask [1, W/16, T, 16]
    assert [tuple(t.shape[:1]) for t in cast] == ([] if mode.is_decode() else [(1,)])
    assert len(calls["_npu_reshape_and_cache"]) == 1 and calls["npu_scatter_nd_update_"] == []
    loc = built.batch.out_cache_loc
    assert torch.equal(kv_rows(pool, 0, loc)[0], built.expected_k[loc.long()])


@needs_emulation
def test_an_nz_pool_is_refused_where_the_ops_read_nd(monkeypatch):
    _npu(monkeypatch, "310P")
    nz = PagedKVPool(2, 128, 1, 2, 128, dtype=torch.float32, kv_layout=FRACTAL_NZ)
    cap = _npu(monkeypatch, "1")
    built = build(Case("nz_a2", ForwardMode.DECODE, ((0, 1),), page_size=128, dtype=torch.float32))
    built.batch.token_to_kv_pool = nz
    backend = select(hal.AttentionConfig(dtype=torch.float32, page_size=128), device="npu").create()
    assert backend.capability == cap
    backend.init_forward_metadata(built.batch)
    with pytest.raises(UnsupportedError, match="fractal_nz on 310P"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)


# ----------------------------------------------------------------------------- vLLM's cache forms


def test_kv_views_read_vllms_stacked_and_split_caches_in_place():
    stacked = torch.zeros(2, 3, 4, 2, 8)  # get_kv_cache_shape: [2, num_blocks, block_size, kv_heads, head_size]
    k, v = kv_views(stacked, 8)
    k[5] = 1.0
    v[6] = 2.0
    assert stacked[0, 1, 1].eq(1).all() and stacked[1, 1, 2].eq(2).all() and stacked.sum() == 16 + 32
    pair = (torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 4))  # vllm-ascend's (k_cache, v_cache)
    k, v = kv_views(pair, 8, 4)
    assert k.shape == (12, 2, 8) and v.shape == (12, 2, 4) and vllm_block_size(pair) == 4
    k[11] = 3.0
    assert pair[0][2, 3].eq(3).all() and k.data_ptr() == pair[0].data_ptr()
    pool = VllmKVPool(4, torch.float32, "cpu", 8, 4)
    pool.bind(0, pair)
    assert pool.get_value_buffer(0).data_ptr() == pair[1].data_ptr()
    head_major = torch.zeros(2, 3, 2, 4, 8).permute(0, 1, 3, 2, 4)  # vLLM's CPU pages: slots not one stride apart
    with pytest.raises(KVCacheError, match="token_major"):
        kv_views(head_major, 8)
    with pytest.raises(KVCacheError, match="v_cache"):
        kv_views((pair[0], torch.zeros(3, 4, 1, 4)), 8, 4)
