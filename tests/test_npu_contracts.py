"""The emulation refuses what each torch_npu op's documented contract refuses (hal.kernels.npu.contracts, issue 25)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from hal.errors import UnsupportedError
from hal.kernels.npu import contracts, emulation, fia_causal_mask, mla_attention, nz_mask, nz_pages, paged_prefill
from hal.kernels.npu.contracts import ALL_CHIPS, CONSTRAINTS, available

NPU = emulation.torch_npu
ROOT = Path(__file__).resolve().parent.parent


def test_every_row_names_a_source_and_a_test_that_exists():
    tests: dict[str, set[str]] = {}
    for row in CONSTRAINTS:
        assert row.chips and set(row.chips) <= set(ALL_CHIPS), row
        assert "@" in row.source and row.rule, row  # repository@commit, path, section
        path, name = row.test.split("::")
        if path not in tests:
            tree = ast.parse((ROOT / path).read_text())
            tests[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in tests[path], row.test
    ops = {row.op for row in CONSTRAINTS}
    assert all(contracts.rule(op, "chips") for op in ops)  # every op has its chips row


def test_op_availability_per_chip():
    """Each op on a chip its row does not list raises, naming the chip and the source."""
    q = torch.zeros(1, 1, 16)
    for op in {row.op for row in CONSTRAINTS}:
        for chip in ALL_CHIPS:
            if available(op, chip):
                continue
            with emulation.chip(chip), pytest.raises(ValueError, match=rf"{op}: called on {chip}: .*\[.*@"):
                getattr(NPU, op)(q, q, q)
    assert not available("_npu_reshape_and_cache_siso", "A3") and available("_npu_reshape_and_cache_siso", "A2")
    assert available("npu_fused_infer_attention_score_v2", "A5")  # vllm-ascend's sinks path, no device gate
    assert not available("npu_fused_infer_attention_score_v2", "310P")
    assert not available("_npu_paged_attention", "A5") and available("npu_scatter_pa_kv_cache", "A5")
    assert contracts.limits_for("A5") and all("_npu_" not in line for line in contracts.limits_for("A5"))


def _decode_args(block_size, head_size=64, kv_heads=1):
    cache = torch.zeros(2, block_size, kv_heads, head_size)
    q = torch.randn(1, kv_heads, head_size)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    return q, cache, table, lens


def test_paged_attention_block_size_limit():
    q, cache, table, lens = _decode_args(256)  # head 64: head * block = 16384, but block_size > 128
    with pytest.raises(ValueError, match=r"block_size 256: .*block_size <= 128"):
        NPU._npu_paged_attention(q, cache, cache, 1, 1, 1.0, table, lens, torch.empty_like(q))
    q, cache, table, lens = _decode_args(128)
    NPU._npu_paged_attention(q, cache, cache, 1, 1, 1.0, table, lens, torch.empty_like(q))
    q, cache, table, lens = _decode_args(128, head_size=512)
    with pytest.raises(ValueError, match=r"head_size = 512: expected in \(0, 256\]"):
        NPU._npu_paged_attention(q, cache, cache, 1, 1, 1.0, table, lens, torch.empty_like(q))


def test_atb_attention_out_contract():
    """The ATB attention ops write ``out`` as it is given: ``[T, heads, v_dim]`` in the query's dtype, contiguous. A
    view with padded rows (what an engine's output buffer may be), another dtype or shape is refused with the rule
    and its source; the ascend backend hands such a buffer to no ATB op (the base class copies into it)."""
    q, cache = torch.randn(2, 1, 64), torch.randn(2, 16, 1, 64)
    table, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    mla_q, mla_cache = torch.randn(2, 4, 80), torch.randn(2, 16, 1, 80)
    calls = {
        "_npu_paged_attention": (q, lambda out: NPU._npu_paged_attention(q, cache, cache, 1, 1, 1.0, table, lens, out)),
        "_npu_paged_attention_splitfuse": (
            q,
            lambda out: NPU._npu_paged_attention_splitfuse(
                query=q,
                key_cache=cache,
                value_cache=cache,
                block_table=table,
                context_lens=lens,
                mask=torch.zeros(2, 3),
                seq_len=torch.tensor([1, 1], dtype=torch.int32),
                num_kv_heads=1,
                num_heads=1,
                scale_value=1.0,
                out=out,
            ),  # fmt: skip
        ),
        "_npu_paged_attention_mla": (
            mla_q[..., :64],
            lambda out: NPU._npu_paged_attention_mla(
                query=mla_q,
                key_cache=mla_cache,
                num_kv_heads=1,
                num_heads=4,
                scale_value=0.1,
                block_table=table,
                context_lens=lens,
                mla_vheadsize=64,
                out=out,
            ),  # fmt: skip
        ),
    }
    for op, (like, call) in calls.items():
        out = torch.full(like.shape, float("nan"))
        call(out)
        assert torch.isfinite(out).all(), op  # written in place
        rows, heads, dim = like.shape
        padded = torch.empty(rows, heads, dim + 8)[..., :dim]
        for bad in (padded, out.to(torch.bfloat16), torch.empty(rows + 1, heads, dim)):
            with pytest.raises(ValueError, match=rf"{op}: out = .*contract says out: .*contiguous.*AtbCommon\.cpp"):
                call(bad)


def test_mla_decode_block_size_limit():
    """_npu_paged_attention_mla (head 576 > 256): block_size <= 128, so MLA decode at pages 256/512 is refused and
    hal routes those pages to FIA v2."""
    for block_size, ok in ((128, True), (256, False), (512, False)):
        cache = torch.randn(2, block_size, 1, 576, dtype=torch.bfloat16)
        q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
        table, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
        call = dict(query=q, key_cache=cache, num_kv_heads=1, num_heads=16, scale_value=0.1, block_table=table,
                    context_lens=lens, mla_vheadsize=512, out=q.new_empty(2, 16, 512))  # fmt: skip
        if ok:
            NPU._npu_paged_attention_mla(**call)
        else:
            with pytest.raises(ValueError, match=rf"block_size {block_size} with head_size 576.*<= 128"):
                NPU._npu_paged_attention_mla(**call)
    from hal.kernels.npu import mla_unsupported_reasons

    why = mla_unsupported_reasons(512, 64, 256, torch.bfloat16, q_heads=16, kv_heads=1, paths=("mla_decode",))
    assert len(why) == 1 and "<= 128" in why[0]


def test_310p_takes_nz_caches_only():
    """310P's ATB ops take FRACTAL_NZ caches [blocks, heads * dim / 16, block_size, 16] and an NZ splitfuse mask;
    the ND layout A2/A3 take is refused there, and an NZ cache is refused on A2."""
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, dim, block, blocks = 2, 4, 32, 16, 3
    nd_k = torch.randn(blocks, block, kv_heads, dim, generator=g, dtype=torch.float32).half()
    nd_v = torch.randn(blocks, block, kv_heads, dim, generator=g, dtype=torch.float32).half()
    q = torch.randn(2, heads, dim, generator=g, dtype=torch.float32).half()
    table = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    nz_k, nz_v = nz_pages(NPU, nd_k), nz_pages(NPU, nd_v)
    assert nz_k.shape == (blocks, kv_heads * dim // 16, block, 16) and emulation.get_npu_format(nz_k) == 29
    out = torch.empty_like(q)
    with emulation.chip("A2"):
        NPU._npu_paged_attention(q, nd_k, nd_v, kv_heads, heads, 0.2, table, lens, out)
        with pytest.raises(ValueError, match=r"key_cache in FRACTAL_NZ on A2"):
            NPU._npu_paged_attention(q, nz_k, nz_v, kv_heads, heads, 0.2, table, lens, torch.empty_like(q))
    with emulation.chip("310P"):
        with pytest.raises(ValueError, match=r"key_cache = .* in format 2 on 310P.*FRACTAL_NZ"):
            NPU._npu_paged_attention(q, nd_k, nd_v, kv_heads, heads, 0.2, table, lens, torch.empty_like(q))
        got = torch.empty_like(q)
        NPU._npu_paged_attention(q, nz_k, nz_v, kv_heads, heads, 0.2, table, lens, got)
        torch.testing.assert_close(got, out)  # the same attention read through the NZ layout
        with pytest.raises(ValueError, match=r"dtype_310p|float16"):  # 310P: float16 only
            NPU._npu_paged_attention(q.bfloat16(), nz_k.bfloat16(), nz_v.bfloat16(), kv_heads, heads, 0.2, table,
                                     lens, torch.empty_like(q).bfloat16())  # fmt: skip
        mask = torch.zeros(2, 20, dtype=torch.float16)
        split = dict(query=q, key_cache=nz_k, value_cache=nz_v, block_table=table, context_lens=lens,
                     seq_len=torch.tensor([1, 1], dtype=torch.int32), num_kv_heads=kv_heads, num_heads=heads,
                     scale_value=0.2)  # fmt: skip
        with pytest.raises(ValueError, match=r"mask = .* in format 2.*FRACTAL_NZ \[1, ceil16"):
            NPU._npu_paged_attention_splitfuse(mask=mask, out=torch.empty_like(q), **split)
        got = torch.empty_like(q)
        NPU._npu_paged_attention_splitfuse(mask=nz_mask(NPU, mask), out=got, **split)
        torch.testing.assert_close(got, out)
        # ReshapeAndCache on 310P: NZ caches (K_CACHE_V_CACHE_NZ); an ND one is refused
        new = torch.randn(2, kv_heads, dim, generator=g, dtype=torch.float32).half()
        slots = torch.tensor([5, -1], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"ND caches on 310P"):
            NPU._npu_reshape_and_cache(new, new, nd_k.clone(), nd_v.clone(), slots)
        NPU._npu_reshape_and_cache(new, new, nz_k, nz_v, slots)
        assert torch.equal(nz_k.permute(0, 2, 1, 3)[0, 5].reshape(kv_heads, dim), new[0])
    # the ATB limits that hold on 310P only: block_size * head_size <= 128 * 128
    with emulation.chip("310P"):
        big = nz_pages(NPU, torch.zeros(2, 128, 1, 256, dtype=torch.float16))
        q1 = torch.zeros(1, 1, 256, dtype=torch.float16)
        one = torch.zeros(1, 1, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"head_size \* block_size = 32768"):
            NPU._npu_paged_attention(q1, big, big, 1, 1, 1.0, one, torch.tensor([3], dtype=torch.int32),
                                     torch.empty_like(q1))  # fmt: skip


def test_scatter_nd_update_contract():
    buf = torch.zeros(8, 2, 4)
    rows = torch.randn(3, 2, 4)
    NPU.npu_scatter_nd_update_(buf, torch.tensor([[1], [5], [7]]), rows)
    assert torch.equal(buf[[1, 5, 7]], rows)
    with pytest.raises(ValueError, match=r"indices \[\[-1\]"):
        NPU.npu_scatter_nd_update_(buf, torch.tensor([[-1]]), rows[:1])  # no negative index: redirect padding
    with pytest.raises(ValueError, match=r"indices \[\[8\]"):
        NPU.npu_scatter_nd_update_(buf, torch.tensor([[8]]), rows[:1])
    with pytest.raises(ValueError, match=r"updates = "):
        NPU.npu_scatter_nd_update_(buf, torch.tensor([[1]]), rows)
    with emulation.chip("310P"), pytest.raises(ValueError, match="bfloat16 on 310P"):
        NPU.npu_scatter_nd_update_(buf.bfloat16(), torch.tensor([[1]]), rows[:1].bfloat16())
    with emulation.chip("A5"), pytest.raises(ValueError, match="called on A5"):
        NPU.npu_scatter_nd_update_(buf, torch.tensor([[1]]), rows[:1])


def _tnd_case(q_lens, kv_lens, dim=128, block=128, kv_heads=1, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block) for n in kv_lens]
    blocks = sum(pages) + 1
    k = torch.randn(blocks, block, kv_heads, dim, generator=g)
    v = torch.randn(blocks, block, kv_heads, dim, generator=g)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    ids = iter(range(1, blocks))
    for r, n in enumerate(pages):
        table[r, :n] = torch.tensor([next(ids) for _ in range(n)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    return q, k, v, table


def _dense(q, k, v, table, q_lens, kv_lens, window=-1, scale=0.1):
    """Causal (and windowed) attention per request, read through the block table."""
    outs, start = [], 0
    block = k.shape[1]
    for r, (s, n) in enumerate(zip(q_lens, kv_lens)):
        keys = k[table[r].long()].reshape(-1, *k.shape[2:])[:n].float()
        vals = v[table[r].long()].reshape(-1, *v.shape[2:])[:n].float()
        group = q.shape[1] // k.shape[2]
        scores = torch.einsum("shd,nhd->hsn", q[start : start + s].float(), keys.repeat_interleave(group, 1)) * scale
        pos = torch.arange(s)[:, None] + n - s
        cols = torch.arange(n)[None, :]
        visible = (cols <= pos) & ((cols >= pos - window) if window >= 0 else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hsn,nhd->shd", scores.softmax(-1), vals.repeat_interleave(group, 1)))
        start += s
    del block
    return torch.cat(outs)


def test_fia_ignores_the_band_at_one_query_token():
    """FIA (v1 and v2) ignore sparse_mode / pre_tokens / next_tokens at Q_S = 1 without rope: the emulation does so
    too, and hal's windowed decode pads each request to two query rows so the band applies."""
    q_lens, kv_lens = [1, 1], [40, 3]
    q, k, v, table = _tnd_case(q_lens, kv_lens)
    raw, _ = NPU.npu_fused_infer_attention_score(
        q, k.view(k.shape[0], 128, -1), v.view(v.shape[0], 128, -1), atten_mask=fia_causal_mask("cpu"),
        block_table=table, input_layout="TND", block_size=128, actual_seq_lengths=[1, 2], actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=1, num_heads=2, scale=0.1, sparse_mode=4, pre_tokens=4, next_tokens=0,
    )  # fmt: skip
    torch.testing.assert_close(raw, _dense(q, k, v, table, q_lens, kv_lens))  # the whole context: band ignored
    got = paged_prefill(NPU, q, k, v, table, q_lens, kv_lens, scale=0.1, causal=True, sliding_window=4)
    torch.testing.assert_close(got, _dense(q, k, v, table, q_lens, kv_lens, window=4))


def test_fia_tnd_batch_limit():
    """TND takes at most 4096 requests per call: the emulation refuses more, hal's wrapper splits the batch."""
    n = contracts_batch = emulation.TND_MAX_BATCH + 3
    q_lens, kv_lens = [1] * n, [2] * n
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 128, 1, 128, generator=g)
    table = torch.ones(n, 1, dtype=torch.int32)
    q = torch.randn(n, 1, 128, generator=g)
    with pytest.raises(ValueError, match=rf"{contracts_batch} requests: .*<= 4096"):
        NPU.npu_fused_infer_attention_score(
            q, k.view(2, 128, -1), k.view(2, 128, -1), block_table=table, input_layout="TND", block_size=128,
            actual_seq_lengths=list(itertools.accumulate(q_lens)), actual_seq_lengths_kv=kv_lens,
            num_key_value_heads=1, num_heads=1, scale=0.1,
        )  # fmt: skip
    got = paged_prefill(NPU, q, k, k, table, q_lens, kv_lens, scale=0.1, causal=False)
    keys = k[1, :2, 0]
    expected = (torch.softmax(q[:, 0] @ keys.T * 0.1, -1) @ keys)[:, None]
    torch.testing.assert_close(got, expected)


