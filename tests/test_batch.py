"""Batches and pools: validation levels, host mirrors, zero-copy pools, device names; bad input raises
hal errors naming the field, and writes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hal
from hal.batch import ForwardBatch, ForwardMode, SpecInfo, host_lens, validate_batch
from hal.conformance.cases import CASES, build
from hal.errors import ConfigError, InvalidBatchError, KVCacheError
from hal.graph import HostReadCounter

CASE_OF_MODE = {
    ForwardMode.DECODE: "decode",
    ForwardMode.EXTEND: "extend_prefix",
    ForwardMode.TARGET_VERIFY: "verify",
}


def _fields(mode: ForwardMode, case_name: str | None = None, mirrors: bool = False) -> dict:
    built = build(next(c for c in CASES if c.name == (case_name or CASE_OF_MODE[mode])))
    fb = built.batch
    fields = {
        "forward_mode": fb.forward_mode,
        "batch_size": fb.batch_size,
        "req_pool_indices": fb.req_pool_indices,
        "seq_lens": fb.seq_lens,
        "out_cache_loc": fb.out_cache_loc,
        "req_to_token_pool": fb.req_to_token_pool,
        "token_to_kv_pool": fb.token_to_kv_pool,
    }
    if mirrors:
        fields["seq_lens_cpu"] = fb.seq_lens_cpu
    if mode.is_target_verify():
        fields["spec_info"] = fb.spec_info
    elif not mode.is_decode():
        fields.update(extend_prefix_lens=fb.extend_prefix_lens, extend_seq_lens=fb.extend_seq_lens)
        if mirrors:
            fields.update(extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu, extend_seq_lens_cpu=fb.extend_seq_lens_cpu)
    return fields


def test_host_lens_come_from_the_mirrors_or_one_read():
    fb = ForwardBatch(**_fields(ForwardMode.EXTEND), validate="full")
    assert fb.seq_lens_sum == sum(fb.seq_lens.tolist())
    assert fb.extend_start_loc.tolist() == [0, 5, 8]
    assert fb.lens.prefix == [9, 0, 20] and fb.lens.query == [5, 3, 11]
    lazy = ForwardBatch(**_fields(ForwardMode.DECODE))  # cheap, no mirrors: nothing read yet
    assert lazy.seq_lens_cpu is None and lazy._lens is None
    assert host_lens(lazy).query == [1, 1, 1, 1] and host_lens(lazy).kv == lazy.seq_lens.tolist()


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
def test_cheap_validation_reads_nothing_from_the_device(mode):
    fields = _fields(mode, mirrors=True)
    mirrors = [fields.get("seq_lens_cpu")]
    with HostReadCounter(host=mirrors) as counter:
        fb = ForwardBatch(**fields, validate="cheap")
    assert counter.reads == [] and fb.lens is not None


def test_full_validation_is_what_catches_data_errors():
    f = _fields(ForwardMode.DECODE)
    loc = f["out_cache_loc"].clone()
    loc[0] += 1
    ForwardBatch(**{**f, "out_cache_loc": loc}, validate="cheap")  # invisible without a read
    with pytest.raises(InvalidBatchError, match="out_cache_loc"):
        ForwardBatch(**{**f, "out_cache_loc": loc}, validate="full")
    ForwardBatch(**{**f, "out_cache_loc": loc}, validate="off")


def test_validation_level_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HAL_VALIDATE", "full")
    f = _fields(ForwardMode.DECODE)
    loc = f["out_cache_loc"].clone()
    loc[0] += 1
    with pytest.raises(InvalidBatchError):
        ForwardBatch(**{**f, "out_cache_loc": loc})
    monkeypatch.setenv("HAL_VALIDATE", "paranoid")
    with pytest.raises(ConfigError, match="HAL_VALIDATE"):
        ForwardBatch(**f)


def test_duplicate_slots_and_idle_tokens_are_rejected():
    f = _fields(ForwardMode.EXTEND)
    rt, row = f["req_to_token_pool"].req_to_token, int(f["req_pool_indices"][0])
    rt[row, 10] = rt[row, 9]  # two query tokens of one request share a slot
    loc = f["out_cache_loc"].clone()
    loc[1] = loc[0]
    assert "written twice" in _bad(ForwardMode.EXTEND, "out_cache_loc", loc, base=f)
    idle = {**_fields(ForwardMode.DECODE), "forward_mode": ForwardMode.IDLE, "batch_size": 0}
    idle.update(req_pool_indices=idle["req_pool_indices"][:0], seq_lens=idle["seq_lens"][:0])
    for level in ("cheap", "full"):
        with pytest.raises(InvalidBatchError, match="IDLE"):
            ForwardBatch(**idle, validate=level)
    ForwardBatch(**{**idle, "out_cache_loc": idle["out_cache_loc"][:0]}, validate="full")


def test_graph_padding_requests_pass_full_validation():
    """SGLang pads a replayed batch with row 0, slot 0 and the fill length: not a data error."""
    f = _fields(ForwardMode.DECODE)

    def pad(t, value):
        return torch.cat([t, t.new_full((2,), value)])

    padded = {
        **f,
        "batch_size": f["batch_size"] + 2,
        "req_pool_indices": pad(f["req_pool_indices"], 0),
        "seq_lens": pad(f["seq_lens"], 1),
        "out_cache_loc": pad(f["out_cache_loc"], 0),
    }
    validate_batch(ForwardBatch(**padded, validate="off"), "full")


def test_an_engines_own_batch_object_is_validated_by_field_names():
    class EngineBatch:  # no hal class: just SGLang's field names
        pass

    engine = EngineBatch()
    for name, value in _fields(ForwardMode.EXTEND, mirrors=True).items():
        setattr(engine, name, value)
    engine.spec_info = None
    assert validate_batch(engine, "full").query == [5, 3, 11]
    engine.extend_seq_lens_cpu = [5, 3, 10]
    with pytest.raises(InvalidBatchError, match="extend_prefix_lens"):
        validate_batch(engine, "cheap")


def test_pool_and_table_checks_answer_as_isinstance_does():
    """validate_batch's protocol checks (hal.kv_cache.conforms) accept and refuse exactly what isinstance does."""
    from types import SimpleNamespace

    from hal.kv_cache import KVPool, ReqToPageTable, ReqToTokenTable, conforms

    pool_members = dict(page_size=16, dtype=torch.float32, get_value_buffer=len, get_kv_buffer=len, set_kv_buffer=len)
    candidates = [
        hal.PagedKVPool(4, 16, 1, 2, 8),
        hal.ReqToTokenPool(4, 64),
        SimpleNamespace(get_key_buffer=len, **pool_members),
        SimpleNamespace(get_key_buffer=None, **pool_members),  # a method member set to None
        SimpleNamespace(**pool_members),  # one member missing
        SimpleNamespace(req_to_token=None),
        SimpleNamespace(req_to_page=torch.zeros(1, 1), page_size=16),
        None,
        3,
    ]
    for protocol in (KVPool, ReqToTokenTable, ReqToPageTable):
        assert [conforms(c, protocol) for c in candidates] == [isinstance(c, protocol) for c in candidates]
    assert conforms(candidates[0], KVPool) and not conforms(candidates[4], KVPool)


