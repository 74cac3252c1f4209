"""hal.kernels.triton against the reference oracle, on CPU through Triton's interpreter.

Shapes are small and tiles are 16 wide so that every kernel takes several loop steps
(the interpreter costs ~3 ms per step per program). Needs ``TRITON_INTERPRET=1`` in the
environment before the session starts (the ``triton`` tox env sets it): setting it here
would switch every later test in the session to the interpreter, GPUs included. On a
GPU the conformance suite runs these kernels through the triton backend.
"""

from __future__ import annotations

import pytest
import torch

from hal.capability import interpreter_enabled

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")
if not interpreter_enabled():
    pytest.skip("needs TRITON_INTERPRET=1 set before the session (tox -e triton)", allow_module_level=True)

from hal.kernels import reference  # noqa: E402
from hal.kernels import triton as tk  # noqa: E402
from hal.kernels.triton import _common  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if not _common.INTERPRETING:
    pytest.skip(
        "hal.kernels.triton was imported before TRITON_INTERPRET=1 was set (set it in conftest.py)",
        allow_module_level=True,
    )

BLOCK = 16  # tile size used by these tests (the GPU defaults are larger)
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # bf16 outputs: ~1 ulp (the interpreter truncates on the fp32 -> bf16 store).
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# ----------------------------------------------------------------------------- helpers