def test_mla_tnd_query_limit():
    """Absorbed MLA in TND takes at most 16 query tokens per request: the emulation refuses more; hal cuts a long
    extend into pieces of 16 over the same pages (right-down causal alignment kept)."""
    g = torch.Generator().manual_seed(2)
    q_lens, kv_lens = [40, 3], [50, 3]
    latent = torch.randn(2, 64, 1, 512, generator=g)
    rope = torch.randn(2, 64, 1, 64, generator=g)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 2, 576, generator=g)
    with pytest.raises(ValueError, match=r"a request of 40 query tokens.*16"):
        NPU.npu_fused_infer_attention_score_v2(
            q[..., :512].contiguous(), latent.view(2, 64, -1), latent.view(2, 64, -1),
            query_rope=q[..., 512:].contiguous(), key_rope=rope.view(2, 64, -1), block_table=table,
            input_layout="TND", block_size=64, actual_seq_qlen=[40, 43], actual_seq_kvlen=kv_lens,
            num_query_heads=2, num_key_value_heads=1, softmax_scale=0.1, sparse_mode=3,
            atten_mask=fia_causal_mask("cpu"),
        )  # fmt: skip
    got = mla_attention(NPU, q, latent, rope, table, q_lens, kv_lens, scale=0.1)
    keys = torch.cat([latent, rope], -1)
    expected = _dense(q, keys, latent, table, q_lens, kv_lens)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_the_doc_holds_the_contract_table():
    doc = (ROOT / "docs" / "hardware-contracts.md").read_text()
    assert contracts.markdown() in doc, "docs/hardware-contracts.md is stale: paste contracts.markdown()"