def _bad(mode, field, value, base: dict | None = None, level: str = "full"):
    fields = {**(base or _fields(mode)), field: value}
    with pytest.raises(InvalidBatchError) as info:
        ForwardBatch(**fields, validate=level)
    return str(info.value)


def test_mismatched_prefix_and_extend():
    f = _fields(ForwardMode.EXTEND)
    msg = _bad(ForwardMode.EXTEND, "extend_seq_lens", f["extend_seq_lens"] + 1)
    assert "extend_prefix_lens + extend_seq_lens" in msg and "seq_lens" in msg


def test_wrong_lengths_and_dtypes_are_named():
    f = _fields(ForwardMode.DECODE)
    assert "len(seq_lens)" in _bad(ForwardMode.DECODE, "seq_lens", f["seq_lens"][:-1])
    assert "req_pool_indices" in _bad(ForwardMode.DECODE, "req_pool_indices", f["req_pool_indices"].float())
    assert "batch_size" in _bad(ForwardMode.DECODE, "batch_size", -1)
    assert "forward_mode" in _bad(ForwardMode.DECODE, "forward_mode", "decode")
    assert "seq_lens" in _bad(ForwardMode.DECODE, "seq_lens", torch.zeros_like(f["seq_lens"]))


def test_out_of_range_rows_and_lengths():
    f = _fields(ForwardMode.DECODE)
    rows = f["req_pool_indices"].clone()
    rows[0] = 10_000
    assert "req_pool_indices" in _bad(ForwardMode.DECODE, "req_pool_indices", rows)
    long = f["seq_lens"].clone()
    long[0] = f["req_to_token_pool"].max_context_len + 1
    msg = _bad(ForwardMode.DECODE, "seq_lens_cpu", long, base={**f, "seq_lens": long}, level="cheap")
    assert "max_context_len" in msg


