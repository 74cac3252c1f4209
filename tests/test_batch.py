"""Bad input: ForwardBatch, pools and layers raise hal errors naming the field, and write nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hal
from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.conformance.cases import CASES, build
from hal.errors import ConfigError, InvalidBatchError, KVCacheError

CASE_OF_MODE = {
    ForwardMode.DECODE: "decode",
    ForwardMode.EXTEND: "extend_prefix",
    ForwardMode.TARGET_VERIFY: "verify",
}


def _fields(mode: ForwardMode, case_name: str | None = None) -> dict:
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
    if mode.is_target_verify():
        fields["spec_info"] = fb.spec_info
    elif not mode.is_decode():
        fields.update(extend_prefix_lens=fb.extend_prefix_lens, extend_seq_lens=fb.extend_seq_lens)
    return fields


def test_valid_batches_get_their_host_mirrors():
    fb = ForwardBatch(**_fields(ForwardMode.EXTEND))
    assert fb.seq_lens_cpu.tolist() == fb.seq_lens.tolist()
    assert fb.seq_lens_sum == sum(fb.seq_lens.tolist())
    assert fb.extend_start_loc.tolist() == [0, 5, 8]
    assert fb.prefix_lens_cpu == [9, 0, 20] and fb.query_lens_cpu == [5, 3, 11]
    decode = ForwardBatch(**_fields(ForwardMode.DECODE))
    assert decode.query_lens_cpu == [1, 1, 1, 1] and decode.kv_lens_cpu == decode.seq_lens.tolist()


def _bad(mode, field, value, base: dict | None = None):
    fields = {**(base or _fields(mode)), field: value}
    with pytest.raises(InvalidBatchError) as info:
        ForwardBatch(**fields)
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
    msg = _bad(ForwardMode.DECODE, "seq_lens", long)
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
    as_int = SpecInfo(spec.draft_token_num, spec.custom_mask.int())
    assert "custom_mask" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", as_int)
    assert "draft_token_num" in _bad(ForwardMode.TARGET_VERIFY, "spec_info", SpecInfo(0, spec.custom_mask))


def test_given_host_mirrors_are_checked():
    f = _fields(ForwardMode.EXTEND)
    assert "extend_seq_lens_cpu" in _bad(ForwardMode.EXTEND, "extend_seq_lens_cpu", [1, 1, 1])
    assert "seq_lens_sum" in _bad(ForwardMode.EXTEND, "seq_lens_sum", 1)
    assert "extend_num_tokens" in _bad(ForwardMode.EXTEND, "extend_num_tokens", 2)
    assert "extend_start_loc" in _bad(ForwardMode.EXTEND, "extend_start_loc", f["extend_seq_lens"])


def test_set_kv_buffer_rejects_bad_slots_and_writes_nothing():
    pool = hal.PagedKVPool(4, 16, 2, 2, 8)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    k = torch.ones(2, 2, 8)
    for loc, field in (
        (torch.tensor([16, pool.num_slots]), "loc range"),
        (torch.tensor([16, -1]), "loc range"),
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
        pool.write(0, 4, torch.arange(5))
    with pytest.raises(KVCacheError, match="req_index"):
        pool.write(2, 0, torch.arange(2))


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


def test_tokens_must_sit_at_their_page_offset():
    """Paged kernels read token i at offset i % page_size of its page: a shuffled page is refused."""
    f = _fields(ForwardMode.EXTEND, "extend_prefix_page16")
    row = int(f["req_pool_indices"][0])
    rt = f["req_to_token_pool"].req_to_token
    rt[row, [0, 1]] = rt[row, [1, 0]]  # two prefix tokens swap places inside their page
    with pytest.raises(InvalidBatchError, match=r"offset i % page_size"):
        ForwardBatch(**f)


def test_the_padding_page_holds_no_request_tokens():
    f = _fields(ForwardMode.EXTEND, "extend_prefix_page16")
    row = int(f["req_pool_indices"][0])
    f["req_to_token_pool"].req_to_token[row, :16] = torch.arange(16)  # the prefix's first page = page 0
    with pytest.raises(InvalidBatchError, match="page 0"):
        ForwardBatch(**f)


def test_pool_dtype_and_dims_are_checked():
    with pytest.raises(KVCacheError, match="dtype"):
        hal.PagedKVPool(4, 16, 1, 2, 8, dtype=torch.int8)
    with pytest.raises(KVCacheError, match="v_head_dim"):
        hal.PagedKVPool(4, 16, 1, 2, 8, v_head_dim=-3)
    with pytest.raises(KVCacheError, match="slots"):
        hal.ReqToTokenPool(2, 8).write(0, 0, [1, 2])
    with pytest.raises(ConfigError, match="logit_cap"):
        hal.AttentionLayer(0, 8, 4, 16, logit_cap=None)