def test_hal_info_lists_the_limits_of_the_emulated_generation(monkeypatch):
    from hal.capability import DeviceCapability
    from hal.devices.npu import AscendBackend

    for chip, arch in (("310P", "Ascend310P"), ("A5", "Ascend950")):
        cap = DeviceCapability(type="npu", available=True, arch=arch, emulated=True)
        notes = AscendBackend.notes(cap)
        limits = [n for n in notes if n.startswith("limit ")]
        assert limits == [f"limit {line}" for line in contracts.limits_for(chip)] and limits
    assert any(
        "FRACTAL_NZ" in n for n in AscendBackend.notes(DeviceCapability(type="npu", available=True, arch="Ascend310P"))
    )


def test_split_modules_keep_their_import_paths():
    """The ascend backend's parts (routing, graph tasks, emulation adapter) and the kernels' (limits, loaders) live in
    modules of their own; the names tests and plugins import stay put, and the mixin names warn."""
    from hal.devices.npu import ascend_backend, emulated_ops, graph_tasks, routing
    from hal.kernels.npu import limits, loaders, ops

    assert ascend_backend.GRAPH_UPDATE_API is graph_tasks.GRAPH_UPDATE_API
    assert (
        ascend_backend._fp8_reason is routing._fp8_reason and ascend_backend._EmulatedOps is emulated_ops._EmulatedOps
    )
    for module in (routing, ascend_backend):
        with pytest.warns(DeprecationWarning, match=r"AscendRouting is deprecated since hal 0\.4\.0 .*AscendBackend"):
            assert module.AscendRouting is ascend_backend.AscendBackend
    for module in (graph_tasks, ascend_backend):
        with pytest.warns(DeprecationWarning, match=r"NpuGraphTasks is deprecated since hal 0\.4\.0 .*GraphTasks"):
            assert module.NpuGraphTasks is graph_tasks.GraphTasks
    for module in (routing, graph_tasks, ascend_backend):
        with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
            module.NoSuchName  # noqa: B018
    for name in ("unsupported_reasons", "mla_unsupported_reasons", "sink_unsupported_reasons", "FIA_TND_HEAD_DIMS"):
        assert getattr(ops, name) is getattr(limits, name)
    for name in ("load_torch_npu", "load_atb", "resolve_ops", "OP_NAMES", "GENERATIONS", "generation_of_soc"):
        assert getattr(ops, name) is getattr(loaders, name)