def test_out_cache_loc_must_match_req_to_token():
    f = _fields(ForwardMode.DECODE)
    loc = f["out_cache_loc"].clone()
    loc[0] += 1
    msg = _bad(ForwardMode.DECODE, "out_cache_loc", loc)
    assert "out_cache_loc" in msg and "req_to_token" in msg


def test_slots_outside_the_pool_are_caught_before_a_kernel_sees_them():
    f = _fields(ForwardMode.EXTEND)
    rt = f["req_to_token_pool"]
    row = int(f["req_pool_indices"][0])
    rt.req_to_token[row, 0] = f["token_to_kv_pool"].num_slots + 5  # a prefix slot past the pool
    msg = _bad(ForwardMode.EXTEND, "forward_mode", ForwardMode.EXTEND, base=f)
    assert "req_to_token slots" in msg


def test_verify_needs_a_mask_of_the_right_size():
    f = _fields(ForwardMode.TARGET_VERIFY)
    spec = f["spec_info"]
    assert "spec_info" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", None)
    short = SpecInfo(spec.draft_token_num, spec.custom_mask[:-1])
    assert "custom_mask" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", short)
    padded = SpecInfo(spec.draft_token_num, torch.cat([spec.custom_mask, spec.custom_mask[:7]]))
    ForwardBatch(**{**f, "spec_info": padded}, validate="full")  # SGLang may pad the mask: the tail is ignored
    as_int = SpecInfo(spec.draft_token_num, spec.custom_mask.int())
    assert "custom_mask" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", as_int)
    assert "draft_token_num" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", SpecInfo(0, spec.custom_mask))


def test_given_host_mirrors_are_checked():
    f = _fields(ForwardMode.EXTEND)
    assert "extend_seq_lens_cpu" in _bad(ForwardMode.EXTEND, "extend_seq_lens_cpu", [1, 1, 1])
    with_mirrors = _fields(ForwardMode.EXTEND, mirrors=True)
    cheap = _bad(ForwardMode.EXTEND, "extend_seq_lens_cpu", [1, 1, 1], base=with_mirrors, level="cheap")
    assert "extend_prefix_lens + extend_seq_lens" in cheap
    assert "seq_lens_sum" in _bad(ForwardMode.EXTEND, "seq_lens_sum", 1)
    assert "extend_num_tokens" in _bad(ForwardMode.EXTEND, "extend_num_tokens", 2)
    assert "extend_start_loc" in _bad(ForwardMode.EXTEND, "extend_start_loc", f["extend_seq_lens"])


def test_set_kv_buffer_rejects_bad_slots_and_writes_nothing():
    pool = hal.PagedKVPool(4, 16, 2, 2, 8)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    k = torch.ones(2, 2, 8)
    for loc, field in (
        (torch.tensor([16, pool.num_slots]), "loc range"),
        (torch.tensor([16, -2]), "loc range"),  # -1 is a padding token (tests/test_padding_slots.py)
        (torch.tensor([[16, 17]]), "loc"),
        (torch.tensor([16.0, 17.0]), "loc"),
    ):
        with pytest.raises(KVCacheError, match=field):
            pool.set_kv_buffer(0, loc, k, k)
    with pytest.raises(KVCacheError, match="cache_k.shape"):
        pool.set_kv_buffer(0, torch.tensor([16, 17]), torch.ones(2, 3, 8), k)
    with pytest.raises(KVCacheError, match="layer_id"):
        pool.set_kv_buffer(2, torch.tensor([16, 17]), k, k)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))
    pool.set_kv_buffer(1, torch.tensor([16, 17]), k.double(), k)  # cast to the pool dtype
    assert pool.k_buffer[1][16:18].eq(1).all() and pool.k_buffer[1].dtype == torch.float32