def make_slots(seq_lens: list[int], layout: str, gen: torch.Generator, page: int = 16) -> list[torch.Tensor]:
    """Distinct int64 pool slots for each request's tokens.

    ``perm``: every token on a random slot of one shared pool (requests interleaved);
    ``page16``: slot = page * 16 + offset, each request on whole pages, pages shuffled.
    """
    total = sum(seq_lens)
    if layout == "perm":
        return list(torch.randperm(total + 7, generator=gen)[:total].split(seq_lens))
    assert layout == "page16"
    pages_per_req = [(n + page - 1) // page for n in seq_lens]
    pages = torch.randperm(sum(pages_per_req) + 2, generator=gen)[: sum(pages_per_req)].split(pages_per_req)
    return [p[torch.arange(n) // page] * page + torch.arange(n) % page for p, n in zip(pages, seq_lens, strict=True)]


class Case:
    """A batch of requests over one pool: ``seq_lens`` tokens each, the last ``extend_lens`` new."""

    def __init__(
        self,
        seq_lens,
        extend_lens,
        *,
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim=None,
        dtype=torch.float32,
        layout="perm",
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.tensor(seq_lens)
        self.extend_lens = torch.tensor(extend_lens)
        self.prefix_lens = self.seq_lens - self.extend_lens
        batch = len(seq_lens)
        v_head_dim = v_head_dim or head_dim
        slots = make_slots(list(seq_lens), layout, gen)
        num_slots = int(torch.cat(slots).max()) + 3
        # req_to_token rows in a shuffled order, wider than needed.
        self.req_pool_indices = torch.randperm(batch + 2, generator=gen)[:batch]
        self.req_to_token = torch.full((batch + 2, max(seq_lens) + 5), -1, dtype=torch.int32)
        for b, s in enumerate(slots):
            self.req_to_token[self.req_pool_indices[b], : len(s)] = s.to(torch.int32)
        self.slots = slots

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.k_buffer = rand(num_slots, kv_heads, head_dim)
        self.v_buffer = rand(num_slots, kv_heads, v_head_dim)
        num_q = int(self.extend_lens.sum())
        self.q = rand(num_q, q_heads, head_dim)
        self.q_heads, self.kv_heads, self.head_dim, self.v_head_dim = q_heads, kv_heads, head_dim, v_head_dim
        self.dtype = dtype
        # The new tokens' K/V, as the kernels get them (and as the pool holds them).
        new = [s[p:] for s, p in zip(slots, self.prefix_lens.tolist(), strict=True)]
        self.new_slots = torch.cat(new) if new else torch.empty(0, dtype=torch.long)
        self.k_new = self.k_buffer[self.new_slots].clone()
        self.v_new = self.v_buffer[self.new_slots].clone()

    def reference(self, **kw):
        out = reference.paged_attention(
            self.q.float(),
            self.k_buffer,
            self.v_buffer,
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.extend_lens,
            **kw,
        )
        assert out.dtype == torch.float32
        return out

    def indices(self, lens, index_dtype=torch.int32, start=None):
        """kv_indptr / kv_indices of the first ``lens[b]`` tokens (from ``start[b]``) of each request."""
        start = torch.zeros_like(lens) if start is None else start
        parts = [self.slots[b][int(start[b]) : int(start[b]) + int(lens[b])] for b in range(len(lens))]
        indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(index_dtype)
        return indptr, torch.cat(parts).to(index_dtype)


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected, **TOL[dtype])


# ----------------------------------------------------------------------------- decode


def run_decode(case: Case, *, num_kv_splits, logit_cap=0.0, index_dtype=torch.int32, extra_splits=0, out=None, **kw):
    batch = len(case.seq_lens)
    kv_indptr, kv_indices = case.indices(case.seq_lens, index_dtype)
    if out is None:
        out = torch.full((batch, case.q_heads, case.v_head_dim), float("nan"), dtype=case.dtype)
    splits = num_kv_splits + extra_splits
    partial_out = torch.full((batch, case.q_heads, splits, case.v_head_dim), float("nan"))
    partial_lse = torch.full((batch, case.q_heads, splits), float("nan"))
    result = tk.decode_attention(
        case.q,
        case.k_buffer,
        case.v_buffer,
        out,
        kv_indptr,
        kv_indices,
        scale=case.head_dim**-0.5,
        logit_cap=logit_cap,
        num_kv_splits=num_kv_splits,
        partial_out=partial_out,
        partial_lse=partial_lse,
        block_n=BLOCK,
        **kw,
    )
    assert result is out
    return out, partial_out, partial_lse


DECODE_CASES = {
    # name: (seq_lens, q_heads, kv_heads, head_dim, v_head_dim, dtype, layout, splits, cap)
    "gqa-fp32-perm": ([1, 37, 16], 4, 2, 64, None, torch.float32, "perm", 4, 0.0),
    "mqa-d80-page16": ([33, 5], 4, 1, 80, None, torch.float32, "page16", 2, 0.0),
    "mha-vdim48": ([20, 1, 9], 2, 2, 64, 48, torch.float32, "perm", 3, 0.0),
    "gqa-bf16-page16": ([37, 2], 4, 2, 64, None, torch.bfloat16, "page16", 2, 0.0),
    "gqa-fp16": ([24, 7], 4, 2, 64, None, torch.float16, "perm", 2, 0.0),
    "cap-one-split": ([40, 3], 4, 2, 64, None, torch.float32, "perm", 1, 5.0),
    "splits-exceed-tokens": ([3, 5], 4, 2, 32, None, torch.float32, "page16", 8, 0.0),
    "group32-bf16-cap": ([19, 4], 32, 1, 16, None, torch.bfloat16, "perm", 2, 2.0),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name):
    seq_lens, hq, hkv, d, dv, dtype, layout, splits, cap = DECODE_CASES[name]
    case = Case(
        seq_lens,
        [1] * len(seq_lens),
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        dtype=dtype,
        layout=layout,
    )
    out, _, partial_lse = run_decode(case, num_kv_splits=splits, logit_cap=cap)
    expected = case.reference(scale=d**-0.5, logit_cap=cap)
    assert_close(out, expected, dtype)
    # Splits are ceil(len / splits) tokens long; the ones past the end are empty.
    for b, n in enumerate(seq_lens):
        share = -(-n // splits)
        for s in range(splits):
            empty = s * share >= n
            assert torch.isneginf(partial_lse[b, :, s]).all() == empty, (b, s)
            assert torch.isfinite(partial_lse[b, :, s]).all() == (not empty), (b, s)


@pytest.mark.parametrize("q_heads", [32, 40])
def test_decode_in_head_blocks_matches_reference(q_heads):
    """On a GPU arch the tables cut a GQA group of 32 (or a ragged 40) into 16-head blocks, one program each."""
    from hal.kernels.triton.sizing import decode_blocks

    assert decode_blocks("sm_90", 16, "fp32", q_heads)[0] == 16
    case = Case([19, 4], [1, 1], q_heads=q_heads, kv_heads=1, head_dim=16)
    out, _, _ = run_decode(case, num_kv_splits=2, logit_cap=2.0, arch="sm_90")
    assert_close(out, case.reference(scale=16**-0.5, logit_cap=2.0), torch.float32)


def test_decode_partial_buffers_and_strides():
    """int64 indices, oversized scratch (only the first num_kv_splits used), strided q and out."""
    case = Case([18, 4], [1, 1], q_heads=4, kv_heads=2, head_dim=32)
    # Move q into a strided view (every other head of a wider tensor).
    wide = torch.zeros(2, 8, 32)
    wide[:, ::2] = case.q
    case.q = wide[:, ::2]
    assert not case.q.is_contiguous()
    out, partial_out, partial_lse = run_decode(case, num_kv_splits=2, index_dtype=torch.int64, extra_splits=3)
    assert_close(out, case.reference(scale=32**-0.5), torch.float32)
    assert torch.isnan(partial_lse[:, :, 2:]).all() and torch.isnan(partial_out[:, :, 2:]).all()
    # The LSE of the splits merges to the full LSE.
    kv = case.k_buffer[case.slots[0]].repeat_interleave(2, dim=1)  # [18, 4, 32]
    scores = torch.einsum("hd,shd->hs", case.q[0], kv) * 32**-0.5
    torch.testing.assert_close(torch.logsumexp(partial_lse[0, :, :2], -1), torch.logsumexp(scores, -1))


def test_decode_request_without_tokens_outputs_zeros():
    case = Case([9, 5], [1, 1], q_heads=2, kv_heads=1, head_dim=16)
    q = torch.randn(3, 2, 16)
    out = torch.full((3, 2, 16), float("nan"))
    kv_indptr = torch.tensor([0, 9, 9, 14], dtype=torch.int32)  # request 1 has no tokens
    kv_indices = torch.cat(case.slots).to(torch.int32)
    tk.decode_attention(
        q,
        case.k_buffer,
        case.v_buffer,
        out,
        kv_indptr,
        kv_indices,
        scale=0.25,
        num_kv_splits=2,
        partial_out=torch.empty(3, 2, 2, 16),
        partial_lse=torch.empty(3, 2, 2),
        block_n=BLOCK,
    )
    assert (out[1] == 0).all()
    assert torch.isfinite(out).all() and out[0].abs().sum() > 0 and out[2].abs().sum() > 0


# ----------------------------------------------------------------------------- extend


def run_extend(case: Case, *, poison_new_slots=True, index_dtype=torch.int32, out=None, **kw):
    """Runs extend_attention; the pool's copies of the new tokens are NaN, to prove they are not read."""
    batch = len(case.seq_lens)
    qo_indptr = torch.nn.functional.pad(torch.cumsum(case.extend_lens, 0), (1, 0)).to(index_dtype)
    kv_indptr, kv_indices = case.indices(case.prefix_lens, index_dtype)
    k_buffer, v_buffer = case.k_buffer.clone(), case.v_buffer.clone()
    if poison_new_slots:
        k_buffer[case.new_slots] = float("nan")
        v_buffer[case.new_slots] = float("nan")
    if out is None:
        out = torch.full((int(case.extend_lens.sum()), case.q_heads, case.v_head_dim), float("nan"), dtype=case.dtype)
    result = tk.extend_attention(
        case.q,
        case.k_new,
        case.v_new,
        out,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        scale=case.head_dim**-0.5,
        max_extend_len=int(case.extend_lens.max()) if batch else 0,
        block_m=BLOCK,
        block_n=BLOCK,
        **kw,
    )
    assert result is out
    return out


EXTEND_CASES = {
    # name: (seq_lens, extend_lens, q_heads, kv_heads, head_dim, v_head_dim, dtype, layout, kwargs)
    "gqa-prefix": ([40, 19, 6], [21, 19, 1], 4, 2, 64, None, torch.float32, "perm", {}),
    "mqa-d80-page16": ([35, 17], [18, 3], 4, 1, 80, None, torch.float32, "page16", {}),
    "mha-vdim48-no-prefix": ([20, 5], [20, 5], 2, 2, 32, 48, torch.float32, "perm", {}),
    "window": ([45, 20], [20, 17], 4, 2, 32, None, torch.float32, "page16", dict(sliding_window=7)),
    "window-zero": ([21], [18], 2, 1, 32, None, torch.float32, "perm", dict(sliding_window=0)),
    "logit-cap": ([30, 9], [17, 9], 4, 2, 64, None, torch.float32, "perm", dict(logit_cap=4.0)),
    "non-causal": ([30, 12], [18, 12], 4, 2, 32, None, torch.float32, "perm", dict(causal=False)),
    "non-causal-window": (
        [30],
        [18],
        2,
        2,
        32,
        None,
        torch.float32,
        "perm",
        dict(causal=False, sliding_window=5),
    ),
    "bf16": ([36, 10], [20, 4], 4, 2, 64, None, torch.bfloat16, "page16", {}),
    "fp16-cap-window": (
        [36, 10],
        [20, 4],
        4,
        2,
        64,
        None,
        torch.float16,
        "perm",
        dict(logit_cap=3.0, sliding_window=9),
    ),
}


@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_matches_reference(name):
    seq_lens, ext, hq, hkv, d, dv, dtype, layout, kw = EXTEND_CASES[name]
    case = Case(seq_lens, ext, q_heads=hq, kv_heads=hkv, head_dim=d, v_head_dim=dv, dtype=dtype, layout=layout)
    out = run_extend(case, **kw)
    assert_close(out, case.reference(scale=d**-0.5, **kw), dtype)


def test_extend_int64_indices_and_unrelated_extra_rows():
    """int64 indptrs; max_extend_len larger than any request; rows of q beyond the requests untouched."""
    case = Case([25, 3], [17, 3], q_heads=2, kv_heads=1, head_dim=16, seed=3)
    qo_indptr = torch.tensor([0, 17, 20], dtype=torch.int64)
    kv_indptr, kv_indices = case.indices(case.prefix_lens, torch.int64)
    out = torch.full((22, 2, 16), 7.0)  # two trailing rows belong to no request
    q = torch.cat([case.q, torch.randn(2, 2, 16)])
    k = torch.cat([case.k_new, torch.randn(2, 1, 16)])
    v = torch.cat([case.v_new, torch.randn(2, 1, 16)])
    tk.extend_attention(
        q,
        k,
        v,
        out,
        case.k_buffer,
        case.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        scale=0.25,
        max_extend_len=40,
        block_m=BLOCK,
        block_n=BLOCK,
    )
    assert_close(out[:20], case.reference(scale=0.25), torch.float32)
    assert (out[20:] == 7.0).all()


@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_small_out_view_with_padded_rows(kernel):
    """``out`` may be a view of an engine's buffer whose rows are strided past their width (what
    ``forward(out=)`` hands the triton backend's run steps): the kernels write each row through its strides and
    leave the padding past it, and the rows past the batch, as they were."""
    extend_lens = [1, 1] if kernel == "decode" else [7, 9]
    case = Case([18, 9], extend_lens, q_heads=4, kv_heads=2, head_dim=16, seed=5)
    tokens, width = case.q.shape[0], 4 * 16
    whole = torch.full((tokens + 2, width + 8), 7.0)
    out = whole[:tokens, :width].view(tokens, 4, 16)
    assert not out.is_contiguous()
    if kernel == "decode":
        result = run_decode(case, num_kv_splits=2, out=out)[0]
    else:
        result = run_extend(case, out=out)
    assert result is out
    assert_close(out, case.reference(scale=16**-0.5), torch.float32)
    untouched = torch.ones_like(whole, dtype=torch.bool)
    untouched[:tokens, :width] = False
    assert (whole[untouched] == 7.0).all()


def random_custom_mask(case: Case, gen: torch.Generator, *, empty_row: tuple[int, int] | None):
    """Per request a random [E, P + E] mask with each token's own (diagonal) key set."""
    blocks = []
    for r, (s, e) in enumerate(zip(case.seq_lens.tolist(), case.extend_lens.tolist(), strict=True)):
        m = torch.rand(e, s, generator=gen) < 0.5
        m[torch.arange(e), s - e + torch.arange(e)] = True
        if empty_row is not None and empty_row[0] == r:
            m[empty_row[1]] = False
        blocks.append(m.flatten())
    return torch.cat(blocks)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("with_indptr", [True, False])
def test_extend_custom_mask(mask_dtype, with_indptr):
    gen = torch.Generator().manual_seed(11)
    case = Case([26, 9], [18, 5], q_heads=4, kv_heads=2, head_dim=32, seed=5)
    mask = random_custom_mask(case, gen, empty_row=(0, 17))  # a row with no visible key
    sizes = case.extend_lens * case.seq_lens
    mask_indptr = torch.nn.functional.pad(torch.cumsum(sizes, 0), (1, 0)) if with_indptr else None
    out = run_extend(case, custom_mask=mask.to(mask_dtype), mask_indptr=mask_indptr)
    expected = case.reference(scale=32**-0.5, custom_mask=mask)
    assert (expected[17] == 0).all()
    assert (out[17] == 0).all()
    assert_close(out, expected, torch.float32)


def test_extend_custom_mask_with_window_and_causal_flag_ignored():
    gen = torch.Generator().manual_seed(2)
    case = Case([30], [20], q_heads=2, kv_heads=2, head_dim=32, seed=9)
    mask = random_custom_mask(case, gen, empty_row=None)
    mask[5 * 30 + 29] = True  # query 5 (position 15) sees the last key, a later one
    for causal in (True, False):
        out = run_extend(case, custom_mask=mask, sliding_window=6, causal=causal)
        expected = case.reference(scale=32**-0.5, custom_mask=mask, sliding_window=6)
        assert_close(out, expected, torch.float32)


def test_default_block_sizes():
    """The GPU tile sizes (64-wide) also run in the interpreter and agree with the reference."""
    case = Case([70, 3], [1, 1], q_heads=4, kv_heads=2, head_dim=32, layout="page16")
    kv_indptr, kv_indices = case.indices(case.seq_lens)
    out = torch.empty(2, 4, 32)
    tk.decode_attention(
        case.q,
        case.k_buffer,
        case.v_buffer,
        out,
        kv_indptr,
        kv_indices,
        scale=0.2,
        num_kv_splits=2,
        partial_out=torch.empty(2, 4, 2, 32),
        partial_lse=torch.empty(2, 4, 2),
    )
    assert_close(out, case.reference(scale=0.2), torch.float32)

    case = Case([90, 30], [70, 30], q_heads=2, kv_heads=1, head_dim=32, seed=1)
    qo_indptr = torch.tensor([0, 70, 100])
    kv_indptr, kv_indices = case.indices(case.prefix_lens)
    out = torch.empty(100, 2, 32)
    tk.extend_attention(
        case.q,
        case.k_new,
        case.v_new,
        out,
        case.k_buffer,
        case.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        scale=0.2,
        max_extend_len=70,
        sliding_window=40,
    )
    assert_close(out, case.reference(scale=0.2, sliding_window=40), torch.float32)


# ----------------------------------------------------------------------------- MLA, sinks, fp8 KV (issue 19)

F8, F5 = torch.float8_e4m3fn, torch.float8_e5m2


def model_case(seq_lens, extend_lens, *, mla=None, kv_dtype=None, k_scale=1.0, v_scale=1.0, **kw) -> Case:
    """A :class:`Case` whose pool is MLA's (``mla=(latent, rope)``: one KV head, the value a view of the
    key's latent columns) and/or fp8 (``kv_dtype``: the pool holds ``quantize_kv(x, kv_dtype, scale)``)."""
    if mla is not None:
        kw.update(kv_heads=1, head_dim=sum(mla), v_head_dim=mla[0])
    case = Case(seq_lens, extend_lens, **kw)
    if kv_dtype is not None:
        case.k_buffer = reference.quantize_kv(case.k_buffer, kv_dtype, k_scale)
        case.v_buffer = reference.quantize_kv(case.v_buffer, kv_dtype, v_scale)
    if mla is not None:
        case.v_buffer = case.k_buffer[..., : mla[0]]
        case.v_new = case.k_new[..., : mla[0]]
    return case


def sinks_for(case: Case, seed: int = 0) -> torch.Tensor:
    """Sink logits in the range of the scores, so that they shift the outputs visibly."""
    return torch.randn(case.q_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


MODEL_DECODE = {
    # name: (model_case kwargs, decode kwargs)
    "sinks-gqa-splits": (dict(q_heads=4, kv_heads=2, head_dim=32), dict(num_kv_splits=3, sinks=True)),
    "sinks-cap-bf16": (
        dict(q_heads=4, kv_heads=1, head_dim=32, dtype=torch.bfloat16),
        dict(num_kv_splits=2, sinks=True, logit_cap=3.0),
    ),
    "fp8-e4m3-scaled": (
        dict(q_heads=4, kv_heads=2, head_dim=32, kv_dtype=F8, k_scale=0.37, v_scale=1.9),
        dict(num_kv_splits=2),
    ),
    "fp8-e5m2-bf16": (
        dict(q_heads=4, kv_heads=2, head_dim=32, dtype=torch.bfloat16, kv_dtype=F5, k_scale=0.5, v_scale=3.0),
        dict(num_kv_splits=2),
    ),
    "mla-64+16": (dict(q_heads=8, mla=(64, 16)), dict(num_kv_splits=2)),
    "mla-512+64-fp8-sinks": (
        dict(q_heads=4, mla=(512, 64), dtype=torch.bfloat16, kv_dtype=F8, k_scale=0.45, v_scale=0.45),
        dict(num_kv_splits=2, sinks=True),
    ),
}


@pytest.mark.parametrize("name", list(MODEL_DECODE))
def test_decode_mla_sinks_fp8(name):
    case_kw, run_kw = MODEL_DECODE[name]
    case = model_case([37, 1, 20], [1, 1, 1], layout="page16", **case_kw)
    sinks = sinks_for(case) if run_kw.pop("sinks", False) else None
    scales = dict(k_scale=case_kw.get("k_scale", 1.0), v_scale=case_kw.get("v_scale", 1.0))
    out, _, _ = run_decode(case, sinks=sinks, **scales, **run_kw)
    cap = run_kw.get("logit_cap", 0.0)
    expected = case.reference(scale=case.head_dim**-0.5, logit_cap=cap, sinks=sinks, **scales)
    assert_close(out, expected, case.dtype)
    if sinks is not None:  # the sink moved the output: without it the kernel would not match
        plain = case.reference(scale=case.head_dim**-0.5, logit_cap=cap, **scales)
        assert (plain - expected).abs().max() > 0.05


MODEL_EXTEND = {
    # name: (model_case kwargs, extend kwargs)
    "sinks-window": (dict(q_heads=4, kv_heads=2, head_dim=32), dict(sinks=True, sliding_window=6)),
    "sinks-mask-blind-row": (dict(q_heads=4, kv_heads=2, head_dim=32), dict(sinks=True, custom_mask=True)),
    "fp8-e4m3-scaled": (dict(q_heads=4, kv_heads=2, head_dim=32, kv_dtype=F8, k_scale=0.37, v_scale=1.9), {}),
    "fp8-e5m2-bf16-window": (
        dict(q_heads=4, kv_heads=1, head_dim=32, dtype=torch.bfloat16, kv_dtype=F5, k_scale=2.0, v_scale=0.3),
        dict(sliding_window=5),
    ),
    "mla-64+16": (dict(q_heads=8, mla=(64, 16)), {}),
    "mla-64+16-fp8-sinks": (dict(q_heads=8, mla=(64, 16), kv_dtype=F8, k_scale=0.45, v_scale=0.45), dict(sinks=True)),
}


@pytest.mark.parametrize("name", list(MODEL_EXTEND))
def test_extend_mla_sinks_fp8(name):
    case_kw, run_kw = dict(MODEL_EXTEND[name][0]), dict(MODEL_EXTEND[name][1])
    case = model_case([30, 9], [17, 9], **case_kw)
    sinks = sinks_for(case, 1) if run_kw.pop("sinks", False) else None
    if run_kw.pop("custom_mask", False):
        run_kw["custom_mask"] = random_custom_mask(case, torch.Generator().manual_seed(3), empty_row=(0, 16))
    scales = dict(k_scale=case_kw.get("k_scale", 1.0), v_scale=case_kw.get("v_scale", 1.0))
    fp8 = "kv_dtype" in case_kw
    # an fp8 pool: the new tokens are read where they are stored; otherwise from k/v (the pool's copies poisoned)
    new = dict(new_kv_loc=case.new_slots) if fp8 else {}
    out = run_extend(case, poison_new_slots=not fp8 and "mla" not in case_kw, sinks=sinks, **scales, **new, **run_kw)
    expected = case.reference(scale=case.head_dim**-0.5, sinks=sinks, **scales, **run_kw)
    assert_close(out, expected, case.dtype)
    if "custom_mask" in run_kw:  # a row that sees no key puts all its mass on the sink: zeros
        assert (out[16] == 0).all()


def test_extend_fp8_pool_needs_the_new_slots():
    case = model_case([9], [4], q_heads=2, kv_heads=1, head_dim=16, kv_dtype=F8)
    with pytest.raises(ValueError, match="new_kv_loc"):
        run_extend(case, poison_new_slots=False)


@triton.jit
def _decode_bytes(b_ptr, out_ptr, N: tl.constexpr, KV_FP8: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _common.fp8_to_f32(tl.load(b_ptr + offs), KV_FP8))


@triton.jit
def _encode_floats(x_ptr, out_ptr, N: tl.constexpr, KV_FP8: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _common.f32_to_fp8(tl.load(x_ptr + offs), KV_FP8))


@pytest.mark.parametrize("dtype", [F8, F5], ids=["e4m3fn", "e5m2"])
def test_fp8_codec_is_torchs_cast_bit_for_bit(dtype):
    """Every byte decodes to torch's value; encoding saturates and rounds to nearest even as torch's
    ``clamp(-max, max).to(fp8)``: random magnitudes over 15 decades, every tie between neighbours,
    subnormals, signed zeros, huge values."""
    fmt = _common.kv_format(torch.empty(0, dtype=dtype))
    every = torch.arange(256, dtype=torch.uint8)
    decoded = torch.empty(256)
    _decode_bytes[(1,)](every, decoded, N=256, KV_FP8=fmt)
    want = every.view(dtype).float()
    assert torch.equal(decoded.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(torch.signbit(decoded)[~want.isnan()], torch.signbit(want)[~want.isnan()])

    gen = torch.Generator().manual_seed(0)
    values = want[want.isfinite()].unique()
    ties = (values[1:] + values[:-1]) / 2
    limit = torch.finfo(dtype).max
    x = torch.cat([torch.randn(4000, generator=gen) * torch.logspace(-9, 6, 4000), ties, -ties])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e30, -1e30, limit, -limit, limit * 1.01])])
    x = torch.nn.functional.pad(x, (0, triton.next_power_of_2(x.numel()) - x.numel()))
    encoded = torch.empty(x.numel(), dtype=torch.uint8)
    _encode_floats[(1,)](x, encoded, N=x.numel(), KV_FP8=fmt)
    assert torch.equal(encoded, x.clamp(-limit, limit).to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", [F8, F5], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fp8_quantises_as_the_reference(dtype, src_dtype):
    gen = torch.Generator().manual_seed(1)
    k_buffer, v_buffer = torch.zeros(20, 2, 24, dtype=dtype), torch.zeros(20, 2, 40, dtype=dtype)
    loc = torch.randperm(20, generator=gen)[:7]
    k = (torch.randn(7, 2, 24, generator=gen) * 300).to(src_dtype)  # saturates at k_scale 0.37 for e4m3
    v = torch.randn(7, 2, 40, generator=gen).to(src_dtype)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    reference.write_kv(expected_k, expected_v, loc, k, v, 0.37, 1.9)
    tk.write_kv(k_buffer, v_buffer, loc, k, v, 0.37, 1.9)
    assert torch.equal(k_buffer.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_buffer.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.float32, F8])
def test_write_kv_mla_stores_the_key_only(kv_dtype):
    """MLA's pool: the value buffer is a view of the key's latent; the write stores latent + rope once
    (v None, or v given: either way the key's bytes are what the pool holds)."""
    gen = torch.Generator().manual_seed(2)
    for v_given in (False, True):
        k_buffer = torch.zeros(12, 1, 80, dtype=kv_dtype)
        v_buffer = k_buffer[..., :64]
        loc = torch.tensor([7, 2, 9])
        k = torch.randn(3, 1, 80, generator=gen)
        v = torch.randn(3, 1, 64, generator=gen) if v_given else None  # a different v must not be stored
        tk.write_kv(k_buffer, v_buffer, loc, k, v, 0.5, 0.5)
        expected = reference.quantize_kv(k, kv_dtype, 0.5)
        assert torch.equal(k_buffer[loc].view(torch.uint8), expected.view(torch.uint8))
        assert not k_buffer[[0, 1, 3, 4, 5, 6, 8, 10, 11]].float().any()


def test_split_head_dim():
    assert _common.split_head_dim(576) == (512, 64)
    assert _common.split_head_dim(80) == (64, 16)
    assert _common.split_head_dim(128) == (128, 0)
    assert _common.split_head_dim(72) == (64, 16)
    assert _common.split_head_dim(8) == (16, 0)


# ----------------------------------------------------------------------------- small kernels


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("src_dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_write_kv(loc_dtype, src_dtype, pool_dtype):
    gen = torch.Generator().manual_seed(0)
    k_buffer = torch.zeros(20, 2, 24, dtype=pool_dtype)
    v_buffer = torch.zeros(20, 2, 40, dtype=pool_dtype)
    loc = torch.randperm(20, generator=gen)[:7].to(loc_dtype)
    k = torch.randn(7, 2, 24, generator=gen).to(src_dtype)
    v = torch.randn(7, 2, 40, generator=gen).to(src_dtype)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    reference.write_kv(expected_k, expected_v, loc, k, v)
    tk.write_kv(k_buffer, v_buffer, loc, k, v)
    # Exact (fp32 -> fp16 rounds to nearest in the interpreter as in torch).
    assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)


def test_write_kv_in_head_blocks():
    """48 KV heads of 256: 32 heads per program (sizing.write_kv_heads), the second block ragged."""
    from hal.kernels.triton.sizing import write_kv_heads

    assert write_kv_heads(48, 256) == 32
    gen = torch.Generator().manual_seed(1)
    k_buffer, v_buffer = torch.zeros(6, 48, 256), torch.zeros(6, 48, 200)
    k, v = torch.randn(2, 48, 256, generator=gen), torch.randn(2, 48, 200, generator=gen)
    loc = torch.tensor([4, 1])
    tk.write_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    assert (k_buffer[[0, 2, 3, 5]] == 0).all() and (v_buffer[[0, 2, 3, 5]] == 0).all()


def test_write_kv_empty_and_strided():
    k_buffer, v_buffer = torch.zeros(8, 1, 16), torch.zeros(8, 1, 8)
    tk.write_kv(k_buffer, v_buffer, torch.empty(0, dtype=torch.int64), torch.empty(0, 1, 16), torch.empty(0, 1, 8))
    assert (k_buffer == 0).all() and (v_buffer == 0).all()
    k = torch.randn(3, 16, 1).transpose(1, 2)  # strided source
    v = torch.randn(3, 1, 8)
    loc = torch.tensor([6, 0, 3])
    tk.write_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    assert (k_buffer[[1, 2, 4, 5, 7]] == 0).all()


@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
def test_build_kv_indices(with_start, out_dtype):
    gen = torch.Generator().manual_seed(4)
    req_to_token = torch.randint(0, 10_000, (6, 1200), generator=gen, dtype=torch.int32)
    req_pool_indices = torch.tensor([4, 0, 2], dtype=torch.int64)
    kv_end = torch.tensor([1100, 1, 0], dtype=torch.int32)  # > one 512 step, one token, empty
    kv_start = torch.tensor([70, 0, 0], dtype=torch.int32) if with_start else None
    start = kv_start if with_start else torch.zeros(3, dtype=torch.int32)
    lens = kv_end - start
    kv_indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    kv_indices = torch.full((int(lens.sum()) + 4,), -5, dtype=out_dtype)
    assert tk.build_kv_indices(req_to_token, req_pool_indices, kv_start, kv_end, kv_indptr, kv_indices) is kv_indices
    expected = torch.cat([req_to_token[r, s:e] for r, s, e in zip(req_pool_indices, start, kv_end, strict=True)])
    assert torch.equal(kv_indices[: len(expected)], expected.to(out_dtype))
    assert (kv_indices[len(expected) :] == -5).all()


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_compute_positions(pos_dtype):
    prefix = torch.tensor([0, 700, 3, 9], dtype=torch.int64)
    seq = torch.tensor([5, 600, 0, 1], dtype=torch.int32)  # one request longer than a 512 step
    start = torch.nn.functional.pad(torch.cumsum(seq, 0), (1, 0))[:-1]
    positions = torch.full((int(seq.sum()) + 2,), -1, dtype=pos_dtype)
    assert tk.compute_positions(prefix, seq, start, positions) is positions
    expected = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix.tolist(), seq.tolist(), strict=True)])
    assert torch.equal(positions[:-2], expected.to(pos_dtype))
    assert (positions[-2:] == -1).all()