# ----------------------------------------------------------------------------- issue 52: limits, round 3


def _fia(q, k, v, table, q_lens, kv_lens, block=128, **kw):
    """FIA v1, TND over the paged caches, as hal calls it (``kw``: the mask arguments)."""
    args = dict(atten_mask=fia_causal_mask("cpu"), sparse_mode=3) | kw
    return NPU.npu_fused_infer_attention_score(
        q, k.view(k.shape[0], block, -1), v.view(v.shape[0], block, -1), block_table=table, input_layout="TND",
        block_size=block, actual_seq_lengths=list(itertools.accumulate(q_lens)), actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=k.shape[2], num_heads=q.shape[1], scale=0.1, **args,
    )[0]  # fmt: skip


def _fia2(q, k, v, table, q_lens, kv_lens, block=128):
    return NPU.npu_fused_infer_attention_score_v2(
        q, k.view(k.shape[0], block, -1), v.view(v.shape[0], block, -1), block_table=table, input_layout="TND",
        block_size=block, actual_seq_qlen=list(itertools.accumulate(q_lens)), actual_seq_kvlen=kv_lens,
        num_query_heads=q.shape[1], num_key_value_heads=k.shape[2], softmax_scale=0.1,
    )[0]  # fmt: skip


def test_fia_kv_length_limit(monkeypatch):
    """FIA / FIA v2 take KV_S <= 262144 at one query token (Q_S > 1: 20M): the emulation refuses a longer decode,
    and hal pads such a request to two query rows, so the Q_S > 1 limit holds and the result is the decode's."""
    from hal.kernels.npu import ops

    q = torch.zeros(1, 1, 128)
    cache = torch.zeros(2, 128, 1, 128)
    long_table = torch.zeros(1, 2049, dtype=torch.int32)  # 2049 pages of 128 cover 262145 keys
    for call in (_fia, _fia2):
        with pytest.raises(ValueError, match=r"request 0: 1 query tokens over 262145 keys.*KV_S <= 262144"):
            call(q, cache, cache, long_table, [1], [262145])
    assert not ops.unsupported_reasons(128, 128, 128, torch.bfloat16, 0, -1, False, True, paths=("fia_decode",))
    why = ops.unsupported_reasons(
        128, 128, 16, torch.bfloat16, 0, -1, False, True, paths=("fia_decode",), max_kv_len=262145
    )
    assert why and "runs at Q_S = 2" in why[0]
    # The same plan at a small stand-in limit, so the emulation computes it: hal's call is the decode's result.
    monkeypatch.setattr(emulation, "FIA_DECODE_MAX_KV", 64)
    monkeypatch.setattr(ops, "FIA_DECODE_MAX_KV", 64)
    q_lens, kv_lens = [1, 1], [100, 30]
    q, k, v, table = _tnd_case(q_lens, kv_lens)
    with pytest.raises(ValueError, match="kv_len|KV_S <= 262144"):
        _fia(q, k, v, table, q_lens, kv_lens, sparse_mode=0, atten_mask=None)
    got = paged_prefill(NPU, q, k, v, table, q_lens, kv_lens, scale=0.1, causal=False)
    torch.testing.assert_close(got, _dense(q, k, v, table, q_lens, kv_lens))
    with pytest.raises(UnsupportedError, match="20971520"):
        paged_prefill(NPU, q, k, v, table, [1], [20971521], scale=0.1, causal=False)