def test_paged_view_is_the_same_memory():
    pool = hal.PagedKVPool(3, 16, 1, 2, 8)
    k_pages, _ = pool.get_paged_kv_buffer(0)
    assert k_pages.shape == (4, 16, 2, 8)
    pool.set_kv_buffer(0, torch.tensor([37]), torch.full((1, 2, 8), 5.0), torch.zeros(1, 2, 8))
    assert k_pages[37 // 16, 37 % 16].eq(5).all()


def test_pool_constructors_validate():
    with pytest.raises(KVCacheError, match="page_size"):
        hal.PagedKVPool(4, 12, 1, 2, 8)
    with pytest.raises(KVCacheError, match="max_context_len"):
        hal.ReqToTokenPool(4, 0)
    pool = hal.ReqToTokenPool(2, 8)
    with pytest.raises(KVCacheError, match="token range"):
        pool.write(1, 4, torch.arange(5))
    with pytest.raises(KVCacheError, match="req_index"):
        pool.write(3, 0, torch.arange(2))
    with pytest.raises(KVCacheError, match="padding row"):
        pool.write(0, 0, torch.arange(2))
    assert pool.req_to_token.shape == (3, 8)  # SGLang's layout: size usable rows after the padding row


@pytest.mark.parametrize(
    "field, value",
    [("tp_q_head_num", 6), ("tp_k_head_num", 0), ("sliding_window_size", -2), ("logit_cap", -1.0), ("attn_type", "x")],
)
def test_layer_fields_are_validated(field, value):
    good = {"layer_id": 0, "tp_q_head_num": 8, "tp_k_head_num": 4, "head_dim": 16}
    with pytest.raises(ConfigError, match=field if field != "tp_q_head_num" else "multiple"):
        hal.AttentionLayer(**{**good, field: value})


def test_layer_defaults():
    layer = hal.AttentionLayer(0, 8, 2, 64)
    assert layer.scaling == 64**-0.5 and layer.v_head_dim == 64 and layer.tp_v_head_num == 2
    assert layer.causal and layer.group_size == 4
    assert not dataclasses.replace(layer, is_cross_attention=True).causal


def test_page_alignment_is_checked_only_for_backends_that_need_it():
    """Paged kernels read token i at offset i % page_size of its page: a shuffled page is refused for them."""
    f = _fields(ForwardMode.EXTEND, "extend_prefix_page16")
    row = int(f["req_pool_indices"][0])
    rt = f["req_to_token_pool"].req_to_token
    rt[row, [0, 1]] = rt[row, [1, 0]]  # two prefix tokens swap places inside their page
    fb = ForwardBatch(**f, validate="full")  # the torch and triton backends read slot by slot: fine
    with pytest.raises(InvalidBatchError, match=r"offset i % page_size"):
        validate_batch(fb, "full", page_aligned=True)


def test_the_padding_page_holds_no_request_tokens():
    f = _fields(ForwardMode.EXTEND, "extend_prefix_page16")
    row = int(f["req_pool_indices"][0])
    f["req_to_token_pool"].req_to_token[row, :16] = torch.arange(16)  # the prefix's first page = page 0
    with pytest.raises(InvalidBatchError, match="page 0"):
        ForwardBatch(**f, validate="full")


def test_pool_dtype_and_dims_are_checked():
    with pytest.raises(KVCacheError, match="dtype"):
        hal.PagedKVPool(4, 16, 1, 2, 8, dtype=torch.int8)
    with pytest.raises(KVCacheError, match="v_head_dim"):
        hal.PagedKVPool(4, 16, 1, 2, 8, v_head_dim=-3)
    with pytest.raises(KVCacheError, match="slots"):
        hal.ReqToTokenPool(2, 8).write(1, 0, [1, 2])
    with pytest.raises(ConfigError, match="logit_cap"):
        hal.AttentionLayer(0, 8, 4, 16, logit_cap=None)


def test_pools_wrap_an_engines_tensors_without_a_copy():
    k = [torch.randn(64, 2, 8) for _ in range(3)]
    v = [torch.randn(64, 2, 4) for _ in range(3)]
    pool = hal.PagedKVPool.from_buffers(k, v, page_size=16, start_layer=5)  # a pipeline stage: layers 5..7
    assert pool.get_key_buffer(6).data_ptr() == k[1].data_ptr() and pool.v_head_dim == 4
    assert (pool.layer_num, pool.head_num, pool.num_pages, pool.num_slots) == (3, 2, 3, 64)
    pool.set_kv_buffer(7, torch.tensor([20]), torch.ones(1, 2, 8), torch.ones(1, 2, 4))
    assert k[2][20].eq(1).all()
    with pytest.raises(KVCacheError, match=r"layer_id.*\[5, 8\)"):
        pool.get_key_buffer(0)
    with pytest.raises(KVCacheError, match="num_slots"):
        hal.PagedKVPool.from_buffers([torch.zeros(40, 2, 8)], [torch.zeros(40, 2, 8)], page_size=16)
    with pytest.raises(KVCacheError, match="k_buffers"):
        hal.PagedKVPool.from_buffers([torch.zeros(64, 2, 8), torch.zeros(64, 3, 8)], v[:2], page_size=16)
    table = torch.zeros(4, 32, dtype=torch.int32)
    req = hal.ReqToTokenPool.from_tensor(table)
    assert req.req_to_token is table and (req.size, req.max_context_len) == (3, 32)
    with pytest.raises(KVCacheError, match="req_to_token"):
        hal.ReqToTokenPool.from_tensor(table.long())


def test_large_host_pools_ask_for_huge_pages(monkeypatch):
    """A host pool of 4 MiB or more madvises the whole huge pages inside each buffer before zeroing it;
    HAL_KV_HUGE_PAGES=0 (and a small pool) leaves the pages alone; another value is refused by name, whatever the
    pool's size."""
    from hal import kv_cache

    calls = []

    class FakeLibc:
        def madvise(self, addr, length, advice):
            calls.append((addr.value, length.value, advice))
            return 0

    monkeypatch.setattr(kv_cache, "_libc", FakeLibc)
    monkeypatch.setattr(kv_cache.sys, "platform", "linux")
    huge = 2 << 20
    pool = hal.PagedKVPool(1023, 16, 1, 8, 128, dtype=torch.bfloat16)  # 1024 * 16 slots x 2 KiB: 32 MiB a buffer
    buffers = pool.k_buffer + pool.v_buffer
    assert len(calls) == len(buffers) and all(buf.eq(0).all() for buf in buffers)
    for buf, (start, length, advice) in zip(buffers, calls):
        end = buf.data_ptr() + buf.numel() * buf.element_size()
        assert advice == 14 and start % huge == 0 and length % huge == 0 and length > 0
        assert buf.data_ptr() <= start and start + length <= end and end - (start + length) < huge
    calls.clear()
    monkeypatch.setenv("HAL_KV_HUGE_PAGES", "0")
    hal.PagedKVPool(1023, 16, 1, 8, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("HAL_KV_HUGE_PAGES", "1")
    hal.PagedKVPool(4, 16, 1, 2, 8)  # 5 KiB
    assert calls == []
    monkeypatch.setenv("HAL_KV_HUGE_PAGES", "yes")
    with pytest.raises(ConfigError, match="HAL_KV_HUGE_PAGES"):
        hal.PagedKVPool(1023, 16, 1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="HAL_KV_HUGE_PAGES"):  # a pool too small for huge pages too
        hal.PagedKVPool(4, 16, 1, 2, 8)


def test_devices_are_normalised():
    assert hal.resolve_device("cpu:0") == torch.device("cpu") == hal.resolve_device(torch.device("cpu"))
    pool = hal.PagedKVPool(2, 16, 1, 2, 8, device="cpu:0")
    req = hal.ReqToTokenPool(2, 8, device="cpu:0")
    assert pool.device == req.device == torch.device("cpu") == pool.k_buffer[0].device
    with pytest.raises(ConfigError, match="device"):
        hal.resolve_device("gpu-ish")


def test_a_mixed_batch_splits_into_its_extends_and_its_decodes_over_the_same_pool():
    """sub_batch takes a MIXED batch's extends (EXTEND) or decodes (DECODE): each part alone over the mixed
    batch's pool attends as the mixed batch did for those requests (what the bench times a mixed call against)."""
    from hal.conformance.builder import sub_batch
    from hal.conformance.case import Case
    from hal.kernels import reference

    built = build(Case("mixed", ForwardMode.MIXED, ((5, 7), (9, 4), (12, 1), (3, 1), (30, 1))))
    k_pool, v_pool = built.expected_k, built.expected_v  # the pool with every new token written
    for requests, mode in (([0, 1], ForwardMode.EXTEND), ([2, 3, 4], ForwardMode.DECODE)):
        fb, q, _, _, tokens = sub_batch(built, requests, mode)
        assert fb.forward_mode == mode and fb.batch_size == len(requests)
        assert len(tokens) == sum(built.case.requests[r][1] for r in requests)
        out = reference.batch_attention(q, k_pool, v_pool, built.layer, fb, acc_dtype=torch.float64)
        torch.testing.assert_close(out, built.expected[tokens], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [0, -16, 1.5])
def test_a_case_with_no_pages_is_refused_where_it_is_made(page_size):
    from hal.conformance import Case

    with pytest.raises(ConfigError, match=f"case bad: page_size = {page_size!r}: expected an int of at least 1"):
        Case("bad", ForwardMode.DECODE, ((3, 1),), page_size=page_size)
    with pytest.raises(ConfigError, match="layer_id 2 is not a layer of its pool"):
        Case("bad", ForwardMode.DECODE, ((3, 1),), layer_id=2)
