"""The CPU backend reads head-major KV pages and block tables in place: every mode, fp32 and bf16, page sizes 1, 16
and 128, against the float64 reference of a token-major pool holding the same contents (``hal.conformance``'s
cases, their pool rewritten head-major slot by slot), on the fused call and on the checked path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hal
from hal.backend import fused_forward_disabled
from hal.conformance.builder import build
from hal.conformance.cases import Case, tolerance
from hal.devices.cpu import CompiledBackend, PlainTorchBackend, cpu_capability
from hal.errors import UnsupportedError
from hal.kernels import cpu as cpu_kernels
from hal.kv_cache import PagedKVPool, kv_rows
from hal.kv_layouts import AMX_PACKED, HEAD_MAJOR, TOKEN_MAJOR
from hal.modes import ForwardMode

needs_kernels = pytest.mark.skipif(not cpu_kernels.status()[0], reason="no compiled CPU kernels here")


def _head_major(fb):
    """``fb`` over a head-major pool holding, slot for slot, what its token-major pool holds."""
    token = fb.token_to_kv_pool
    pool = PagedKVPool(
        token.num_pages,
        token.page_size,
        token.layer_num,
        token.head_num,
        token.head_dim,
        token.v_head_dim,
        dtype=token.dtype,
        start_layer=token.start_layer,
        kv_layout=HEAD_MAJOR,
    )
    slots = torch.arange(token.num_slots)
    for layer_id in range(token.start_layer, token.start_layer + token.layer_num):
        k, v = kv_rows(token, layer_id, slots)
        for pages, rows in zip(pool.get_kv_pages(layer_id), (k, v)):
            hal.kv_layouts.KV_LAYOUTS[HEAD_MAJOR].write(pages, slots, rows)
    return dataclasses.replace(fb, token_to_kv_pool=pool)


def _page_table(fb):
    """``fb`` with its request table given as a block table only (the same pages)."""
    ps = fb.token_to_kv_pool.page_size
    tokens = fb.req_to_token_pool.req_to_token
    pages = hal.ReqToPagePool(tokens.shape[0] - 1, -(-tokens.shape[1] // ps), ps)
    for row, n in zip(fb.req_pool_indices.tolist(), fb.lens.kv):
        pages.write(row, 0, tokens[row, : -(-n // ps) * ps : ps].long() // ps)
    return dataclasses.replace(fb, req_to_token_pool=None, req_to_page_pool=pages)


def _cases(page_size: int, dtype: torch.dtype) -> list[Case]:
    common = {"page_size": page_size, "dtype": dtype, "head_dim": 32, "tp_q_head_num": 4, "tp_k_head_num": 2}
    return [
        Case("decode", ForwardMode.DECODE, ((20, 1), (33, 1), (0, 1)), **common),
        Case("extend", ForwardMode.EXTEND, ((17, 5), (0, 9), (40, 3)), **common),
        Case("mixed", ForwardMode.MIXED, ((12, 1), (30, 1), (0, 7)), **common),
        Case("verify", ForwardMode.TARGET_VERIFY, ((9, 3), (21, 3)), **common),
    ]


CASES = [case for ps in (1, 16, 128) for dtype in (torch.float32, torch.bfloat16) for case in _cases(ps, dtype)]


def _run(backend, built, fb):
    backend.init_forward_metadata(fb)
    return backend.forward(built.q, built.k, built.v, built.layer, fb, **built.forward_kwargs)


def _check(built, fb, out):
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(built.case.dtype))
    slots = torch.arange(fb.token_to_kv_pool.num_slots)
    k, v = kv_rows(fb.token_to_kv_pool, built.layer.layer_id, slots)
    assert torch.equal(k, built.expected_k) and torch.equal(v, built.expected_v)  # the new tokens' KV, and no other


@needs_kernels
@pytest.mark.parametrize("table", ["token", "page"])
@pytest.mark.parametrize("path", ["fused", "checked"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}-ps{c.page_size}-{str(c.dtype)[6:]}")
def test_compiled_backend_reads_head_major_pages_in_place(case, path, table):
    built = build(case)
    fb = _head_major(built.batch)
    if table == "page":
        fb = _page_table(fb)
    backend = CompiledBackend(cpu_capability(), validate="full")
    if path == "checked":
        with fused_forward_disabled():
            out = _run(backend, built, fb)
    else:
        out = _run(backend, built, fb)
    assert backend.forward_metadata.path == "compiled" and backend.forward_metadata.kv_layout == HEAD_MAJOR
    if table == "page":
        assert backend.forward_metadata.req_to_token is None  # the block table as it is: nothing derived
    _check(built, fb, out)


@pytest.mark.parametrize("table", ["token", "page"])
def test_plain_plans_gather_from_head_major_pages(table):
    """An fp8 pool (and an instance without kernels) runs the plain torch plan: it gathers the keys from the
    head-major pages (and the slots from a block table)."""
    fp8 = Case(
        "fp8",
        ForwardMode.EXTEND,
        ((17, 5), (0, 9)),
        page_size=16,
        head_dim=32,
        kv_cache_dtype=torch.float8_e4m3fn,
        k_scale=0.5,
        v_scale=2.0,
    )
    for case, kernels in ((fp8, True), (dataclasses.replace(fp8, kv_cache_dtype=None, name="plain"), False)):
        built = build(case)
        fb = _head_major(built.batch)
        fb = _page_table(fb) if table == "page" else fb
        backend = CompiledBackend(cpu_capability(), validate="full")
        if not kernels:
            backend.kernels, backend._fusable = None, False
        out = _run(backend, built, fb)
        assert backend.forward_metadata.path == "plain_torch"
        _check(built, fb, out)


def test_compiled_backend_declares_every_layout_and_both_tables_and_the_plain_one_token_major_only():
    declared = CompiledBackend.declaration()
    assert declared.kv_layouts == (AMX_PACKED, TOKEN_MAJOR, HEAD_MAJOR) and declared.reads_tables == {"token", "page"}
    plain = PlainTorchBackend.declaration()
    assert plain.kv_layouts == (TOKEN_MAJOR,) and plain.reads_tables == {"token"}
    config = hal.AttentionConfig(dtype=torch.float32, head_dim=32, tp_q_head_num=4, tp_k_head_num=2, page_size=16)
    selection = hal.select(dataclasses.replace(config, kv_layout=HEAD_MAJOR), device="cpu", backend="torch")
    assert selection.create_kv_pool(4).kv_layout == HEAD_MAJOR
    assert hal.select(config, device="cpu", backend="torch").create_kv_pool(4).kv_layout == TOKEN_MAJOR


@needs_kernels
def test_hals_pool_is_amx_packed_where_the_amx_path_reads_bf16_pages_of_32_and_token_major_elsewhere(monkeypatch):
    """Selection allocates AMX-packed pages where the amx path's tiles read them (the emulated path stands for
    it here), for bf16 pools of pages of a multiple of 32, and names why not where a config asks for them."""
    config = hal.AttentionConfig(dtype=torch.bfloat16, head_dim=64, tp_q_head_num=8, tp_k_head_num=2, page_size=32)
    path = cpu_kernels.isa()
    if path not in ("amx", "amx_emulated"):
        with pytest.raises(hal.errors.NoBackendError, match=f"through AMX tiles, which the {path} path"):
            hal.select(dataclasses.replace(config, kv_layout=AMX_PACKED), device="cpu", backend="torch")
        assert hal.select(config, device="cpu", backend="torch").kv_layout == TOKEN_MAJOR
    monkeypatch.setenv("HAL_CPU_ISA", "amx_emulated")
    assert hal.select(config, device="cpu", backend="torch").create_kv_pool(2).kv_layout == AMX_PACKED
    mla = dataclasses.replace(
        config, tp_k_head_num=1, head_dim=576, v_head_dim=512, kv_lora_rank=512, qk_rope_head_dim=64
    )
    assert isinstance(hal.select(mla, device="cpu", backend="torch").create_kv_pool(2), hal.MLAKVPool)
    for other, why in (
        (dataclasses.replace(config, page_size=16), "a multiple of 32, not 16"),
        (dataclasses.replace(config, dtype=torch.float32), "holds bf16 for AMX tiles, not fp32"),
        (dataclasses.replace(config, head_dim=80), "dim a multiple of 32, not 80"),
    ):
        assert hal.select(other, device="cpu", backend="torch").kv_layout == TOKEN_MAJOR
        with pytest.raises(hal.errors.NoBackendError, match=why):
            hal.select(dataclasses.replace(other, kv_layout=AMX_PACKED), device="cpu", backend="torch")


def test_hal_kv_layout_names_the_pools_layout_where_the_config_names_none(monkeypatch):
    config = hal.AttentionConfig(dtype=torch.float32, head_dim=32, tp_q_head_num=4, tp_k_head_num=2, page_size=16)
    monkeypatch.setenv("HAL_KV_LAYOUT", HEAD_MAJOR)
    assert hal.select(config, device="cpu", backend="torch").create_kv_pool(2).kv_layout == HEAD_MAJOR
    named = dataclasses.replace(config, kv_layout=TOKEN_MAJOR)
    assert hal.select(named, device="cpu", backend="torch").kv_layout == TOKEN_MAJOR  # the engine's pools win
    monkeypatch.setenv("HAL_KV_LAYOUT", "page_major")
    with pytest.raises(hal.errors.ConfigError, match="HAL_KV_LAYOUT.*page_major.*token_major"):
        hal.select(config, device="cpu")


def test_a_backend_reading_token_major_only_refuses_a_head_major_pool_before_writing():
    built = build(_cases(16, torch.float32)[1])
    fb = _head_major(built.batch)
    before = [t.clone() for t in fb.token_to_kv_pool.get_kv_pages(0)]
    backend = PlainTorchBackend(cpu_capability(), validate="full")
    backend.init_forward_metadata(fb)
    with pytest.raises(UnsupportedError, match="head_major.*token_major"):
        backend.forward(built.q, built.k, built.v, built.layer, fb)
    assert all(torch.equal(a, b) for a, b in zip(before, fb.token_to_kv_pool.get_kv_pages(0)))


@needs_kernels
def test_the_checked_steps_read_back_and_check_against_head_major_pages():
    """save_kv_cache=False reads nothing new (the caller wrote the pool); a layer whose heads do not match the
    pool's pages is named."""
    built = build(_cases(16, torch.float32)[1])
    fb = _head_major(built.batch)
    pool = fb.token_to_kv_pool
    pool.set_kv_buffer(built.layer, fb.out_cache_loc, built.k.view(-1, 2, 32), built.v.view(-1, 2, 32))
    backend = CompiledBackend(cpu_capability(), validate="full")
    steps_k, steps_v = backend.new_kv_from_cache(built.layer, fb)
    assert torch.equal(steps_k, built.k.view(-1, 2, 32)) and torch.equal(steps_v, built.v.view(-1, 2, 32))
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, None, None, built.layer, fb, save_kv_cache=False)
    _check(built, fb, out)
    wrong = dataclasses.replace(built.layer, tp_k_head_num=1, tp_v_head_num=1, tp_q_head_num=2)
    with pytest.raises(hal.errors.InvalidBatchError, match="KV pool's \\(2, 32, 32\\)"):
        backend.check_inputs(built.q[:, :64], built.k[:, :32], built.v[:, :32], wrong, fb)