def test_fia_decode_block_size_limit():
    """FIA at Q_S = 1 takes pages that are multiples of 16 up to 512 (the contract row): 1024 and 2048 are refused."""
    for block in (1024, 2048):
        q, k, v, table = _tnd_case([1], [20], block=block)
        with pytest.raises(ValueError, match=rf"block_size {block} at Q_S = 1.*<= 512"):
            _fia(q, k, v, table, [1], [20], block=block, sparse_mode=0, atten_mask=None)
    q, k, v, table = _tnd_case([1], [20], block=512)
    torch.testing.assert_close(_fia(q, k, v, table, [1], [20], block=512), _dense(q, k, v, table, [1], [20]))


def test_fia_mixed_windowed_rows_are_banded_per_row():
    """Upstream does not say whether a one-token row of a longer TND call is banded: the emulation lets it see every
    key (the reading hal must not rely on), and hal pads such rows, so its result is the band's either way."""
    q_lens, kv_lens = [1, 3], [40, 10]
    q, k, v, table = _tnd_case(q_lens, kv_lens)
    raw = _fia(q, k, v, table, q_lens, kv_lens, sparse_mode=4, pre_tokens=4, next_tokens=0)
    torch.testing.assert_close(raw[:1], _dense(q, k, v, table, q_lens, kv_lens)[:1])  # row 0 unbanded
    torch.testing.assert_close(raw[1:], _dense(q, k, v, table, q_lens, kv_lens, window=4)[1:])
    got = paged_prefill(NPU, q, k, v, table, q_lens, kv_lens, scale=0.1, causal=True, sliding_window=4)
    torch.testing.assert_close(got, _dense(q, k, v, table, q_lens, kv_lens, window=4))


