"""hal.kernels.npu: the torch_npu wrappers over the CPU emulation, checked against the reference."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
import types

import pytest
import torch

from hal.kernels import reference
from hal.kernels.npu import (
    OP_NAMES,
    buffer_pages,
    emulation,
    fia_causal_mask,
    is_emulation,
    load_torch_npu,
    ops,
    paged_decode,
    paged_mixed,
    paged_prefill,
    resolve_ops,
    splitfuse_mask,
    unsupported_reasons,
    write_kv,
)
from hal.kernels.npu import block_tables as make_block_tables

NPU = emulation.torch_npu
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class Case:
    """A paged KV pool holding a batch: prefix K/V in place, new K/V written through ``write_kv``."""

    def __init__(self, q_lens, kv_lens, q_heads, kv_heads, head_dim, block_size, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.block_size, self.dtype = block_size, dtype
        batch = len(q_lens)
        blocks_per_req = [math.ceil(n / block_size) for n in kv_lens]
        self.max_blocks = max(blocks_per_req)
        num_blocks = sum(blocks_per_req) + 3  # page 0 stays reserved, as in hal's pool
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.block_table = torch.zeros(batch, self.max_blocks, dtype=torch.int32)
        for r, n in enumerate(blocks_per_req):
            self.block_table[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        cols = torch.arange(self.max_blocks * block_size)
        self.req_to_token = (self.block_table.long()[:, cols // block_size] * block_size + cols % block_size).int()
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.k_buf = torch.randn(shape, generator=g).to(dtype)
        self.v_buf = torch.randn(shape, generator=g).to(dtype)
        self.k_cache, self.v_cache = buffer_pages(self.k_buf, block_size), buffer_pages(self.v_buf, block_size)
        pairs = enumerate(zip(q_lens, kv_lens, strict=True))
        self.slots = torch.cat([self.req_to_token[r, n - s : n].long() for r, (s, n) in pairs])
        self.k_buf[self.slots] = float("nan")  # the new tokens must come from write_kv
        self.v_buf[self.slots] = float("nan")
        total = sum(q_lens)
        self.new_k = torch.randn(total, kv_heads, head_dim, generator=g)  # float32: write_kv casts
        self.new_v = torch.randn(total, kv_heads, head_dim, generator=g)
        self.q = torch.randn(total, q_heads, head_dim, generator=g).to(dtype)
        self.scale = head_dim**-0.5
        write_kv(NPU, self.new_k, self.new_v, self.k_cache, self.v_cache, self.slots)

    def reference(self, **kwargs):
        return reference.paged_attention(
            self.q,
            self.k_buf,
            self.v_buf,
            self.req_to_token,
            torch.arange(len(self.q_lens)),
            torch.tensor(self.kv_lens),
            torch.tensor(self.q_lens),
            scale=self.scale,
            **kwargs,
        )


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(8, 2, id="gqa")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# ----------------------------------------------------------------------------- loading


def test_emulated_namespace_has_the_real_op_names():
    assert is_emulation(NPU)
    for name in OP_NAMES:
        assert callable(getattr(NPU, name))
    assert not is_emulation(types.SimpleNamespace())


def test_load_torch_npu_reasons(monkeypatch):
    real_find_spec = importlib.util.find_spec

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch_npu" else real_find_spec(n))
    assert load_torch_npu() == (None, "torch_npu not installed")
    used, why = resolve_ops()
    assert used is NPU and "torch_npu not installed" in why
    assert resolve_ops(allow_emulation=False) == (None, "torch_npu not installed")

    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torch_npu" else real_find_spec(n))
    real_import = importlib.import_module

    def broken(name, *args):
        if name == "torch_npu":
            raise OSError("libascendcl.so: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", broken)
    module, why = load_torch_npu()
    assert module is None
    assert why.startswith("torch_npu failed to import (CANN libraries missing?): OSError: libascendcl.so")

    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.1.0"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert load_torch_npu()[1] == f"torch_npu 2.1.0 lacks {', '.join(OP_NAMES)} (too old for hal's Ascend backend)"
    for name in OP_NAMES:
        setattr(fake, name, getattr(NPU, name))
    fake.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    assert load_torch_npu() == (None, "no NPU device visible (torch_npu.npu.is_available() is False)")
    fake.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
    assert load_torch_npu() == (fake, "")
    assert resolve_ops() == (fake, "")


# ----------------------------------------------------------------------------- write_kv


def test_write_kv_matches_reference_and_skips_negative_slots():
    g = torch.Generator().manual_seed(1)
    k_buf = torch.randn(6 * 16, 2, 32, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(6 * 16, 2, 32, generator=g).to(torch.bfloat16)
    k, v = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([17, 3, -1, 94, 40])  # int64, as SGLang's out_cache_loc
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    keep = slots >= 0
    reference.write_kv(k_ref, v_ref, slots[keep], k[keep], v[keep])
    write_kv(NPU, k, v, buffer_pages(k_buf, 16), buffer_pages(v_buf, 16), slots)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    assert torch.equal(buffer_pages(k_buf, 16)[94 // 16, 94 % 16], k[3].to(torch.bfloat16))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_decode_matches_reference(block_size, q_heads, kv_heads, dtype):
    kv_lens = [1, 17, block_size, 2 * block_size + 3, 5]
    case = Case([1] * 5, kv_lens, q_heads, kv_heads, 32, block_size, dtype, seed=block_size + q_heads)
    out = torch.full_like(case.q, float("nan"))
    got = paged_decode(NPU, case.q, case.k_cache, case.v_cache, case.block_table, kv_lens, scale=case.scale, out=out)
    assert got is out and got.dtype == dtype and got.shape == (5, q_heads, 32)
    torch.testing.assert_close(got, case.reference(), **TOL[dtype])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", HEADS)
def test_paged_prefill_matches_reference(q_heads, kv_heads, dtype, causal):
    q_lens, kv_lens = [5, 1, 37, 130], [5, 20, 140, 300]  # fresh prefill, decode-like, prefix + new
    case = Case(q_lens, kv_lens, q_heads, kv_heads, 128, 128, dtype, seed=q_heads)
    got = paged_prefill(
        NPU,
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_table,
        q_lens,
        kv_lens,
        scale=case.scale,
        causal=causal,
    )
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got, case.reference(causal=causal), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_mixed_matches_reference(block_size, q_heads, kv_heads, dtype):
    q_lens = [1, 9, 1, 40, 3]  # decodes and chunked prefills, one without a prefix
    kv_lens = [33, 9, 1, 40 + block_size, 3 + 2 * block_size]
    case = Case(q_lens, kv_lens, q_heads, kv_heads, 32, block_size, dtype, seed=7 + block_size)
    got = paged_mixed(
        NPU,
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_table,
        torch.tensor(q_lens),
        kv_lens,
        scale=case.scale,
    )
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got, case.reference(), **TOL[dtype])


def test_paged_mixed_carries_window_custom_mask_and_non_causal():
    q_lens, kv_lens = [1, 6, 4], [20, 6, 25]
    case = Case(q_lens, kv_lens, 4, 2, 32, 16, torch.float32, seed=3)
    args = (NPU, case.q, case.k_cache, case.v_cache, case.block_table, q_lens, kv_lens)
    got = paged_mixed(*args, scale=case.scale, sliding_window=4)
    torch.testing.assert_close(got, case.reference(sliding_window=4), **TOL[torch.float32])
    got = paged_mixed(*args, scale=case.scale, causal=False)
    torch.testing.assert_close(got, case.reference(causal=False), **TOL[torch.float32])
    g = torch.Generator().manual_seed(5)
    parts = []
    for s, n in zip(q_lens, kv_lens, strict=True):
        m = torch.rand(s, n, generator=g) < 0.5
        m[torch.arange(s), torch.arange(n - s, n)] = True  # each token sees itself
        parts.append(m.flatten())
    custom = torch.cat(parts)
    got = paged_mixed(*args, scale=case.scale, custom_mask=custom)
    torch.testing.assert_close(got, case.reference(custom_mask=custom), **TOL[torch.float32])


def test_fia_contiguous_tnd_uses_cumulative_kv_lengths_and_returns_lse():
    q_lens, kv_lens = [3, 1, 16], [3, 9, 20]
    case = Case(q_lens, kv_lens, 4, 2, 128, 128, torch.float32, seed=11)
    mask = fia_causal_mask("cpu")
    common = dict(
        atten_mask=mask,
        input_layout="TND",
        actual_seq_lengths=list(itertools.accumulate(q_lens)),
        num_heads=4,
        num_key_value_heads=2,
        scale=case.scale,
        sparse_mode=3,
        softmax_lse_flag=True,
    )
    key = torch.cat([case.k_buf[case.req_to_token[r, :n].long()] for r, n in enumerate(kv_lens)])
    value = torch.cat([case.v_buf[case.req_to_token[r, :n].long()] for r, n in enumerate(kv_lens)])
    out, lse = NPU.npu_fused_infer_attention_score(
        case.q, key, value, actual_seq_lengths_kv=list(itertools.accumulate(kv_lens)), **common
    )
    torch.testing.assert_close(out, case.reference(), **TOL[torch.float32])
    assert lse.shape == (sum(q_lens), 4, 1) and lse.dtype == torch.float32
    # LSE of request 2's last token (sees all 20 keys), head 3 (kv head 1), computed directly.
    k = case.k_buf[case.req_to_token[2, :20].long(), 1]
    expected = torch.logsumexp(k @ case.q[-1, 3] * case.scale, dim=0)
    torch.testing.assert_close(lse[-1, 3, 0], expected)
    paged_out, paged_lse = NPU.npu_fused_infer_attention_score(
        case.q,
        case.k_cache.view(case.k_cache.shape[0], 128, -1),
        case.v_cache.view(case.v_cache.shape[0], 128, -1),
        block_table=case.block_table,
        block_size=128,
        actual_seq_lengths_kv=kv_lens,
        **common,
    )
    torch.testing.assert_close(paged_out, out)
    torch.testing.assert_close(paged_lse, lse)
    _, no_lse = NPU.npu_fused_infer_attention_score(
        case.q,
        key,
        value,
        actual_seq_lengths_kv=list(itertools.accumulate(kv_lens)),
        **{**common, "softmax_lse_flag": False},
    )
    assert no_lse.shape == (1,) and no_lse.item() == 0


def test_fia_accepts_the_heads_major_paged_layout():
    q_lens, kv_lens = [2, 7], [130, 7]
    case = Case(q_lens, kv_lens, 4, 2, 128, 128, torch.float32, seed=2)
    out, _ = NPU.npu_fused_infer_attention_score(
        case.q,
        case.k_cache.permute(0, 2, 1, 3).contiguous(),  # (blocknum, KV_N, blocksize, D)
        case.v_cache.permute(0, 2, 1, 3).contiguous(),
        atten_mask=fia_causal_mask("cpu"),
        block_table=case.block_table,
        input_layout="TND",
        block_size=128,
        actual_seq_lengths=[2, 9],
        actual_seq_lengths_kv=kv_lens,
        num_heads=4,
        num_key_value_heads=2,
        scale=case.scale,
        sparse_mode=3,
    )
    torch.testing.assert_close(out, case.reference(), **TOL[torch.float32])


# ----------------------------------------------------------------------------- masks and helpers


def test_splitfuse_mask_rows_are_vllm_ascend_rows():
    q_lens, kv_lens = [1, 3, 2], [4, 3, 6]
    positions = [3, 0, 1, 2, 4, 5]
    width = max(kv_lens)
    flag = torch.ones(8, 8, dtype=torch.bool).triu_(1)  # vllm-ascend's upper-triangle flag
    for dtype, value in ((torch.bfloat16, -10000.0), (torch.float16, float("-inf"))):
        expected = torch.zeros(8, 8).masked_fill(flag, value)[positions, :width].to(dtype)
        mask = splitfuse_mask(q_lens, kv_lens, dtype, "cpu")
        assert mask.dtype == dtype and torch.equal(mask, expected)
    windowed = splitfuse_mask(q_lens, kv_lens, torch.float32, "cpu", sliding_window=1)
    assert (windowed[4] == 0).tolist() == [False, False, False, True, True, False]


def test_fia_causal_mask_and_block_tables():
    mask = fia_causal_mask("cpu")
    assert mask is fia_causal_mask(torch.device("cpu"))
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert mask[0, 1] == 1 and mask[1, 1] == 0 and mask[2047, 0] == 0
    case = Case([1, 1], [40, 17], 4, 4, 32, 16, torch.float32)
    table = make_block_tables(case.req_to_token, torch.tensor([1, 0]), 16, case.max_blocks)
    assert table.dtype == torch.int32
    assert torch.equal(table, case.block_table[[1, 0]])


# ----------------------------------------------------------------------------- rejected inputs


@pytest.fixture(scope="module")
def decode_case():
    return Case([1, 1, 1], [5, 40, 17], 4, 2, 32, 16, torch.float32, seed=9)


def _decode(case, **override):
    kwargs = dict(
        query=case.q,
        key_cache=case.k_cache,
        value_cache=case.v_cache,
        num_kv_heads=2,
        num_heads=4,
        scale_value=case.scale,
        block_table=case.block_table,
        context_lens=torch.tensor(case.kv_lens, dtype=torch.int32),
        out=torch.empty_like(case.q),
    )
    kwargs.update(override)
    NPU._npu_paged_attention(**kwargs)
    return kwargs["out"]


def test_decode_rejects_bad_inputs(decode_case):
    c = decode_case
    torch.testing.assert_close(_decode(c), c.reference(), **TOL[torch.float32])
    with pytest.raises(ValueError, match=r"block_table = .*int64.*expected dtype int32"):
        _decode(c, block_table=c.block_table.long())
    with pytest.raises(TypeError, match=r"context_lens = \[5, 40, 17\]: expected a torch.Tensor .*host data"):
        _decode(c, context_lens=c.kv_lens)
    with pytest.raises(ValueError, match=r"context_lens = .*int64.*expected dtype int32"):
        _decode(c, context_lens=torch.tensor(c.kv_lens))
    with pytest.raises(ValueError, match=r"context_lens = .*shape=\[2\].*expected shape \[batch\] = \[3\]"):
        _decode(c, context_lens=torch.tensor([5, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key_cache = .*shape=\[.*, 2, 32\].*expected a 4-D tensor"):
        _decode(c, key_cache=c.k_buf)
    with pytest.raises(ValueError, match=r"key_cache = .*expected 2 kv heads in dim 2"):
        _decode(c, key_cache=c.k_cache.transpose(1, 2), value_cache=c.v_cache.transpose(1, 2))
    with pytest.raises(ValueError, match=r"block_table = .*expected >= 3 columns"):
        _decode(c, block_table=c.block_table[:, :2].contiguous())
    with pytest.raises(ValueError, match=r"block_table\[0\] = \[10000\]: expected block ids in \[0, 9\)"):
        _decode(c, block_table=c.block_table.clone().fill_(10_000))
    with pytest.raises(ValueError, match=r"out = .*bfloat16.*: the op's contract says out: .* in query's dtype"):
        _decode(c, out=torch.empty_like(c.q, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"num_kv_heads = 3: expected a divisor of num_heads = 4"):
        _decode(c, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_heads = 8: expected the query's head count 4"):
        _decode(c, num_heads=8)
    meta_lens = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match=r"context_lens = Tensor\(device=meta\): expected host lengths"):
        paged_decode(NPU, c.q, c.k_cache, c.v_cache, c.block_table, meta_lens, scale=c.scale)


def test_atb_cache_shape_limits():
    q = torch.randn(1, 2, 256)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    big = torch.zeros(2, 128, 2, 256)  # head_size * block_size = 32768: parallel decoding (splitfuse) refuses it
    mask = torch.zeros(1, 128)
    with pytest.raises(ValueError, match=r"head_size \* block_size = 32768: expected <= 128 \* 128"):
        NPU._npu_paged_attention_splitfuse(
            query=q, key_cache=big, value_cache=big, block_table=table, context_lens=lens, mask=mask,
            seq_len=torch.tensor([1], dtype=torch.int32), num_kv_heads=2, num_heads=2, scale_value=1.0,
            out=torch.empty_like(q),
        )  # fmt: skip
    NPU._npu_paged_attention(q, big, big, 2, 2, 1.0, table, lens, torch.empty_like(q))  # plain decode takes it
    odd = torch.zeros(2, 24, 2, 256)
    with pytest.raises(ValueError, match=r"block_size \(key_cache dim 1\) = 24: expected a multiple of 16"):
        NPU._npu_paged_attention(q, odd, odd, 2, 2, 1.0, table, lens, torch.empty_like(q))


def test_reshape_and_cache_rejects_bad_inputs():
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    k = torch.ones(3, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"slot_indices = .*int64.*expected dtype int32"):
        NPU._npu_reshape_and_cache(k, k, cache, cache.clone(), slots.long())
    with pytest.raises(ValueError, match=r"key = .*float32.*expected dtype torch.bfloat16 .*does not cast"):
        NPU._npu_reshape_and_cache(k.float(), k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"expected no repeated slot"):
        NPU._npu_reshape_and_cache(k, k, cache, cache.clone(), torch.tensor([1, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected slots < num_blocks \* block_size = 64"):
        NPU._npu_reshape_and_cache(k, k, cache, cache.clone(), torch.tensor([1, 64, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key_cache = .*expected a 4-D tensor"):
        NPU._npu_reshape_and_cache(k, k, cache.view(64, 2, 8), cache.clone(), slots)
    with pytest.raises(ValueError, match=r"slot_indices = .*expected shape \[num_tokens\] = \[3\]"):
        NPU._npu_reshape_and_cache(k, k, cache, cache.clone(), slots[:2])
    assert torch.count_nonzero(cache) == 0  # nothing was written by the rejected calls


@pytest.fixture(scope="module")
def prefill_case():
    return Case([4, 9], [10, 9], 4, 2, 128, 128, torch.float32, seed=4)


def _fia(case, **override):
    nb = case.k_cache.shape[0]
    kwargs = dict(
        atten_mask=fia_causal_mask("cpu"),
        block_table=case.block_table,
        input_layout="TND",
        block_size=128,
        actual_seq_lengths=[4, 13],
        actual_seq_lengths_kv=[10, 9],
        num_key_value_heads=2,
        num_heads=4,
        scale=case.scale,
        sparse_mode=3,
    )
    kwargs.update(override)
    query = kwargs.pop("query", case.q)
    key = kwargs.pop("key", case.k_cache.view(nb, 128, -1))
    return NPU.npu_fused_infer_attention_score(query, key, key, **kwargs)


def test_fia_rejects_bad_inputs(prefill_case):
    c = prefill_case
    assert _fia(c)[0].shape == (13, 4, 128)
    with pytest.raises(TypeError, match=r"actual_seq_lengths = Tensor.*expected a host list of ints"):
        _fia(c, actual_seq_lengths=torch.tensor([4, 13]))
    with pytest.raises(ValueError, match=r"actual_seq_lengths = \[4, 9\]: expected a last element equal to T = 13"):
        _fia(c, actual_seq_lengths=[4, 9])
    with pytest.raises(ValueError, match=r"expected cumulative end offsets"):
        _fia(c, actual_seq_lengths=[13, 4])
    with pytest.raises(ValueError, match=r"actual_seq_lengths_kv = \[10\]: expected 2 elements"):
        _fia(c, actual_seq_lengths_kv=[10])
    with pytest.raises(ValueError, match=r"request 0 = \(4, 3\): expected query length <= KV length"):
        _fia(c, actual_seq_lengths_kv=[3, 9])
    with pytest.raises(ValueError, match=r"key = .*expected \(blocknum, KV_N=2, block_size=128, D\).*\.view"):
        _fia(c, key=c.k_cache)  # hal's [blocks, block_size, heads, dim] layout, not viewed
    with pytest.raises(ValueError, match=r"block_table = .*int64.*expected dtype int32"):
        _fia(c, block_table=c.block_table.long())
    with pytest.raises(
        ValueError, match=r"sparse_mode = 2: the op's contract says TND takes sparse_mode 0 .*, 3 .* or 4"
    ):
        _fia(c, sparse_mode=2)
    with pytest.raises(
        ValueError, match=r"query D = 64: .*Q_D = K_D = V_D = 128.*torch_npu-npu_fused_infer_attention_score"
    ):
        small = Case([4, 9], [10, 9], 4, 2, 64, 128, torch.float32, seed=4)
        _fia(small, query=small.q, key=small.k_cache.view(-1, 128, 128))
    with pytest.raises(
        ValueError,
        match=r"atten_mask = None: expected the compressed 2048 x 2048 causal mask \(required by sparse_mode",
    ):
        _fia(c, atten_mask=None)
    with pytest.raises(ValueError, match=r"atten_mask = .*shape=\[16, 16\].*expected shape \(2048, 2048\)"):
        _fia(c, atten_mask=torch.ones(16, 16, dtype=torch.bool).triu(1))
    with pytest.raises(ValueError, match=r"expected the compressed causal mask"):
        _fia(c, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril(-1))
    with pytest.raises(ValueError, match=r"atten_mask = .*float32.*expected dtype bool/int8/uint8"):
        _fia(c, atten_mask=fia_causal_mask("cpu").float())
    with pytest.raises(ValueError, match=r"query = .*expected a contiguous tensor"):
        _fia(c, query=c.q.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(NotImplementedError, match=r"input_layout = 'BSH': the emulation implements 'TND' only"):
        _fia(c, input_layout="BSH")
    with pytest.raises(NotImplementedError, match=r"does not implement antiquant_scale"):
        _fia(c, antiquant_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"num_heads = 2: expected the query's N = 4"):
        _fia(c, num_heads=2)


def test_prefill_block_size_and_window_limits():
    case = Case([3, 2], [3, 20], 4, 2, 128, 16, torch.float32, seed=6)
    args = (NPU, case.q, case.k_cache, case.v_cache, case.block_table, [3, 2], [3, 20])
    with pytest.raises(ValueError, match=r"block_size = 16: expected a multiple of 128 in \[128, 512\]"):
        paged_prefill(*args, scale=case.scale, causal=True)
    # A window is FIA's band (sparse_mode 4, as vllm-ascend passes it), at Q_S > 1 only.
    wide = Case([3, 2], [3, 20], 4, 2, 128, 128, torch.float32, seed=6)
    got = paged_prefill(NPU, wide.q, wide.k_cache, wide.v_cache, wide.block_table, [3, 2], [3, 20],
                        scale=wide.scale, causal=True, sliding_window=4)  # fmt: skip
    torch.testing.assert_close(got, wide.reference(sliding_window=4), **TOL[torch.float32])
    # Decode-only batches (Q_S = 1) only need 16-aligned blocks.
    one = Case([1, 1], [3, 20], 4, 2, 128, 16, torch.float32, seed=6)
    got = paged_prefill(
        NPU, one.q, one.k_cache, one.v_cache, one.block_table, [1, 1], [3, 20], scale=one.scale, causal=True
    )
    torch.testing.assert_close(got, one.reference(), **TOL[torch.float32])


def test_splitfuse_rejects_bad_inputs():
    case = Case([1, 4], [9, 6], 4, 2, 32, 16, torch.bfloat16, seed=8)
    mask = splitfuse_mask([1, 4], [9, 6], torch.bfloat16, "cpu")

    def call(**override):
        kwargs = dict(
            query=case.q,
            key_cache=case.k_cache,
            value_cache=case.v_cache,
            block_table=case.block_table,
            context_lens=torch.tensor([9, 6], dtype=torch.int32),
            mask=mask,
            seq_len=torch.tensor([1, 4], dtype=torch.int32),
            num_kv_heads=2,
            num_heads=4,
            scale_value=case.scale,
            out=torch.empty_like(case.q),
        )
        kwargs.update(override)
        NPU._npu_paged_attention_splitfuse(**kwargs)
        return kwargs["out"]

    torch.testing.assert_close(call(), case.reference(), **TOL[torch.bfloat16])
    with pytest.raises(ValueError, match=r"seq_len = \[1, 3\]: expected query lengths summing to num_tokens = 5"):
        call(seq_len=torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_len\[0\] = 0: expected 1 <= seq_len <= context_lens\[0\] = 9"):
        call(seq_len=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_len\[1\] = 4: expected 1 <= seq_len <= context_lens\[1\] = 3"):
        call(context_lens=torch.tensor([9, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"mask = .*shape=\[5, 8\].*max_seq_len >= 9"):
        call(mask=mask[:, :8])
    with pytest.raises(ValueError, match=r"mask = .*bool.*expected dtype float16/bfloat16"):
        call(mask=mask == 0)
    with pytest.raises(TypeError, match=r"seq_len = \[1, 4\]: expected a torch.Tensor"):
        call(seq_len=[1, 4])


# ----------------------------------------------------------------------------- support matrix


def test_unsupported_reasons():
    ok = dict(
        head_dim=128, v_head_dim=128, block_size=128, dtype=torch.bfloat16, logit_cap=0.0,
        sliding_window=-1, custom_mask=False, causal=True,
    )  # fmt: skip
    assert unsupported_reasons(**ok) == []
    assert unsupported_reasons(**ok, kv_heads=8, q_heads=32) == []
    fp32 = unsupported_reasons(**{**ok, "dtype": torch.float32})
    assert len(fp32) == 3 and all("dtype torch.float32 unsupported" in r for r in fp32)
    window = unsupported_reasons(**{**ok, "sliding_window": 1024})
    assert [r.split(" ")[0] for r in window] == ["_npu_paged_attention"]  # FIA takes it as band mode 4
    custom = unsupported_reasons(**{**ok, "custom_mask": True})
    assert len(custom) == 1 and custom[0].startswith("npu_fused_infer_attention_score (extend): custom mask")
    assert unsupported_reasons(**{**ok, "custom_mask": True, "sliding_window": 4}, paths=("mixed",)) == []
    small_pages = unsupported_reasons(**{**ok, "block_size": 16})
    assert len(small_pages) == 1 and "multiple of 128 in [128, 512]" in small_pages[0]
    mla = unsupported_reasons(**{**ok, "head_dim": 192, "v_head_dim": 128})
    assert sum("v_head_dim 128 != head_dim 192" in r for r in mla) == 3
    assert any("head_dim * page size = 24576 > 128 * 128" in r for r in mla)  # splitfuse (parallel decoding)
    big_pages = unsupported_reasons(**{**ok, "block_size": 256, "head_dim": 64, "v_head_dim": 64}, paths=("decode",))
    assert len(big_pages) == 1 and "<= 128" in big_pages[0]  # ATB PagedAttention: block_size <= 128
    cap = unsupported_reasons(**{**ok, "logit_cap": 30.0})
    assert len(cap) == 3 and all("soft-cap" in r for r in cap)
    assert unsupported_reasons(**{**ok, "causal": False}) == []
    assert any("<= 64" in r for r in unsupported_reasons(**ok, kv_heads=1, q_heads=128))
    assert unsupported_reasons(**{**ok, "head_dim": 192, "v_head_dim": 192, "block_size": 128}, paths=("extend",)) == []
    for head_dim in (64, 80, 96, 256, 512):  # FIA TND takes 128 or 192 without rope: the rest go to splitfuse
        fia = unsupported_reasons(**{**ok, "head_dim": head_dim, "v_head_dim": head_dim}, paths=("extend",))
        assert len(fia) == 1 and "TND takes head dim 128 or 192" in fia[0], fia


def test_wrappers_are_thin_and_keyword_called():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            def op(*args, **kwargs):
                calls.append((name, args, kwargs))
                return getattr(NPU, name)(*args, **kwargs)

            return op

    case = Case([1, 1], [3, 20], 4, 2, 32, 16, torch.float32, seed=1)
    paged_decode(Recorder(), case.q, case.k_cache, case.v_cache, case.block_table, [3, 20], scale=0.5)
    name, args, kwargs = calls[-1]
    assert name == "_npu_paged_attention" and args == ()
    assert kwargs["context_lens"].dtype == torch.int32 and kwargs["context_lens"].device.type == "cpu"
    assert kwargs["num_heads"] == 4 and kwargs["num_kv_heads"] == 2 and kwargs["scale_value"] == 0.5
    assert ops.OP_NAMES == OP_NAMES


# ----------------------------------------------------------------------------- MLA and sinks (FIA v2, ATB MLA ops)

MLA_R, MLA_P = 512, 64  # DeepSeek's latent and rope part, the dims the ops take


def _mla_pool(kv_lens, block_size=16, heads=8, seed=0):
    """A shuffled paged ``[blocks, block_size, 1, latent + rope]`` cache, its block table and queries."""
    g = torch.Generator().manual_seed(seed)
    per_req = [max(1, -(-n // block_size)) for n in kv_lens]
    blocks = sum(per_req) + 2
    order = (torch.randperm(blocks, generator=g)).tolist()
    table = torch.zeros(len(kv_lens), max(per_req), dtype=torch.int32)
    for r, n in enumerate(per_req):
        table[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    cache = torch.randn(blocks, block_size, 1, MLA_R + MLA_P, generator=g)
    return cache, table


def _mla_expected(q, cache, table, q_lens, kv_lens, scale, visible=None, sink=None):
    """float64 absorbed MLA: scores over latent ++ rope, values the latent; ``visible(r, s, L)`` bool [s, L]."""
    outs, start = [], 0
    for r, (s, n) in enumerate(zip(q_lens, kv_lens)):
        keys = cache[table[r].long()].reshape(-1, cache.shape[-1])[:n].double()
        scores = torch.einsum("shd,ld->hsl", q[start : start + s].double(), keys) * scale
        if visible is not None:
            scores = scores.masked_fill(~visible(r, s, n), float("-inf"))
        if sink is not None:
            scores = torch.cat([scores, sink.double()[:, None, None].expand(-1, s, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :n]
        outs.append(torch.einsum("hsl,ld->shd", probs, keys[:, :MLA_R]))
        start += s
    return torch.cat(outs)


def _right_down(pre=None):
    def visible(_, s, n):
        pos = torch.arange(s)[:, None] + n - s
        cols = torch.arange(n)[None]
        return (cols <= pos) & (cols >= pos - pre if pre is not None else True)

    return visible


@pytest.mark.parametrize("heads", [8, 6])  # 6: the wrapper pads the heads to a power of two, as upstream
@pytest.mark.parametrize("window", [-1, 5])
def test_mla_attention_is_absorbed_mla_over_the_split_caches(heads, window):
    q_lens, kv_lens = [3, 1, 4], [20, 9, 4]
    cache, table = _mla_pool(kv_lens)
    q = torch.randn(sum(q_lens), heads, MLA_R + MLA_P)
    latent, rope = cache[..., :MLA_R].contiguous(), cache[..., MLA_R:].contiguous()
    out = ops.mla_attention(NPU, q, latent, rope, table, q_lens, kv_lens, scale=0.07, sliding_window=window)
    expected = _mla_expected(q, cache, table, q_lens, kv_lens, 0.07, _right_down(window if window >= 0 else None))
    assert out.shape == (sum(q_lens), heads, MLA_R)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_mla_tree_mask_hides_draft_tokens_and_shows_the_prefix():
    q_lens, kv_lens = [3, 2], [10, 7]
    cache, table = _mla_pool(kv_lens)
    q = torch.randn(5, 8, MLA_R + MLA_P)
    trees = [torch.tensor([[0, 1, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.bool), torch.tensor([[0, 1], [1, 0]]) > 0]
    latent, rope = cache[..., :MLA_R].contiguous(), cache[..., MLA_R:].contiguous()
    flat = torch.cat([t.flatten() for t in trees])
    out = ops.mla_attention(NPU, q, latent, rope, table, q_lens, kv_lens, scale=0.1, tree_mask=flat)

    def visible(r, s, n):
        return torch.cat([torch.ones(s, n - s, dtype=torch.bool), ~trees[r]], dim=1)

    torch.testing.assert_close(
        out.double(), _mla_expected(q, cache, table, q_lens, kv_lens, 0.1, visible), atol=1e-5, rtol=1e-5
    )


def test_paged_attention_mla_reads_the_value_from_the_keys_latent():
    kv_lens = [17, 1, 40]
    cache, table = _mla_pool(kv_lens, heads=16)
    q = torch.randn(3, 16, MLA_R + MLA_P)
    out = ops.mla_decode(NPU, q, cache, table, kv_lens, kv_lora_rank=MLA_R, scale=0.05)
    torch.testing.assert_close(
        out.double(), _mla_expected(q, cache, table, [1, 1, 1], kv_lens, 0.05), atol=1e-5, rtol=1e-5
    )


def test_write_latent_writes_the_one_cache_and_skips_negative_slots():
    cache = torch.zeros(4, 16, 1, 24)
    key = torch.randn(3, 1, 24)
    ops.write_latent(NPU, key, cache, torch.tensor([17, -1, 3]))
    flat = cache.view(-1, 1, 24)
    assert torch.equal(flat[17], key[0]) and torch.equal(flat[3], key[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2
    with pytest.raises(ValueError, match="no repeated slot"):
        ops.write_latent(NPU, key, cache, torch.tensor([5, 5, 6]))
    with pytest.raises(ValueError, match="key = .*expected dtype torch.bfloat16"):
        NPU._npu_reshape_and_cache_siso(
            key=key, key_cache=cache.bfloat16(), slot_indices=torch.zeros(3, dtype=torch.int32)
        )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [-1, 0, 6])
def test_paged_attention_sinks_adds_the_sink_to_every_denominator(window, causal):
    c = Case([1, 5, 12], [9, 30, 12], 8, 2, 128, 128, torch.float32)
    sinks = torch.randn(8) * 3
    out = ops.paged_attention_sinks(
        *(NPU, c.q, c.k_cache, c.v_cache, c.block_table, c.q_lens, c.kv_lens, sinks),
        scale=c.scale,
        sliding_window=window,
        causal=causal,
    )
    expected = c.reference(sliding_window=window, sinks=sinks, causal=causal)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(key_rope=None), "both set or both None"),
        (dict(sparse_mode=9, atten_mask=torch.zeros(3, dtype=torch.bool)), r"shape \(sum\(Q_S_i \*\* 2\),\)"),
        (dict(learnable_sink=torch.zeros(8)), "value D <= 128"),
        (dict(sparse_mode=2), "0, 3, 4 or 9"),
        (dict(block_size=8), "block_size"),
    ],
)
def test_fia_v2_refuses_what_its_doc_forbids(change, error):
    cache, table = _mla_pool([10])
    q = torch.randn(2, 8, MLA_R + MLA_P)
    latent, rope = cache[..., :MLA_R].contiguous(), cache[..., MLA_R:].contiguous()
    kwargs = dict(
        query_rope=q[..., MLA_R:].contiguous(),
        key_rope=rope.view(rope.shape[0], 16, -1),
        block_table=table,
        input_layout="TND",
        block_size=16,
        actual_seq_qlen=[2],
        actual_seq_kvlen=[10],
        num_query_heads=8,
        num_key_value_heads=1,
        sparse_mode=0,
    )
    kwargs.update(change)
    with pytest.raises((ValueError, TypeError), match=error):
        NPU.npu_fused_infer_attention_score_v2(
            q[..., :MLA_R].contiguous(), latent.view(-1, 16, MLA_R), latent.view(-1, 16, MLA_R), **kwargs
        )


def test_mla_reasons_name_the_ops_limits():
    assert ops.mla_unsupported_reasons(512, 64, 16, torch.bfloat16, q_heads=16, kv_heads=1) == []
    why = ops.mla_unsupported_reasons(64, 16, 16, torch.bfloat16, q_heads=8, kv_heads=1)
    assert any("_npu_paged_attention_mla" in w and "512 + 64" in w for w in why)
    assert any("npu_fused_infer_attention_score_v2" in w and "512 or 128" in w for w in why)
    tree = ops.mla_unsupported_reasons(128, 64, 16, torch.float16, q_heads=8, kv_heads=1, paths=("mla_tree",))
    assert tree == [
        "npu_fused_infer_attention_score_v2 (mla_tree): the verify tree mask (sparse_mode 9) needs latent D = 512"
    ]
    assert ops.sink_unsupported_reasons(128, 128, 128, torch.bfloat16, 0.0, True, kv_heads=2, q_heads=8) == []
    assert any(
        "value D <= 128" in w
        for w in ops.sink_unsupported_reasons(192, 192, 128, torch.bfloat16, 0.0, True, kv_heads=2, q_heads=8)
    )