# ----------------------------------------------------------------------------- API


def test_is_available_under_interpreter():
    ok, reason = tk.is_available()
    assert ok is True and "interpreter" in reason


def test_bad_arguments_raise_before_launch():
    q, kb, vb = torch.randn(2, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    common = dict(scale=1.0, num_kv_splits=2, partial_out=torch.empty(2, 4, 2, 16), partial_lse=torch.empty(2, 4, 2))
    with pytest.raises(ValueError, match="out must be"):
        tk.decode_attention(q, kb, vb, torch.empty(2, 4, 8), indptr, indices, **common)
    with pytest.raises(ValueError, match="partial_out"):
        tk.decode_attention(q, kb, vb, torch.empty(2, 4, 16), indptr, indices, **{**common, "num_kv_splits": 3})
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        tk.decode_attention(
            torch.randn(2, 3, 16),
            kb,
            vb,
            torch.empty(2, 3, 16),
            indptr,
            indices,
            **{**common, "partial_out": torch.empty(2, 3, 2, 16), "partial_lse": torch.empty(2, 3, 2)},
        )
    with pytest.raises(TypeError, match="float32"):
        tk.write_kv(kb.double(), vb, torch.tensor([0]), kb[:1], vb[:1])


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_small_backend_forward_writes_out_in_place(mode, monkeypatch):
    """The triton backend's run steps take ``out``: ``forward(out=)`` with a buffer whose rows are padded past their
    width gets the kernels' rows written there, so the base class copies nothing; rows right, padding untouched."""
    import dataclasses

    import hal.backend
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build, tolerance
    from hal.devices.cpu import device
    from hal.devices.triton_backend import TritonBackend

    reqs = ((5, 1), (17, 1)) if mode == "DECODE" else ((9, 3), (0, 4))
    built = build(Case(f"out_{mode}", ForwardMode[mode], reqs, tp_q_head_num=4, tp_k_head_num=2, head_dim=16))
    layer, tokens = built.layer, built.q.shape[0]
    width = layer.tp_q_head_num * layer.v_head_dim
    whole = torch.full((tokens + 2, width + 8), -7.0)
    out = whole[:, :width]
    written_in_place, write_output = [], hal.backend.write_output

    def watched(result, q, layer, rows):
        written_in_place.append(result.data_ptr() == rows.data_ptr())
        return write_output(result, q, layer, rows)

    monkeypatch.setattr(hal.backend, "write_output", watched)
    backend = TritonBackend(dataclasses.replace(device.probe(), triton_target="cpu:interpreter"))
    backend.init_forward_metadata(built.batch)
    result = backend.forward(built.q, built.k, built.v, layer, built.batch, out=out)
    assert result.data_ptr() == out.data_ptr() and written_in_place == [True]
    torch.testing.assert_close(out[:tokens], built.expected.float(), **tolerance(torch.float32))
    assert (whole[tokens:] == -7.0).all() and (whole[:, width:] == -7.0).all()