def test_fia_v2_refuses_v_d_192_paged():
    """FIA v2 in page attention takes no V_D = 192 ('GQA和PA场景不支持V_D等于192'): the emulation refuses it, hal's sink
    route names it, and a paged 192/192 layer goes to FIA v1, whose TND rule takes it."""
    from hal.kernels.npu import ops

    q, k, v, table = _tnd_case([2], [20], dim=192)
    with pytest.raises(ValueError, match="tnd_head_dim|V_D = 192"):
        _fia2(q, k, v, table, [2], [20])
    torch.testing.assert_close(_fia(q, k, v, table, [2], [20]), _dense(q, k, v, table, [2], [20]))
    why = ops.sink_unsupported_reasons(192, 192, 128, torch.bfloat16, 0, True, kv_heads=1, q_heads=2)
    assert any("V_D等于192" in r for r in why)


def test_a5_fia_takes_the_head_dims_vllm_ascend_sends():
    """On A5 vllm-ascend sends every head size to FIA TND (no gate, no large-head fallback): the emulation and the
    routing take a multiple of 16 up to 512 there; A2/A3 keep the doc's 128 / 192."""
    from hal.kernels.npu import ops

    q, k, v, table = _tnd_case([3, 1], [20, 9], dim=256)
    with emulation.chip("A5"):
        torch.testing.assert_close(_fia(q, k, v, table, [3, 1], [20, 9]), _dense(q, k, v, table, [3, 1], [20, 9]))
    with pytest.raises(ValueError, match="tnd_head_dim|query D = 256"):
        _fia(q, k, v, table, [3, 1], [20, 9])  # A2
    q, k, v, table = _tnd_case([2], [20], dim=520)
    with emulation.chip("A5"), pytest.raises(ValueError, match="query D = 520.*<= 512"):
        _fia(q, k, v, table, [2], [20])
    args = (256, 256, 128, torch.bfloat16, 0, -1, False, True)
    assert not ops.unsupported_reasons(*args, paths=("extend", "fia_decode"), chip="A5")
    assert any("head_dim 256" in r for r in ops.unsupported_reasons(*args, paths=("extend",)))


def test_310p_batch_limit_counts_requests_and_hal_splits_larger_batches(monkeypatch):
    """ATB PagedAttention on 310P takes 0 < batch <= 2048, batch being requests: one request of more query tokens is
    served, a decode of 2049 requests is refused by the op and split by hal."""
    from hal.kernels.npu import ops

    heads, dim, block = 1, 16, 16
    nd = torch.zeros(1, block, heads, dim, dtype=torch.float16)
    with emulation.chip("310P"):
        kc = nz_pages(NPU, nd)
        with pytest.raises(ValueError, match="a batch of 2049 requests.*0<batch<=2048"):
            q, table = torch.zeros(2049, heads, dim, dtype=torch.float16), torch.zeros(2049, 1, dtype=torch.int32)
            ops.paged_decode(NPU, q, kc, kc, table, [1] * 2049, scale=0.1, num_kv_heads=heads)
    monkeypatch.setattr(emulation, "ATB_310P_MAX_BATCH", 2)  # a small stand-in limit: the emulation computes it
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(5, block, heads, dim, generator=g).half()
    table = torch.arange(5, dtype=torch.int32).view(5, 1)
    q = torch.randn(5, heads, dim, generator=g).half()
    with emulation.chip("310P"):
        kc = nz_pages(NPU, pages)
        with pytest.raises(ValueError, match="a batch of 5 requests"):
            ops.paged_decode(NPU, q, kc, kc, table, [4, 9, 16, 1, 7], scale=0.1, num_kv_heads=heads)
        got = ops.paged_decode(NPU, q, kc, kc, table, [4, 9, 16, 1, 7], scale=0.1, num_kv_heads=heads, max_batch=2)
        # one request of 3 query tokens: batch 1 (tokens are not the batch)
        mixed = ops.paged_mixed(NPU, q[:3], kc, kc, table[:1], [3], [9], scale=0.1, nz=True, num_kv_heads=heads)
    lens = [4, 9, 16, 1, 7]
    want = _dense(q.float(), pages.float(), pages.float(), table, [1] * 5, lens, scale=0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    want = _dense(q[:3].float(), pages.float(), pages.float(), table, [3], [9], scale=0.1)
    torch.testing.assert_close(mixed.float(), want, atol=2e-3, rtol=2e-3)
